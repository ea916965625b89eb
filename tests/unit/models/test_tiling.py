"""Sequence tiling inside a layer (`model.tile_tokens`, `flashcp.models.tiling`).

The tiled layer equals the untiled one: forward outputs row for row (bitwise wherever the
BLAS kernel computes a row the same way for the tile's row count, which the test probes on
the spot; else within `bench.numerics`'s rule), weight and input gradients within the rule
(their sums over tokens run tile by tile). Every recompute mode, every architecture (MoE with
its router per tile), LoRA adapters inside the tiled projections, the CP machinery at one
rank. LoRA dropout: each tile's replay reuses the mask its forward drew — checked against
Paddle's own reentrant recompute run per tile, with a negative control that forgets the RNG
state, and the backward hands the caller's RNG state back as it found it. Bad combinations
fail in the config, naming the keys. The working set shrinks: the allocator peak of a tiled
forward + backward, and of a forward without autograd, is measured against the untiled.
"""

from __future__ import annotations

import random

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from paddle.distributed.fleet.utils import recompute as fleet_recompute

from bench import numerics
from flashcp.attention import registry as cp_modes
from flashcp.checkpoint.state import rng_state
from flashcp.config import build_config, load_config
from flashcp.distributed import NamedGroup, ParallelDims, ParallelGroups
from flashcp.lora.model import apply_lora, lora_layers
from flashcp.metrics.memory import PeakMeter
from flashcp.models import base, build_model, preset
from flashcp.models import tiling as tiling_mod
from flashcp.models.moe import MoE
from flashcp.models.tiling import check_tile_tokens, tiled
from flashcp.parallelize import apply_tiling, parallelize
from flashcp.problems import ProblemsError
from helpers.batches import packed_batch
from helpers.paths import CONFIGS

B, S = 2, 32
ARCHS = ("tiny", "tiny_glm", "tiny_glm_moe")
MODES = ("none", "full", "refined")
DENSE = ("tiny", "tiny_glm")


def _loss(model, hidden, ids):
    return F.cross_entropy(model.logits(hidden), ids.unsqueeze(-1)).mean()


def _run(name: str, mode: str, tile: int, seq: int = S, **overrides):
    model = build_model(preset(name, recompute=mode, tile_tokens=tile, **overrides), seed=0)
    ids, pos, ctx = packed_batch(seq)
    hidden = model(ids, pos, ctx)
    loss = _loss(model, hidden, ids)
    loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    return model, float(loss), hidden.numpy(), grads


def _rows_bitwise(model, tile: int, seq: int = S) -> bool:
    """Whether this machine's BLAS gives every matmul the layer can run on a 2-D weight of
    `model` (``x @ w`` and ``x @ w^T``, as `Linear` and `cast_linear` run them) bitwise the same
    rows for a tile of `tile` tokens as for the whole `seq` (the condition for a bitwise
    forward: BLAS may pick its kernel by the row count, e.g. MKL's AVX2 path)."""
    rng = np.random.default_rng(5)
    for param in model.parameters():
        if len(param.shape) != 2:
            continue
        w = paddle.to_tensor(rng.standard_normal(param.shape), "float32")
        for width, transpose in ((param.shape[0], False), (param.shape[1], True)):
            x = paddle.to_tensor(rng.standard_normal((B, seq, width)), "float32")
            whole = paddle.matmul(x, w, transpose_y=transpose).numpy()
            parts = [
                paddle.matmul(x[:, a : a + tile], w, transpose_y=transpose).numpy()
                for a in range(0, seq, tile)
            ]
            if not np.array_equal(np.concatenate(parts, axis=1), whole):
                return False
    return True


def _assert_grads_close(got: dict, want: dict, tokens: int) -> None:
    assert got.keys() == want.keys()
    for key in want:
        norm = float(np.linalg.norm(want[key]))
        numerics.assert_close(got[key], want[key], n=tokens, scale=norm, norm="l2", what=key)


# ------------------------------------------------------------------------------- parity


@pytest.mark.equivalence
@pytest.mark.parametrize("tile", [5, 16])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ARCHS)
def test_tiled_layer_matches_untiled(name: str, mode: str, tile: int) -> None:
    """Tiles of 5 (not dividing 32: a short last tile) and 16 tokens, every recompute mode."""
    _, loss0, h0, g0 = _run(name, mode, 0)
    model, loss, h, g = _run(name, mode, tile)
    args = model.args
    width = max(args.hidden_size, args.intermediate_size, args.moe_intermediate_size)
    numerics.assert_close(h, h0, n=width, what="hidden")
    numerics.assert_close(loss, loss0, n=B * S, scale=loss0, what="loss")
    _assert_grads_close(g, g0, B * S)
    if name in DENSE and _rows_bitwise(model, tile):
        np.testing.assert_array_equal(h, h0, err_msg="rows are bitwise here: so is the layer")


