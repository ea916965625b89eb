"""A layer's forward without gradients (recompute's first pass, DPO's reference pass) against
the planner's `nograd_forward_transient`, by Paddle's allocator."""

from __future__ import annotations

import gc
from typing import Any

import paddle
import pytest

from flashcp.models import build_model, preset
from flashcp.plan import activations as act
from flashcp.plan import plan
from flashcp.plan.counts import Dtypes
from flashcp.plan.moe_rows import ExpertRows
from helpers.configs import PLANNED, Sections, TinyCfg
from helpers.kept import allocated_by, causal_batch

B, S = 2, 128
CASES = [
    ("tiny_glm", {}), ("tiny_llama", {}), ("tiny_qwen3", {}), ("tiny", {}), ("tiny_ernie", {}),
    ("tiny_qwen2", {}), ("tiny_glm_moe", {}), ("tiny_qwen3_moe", {}),
    ("tiny_glm_moe", {"num_experts_per_tok": 3}), ("tiny_qwen3_moe", {"num_experts_per_tok": 1}),
    ("tiny_qwen3", {"num_kv_heads": 4}), ("tiny_qwen3", {"num_kv_heads": 1}),
]  # fmt: skip


@pytest.fixture
def tiny_base() -> Sections:
    return PLANNED


def _nograd_peak(model: Any, index: int, hold: list[Any] | None = None) -> tuple[int, Any]:
    """The allocator's peak above the start of decoder layer `index`'s forward without
    gradients (its input already allocated), on the second of two forwards, and the expert
    layout that layer laid out (None for a dense layer)."""
    from flashcp.models import experts

    layer = dict(model.named_sublayers())[f"model.layers.{index}"]
    core = paddle.base.core
    seen: dict[str, Any] = {}
    layouts: list[Any] = []
    original = experts.plan_layout

    def spy(*a: Any) -> Any:
        layouts.append(original(*a))
        return layouts[-1]

    def enter(*_: Any) -> None:
        gc.collect()
        seen["start"] = core.host_memory_stat_current_value("Allocated", 0)
        core.host_memory_stat_reset_peak_value("Allocated", 0)
        layouts.clear()

    def leave(*_: Any) -> None:
        seen["peak"] = core.host_memory_stat_peak_value("Allocated", 0) - seen["start"]
        seen["layout"] = layouts[-1] if layouts else None
        if hold is not None:
            hold.clear()

    hooks = [layer.register_forward_pre_hook(enter), layer.register_forward_post_hook(leave)]
    ids, pos, ctx = causal_batch(256, B, S)
    experts.plan_layout = spy
    try:
        for _ in range(2):
            with paddle.no_grad():
                out = model(ids, pos, ctx)
            del out
    finally:
        experts.plan_layout = original
        for h in hooks:
            h.remove()
    return int(seen["peak"]), seen["layout"]


