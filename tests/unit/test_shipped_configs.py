"""Every file under configs/ validates, documents its launch command, and (CPU ones) builds."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import paddle
import pytest

from flashcp import cli
from flashcp.config import collect, load_config, read_yaml
from flashcp.cp import make_assignment
from flashcp.data import TrainData
from flashcp.models import AttentionContext, build_model
from flashcp.plan import GIB, plan
from flashcp.plan.report import GPUS_PER_NODE, over_budget
from flashcp.recipes.adapters import apply_lora_config
from flashcp.recipes.dpo_stream import DPOData
from flashcp.trainer import resolve_dtype

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))
EXPECTED = {
    "gpt/tiny_cp2.yaml",
    "gpt/tiny_cp4.yaml",
    "glm/tiny_cp2.yaml",
    "glm/tiny_moe_cp2.yaml",
    "glm/glm4_9b_cp8.yaml",
    "glm/glm45_air_cp8.yaml",
    "gpt/tiny_sft_packed_cp2.yaml",
    "glm/tiny_dpo_lora_cp2.yaml",
    "glm/tiny_dpo_lora_pp2.yaml",
    "glm/tiny_moe_dpo_lora_pp2_cp2.yaml",
    "glm/glm45_air_dpo_lora_pp_cp.yaml",
    "glm/glm4_9b_dpo_lora_pp2_cp4.yaml",
}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_expected_configs_ship() -> None:
    assert {str(p.relative_to(ROOT / "configs")) for p in CONFIGS} >= EXPECTED


@pytest.mark.parametrize("path", CONFIGS, ids=_rel)
def test_config_validates_for_its_world_size(path: Path) -> None:
    raw = read_yaml(path)
    cfg, errors = collect(raw, source=_rel(path))
    assert cfg is not None and errors == [], "\n".join(map(str, errors))
    world = cfg.parallel.world_size
    _, errors = collect(raw, source=_rel(path), world_size=world)
    assert errors == []
    _, errors = collect(raw, source=_rel(path), world_size=world + 1)
    assert [e.key for e in errors] == ["parallel"]


@pytest.mark.parametrize("path", CONFIGS, ids=_rel)
def test_header_shows_launch_commands(path: Path) -> None:
    cfg = load_config(path)
    lines = path.read_text().splitlines()
    header = []
    for line in lines:
        if not line.startswith("#"):
            break
        header.append(line)
    text = "\n".join(header)
    assert header, f"{_rel(path)} has no header comment"
    assert f"flashcp train {_rel(path)}" in text
    world = cfg.parallel.world_size
    single = f"--nproc_per_node {world} src/flashcp/train.py" in text
    nodes = -(-world // GPUS_PER_NODE)
    multi = (  # one launcher per node
        world > GPUS_PER_NODE
        and f"--nnodes {nodes} --node-rank R" in text
        and f"--nnodes {nodes} --rank R" in text
        and f"--nproc_per_node {world // nodes} src/flashcp/train.py" in text
    )
    assert single or multi, f"{_rel(path)}: no launch command for {world} processes"
    assert f"--config {_rel(path)}" in text


def _header(path: Path) -> str:
    """The header comment as one line of text."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(lines)


GPU_CONFIGS = [p for p in CONFIGS if load_config(p).run.device == "gpu"]


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=_rel)
def test_gpu_config_fits_its_budget_by_the_plan(path: Path) -> None:
    """Issue 11: every GPU config plans within 96 GiB per H20 (`hardware.memory_gib`), and its
    header states the planned peak per rank and the GPUs / nodes it needs."""
    cfg = load_config(path)
    assert cfg.hardware.memory_gib == 96
    p = plan(cfg, device="gpu")
    assert p.fits, over_budget(p)
    header = _header(path)
    peak = re.search(r"planned peak ([\d.]+) GiB per rank", header)
    assert peak, f"{_rel(path)}: the header does not state the planned peak"
    assert float(peak.group(1)) == round(p.peak.total_bytes / GIB, 1)
    need = re.search(r"needs (\d+) GPUs = (\d+) nodes? of 8", header)
    assert need, f"{_rel(path)}: the header does not state the GPUs / nodes it needs"
    world = cfg.parallel.world_size
    assert (int(need.group(1)), int(need.group(2))) == (world, -(-world // GPUS_PER_NODE))


@pytest.mark.parametrize("path", CONFIGS, ids=_rel)
def test_config_builds_or_is_marked_gpu(path: Path) -> None:
    cfg = load_config(path)
    if cfg.run.device == "gpu":
        assert cfg.train.dtype == "bfloat16"
        return  # real shapes: schema and arithmetic only (checked above)
    # CPU-sized configs say auto: float32 here, bfloat16 on a GPU (whose FlashAttention
    # kernels have no float32), so the same file runs on both.
    assert cfg.train.dtype == "auto"
    assert resolve_dtype(cfg, "cpu") == "float32" and resolve_dtype(cfg, "gpu") == "bfloat16"
    paddle.seed(0)
    model = build_model(cfg.model)
    if cfg.extras.get("lora") is not None:
        apply_lora_config(model, cfg.extras["lora"])  # every target pattern matches a layer
    data = DPOData(cfg) if cfg.run.recipe == "dpo" else TrainData(cfg)
    batch = data.next_step()[0]
    asg = make_assignment(cfg.parallel.cp_mode, cfg.parallel.cp, batch.mask.indices, causal=True)
    assert asg.world == cfg.parallel.cp
    asg.chunk_len(batch.seq_len)  # the layout splits this config's sequences
    ctx = AttentionContext(mask=batch.mask.indices, causal=True)  # whole sequence, no CP group
    hidden = model(paddle.to_tensor(batch.input_ids), paddle.to_tensor(batch.positions), ctx)
    logits = model.logits(hidden)
    assert list(logits.shape) == [*batch.input_ids.shape, cfg.model.vocab_size]
    assert np.isfinite(logits.numpy()).all()


def test_flashcp_validate_all(monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(ROOT)
    assert cli.main(["validate"]) == 0
    out = capsys.readouterr().out
    assert f"{len(CONFIGS)} of {len(CONFIGS)} config(s) valid" in out
    assert "glm_moe ~106.9B params" in out