@pytest.mark.parametrize("name", ARCHS)
def test_one_tile_is_the_untiled_layer_bitwise(name: str) -> None:
    """`tile_tokens` >= the local length runs the layer as it is: same ops, same bits."""
    _, loss0, h0, g0 = _run(name, "full", 0)
    for tile in (S, 4 * S):
        _, loss, h, g = _run(name, "full", tile)
        assert loss == loss0
        np.testing.assert_array_equal(h, h0)
        for key in g0:
            np.testing.assert_array_equal(g[key], g0[key], err_msg=key)


def test_negative_control_output_gradient_rows_one_tile_off(monkeypatch) -> None:
    """The comparison above sees a backward that slices the output gradient at the wrong rows
    (the next tile's, the first tile's for the last)."""
    _, _, _, g0 = _run("tiny_glm", "full", 0)
    real = tiling_mod._rows

    def shifted(x, start, stop):  # the output gradient is sliced with autograd on
        if not paddle.is_grad_enabled():
            return real(x, start, stop)
        width = stop - start
        moved = stop if stop + width <= int(x.shape[1]) else 0
        return real(x, moved, moved + width)

    monkeypatch.setattr(tiling_mod, "_rows", shifted)
    _, _, _, g = _run("tiny_glm", "full", 8)
    worst = max(
        numerics.compare(g[k], g0[k], n=B * S, scale=float(np.linalg.norm(g0[k])), norm="l2").units
        for k in g0
    )
    assert worst > 10 * numerics.FACTOR


def test_forced_cp_path_at_one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CP implementation (plan, gather, scatter) between tiled blocks, full recompute."""
    monkeypatch.setattr(
        cp_modes, "implementation_for", lambda ctx: cp_modes.implementation(ctx.mode)
    )
    _, loss0, h0, g0 = _run("tiny_glm", "full", 0)
    _, loss, h, g = _run("tiny_glm", "full", 8)
    numerics.assert_close(h, h0, n=256, what="hidden")
    _assert_grads_close(g, g0, B * S)


def test_no_grad_forward_is_tiled_too() -> None:
    """Without autograd (DPO reference, eval, recompute's first pass) tiles run one by one."""
    model = build_model(preset("tiny_glm", tile_tokens=6), seed=0)
    plain = build_model(preset("tiny_glm"), seed=0)
    ids, pos, ctx = packed_batch()
    with paddle.no_grad():
        h = model(ids, pos, ctx).numpy()
        h0 = plain(ids, pos, ctx).numpy()
    numerics.assert_close(h, h0, n=256, what="hidden")


# ------------------------------------------------------------------------------------ MoE


@pytest.mark.parametrize("mode", ["none", "full"])
def test_moe_router_per_tile_counts_each_token_once(mode: str) -> None:
    """The load statistics (calls under autograd: the tile replays) equal the untiled run's."""
    loads = []
    for tile in (0, 5):
        model, *_ = _run("tiny_glm_moe", mode, tile)
        moes = [m for m in model.sublayers() if isinstance(m, MoE)]
        loads.append([m.take_stats().load for m in moes])
    for a, b in zip(*loads, strict=True):
        np.testing.assert_array_equal(a, b)
        assert a.sum() == B * S * preset("tiny_glm_moe").num_experts_per_tok


# ----------------------------------------------------------------------------------- LoRA


def _lora_model(tile: int, mode: str, dropout: float = 0.0):
    model = build_model(preset("tiny_glm", recompute=mode, tile_tokens=tile), seed=0)
    targets = [".*q_proj", ".*k_proj", ".*v_proj", ".*o_proj", ".*gate_up_proj", ".*down_proj"]
    lora = apply_lora(model, rank=4, alpha=8, dropout=dropout, target_modules=targets, seed=3)
    rng = np.random.default_rng(2)
    for _, layer in lora_layers(lora):
        layer.lora_B.set_value(rng.normal(0, 0.05, layer.lora_B.shape).astype("float32"))
    return model, lora


def _lora_grads(lora, model, seed: int = 0) -> tuple[float, dict]:
    ids, pos, ctx = packed_batch()
    paddle.seed(seed)
    loss = _loss(model, lora(ids, pos, ctx), ids)
    loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in lora.named_parameters() if p.grad is not None}
    return float(loss), grads