@pytest.mark.parametrize("numpy_ops", [True, False], ids=["numpy-ops", "paddle-ops"])
@pytest.mark.parametrize(
    ("preset_name", "overrides"),
    CASES,
    ids=[n + "".join(f"-{k}{v}" for k, v in o.items()) for n, o in CASES],
)
def test_nograd_layer_forward_peaks_where_the_plan_says(
    preset_name: str, overrides: dict[str, int], numpy_ops: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One decoder layer's no-grad forward peaks at `nograd_forward_transient` above its
    input, to one float per token, for every family (dense, sandwich norms,
    QK-norm, GELU, MoE with and without a shared expert, k = 1, 2, 3 experts per token at the
    buffer it laid out), with numpy's element-wise ops and with Paddle's (the GPU path's
    code; the attention kernel is still the CPU one, with its copies of q, k and v), with
    grouped and ungrouped KV heads."""
    from flashcp.models import cpu_elementwise

    if not numpy_ops:
        monkeypatch.setattr(cpu_elementwise, "applies", lambda *tensors: False)
        cpu_attention = act.nograd_attention  # the kernel here is the CPU one, copies and all

        def attention(args: Any, dt: Dtypes) -> Any:
            return cpu_attention(args, Dtypes(c=4, res=4, param=4))

        monkeypatch.setattr(act, "nograd_attention", attention)
    args = preset(preset_name, num_layers=2, **overrides)
    index = 1 if args.is_moe_layer(1) else 0
    measured, layout = _nograd_peak(build_model(args, seed=0), index)
    rows = None
    if layout is not None:
        rows = ExpertRows(layout.rows / (B * S), layout.rows > sum(layout.counts), 0, 0)
    dt = Dtypes(c=4, res=4, param=4, gpu=not numpy_ops)
    planned = act.nograd_forward_transient(args, index, dt, rows).bytes(dt) * B * S
    assert abs(measured - planned) <= 4 * B * S, (measured / (4 * B * S), planned / (4 * B * S))


def test_a_layer_holding_a_dead_tensor_is_caught() -> None:
    """Negative control: a layer that still holds its v projection through the MLP (as the
    layer's forward did before it dropped q, k and v after attention) peaks `kv` floats per
    token above the plan — the measurement sees a held tensor."""
    args = preset("tiny_glm", num_layers=2)
    model = build_model(args, seed=0)
    attn = dict(model.named_sublayers())["model.layers.0.self_attn"]
    held: list[Any] = []
    attn.v_proj.register_forward_post_hook(lambda _layer, _inp, out: held.append(out))
    measured, _ = _nograd_peak(model, 0, hold=held)
    dt = Dtypes(c=4, res=4, param=4)
    planned = act.nograd_forward_transient(args, 0, dt).bytes(dt) * B * S
    kv = args.num_kv_heads * args.head_size
    assert measured - planned == pytest.approx(kv * 4 * B * S, abs=4 * B * S)


@pytest.mark.parametrize("mode", ["full", "refined"])
@pytest.mark.parametrize("preset_name", ["tiny_glm", "tiny_qwen3", "tiny", "tiny_glm_moe",
                                         "tiny_qwen3_moe"])  # fmt: skip
def test_recompute_forward_peaks_at_the_planned_moment(
    preset_name: str, mode: str, tiny_cfg: TinyCfg
) -> None:
    """The plan's `forward: layer` moment (the layers below kept, and one layer's no-grad
    forward: `activations` + `layer_working_set`) is the allocator's peak over a recompute
    forward of the whole model, to one float per token — refined recompute's first pass
    holding each layer's LSE through its MLP too. Negative control: the other mode's plan."""

    def config(recompute: str) -> Any:
        return tiny_cfg(
            model={"preset": preset_name, "recompute": recompute},
            data={"micro_batch_size": B, "seq_len": S},
            train={"dtype": "float32"},
        )

    def planned(recompute: str) -> float:
        moment = plan(config(recompute), device="cpu").ranks[0].moments["forward: layer"]
        return moment["activations"] + moment["layer_working_set"]

    cfg = config(mode)

    model = build_model(cfg.model, seed=0)
    ids, pos, ctx = causal_batch(cfg.model.vocab_size, B, S)
    measured = allocated_by(lambda: model(ids, pos, ctx))[1]
    assert abs(measured - planned(mode)) <= 4 * B * S, (measured, planned(mode))
    other = "full" if mode == "refined" else "refined"
    assert abs(measured - planned(other)) > 4 * B * S
    # without recompute no layer runs a forward without gradients
    assert "forward: layer" not in plan(config("none"), device="cpu").ranks[0].moments


@pytest.mark.parametrize(
    ("preset_name", "recompute"),
    [("tiny_glm", "none"), ("tiny_qwen3", "none"), ("tiny", "none"), ("tiny_glm_moe", "none"),
     ("tiny_glm", "refined")],
)  # fmt: skip
def test_dpo_reference_forward_peaks_at_the_planned_moment(
    preset_name: str, recompute: str, tiny_cfg: TinyCfg
) -> None:
    """The plan's `reference forward` moment (DPO's reference log-probs: the model without
    gradients), its activations less the final norm's, is the allocator's peak over a no-grad
    forward of the whole model, to one float per token — a layer's peak over its input, and
    the input and rotary tables; under refined recompute too (the reference pass pins no
    LSE: recompute runs only while gradients are recorded). Negative control: the peak of
    the layer alone."""
    cfg = tiny_cfg(
        model={"preset": preset_name, "recompute": recompute},
        data={"micro_batch_size": B, "seq_len": S},
        train={"dtype": "float32"},
        run={"recipe": "dpo", "output_dir": "/nonexistent/run"},
    )
    args, dt = cfg.model, Dtypes(c=4, res=4, param=4)
    norm = int(act.final_norm(args).bytes(dt) * B * S)  # after the layers, counted with them
    planned = plan(cfg, device="cpu").ranks[0].moments["reference forward"]["activations"] - norm
    model = build_model(cfg.model, seed=0)
    ids, pos, ctx = causal_batch(cfg.model.vocab_size, B, S)
    measured = allocated_by(paddle.no_grad()(lambda: model(ids, pos, ctx)))[1]
    assert abs(measured - planned) <= 4 * B * S, (measured, planned)
    layers = range(args.num_layers)
    alone = max(act.nograd_forward_transient(args, i, dt).bytes(dt) for i in layers) * B * S
    assert abs(measured - alone) > 4 * B * S


@pytest.mark.parametrize("mode", ["full", "refined"])
@pytest.mark.parametrize(("batch", "seq", "tile"), [(1, 256, 64), (2, 128, 32), (2, 128, 64)])
@pytest.mark.parametrize("preset_name", ["tiny_glm", "tiny_qwen3", "tiny", "tiny_glm_moe"])
def test_tiled_recompute_forward_peaks_at_the_planned_moment(
    preset_name: str,
    batch: int,
    seq: int,
    tile: int,
    mode: str,
    tiny_cfg: TinyCfg,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under sequence tiling (`model.tile_tokens`) the plan's `forward: layer` moment is the
    allocator's peak over a whole recompute forward, to one float per token: the attention
    over full-length q, k, v, or the `after` block's full-length attention and layer outputs
    with one tile — `tile_tokens` of every row of the micro-batch — of the rest. Negative
    control (two rows): a tile counted as `tile_tokens` tokens in all."""
    cfg = tiny_cfg(
        model={"preset": preset_name, "recompute": mode, "tile_tokens": tile},
        data={"micro_batch_size": batch, "seq_len": seq},
        train={"dtype": "float32"},
    )

    def planned() -> float:
        moment = plan(cfg, device="cpu").ranks[0].moments["forward: layer"]
        return moment["activations"] + moment["layer_working_set"]

    model = build_model(cfg.model, seed=0)
    ids, pos, ctx = causal_batch(cfg.model.vocab_size, batch, seq)
    measured = allocated_by(lambda: model(ids, pos, ctx))[1]
    tokens = batch * seq
    assert abs(measured - planned()) <= 4 * tokens, (measured, planned())
    if (batch, tile, preset_name) == (2, 64, "tiny_glm"):  # there the `after` moment peaks
        from flashcp.plan.setup import Setup

        monkeypatch.setattr(Setup, "tile", property(lambda s: s.features.tile_tokens))
        assert abs(measured - planned()) > 4 * tokens


