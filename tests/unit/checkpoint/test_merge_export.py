"""The streamed merged LoRA export (`flashcp.checkpoint.merge_export`) and its safetensors writer.

Stages built alone (as the trainer's ranks hold them) each write their shard; the directory
then holds base + adapters (checked against a float64 reference at a tolerance derived from
float32 arithmetic) and loads back into a whole model whose logits are the adapted model's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import paddle
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from bench import numerics
from flashcp.attention.context import AttentionContext
from flashcp.checkpoint.merge_export import merged_specs, write_merged_index, write_merged_stage
from flashcp.lora.model import apply_lora, lora_layers
from flashcp.models import build_model, preset
from flashcp.models.hf_load import load_hf_checkpoint
from flashcp.models.init import InitRule, fill_parameter
from flashcp.models.safetensors_stream import TensorSpec, safetensors_dtype, write_streaming
from flashcp.models.weight_files import INDEX_FILE
from flashcp.pipeline.stage import build_stage

TARGETS = [".*q_proj", ".*o_proj", ".*down_proj", r".*mlp\.experts"]
EPS32 = float(np.finfo(np.float32).eps)


def _adapted(model: paddle.nn.Layer) -> paddle.nn.Layer:
    """LoRA on `model` with every B set away from zero, keyed by name (any stage agrees)."""
    apply_lora(model, rank=4, alpha=8, target_modules=TARGETS, seed=7, require_match=False)
    for name, layer in lora_layers(model):
        for sub, p in layer.named_parameters():
            if sub.endswith("lora_B"):
                fill_parameter(p, 9, f"{name}.{sub}", InitRule("normal", 0.05))
    return model


def _pieces(layer_name: str, layer: paddle.nn.Layer):
    """(HF key, W, A, B, columns) of every adapted matrix of a LoRA layer: the layer's own for
    a linear one, each expert's gate / up / down pieces for stacked experts."""
    if not hasattr(layer, "gate_up_proj"):
        yield f"{layer_name}.weight", layer.weight, layer.lora_A, layer.lora_B, None
        return
    inter = layer.intermediate_size
    for e in range(layer.num_experts):
        for piece, proj, cols in [
            ("gate_proj", "gate_up_proj", (0, inter)),
            ("up_proj", "gate_up_proj", (inter, 2 * inter)),
            ("down_proj", "down_proj", None),
        ]:
            w, a, b = (getattr(layer, proj + s)[e] for s in ("", "_lora_A", "_lora_B"))
            yield f"{layer_name}.{e}.{piece}.weight", w, a, b, cols


def _float64(t: paddle.Tensor) -> np.ndarray:
    return t.astype("float32").numpy().astype(np.float64)


@pytest.mark.parametrize(
    ("name", "overrides", "pp", "dtype"),
    [
        ("tiny_glm_moe", {"num_layers": 3}, 2, "float32"),
        ("tiny_glm", {"tie_embeddings": True, "num_layers": 3}, 3, "bfloat16"),
    ],
)
def test_stage_by_stage_export_is_base_plus_adapters(
    tmp_path: Path, name: str, overrides: dict, pp: int, dtype: str
) -> None:
    args = preset(name, **overrides)
    stages = [_adapted(build_stage(args, s, pp, param_dtype=dtype, seed=0)) for s in range(pp)]
    out = tmp_path / "merged"
    for stage in stages:
        write_merged_stage(stage, out)
    names = write_merged_index(out, args, pp, dtype)
    assert names == [f"model-0000{s + 1}-of-0000{pp}.safetensors" for s in range(pp)]
    index = json.loads((out / INDEX_FILE).read_text())
    weight_map = index["weight_map"]
    assert not any(k.endswith(("lora_A", "lora_B")) for k in weight_map)
    if args.tie_embeddings:  # written once, by the first stage
        assert weight_map["model.embed_tokens.weight"] == names[0]
        assert "lm_head.weight" not in weight_map
    # each adapted weight: W + A·B·alpha/r, against float64 (tolerance: float32 rounding of
    # W + s·Σ_k A_ik B_kj, r + 1 terms, then the storage dtype's rounding of the result)
    checked = 0
    for stage in stages:
        for layer_name, layer in lora_layers(stage):
            for key, w, a, b, cols in _pieces(layer_name, layer):
                checked += _check_merged(out, weight_map, key, w, a, b, cols, layer, dtype)
    assert checked == sum(
        len(list(_pieces(n, layer))) for s in stages for n, layer in lora_layers(s)
    )
    assert checked > 0
    # it loads back (through the index) into a whole model: the adapted model's logits
    whole = _adapted(build_model(args, param_dtype=dtype, seed=0))
    merged = build_model(args, param_dtype=dtype, seed=1)  # other weights until loaded
    report = load_hf_checkpoint(merged, out)
    assert len(report.loaded) == len(weight_map)
    rng = np.random.default_rng(0)
    ids = paddle.to_tensor(rng.integers(0, 256, (2, 16)).astype("int64"))
    pos = paddle.to_tensor(np.tile(np.arange(16), (2, 1)).astype("int64"))
    ctx = AttentionContext(mask=None, causal=True)
    with paddle.no_grad():
        got, want = merged(ids, pos, ctx).numpy(), whole(ids, pos, ctx).numpy()
    if dtype == "float32":  # merged vs unmerged: another float32 order, the float32 rule
        # (bench.numerics), n = the hidden size (the reduction a merged weight's rounding enters)
        numerics.assert_close(got, want, n=args.hidden_size, what="merged hidden states")
        with paddle.no_grad():  # negative control: the base model without the adapters
            base = build_model(args, param_dtype=dtype, seed=0)(ids, pos, ctx).numpy()
        numerics.assert_rejects(base, want, n=args.hidden_size)
    else:  # the merged bf16 weights carry one more bf16 rounding (2^-9 relative)
        assert np.linalg.norm(got - want) < 2.0**-6 * np.linalg.norm(want)


