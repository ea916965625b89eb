"""`flashcp export RUN OUT --adapters-for paddleformers`: a LoRA run's adapters in PaddleFormers'
fused GLM-4.5 layout. PaddleFormers itself makes the base directory and loads the result
(``LoRAModel.from_pretrained`` into its ``Glm4MoeForCausalLMDeprecated``), and its logits are
the run's; the fusion's column order is PaddleFormers' own conversion, bit for bit."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import pytest
from safetensors import safe_open

from bench import numerics
from flashcp import cli, masks
from flashcp.attention.context import AttentionContext
from flashcp.checkpoint import fused_adapters
from flashcp.checkpoint.export import ExportError, export_run
from flashcp.checkpoint.fused_adapters import FusedExportError, FusedModule, fuse_adapters
from flashcp.models import preset
from helpers.configs import tiny_config
from helpers.paddleformers_glm import glm_logits, load_glm, random_glm, save_glm
from helpers.trainruns import fit

ARGS = preset(
    "tiny_glm_moe", vocab_size=300, use_qk_norm=True, rotary_base=50_000.0, max_seq_len=64
)
IDS = np.random.default_rng(1).integers(0, 300, (2, 16))
TARGETS = [".*q_proj", ".*k_proj", ".*v_proj", ".*o_proj", ".*gate_proj", ".*up_proj",
           ".*down_proj", r".*mlp\.experts"]  # fmt: skip
"""Every kind of adapter: fused (q/k/v, gate/up), plain, and the routed experts."""


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GLM-4.5 directory PaddleFormers saved."""
    return save_glm(random_glm(ARGS, seed=7), tmp_path_factory.mktemp("pf") / "glm45")


