"""Every file under configs/ validates, documents its launch command, and (CPU ones) builds;
the GPU recipes point at a model directory and a dataset (placeholders to fill in) whose
filled-in form gives the model the file states."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import shlex
from pathlib import Path

import numpy as np
import paddle
import pytest

from flashcp import cli
from flashcp.attention.context import AttentionContext
from flashcp.attention.registry import make_assignment
from flashcp.commands.run import node_problem
from flashcp.config import collect, load_config, read_yaml
from flashcp.config.device_rule import compute_dtype
from flashcp.config.placeholders import find_placeholders
from flashcp.data import TrainData
from flashcp.data.dpo_stream import DPOData
from flashcp.lora.setup import apply_lora_config
from flashcp.models import build_model, preset
from flashcp.models.hf_config import TRAINING_FIELDS, hf_config
from flashcp.plan import GIB, plan
from flashcp.plan.report import GPUS_PER_NODE, over_budget
from flashcp.problems import ProblemsError
from helpers.paths import ROOT

CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))
EXPECTED = {
    "gpt/tiny_cp2.yaml",
    "gpt/tiny_cp4.yaml",
    "glm/tiny_cp2.yaml",
    "glm/tiny_moe_cp2.yaml",
    "glm/tiny_moe_mtp_cp2.yaml",
    "glm/glm4_9b_cp8.yaml",
    "glm/glm45_air_cp8.yaml",
    "gpt/tiny_sft_packed_cp2.yaml",
    "glm/tiny_dpo_lora_cp2.yaml",
    "glm/tiny_dpo_lora_pp2.yaml",
    "glm/tiny_moe_dpo_lora_pp2_cp2.yaml",
    "glm/glm45_air_dpo_lora_pp_cp.yaml",
    "glm/glm45_air_dpo_lora_ep.yaml",
    "glm/glm4_9b_dpo_lora_pp2_cp4.yaml",
    "glm/glm4_9b_dpo_lora_4m_cp8.yaml",
    "glm/glm4_9b_sft_4m_cp8.yaml",
    "glm/glm45_air_sft_ep8_pp4_cp8.yaml",
    "gpt/tiny_sliding_window_cp2.yaml",
    "gpt/tiny_global_window_cp2.yaml",
    "glm/tiny_prefix_lm_sft_cp2.yaml",
    "ernie/tiny_cp2.yaml",
    "ernie/tiny_moe_ep2_cp2.yaml",
    "llama/tiny_cp2.yaml",
    "qwen/tiny_qwen2_cp2.yaml",
    "qwen/tiny_qwen3_cp2.yaml",
    "qwen/tiny_qwen3_moe_ep2_cp2.yaml",
    "qwen/tiny_qwen3_dpo_lora_cp2.yaml",
}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_expected_configs_ship() -> None:
    assert {str(p.relative_to(ROOT / "configs")) for p in CONFIGS} >= EXPECTED


@pytest.mark.parametrize("path", CONFIGS, ids=_rel)
def test_config_validates_for_its_world_size(path: Path) -> None:
    raw = read_yaml(path)
    cfg, errors = collect(raw, source=_rel(path), allow_placeholders=True)
    assert cfg is not None and errors == [], "\n".join(map(str, errors))
    world = cfg.parallel.world_size
    _, errors = collect(raw, source=_rel(path), world_size=world, allow_placeholders=True)
    assert errors == []
    _, errors = collect(raw, source=_rel(path), world_size=world + 1, allow_placeholders=True)
    assert [e.key for e in errors] == ["parallel"]


@pytest.mark.parametrize("path", CONFIGS, ids=_rel)
def test_header_shows_launch_commands(path: Path) -> None:
    cfg = load_config(path, allow_placeholders=True)
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


GPU_CONFIGS = [p for p in CONFIGS if load_config(p, allow_placeholders=True).run.device == "gpu"]


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=_rel)
def test_gpu_config_fits_its_budget_by_the_plan(path: Path) -> None:
    """Issue 11: every GPU config plans within 96 GiB per H20 (`hardware.memory_gib`), and its
    header states the planned peak per rank and the GPUs / nodes it needs."""
    cfg = load_config(path, allow_placeholders=True)
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
    cfg = load_config(path, allow_placeholders=True)
    if cfg.run.device == "gpu":
        assert cfg.train.dtype == "bfloat16"
        return  # real shapes: schema and arithmetic only (checked above)
    # CPU-sized configs say auto: float32 here, bfloat16 on a GPU (whose FlashAttention
    # kernels have no float32), so the same file runs on both.
    assert cfg.train.dtype == "auto"
    assert compute_dtype(cfg, "cpu") == "float32" and compute_dtype(cfg, "gpu") == "bfloat16"
    paddle.seed(0)
    model = build_model(cfg.model)
    if cfg.extras.get("lora") is not None:
        apply_lora_config(model, cfg.extras["lora"])  # every target pattern matches a layer
    data = DPOData(cfg) if cfg.run.recipe == "dpo" else TrainData(cfg)
    batch = data.next_step()[0]
    mask = batch.mask  # its attention.mask (causal documents by default)
    asg = make_assignment(cfg.parallel.cp_mode, cfg.parallel.cp, mask.indices, causal=mask.causal)
    assert asg.world == cfg.parallel.cp
    asg.chunk_len(batch.seq_len)  # the layout splits this config's sequences
    ctx = AttentionContext(mask=mask.indices, causal=mask.causal)  # whole sequence, no CP group
    hidden = model(paddle.to_tensor(batch.input_ids), paddle.to_tensor(batch.positions), ctx)
    logits = model.logits(hidden)
    assert list(logits.shape) == [*batch.input_ids.shape, cfg.model.vocab_size]
    assert np.isfinite(logits.numpy()).all()


def test_flashcp_validate_all(monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(ROOT)
    assert cli.main(["validate"]) == 0
    out = capsys.readouterr().out
    assert f"{len(CONFIGS)} of {len(CONFIGS)} config(s) valid" in out
    assert "glm_moe ~110.5B params from /path/to/GLM-4.5-Air" in out  # with the MTP layer
    assert out.count("fill in before training: model.from_pretrained (/path/to/") == len(GPU)


# -- the GPU recipes: a model directory and a dataset to fill in ------------------------------

GPU = {  # recipe → (preset with the public config.json shape, run.recipe)
    "glm/glm4_9b_cp8.yaml": ("glm4_9b", "sft"),
    "glm/glm4_9b_dpo_lora_pp2_cp4.yaml": ("glm4_9b", "dpo"),
    "glm/glm4_9b_dpo_lora_4m_cp8.yaml": ("glm4_9b", "dpo"),
    "glm/glm4_9b_sft_4m_cp8.yaml": ("glm4_9b", "sft"),
    "glm/glm45_air_cp8.yaml": ("glm45_air", "sft"),
    "glm/glm45_air_dpo_lora_pp_cp.yaml": ("glm45_air", "dpo"),
    "glm/glm45_air_dpo_lora_ep.yaml": ("glm45_air", "dpo"),
    "glm/glm45_air_sft_ep8_pp4_cp8.yaml": ("glm45_air", "sft"),
    "llama/llama31_8b_sft_256k_cp8.yaml": ("llama31_8b", "sft"),
    "qwen/qwen3_8b_sft_256k_cp8.yaml": ("qwen3_8b", "sft"),
    "qwen/qwen3_30b_a3b_dpo_lora_ep.yaml": ("qwen3_30b_a3b", "dpo"),
    "ernie/ernie45_21b_a3b_sft_128k_cp8.yaml": ("ernie45_21b_a3b", "sft"),
    "ernie/ernie45_21b_a3b_dpo_lora_128k_cp8.yaml": ("ernie45_21b_a3b", "dpo"),
}
LONG = {"glm/glm4_9b_dpo_lora_4m_cp8.yaml": 4194304, "glm/glm4_9b_sft_4m_cp8.yaml": 4194304,
        "llama/llama31_8b_sft_256k_cp8.yaml": 262144,
        "qwen/qwen3_8b_sft_256k_cp8.yaml": 262144}  # fmt: skip
"""Recipes whose model directory must state a longer max_position_embeddings than the public
config.json (a copy with it raised: rotary positions only bound the sequence by it)."""


def _model_dir(root: Path, config_json: dict) -> Path:
    """A model directory as `model.from_pretrained` checks it before launch: config.json, a
    weight index (naming the MTP layers' tensors it declares, as GLM-4.5's index does) and
    tokenizer.json (the weights themselves are read only by the trainer)."""
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config_json, indent=1))
    layers = config_json.get("num_hidden_layers", 0)
    mtp = range(layers, layers + config_json.get("num_nextn_predict_layers", 0))
    weight_map = {f"model.layers.{i}.eh_proj.weight": "model-00001.safetensors" for i in mtp}
    index = {"metadata": {}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    (root / "tokenizer.json").write_text("{}")
    return root


def test_every_gpu_config_is_a_gpu_recipe() -> None:
    gpu = {str(p.relative_to(ROOT / "configs")) for p in CONFIGS
           if load_config(p, allow_placeholders=True).run.device == "gpu"}  # fmt: skip
    assert gpu == set(GPU)


@pytest.mark.parametrize("name", sorted(GPU))
def test_gpu_recipe_needs_its_model_directory_and_data(name: str, tmp_path: Path) -> None:
    path = ROOT / "configs" / name
    shape, recipe = GPU[name]
    raw = read_yaml(path)
    assert dict(find_placeholders(raw)).keys() == {"model.from_pretrained", "data.path"}
    static = load_config(path, allow_placeholders=True)  # what `flashcp validate` and a
    assert static.run.recipe == recipe  # pre-launch memory plan see
    assert static.data.tokenizer == raw["model"]["from_pretrained"]  # the directory's own
    assert "tokenizer" not in raw["data"]  # no byte tokenizer, no toy corpus
    # the model section restates the real model's config.json (the preset's public shape)
    training = {k: getattr(static.model, k) for k in TRAINING_FIELDS}
    longer = {"max_seq_len": LONG[name]} if name in LONG else {}
    assert static.model == dataclasses.replace(preset(shape, **longer), **training)

    with pytest.raises(ProblemsError) as refused:  # unfilled: refused, both named
        load_config(path)
    assert [e.key for e in refused.value.problems] == ["model.from_pretrained", "data.path"]
    wants = {"sft": "'messages' list", "dpo": "'prompt', 'chosen' and 'rejected'"}[recipe]
    assert wants in refused.value.problems[1].message

    # filled in with that model's directory (config.json as transformers 4.x writes it for the
    # checkpoint, with its multi-token-prediction layer and token ids): the same model
    ids = {"eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329}  # GLM's
    if not shape.startswith("glm"):  # the others' own ids sit below their vocabularies
        ids = {"eos_token_id": 2, "pad_token_id": 0}
    config = hf_config(preset(shape, **longer), "bfloat16", token_ids=ids)
    if shape == "glm45_air":
        config["num_nextn_predict_layers"] = 1
    model_dir = _model_dir(tmp_path / "model", config)
    data = tmp_path / "data.jsonl"
    data.write_text("{}\n")
    fill = [f"model.from_pretrained={model_dir}", f"data.path={data}"]
    filled = load_config(path, fill)
    assert filled.model == static.model
    assert filled.checkpoint.init_from == filled.data.tokenizer == str(model_dir)
    # negative control: a directory of another depth is refused, naming the key and both values
    config["num_hidden_layers"] = static.model.num_layers - 1
    other = _model_dir(tmp_path / "other", config)
    with pytest.raises(ProblemsError, match=(
        rf"model\.num_layers: {static.model.num_layers} contradicts config\.json "
        rf"num_hidden_layers {static.model.num_layers - 1} in {other}"
    )):  # fmt: skip
        load_config(path, [f"model.from_pretrained={other}", f"data.path={data}"])


def _header_commands(path: Path) -> list[list[str]]:
    """The shell commands in a config's header comment (continuation lines joined)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].strip())
    text = "\n".join(lines).replace("\\\n", " ")
    return [shlex.split(t) for t in text.splitlines() if t.startswith(("flashcp ", "python "))]