@pytest.mark.equivalence
@pytest.mark.parametrize("mode", ["none", "full"])
def test_lora_adapters_inside_tiled_projections(mode: str) -> None:
    """Adapters on every tiled projection get the untiled gradients (and only they do). Under
    `none` the frozen embeddings feed layer 0 an input without gradient: the tiles still run
    their backward for the adapters."""
    model0, lora0 = _lora_model(0, mode)
    loss0, g0 = _lora_grads(lora0, model0)
    model, lora = _lora_model(7, mode)
    loss, g = _lora_grads(lora, model)
    assert g0 and all(k.endswith(("lora_A", "lora_B")) for k in g0)
    assert len(g0) == 2 * 6 * 2  # layers × targets × (A, B)
    numerics.assert_close(loss, loss0, n=B * S, scale=loss0)
    _assert_grads_close(g, g0, B * S)


def _paddle_recompute_tiles(fn, inputs, tile, tables=()):
    """`flashcp.models.tiling.tiled` by other means: each tile through Paddle's own reentrant
    recompute (`preserve_rng_state`), outputs concatenated (the reference)."""
    length = int(inputs[0].shape[1])
    outs = []
    for a in range(0, length, tile):
        parts = []
        for x in inputs:
            part = x[:, a : a + tile]
            if part.stop_gradient:  # frozen embeddings: the adapters inside still train
                part = part.detach()
                part.stop_gradient = False
            parts.append(part)
        parts += [t[:, a : a + tile] for t in tables]
        out = fleet_recompute(fn, *parts, use_reentrant=True, preserve_rng_state=True)
        outs.append(out if isinstance(out, tuple) else (out,))
    return tuple(paddle.concat(list(col), axis=1) for col in zip(*outs, strict=True))


@pytest.mark.parametrize("broken", [False, True])
def test_lora_dropout_mask_replayed_per_tile(monkeypatch: pytest.MonkeyPatch, broken: bool) -> None:
    """LoRA dropout inside tiles: each tile's backward replays the mask its forward drew.

    Reference: the same tiles through Paddle's own reentrant recompute. Negative control
    (`broken`): a replay that does not restore the tile's RNG state draws new masks, and its
    gradients are rejected by a wide margin."""
    tile = 8
    model, lora = _lora_model(tile, "none", dropout=0.5)
    lora.train()
    _, got = _lora_grads(lora, model, seed=11)
    ref_model, ref_lora = _lora_model(tile, "none", dropout=0.5)
    ref_lora.train()
    monkeypatch.setattr(base, "tiled", _paddle_recompute_tiles)
    _, want = _lora_grads(ref_lora, ref_model, seed=11)
    monkeypatch.undo()
    if broken:
        monkeypatch.setattr(tiling_mod._RestoredRng, "__enter__", lambda self: None)
        monkeypatch.setattr(tiling_mod._RestoredRng, "__exit__", lambda self, *e: None)
        model, lora = _lora_model(tile, "none", dropout=0.5)
        lora.train()
        _, got = _lora_grads(lora, model, seed=11)
    assert got.keys() == want.keys()
    units = max(
        numerics.compare(
            got[k], want[k], n=B * S, scale=float(np.linalg.norm(want[k])), norm="l2"
        ).units
        for k in want
    )
    if broken:
        assert units > 10 * numerics.FACTOR
    else:
        assert units <= numerics.FACTOR


@pytest.mark.parametrize("mode", ["none", "full"])
def test_backward_leaves_the_callers_random_state_as_it_found_it(mode: str) -> None:
    """A tiled block's backward replays each tile under the RNG state of its forward and then
    hands the caller's state back: after backward, Paddle's generator, numpy's and Python's
    states are what the caller left before it (as an untiled layer's backward, which draws
    nothing, leaves them), so a dropout after the layer, or the next step's masks, never
    repeat a tile's masks. The caller draws between forward and backward (its own dropout,
    the next micro-batch's data), so a replay that stays in a tile's saved state is seen in
    every generator."""
    model, lora = _lora_model(8, mode, dropout=0.5)  # 4 tiles of the 32 tokens
    lora.train()
    ids, pos, ctx = packed_batch()
    paddle.seed(11)
    np.random.seed(11)
    random.seed(11)
    start = rng_state()
    loss = _loss(model, lora(ids, pos, ctx), ids)
    assert rng_state()["paddle"] != start["paddle"]  # the tiles drew masks: states to replay
    paddle.rand([7])
    np.random.rand(3)
    random.random()
    caller = rng_state()
    loss.backward()
    assert rng_state() == caller, "backward left the caller's RNG in a tile's replayed state"