def _check_merged(out, weight_map, key, w, a, b, cols, layer, dtype) -> int:
    """One merged matrix in the export against W + A·B·alpha/r in float64."""
    with safe_open(str(out / weight_map[key]), "np") as f:
        raw = f.get_slice(key)
        assert raw.get_dtype() == ("BF16" if dtype == "bfloat16" else "F32")
    got = _float64(_read(out / weight_map[key], key)).T  # HF [out, in]
    w, a, b = _float64(w), _float64(a), _float64(b)
    s = float(layer.scaling)
    want = w + a @ b * s
    size = np.abs(w) + s * (np.abs(a) @ np.abs(b))
    if cols is not None:
        want, size = want[:, cols[0] : cols[1]], size[:, cols[0] : cols[1]]
        w = w[:, cols[0] : cols[1]]
    unit = 2.0**-8 if dtype == "bfloat16" else EPS32
    np.testing.assert_array_less(np.abs(got - want), (6 * EPS32) * size + unit * size)
    # negative control: without the adapters (or with another scaling) it is off
    assert np.abs(got - w).max() > 10 * ((6 * EPS32 + unit) * size).max()
    return 1


def _read(path: Path, key: str) -> paddle.Tensor:
    with safe_open(str(path), framework="paddle") as f:
        return f.get_tensor(key)


def test_export_replaces_an_earlier_layout(tmp_path: Path) -> None:
    args = preset("tiny_glm")
    out = tmp_path / "merged"
    for s in range(2):
        write_merged_stage(_adapted(build_stage(args, s, 2, seed=0)), out)
    write_merged_index(out, args, 2, "float32")
    write_merged_stage(_adapted(build_model(args, seed=0)), out)
    assert write_merged_index(out, args, 1, "float32") == ["model-00001-of-00001.safetensors"]
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model-00001-of-00001.safetensors"]
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2


def test_streamed_file_reads_back_and_checks_its_specs(tmp_path: Path) -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = paddle.to_tensor(np.array([1.5, -2.0], np.float32)).astype("bfloat16")
    specs = [
        TensorSpec("z", "F32", [2, 3], lambda: a),
        TensorSpec("b", "BF16", [2], lambda: b.numpy()),
    ]
    path = tmp_path / "x.safetensors"
    assert write_streaming(path, specs, metadata={"format": "pt"}) == 24 + 4
    np.testing.assert_array_equal(load_file(str(path))["z"], a)
    with safe_open(str(path), framework="paddle") as f:
        assert f.metadata() == {"format": "pt"}
        assert f.get_tensor("b").astype("float32").numpy().tolist() == [1.5, -2.0]
    with pytest.raises(ValueError, match="duplicate tensor keys"):
        write_streaming(path, [specs[0], specs[0]])
    wrong = TensorSpec("w", "F32", [3, 2], lambda: a)
    with pytest.raises(ValueError, match=r"w: produced \[2, 3\] float32, the header says"):
        write_streaming(tmp_path / "y.safetensors", [wrong])
    assert not list(tmp_path.glob("y.safetensors*"))  # nothing half-written is left
    with pytest.raises(ValueError, match="no safetensors dtype for paddle.complex64"):
        safetensors_dtype(paddle.complex64)


def test_merged_specs_refuse_merged_adapters() -> None:
    model = _adapted(build_model(preset("tiny_glm"), seed=0))
    next(layer for _, layer in lora_layers(model)).merged = True
    specs = {s.key: s for s in merged_specs(model)}
    with pytest.raises(RuntimeError, match="already merged"):
        specs["model.layers.0.self_attn.q_proj.weight"].produce()