def test_air_recipe_header_shows_the_two_node_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both two-node forms, with flags their own parsers accept and a node split that fits."""
    # (`paddle.distributed.launch` is also a function name there: import the module by path)
    launch_args = importlib.import_module("paddle.distributed.launch.context.args_envs")

    path = ROOT / "configs" / "glm" / "glm45_air_dpo_lora_pp_cp.yaml"
    world = load_config(path, allow_placeholders=True).parallel.world_size
    two_node = [c for c in _header_commands(path) if "--nnodes" in c]
    assert [c[0] for c in two_node] == ["flashcp", "python"]
    for rank in ("0", "1"):
        argv = [rank if a == "R" else "10.0.0.1:29500" if a == "HOST:PORT" else a
                for a in two_node[0][1:]]  # fmt: skip
        args, extra = cli.build_parser().parse_known_args(argv)
        assert (args.command, args.nnodes, args.node_rank) == ("train", 2, int(rank))
        assert args.master == "10.0.0.1:29500" and args.config == _rel(path)
        assert node_problem(args) is None
        assert {o.split("=")[0] for o in args.overrides + extra} == {
            "model.from_pretrained", "data.path"}  # fmt: skip
    launch = two_node[1]
    assert launch[:3] == ["python", "-m", "paddle.distributed.launch"]
    # Paddle's launcher's own parser (it reads sys.argv; PADDLE_TRAINER_ID would set the rank)
    monkeypatch.delenv("PADDLE_TRAINER_ID", raising=False)
    monkeypatch.setattr("sys.argv", ["launch", *["1" if a == "R" else a for a in launch[3:]]])
    parsed, _ = launch_args.parse_args()
    assert (parsed.nnodes, parsed.rank, parsed.master) == ("2", 1, "HOST:PORT")
    assert int(parsed.nproc_per_node) * 2 == world
    assert parsed.training_script == "src/flashcp/train.py"
    assert parsed.training_script_args[:2] == ["--config", _rel(path)]


HOST = [p for p in GPU_CONFIGS if load_config(p, allow_placeholders=True).hardware.host_memory_gib]


@pytest.mark.parametrize("path", HOST, ids=_rel)
def test_long_context_header_numbers_come_from_the_plan(path: Path) -> None:
    """Issue 20: a config with a host budget states its planned host peak per node and its
    estimated step time, as the plan and the step-time estimate give them; a one-node config
    also the longest sequence its node fits (`flashcp plan --longest`)."""
    from flashcp.plan.longest import longest
    from flashcp.plan.report import _duration
    from flashcp.plan.steptime import estimate

    cfg = load_config(path, allow_placeholders=True)
    p = plan(cfg, device="gpu")
    assert p.fits and p.host is not None
    assert p.host.budget_bytes == cfg.hardware.host_memory_gib * GIB
    header = _header(path)
    host = re.search(r"planned host peak ([\d,]+) GiB per node", header)
    assert host, f"{_rel(path)}: the header does not state the planned host peak"
    assert int(host.group(1).replace(",", "")) == round(p.host.peak.total_bytes / GIB)
    step = estimate(cfg)
    assert f"Estimated step time {_duration(step.seconds)}" in header
    if cfg.parallel.world_size <= GPUS_PER_NODE:
        found = longest(cfg)
        assert f"this node fits by the plan: {found.seq_len:,} tokens" in header
        assert found.seq_len >= cfg.data.seq_len


@pytest.mark.parametrize("name", ["glm4_9b_sft_4m_cp8", "glm4_9b_dpo_lora_4m_cp8"])
def test_the_4m_recipes_meet_the_issue_goal(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 20: GLM-4-9B full fine-tune and LoRA-DPO at >= 4,194,304 tokens per sequence on
    one node of 8, by the plan (device and host), and `flashcp plan --longest --json` says at
    least that."""
    path = ROOT / f"configs/glm/{name}.yaml"
    cfg = load_config(path, allow_placeholders=True)
    assert cfg.data.seq_len >= 4194304 and cfg.parallel.world_size == 8
    p = plan(cfg)
    assert p.fits and p.host is not None and p.host_fits
    assert cli.main(["plan", str(path), "--longest", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["longest_seq_len"] >= 4194304