# ------------------------------------------------------------------------ the primitive


def test_tiled_function_inputs_and_tables() -> None:
    """`tiled` on a plain function: the table input gets no gradient, the others theirs."""
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal((2, 13, 4)).astype("float32")
    t0 = rng.standard_normal((2, 13, 1)).astype("float32")
    w = paddle.to_tensor(rng.standard_normal((4, 3)).astype("float32"), stop_gradient=False)

    def fn(x, t):
        y = paddle.tanh(paddle.matmul(x, w)) * t
        return y, (x * x).sum(-1, keepdim=True)

    results = []
    for tile in (0, 4):
        w.clear_gradient()
        x = paddle.to_tensor(x0, stop_gradient=False)
        t = paddle.to_tensor(t0)
        y, z = tiled(fn, [x], tile, tables=(t,))
        (y.sum() * 2 + (z * z).sum()).backward()
        assert t.grad is None
        results.append((y.numpy(), z.numpy(), x.grad.numpy(), w.grad.numpy()))
    for a, b in zip(*results, strict=True):
        numerics.assert_close(a, b, n=13, scale=float(np.abs(b).max()))


def test_check_tile_tokens() -> None:
    assert check_tile_tokens(0) == 0 and check_tile_tokens(np.int64(8)) == 8
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="model.tile_tokens"):
            check_tile_tokens(bad)


# ---------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        (["model.tile_tokens=-4"], "model.tile_tokens", "integer >= 0"),
        (
            ["model.moe_capacity_factor=1.25", "model.tile_tokens=64"],
            "model.tile_tokens",
            "model.moe_capacity_factor: 0",
        ),  # fmt: skip
        (
            ["model.router_aux_loss_coef=0.001", "model.tile_tokens=64"],
            "model.tile_tokens",
            "model.router_aux_loss_coef: 0",
        ),  # fmt: skip
    ],
)
def test_config_refuses_what_tiling_cannot_do(overrides, key, words) -> None:
    config = CONFIGS / "glm" / "tiny_moe_cp2.yaml"
    with pytest.raises(ProblemsError) as info:
        load_config(config, overrides)
    text = str(info.value)
    assert key in text and words in text, text


def test_config_accepts_tiling_with_every_recompute_mode() -> None:
    config = CONFIGS / "glm" / "tiny_moe_cp2.yaml"
    for mode in MODES:
        cfg = load_config(config, [f"model.recompute={mode}", "model.tile_tokens=64"])
        assert cfg.model.tile_tokens == 64


# ---------------------------------------------------------------------------------- memory


def _peak(tile: int, seq: int) -> int:
    args = preset("small_glm", recompute="full", tile_tokens=tile, num_layers=2)
    model = build_model(args, seed=0)
    ids, pos, ctx = packed_batch(seq, vocab=args.vocab_size)
    labels = paddle.concat([ids[:, 1:], paddle.full([B, 1], -100, "int64")], axis=1)
    with PeakMeter() as meter:
        hidden = model(ids, pos, ctx)
        (-model.token_logprobs(hidden, labels).mean()).backward()
        del hidden
    return meter.peak_bytes


def test_tiling_bounds_the_layer_backward_working_set() -> None:
    """small_glm (hidden 256, MLP 1024 wide) under full recompute: a layer's replay keeps every
    intermediate of its S tokens; tiled, one tile's. The per-token slope of the peak drops."""
    lengths = (256, 512)
    plain = [_peak(0, s) for s in lengths]
    tiled_ = [_peak(32, s) for s in lengths]
    slope_plain = (plain[1] - plain[0]) / (B * (lengths[1] - lengths[0]))
    slope_tiled = (tiled_[1] - tiled_[0]) / (B * (lengths[1] - lengths[0]))
    assert slope_tiled < 0.6 * slope_plain, (slope_plain, slope_tiled)