@pytest.fixture(scope="module")
def lora_run(base: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """(run directory, trainer) of 2 LoRA steps from `base`, the adapters moved well off zero."""
    tmp = tmp_path_factory.mktemp("lora")
    cfg = tiny_config(tmp, base={"model": {"from_pretrained": str(base)}},
                      data={"seq_len": 32, "micro_batch_size": 2, "tokenizer": "byte"},
                      train={"steps": 2, "lr": 3e-2, "warmup_steps": 0, "seed": 2},
                      lora={"rank": 4, "alpha": 8.0, "target_modules": TARGETS},
                      checkpoint={"every": 2},
                      run={"device": "cpu", "recipe": "sft"})  # fmt: skip
    return tmp / "run", fit(cfg).trainer


def _logits(model: paddle.nn.Layer, ids: np.ndarray) -> np.ndarray:
    b, s = ids.shape
    pos = paddle.arange(s, dtype="int64").unsqueeze(0).expand([b, s])
    ctx = AttentionContext(mask=masks.causal_mask(b, s).indices, causal=True)
    with paddle.no_grad():
        return model.logits(model(paddle.to_tensor(ids), pos, ctx)).numpy()


def _paddleformers_lora(base: Path, adapters: Path) -> np.ndarray:
    """PaddleFormers' logits: its class from `base`, `LoRAModel.from_pretrained(adapters)`."""
    from paddleformers.peft import LoRAModel

    lora = LoRAModel.from_pretrained(load_glm(base), str(adapters))
    lora.eval()
    return glm_logits(lora.model, IDS)


N = ARGS.hidden_size * IDS.shape[1]
"""The longest reduction in front of a logit (the float32 rule's n)."""


def test_qkv_columns_are_paddleformers_fusion(base: Path) -> None:
    """PaddleFormers' own load fuses the directory's q/k/v into ``qkv_proj``: each projection
    is exactly at `qkv_columns` (per KV head: its query heads, k, v)."""
    pf = load_glm(base)
    index = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    columns = fused_adapters.qkv_columns(ARGS)
    fused = pf.model.layers[0].self_attn.qkv_proj.weight.numpy()  # [in, out]
    assert sorted(np.concatenate(list(columns.values()))) == list(range(fused.shape[1]))
    for proj, cols in columns.items():
        key = f"model.layers.0.self_attn.{proj}.weight"
        with safe_open(str(base / index[key]), "numpy") as f:
            np.testing.assert_array_equal(fused[:, cols], f.get_tensor(key).T, err_msg=proj)
    naive = np.arange(columns["q_proj"].size)  # q first, as concatenated: not PaddleFormers'
    assert not np.array_equal(naive, columns["q_proj"])


def test_block_diagonal_fusion_is_the_separate_adapters() -> None:
    """x·A·B of the fused adapter = each piece's x·A_i·B_i in its own columns (float64)."""
    rng = np.random.default_rng(0)

    def normal(*shape: int) -> np.ndarray:  # float32 values: the fused float32 A, B hold them
        return rng.standard_normal(shape).astype(np.float32).astype(np.float64)

    shapes = ((2, 4, np.array([5, 0, 3, 1])), (3, 2, np.array([2, 4])))
    pieces = [(normal(6, r), normal(r, k), c) for r, k, c in shapes]
    module = FusedModule(6, pieces)  # type: ignore[arg-type]
    assert module.rank == 5
    a, b = module.arrays(8)  # padded: 3 zero columns of A, zero rows of B
    x = rng.standard_normal((3, 6))
    want = np.zeros((3, 6))
    for pa, pb, cols in pieces:
        want[:, cols] = x @ pa @ pb
    # exactly the pieces' values in A and B, the products in float64 on both sides: only
    # float64 summation order differs, so a float64-tight tolerance
    got = x @ a.astype(np.float64) @ b.astype(np.float64)
    tight = 1e-12 * float(np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=0, atol=tight)
    # negative control: pieces side by side, their columns ignored
    naive = np.concatenate([x @ pa @ pb for pa, pb, _ in pieces], axis=1)
    assert np.abs(got - naive).max() > 1e6 * tight
    assert not a[:, 5:].any() and not b[5:].any()


def test_paddleformers_loads_the_export_with_the_runs_logits(
    base: Path, lora_run: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, trainer = lora_run
    out = tmp_path / "pf_adapters"
    assert cli.main(["export", str(run), str(out), "--adapters-for", "paddleformers"]) == 0
    printed = capsys.readouterr().out
    assert "r 12, lora_alpha 24 (scaling 2, the run's alpha / rank)" in printed  # 3 pieces of 4
    config = json.loads((out / "lora_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (12, 24.0)
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        "Glm4MoeForCausalLM"
    ]
    want = _logits(trainer.model, IDS)
    got = _paddleformers_lora(base, out)
    numerics.assert_close(got, want, n=N, what="PaddleFormers + exported adapters vs the run")
    # negative controls: the base alone, and q/k/v fused in concatenation order
    numerics.assert_rejects(glm_logits(load_glm(base), IDS), want, n=N)
    naive = tmp_path / "naive"
    mp = pytest.MonkeyPatch()
    with mp.context() as patch:
        width = ARGS.head_size
        q, kv = ARGS.num_heads * width, ARGS.num_kv_heads * width
        plain = {"q_proj": np.arange(q), "k_proj": q + np.arange(kv),
                 "v_proj": q + kv + np.arange(kv)}  # fmt: skip
        patch.setattr(fused_adapters, "qkv_columns", lambda args: plain)
        export_run(run, naive, adapters_for="paddleformers")
    numerics.assert_rejects(_paddleformers_lora(base, naive), want, n=N)


def test_what_has_no_exact_place_is_refused(
    lora_run: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, _ = lora_run
    assert cli.main(["export", str(run), str(tmp_path / "o"), "--adapters-for",
                     "paddleformers", "--merge-lora"]) == 2  # fmt: skip
    assert "drop --merge-lora" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    a, b = np.zeros((64, 4), np.float32), np.zeros((4, 64), np.float32)
    glm4 = dataclasses.replace(preset("tiny_glm"))
    with pytest.raises(FusedExportError, match="no class with fused projections for arch 'glm'"):
        fuse_adapters({"model.layers.0.self_attn.q_proj.lora_A": a}, glm4)
    q = "model.layers.2.self_attn.q_proj"  # layer 2 of 2: an MTP layer's
    message = r"model\.layers\.2\.self_attn\.q_proj\.lora_A.*multi-token-prediction.*--merge-lora"
    with pytest.raises(FusedExportError, match=message):
        fuse_adapters({f"{q}.lora_A": a, f"{q}.lora_B": b}, ARGS)
    with pytest.raises(ExportError, match="pass --merge-lora .* or --adapters-for paddleformers"):
        export_run(run, tmp_path / "x")