@pytest.mark.parametrize("tile", [0, 64])
@pytest.mark.parametrize("mode", ["full", "refined"])
@pytest.mark.parametrize("preset_name", ["tiny_glm", "tiny_qwen3", "tiny_glm_moe"])
def test_bf16_stream_recompute_forward_peaks_at_the_planned_moment(
    preset_name: str, mode: str, tile: int, tiny_cfg: TinyCfg
) -> None:
    """With a bf16 residual stream (`model.residual_dtype`) the `forward: layer` moment is
    still the measured peak, to one float per token: untiled, the layer's float32 copy of its
    input lives through the layer; tiled, a tile's upcast dies at its residual add and the
    bf16 rows stay. Negative control: the tiled plan with the untiled layer's upcast."""
    B, S = 2, 128
    cfg = tiny_cfg(
        model={"preset": preset_name, "recompute": mode, "tile_tokens": tile,
               "residual_dtype": "bfloat16"},
        data={"micro_batch_size": B, "seq_len": S},
        train={"dtype": "float32"},
    )  # fmt: skip
    moment = plan(cfg, device="cpu").ranks[0].moments["forward: layer"]
    planned = moment["activations"] + moment["layer_working_set"]
    model = build_model(cfg.model, seed=0)
    ids, pos, ctx = causal_batch(cfg.model.vocab_size, B, S)
    measured = allocated_by(lambda: model(ids, pos, ctx))[1]
    assert abs(measured - planned) <= 4 * B * S, (measured, planned)
    if tile and preset_name == "tiny_glm":  # its `after` moment peaks: half the tokens a tile
        upcast = cfg.model.hidden_size * 4 * B * S // 2
        assert abs(measured - (planned + upcast)) > 4 * B * S