def _no_grad_peak(tile: int, seq: int) -> int:
    """Allocator peak of a small_glm forward without autograd (eval, DPO's reference pass,
    full recompute's first pass), the output included."""
    args = preset("small_glm", tile_tokens=tile, num_layers=2)
    model = build_model(args, seed=0)
    ids, pos, ctx = packed_batch(seq, vocab=args.vocab_size)
    with paddle.no_grad(), PeakMeter() as meter:
        hidden = model(ids, pos, ctx)
        del hidden
    return meter.peak_bytes


def test_no_grad_forward_working_set_is_bounded_by_the_tile() -> None:
    """Without autograd the tiles run one after the other too, so the forward's working set
    (a layer's MLP activations, 1024 wide for small_glm) is one tile's, not the sequence's:
    the per-token slope of the allocator peak drops (an untiled no-grad forward measured
    about twice the tiled one's peak)."""
    lengths = (256, 512)
    plain = [_no_grad_peak(0, s) for s in lengths]
    tiled_ = [_no_grad_peak(32, s) for s in lengths]
    tokens = B * (lengths[1] - lengths[0])
    slope_plain, slope_tiled = ((p[1] - p[0]) / tokens for p in (plain, tiled_))
    assert slope_tiled < 0.6 * slope_plain, f"peaks untiled {plain}, tiled {tiled_} (bytes)"


# ------------------------------------------------------------------------- parallelize


def test_parallelize_applies_tiling_after_recompute() -> None:
    """`flashcp.parallelize` sets `model.tile_tokens` on a stage built without it: the same
    gradients, bitwise, as the stage built tiled; a bad value is refused by its key."""
    cfg = build_config({"model": {"preset": "tiny_glm", "recompute": "full", "tile_tokens": 8}})
    model = build_model(preset("tiny_glm"), seed=0)  # built untiled, no recompute
    one = NamedGroup("world", 0, -1, [0], pg=None)
    groups = ParallelGroups(ParallelDims(dp=1, pp=1, cp=1, world_size=1), 0, one, one, one, one,
                            "none")  # fmt: skip
    assert parallelize(model, cfg, groups) is None
    assert [layer.tile_tokens for layer in model.decoder_layers()] == [8, 8]
    ids, pos, ctx = packed_batch()
    _loss(model, model(ids, pos, ctx), ids).backward()
    got = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
    _, _, _, want = _run("tiny_glm", "full", 8)
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    with pytest.raises(ValueError, match="model.tile_tokens"):
        apply_tiling(model, -1)


def _bf16_stream_peak(seq: int, upcast_whole: bool, monkeypatch: pytest.MonkeyPatch) -> int:
    """Peak of a tiled small_glm step on a bf16 stream; `upcast_whole` emulates upcasting the
    whole layer input before the tiled blocks (what the layers did before per-tile upcasts)."""
    if upcast_whole:
        forward = base.DecoderLayer.forward

        def whole(self, h, rotary, attn):  # float32 in, tiled as a float32 stream, rounded out
            self.residual_dtype = "float32"
            return forward(self, h.astype("float32"), rotary, attn).astype("bfloat16")

        monkeypatch.setattr(base.DecoderLayer, "forward", whole)
    args = preset("small_glm", recompute="full", tile_tokens=32, num_layers=2,
                  residual_dtype="bfloat16")  # fmt: skip
    model = build_model(args, seed=0)
    ids, pos, ctx = packed_batch(seq, vocab=args.vocab_size)
    labels = paddle.concat([ids[:, 1:], paddle.full([B, 1], -100, "int64")], axis=1)
    with PeakMeter() as meter:
        hidden = model(ids, pos, ctx)
        (-model.token_logprobs(hidden, labels).mean()).backward()
        del hidden
    monkeypatch.undo()
    return meter.peak_bytes


def test_bf16_stream_tiles_upcast_their_own_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a bf16 stream a tiled layer upcasts tile by tile: no full-length float32 copy of its
    input (4·H bytes per token) and its input/output gradients in bf16. Against the same model
    upcasting the whole input first, the per-token slope of the step's peak drops by at least
    that copy."""
    lengths = (256, 512)
    tokens = B * (lengths[1] - lengths[0])
    new = [_bf16_stream_peak(s, False, monkeypatch) for s in lengths]
    old = [_bf16_stream_peak(s, True, monkeypatch) for s in lengths]
    slope_new, slope_old = ((p[1] - p[0]) / tokens for p in (new, old))
    hidden = preset("small_glm").hidden_size
    assert slope_old - slope_new >= 4 * hidden, (slope_old, slope_new)
