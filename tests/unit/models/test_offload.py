"""Activation offload (`flashcp.models.offload`, `train.offload_activations`).

* Same ops, same order: losses and gradients with offload are BITWISE those without, for GPT,
  GLM-4 and GLM-4.5 MoE, full and refined recompute, on the CP code path, with frozen
  embeddings (LoRA) and learned positions, and with micro-batches back-propagated in any order.
* A tensor back from the host keeps its values and its `stop_gradient` flag, as Paddle's
  backward receives it (a layer input restored as a constant crashes Paddle's recompute).
* What moved is counted at the copy: the host bytes are exactly the layer inputs (plus the
  refined attention outputs and LSEs), and Paddle's allocator holds exactly that much less
  after the forward pass (numpy buffers are outside it).
* The GPU transport (pinned buffers, a side stream, events) runs here against a fake of the
  Paddle stream API whose side stream runs only when something waits for it: any missing wait
  would read a freed buffer or an unwritten one.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from flashcp.attention import registry as cp_modes
from flashcp.config import config_changes, config_hash, hashed_dict, load_config
from flashcp.metrics import memory
from flashcp.models import build_model, preset
from flashcp.models import offload as off
from flashcp.models.offload_transport import NumpyTransport, PinnedTransport, default_transport
from flashcp.pipeline.stage import build_stage
from flashcp.problems import ProblemsError
from helpers.batches import packed_batch
from helpers.paths import CONFIGS

B, S = 2, 32
GLM = CONFIGS / "glm" / "tiny_cp2.yaml"
ARCHS = ("tiny", "tiny_glm", "tiny_glm_moe")


def _loss(model, seq: int = S, seed: int = 0) -> paddle.Tensor:
    ids, pos, ctx = packed_batch(seq, seed)
    return F.cross_entropy(model.logits(model(ids, pos, ctx)), ids.unsqueeze(-1)).mean()


def _grads(model) -> dict[str, np.ndarray]:
    return {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}


def _model(name: str, mode: str, offload: bool, transport: Any = None, **overrides):
    paddle.seed(0)
    model = build_model(preset(name, recompute=mode, **overrides), seed=0)
    off.apply_activation_offload(model, offload, transport)
    return model


def _run(name: str, mode: str, offload: bool, **overrides):
    model = _model(name, mode, offload, **overrides)
    off.reset_offload_stats()
    loss = _loss(model)
    moved = off.offload_stats()
    loss.backward()
    return float(loss), _grads(model), moved, off.offload_stats()


def _assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def _layer_bytes(args, dtype_bytes: int = 4) -> int:
    return B * S * args.hidden_size * dtype_bytes


def _refined_bytes(args) -> int:
    out = B * S * args.num_heads * args.head_size * 4
    lse = B * args.num_heads * S * 4
    return out + lse


@pytest.mark.parametrize("mode", ("full", "refined"))
@pytest.mark.parametrize("name", ARCHS)
def test_offload_is_bitwise_and_counts_what_moved(name: str, mode: str) -> None:
    loss0, grads0, _, _ = _run(name, mode, offload=False)
    loss, grads, after_forward, after_backward = _run(name, mode, offload=True)
    assert loss == loss0
    _assert_same(grads, grads0)
    args = preset(name)
    per_layer = _layer_bytes(args) + (_refined_bytes(args) if mode == "refined" else 0)
    assert after_forward.offloaded_bytes == args.num_layers * per_layer
    assert after_forward.host_bytes == after_forward.offloaded_bytes
    assert after_backward.reloaded_bytes == after_forward.offloaded_bytes
    assert after_backward.host_bytes == 0  # every host copy freed when it came back
    assert after_backward.host_peak_bytes == after_forward.offloaded_bytes


class _StaleTransport(NumpyTransport):
    """Negative control: brings back the FIRST tensor it sent whatever was asked for (a store
    that mixes up layers)."""

    def __init__(self) -> None:
        self.first: np.ndarray | None = None

    def send(self, tensor: paddle.Tensor) -> np.ndarray:
        host = super().send(tensor)
        if self.first is None:
            self.first = host
        return host

    def fetch(self, host: Any, shape: list[int], dtype: Any) -> paddle.Tensor:
        return super().fetch(self.first, shape, dtype)


def test_negative_control_a_mixed_up_store_changes_the_gradients() -> None:
    """The bitwise comparisons above are not vacuous: the restored values are what backward
    uses, so handing back another layer's input changes the gradients."""
    _, grads0, _, _ = _run("tiny_glm", "full", offload=False)
    model = _model("tiny_glm", "full", True, _StaleTransport())
    _loss(model).backward()
    grads = _grads(model)
    assert grads.keys() == grads0.keys()
    assert any(not np.array_equal(grads[k], grads0[k]) for k in grads0)


def test_offload_off_changes_nothing() -> None:
    """`train.offload_activations: false`: no offloader, no copy, no counter moves."""
    model = _model("tiny_glm", "full", offload=False)
    assert off.offloader_of(model) is None
    off.reset_offload_stats()
    _loss(model).backward()
    assert off.offload_stats() == off.OffloadStats()


def test_bitwise_on_the_cp_code_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """At one rank the all-gather-KV implementation runs (plan, gather, scatter)."""
    monkeypatch.setattr(
        cp_modes, "implementation_for", lambda ctx: cp_modes.implementation(ctx.mode)
    )
    for mode in ("full", "refined"):
        loss0, grads0, _, _ = _run("tiny_glm", mode, offload=False)
        loss, grads, _, _ = _run("tiny_glm", mode, offload=True)
        assert loss == loss0
        _assert_same(grads, grads0)


@pytest.mark.parametrize("name", ("tiny_glm", "tiny_glm_moe"))
def test_frozen_embeddings_lora_style(name: str) -> None:
    """The layer input takes no gradient (LoRA): the recompute gets a detached copy that
    shares the embedding output's buffer; both are released, the layers still train."""
    results = {}
    for offload in (False, True):
        model = _model(name, "full", offload)
        model.model.embed_tokens.weight.stop_gradient = True
        _loss(model).backward()
        results[offload] = _grads(model)
    assert "model.layers.0.self_attn.q_proj.weight" in results[False]
    _assert_same(results[True], results[False])


def test_bfloat16_stored_weights() -> None:
    """bf16 storage: the layers' cast-linear PyLayers save tensors inside the no-grad forward;
    they pass through the offload hooks untouched."""

    def run(offload: bool):
        paddle.seed(0)
        model = build_model(
            preset("tiny_glm_moe", recompute="full"), seed=0, param_dtype="bfloat16"
        )
        off.apply_activation_offload(model, offload)
        loss = _loss(model)
        loss.backward()
        return float(loss), _grads(model)

    loss0, grads0 = run(False)
    loss, grads = run(True)
    assert loss == loss0
    _assert_same(grads, grads0)


def test_learned_positions() -> None:
    loss0, grads0, _, _ = _run("tiny", "full", offload=False, position="learned")
    loss, grads, _, _ = _run("tiny", "full", offload=True, position="learned")
    assert loss == loss0
    _assert_same(grads, grads0)


@pytest.mark.parametrize("mode", ("full", "refined"))
def test_micro_batches_backward_in_any_order(mode: str) -> None:
    """Two micro-batches in flight (1F1B / GPipe): each handle finds its own layer's tensors
    whatever order the backwards run in; the same gradients as without offload."""

    def grads(offload: bool, reverse: bool) -> dict[str, np.ndarray]:
        model = _model("tiny_glm_moe", mode, offload)
        losses = [_loss(model, seq=32, seed=1), _loss(model, seq=16, seed=2)]
        for loss in reversed(losses) if reverse else losses:
            loss.backward()
        return _grads(model)

    want = grads(offload=False, reverse=False)
    for reverse in (False, True):
        _assert_same(grads(offload=True, reverse=reverse), want)


def test_residual_bfloat16_halves_the_bytes() -> None:
    loss0, grads0, _, _ = _run("tiny_glm", "full", offload=False, residual_dtype="bfloat16")
    loss, grads, moved, _ = _run("tiny_glm", "full", offload=True, residual_dtype="bfloat16")
    assert loss == loss0
    _assert_same(grads, grads0)
    args = preset("tiny_glm")
    assert moved.offloaded_bytes == args.num_layers * _layer_bytes(args, dtype_bytes=2)


def test_allocator_holds_exactly_what_did_not_move() -> None:
    """After the forward pass Paddle's allocator holds the layer inputs without offload and
    not with it: the difference is the bytes counted at the copy (numpy is outside it)."""
    held = {}
    for offload in (False, True):
        model = _model("tiny_glm", "full", offload, num_layers=4)
        gc.collect()
        start = memory.allocated_bytes()
        off.reset_offload_stats()
        loss = _loss(model)
        held[offload] = memory.allocated_bytes() - start
        moved = off.offload_stats().host_bytes
        loss.backward()
        del loss, model
    args = preset("tiny_glm")
    assert moved == 4 * _layer_bytes(args)
    assert held[False] - held[True] == moved


def test_a_forward_without_backward_frees_its_host_copies() -> None:
    model = _model("tiny_glm", "refined", offload=True)
    off.reset_offload_stats()
    loss = _loss(model)
    assert off.offload_stats().host_bytes > 0
    del loss
    gc.collect()
    assert off.offload_stats().host_bytes == 0


def test_previous_layer_is_prefetched_during_a_backward() -> None:
    """When backward reaches layer i, layer i-1's copy back starts (overlapping layer i's
    backward on a GPU), not when backward reaches layer i-1."""
    model = _model("tiny_glm", "full", offload=True, num_layers=3)
    order: list[tuple[str, int]] = []
    transport = off.offloader_of(model).transport
    real_fetch = transport.fetch

    def fetch(host, shape, dtype):
        order.append(("fetch", len(order)))
        return real_fetch(host, shape, dtype)

    transport.fetch = fetch  # type: ignore[method-assign]
    replays: list[int] = []
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(
            lambda layer, args, i=i: replays.append(i) if paddle.is_grad_enabled() else None
        )
    loss = _loss(model)
    fetched_before: dict[int, int] = {}

    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(
            lambda layer, args, i=i: fetched_before.__setitem__(i, len(order))
        )
    loss.backward()
    assert replays == [2, 1, 0]
    # top layer: its own copy and layer 1's; layer 1: layer 0's already under way
    assert fetched_before == {2: 2, 1: 3, 0: 3}


def test_apply_refuses_without_recompute() -> None:
    model = build_model(preset("tiny_glm"), seed=0)
    with pytest.raises(ValueError, match="model.recompute"):
        off.apply_activation_offload(model, True)
    assert off.apply_activation_offload(model, False) is None


def test_config_refuses_offload_without_recompute() -> None:
    with pytest.raises(ProblemsError) as err:
        load_config(GLM, ["train.offload_activations=true", "model.recompute=none"])
    keys = [e.key for e in err.value.problems]
    assert keys == ["train.offload_activations"]
    assert "model.recompute" in err.value.problems[0].message
    for mode in ("full", "refined"):
        cfg = load_config(GLM, ["train.offload_activations=true", f"model.recompute={mode}"])
        assert cfg.train.offload_activations is True
    assert load_config(GLM).train.offload_activations is False  # the default


def test_offload_does_not_bind_checkpoints_but_the_residual_dtype_does() -> None:
    """A run may resume with offload switched on or off (the same numbers); a bf16 residual
    stream computes other numbers. A checkpoint written before `model.residual_dtype` existed
    computed with float32, its default: resuming it at float32 is no change."""
    base = load_config(GLM, ["model.recompute=full"])
    moved = load_config(GLM, ["model.recompute=full", "train.offload_activations=true"])
    assert config_hash(moved) == config_hash(base)
    bf16 = load_config(GLM, ["model.recompute=full", "model.residual_dtype=bfloat16"])
    assert config_hash(bf16) != config_hash(base)
    assert hashed_dict(bf16)["model"]["residual_dtype"] == "bfloat16"
    earlier = hashed_dict(base)
    del earlier["model"]["residual_dtype"]
    assert config_changes(earlier, base) == []
    assert config_changes(earlier, bf16) == ["model.residual_dtype"]


# ------------------------------------------------------------------ the GPU transport, faked


class FakeStream:
    """A stream whose work runs only when something waits for it (the worst a real side
    stream can do). The compute stream is the host: it runs at once."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ops: list[Any] = []
        self.done = 0

    def run_until(self, pos: int) -> None:
        while self.done < pos:
            op = self.ops[self.done]
            self.done += 1
            op()

    def run_all(self) -> None:
        self.run_until(len(self.ops))

    def wait_event(self, event: FakeEvent) -> None:
        if self.name == "compute":  # the host blocks until the side stream got there
            event.synchronize()
        else:
            self.ops.append(event.synchronize)


class FakeEvent:
    def __init__(self) -> None:
        self.stream: FakeStream | None = None
        self.pos = 0

    def record(self, stream: FakeStream) -> None:
        self.stream, self.pos = stream, len(stream.ops)

    def query(self) -> bool:
        return self.stream is None or self.stream.done >= self.pos

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.run_until(self.pos)


class FakePinned:
    """A pinned host buffer: filled when the side stream runs the copy."""

    def __init__(self) -> None:
        self.array: np.ndarray | None = None


class FakeStreams:
    """`offload_transport.CudaStreams` with Paddle's ordering semantics and a lazy side stream:
    a copy reads its source when the side stream runs it, so a device buffer freed too early
    fails, and a destination read before its copy landed holds NaN."""

    def __init__(self) -> None:
        self.compute = FakeStream("compute")
        self.side = FakeStream("side")
        self.active = self.compute
        self.copies_out = 0

    def event(self) -> FakeEvent:
        return FakeEvent()

    def current(self) -> FakeStream:
        return self.active

    def guard(self, stream: FakeStream):
        streams = self

        class Guard:
            def __enter__(self) -> None:
                self.previous, streams.active = streams.active, stream

            def __exit__(self, *exc: object) -> None:
                streams.active = self.previous

        return Guard()

    def to_pinned(self, tensor: paddle.Tensor) -> FakePinned:
        assert self.active is self.side, "copies run on the side stream"
        host = FakePinned()
        self.copies_out += 1

        def copy() -> None:
            assert tensor._is_initialized(), "the device buffer was freed before its copy ran"
            host.array = NumpyTransport().send(tensor)

        self.active.ops.append(copy)
        return host

    def empty(self, shape: list[int], dtype: Any) -> paddle.Tensor:
        assert self.active is self.compute, "allocated in the compute stream's order"
        return paddle.full(shape, float("nan"), dtype=dtype)

    def copy_into(self, dst: paddle.Tensor, src: FakePinned) -> None:
        assert self.active is self.side

        def copy() -> None:
            assert src.array is not None, "copied back before the copy out ran"
            paddle.assign(paddle.to_tensor(src.array), output=dst)

        self.active.ops.append(copy)


@pytest.mark.parametrize("mode", ("full", "refined"))
def test_pinned_transport_against_lazy_streams(mode: str) -> None:
    loss0, grads0, _, _ = _run("tiny_glm_moe", mode, offload=False, num_layers=4)
    streams = FakeStreams()
    model = _model("tiny_glm_moe", mode, True, PinnedTransport(streams), num_layers=4)
    offloader = off.offloader_of(model)
    off.reset_offload_stats()
    loss = _loss(model)
    per_layer = 3 if mode == "refined" else 1  # input (+ attention output and LSE)
    assert streams.copies_out == 4 * per_layer
    # nothing has run on the side stream except what the bound on copies in flight forced
    assert len(offloader.leaving) <= off.MAX_LEAVING
    alive = [s for s in offloader.leaving if s.device is not None]
    assert alive and all(s.device._is_initialized() for s in alive)
    streams.side.run_all()
    offloader.poll()  # the copies have landed: their device buffers go
    assert not offloader.leaving
    assert off.offload_stats().host_bytes == off.offload_stats().offloaded_bytes
    loss.backward()
    assert float(loss) == loss0
    _assert_same(_grads(model), grads0)
    # host copies are freed only once their copy back has run (the last one is polled later)
    streams.side.run_all()
    offloader.flush()
    assert not offloader.returning
    assert off.offload_stats().host_bytes == 0


def test_pinned_transport_uses_the_original_while_its_copy_is_in_flight() -> None:
    """Backward reaching a layer whose copy out is still running (the last layer under 1F1B)
    uses the device tensor itself, then frees the host copy once the copy has run."""
    loss0, grads0, _, _ = _run("tiny_glm", "full", offload=False)
    streams = FakeStreams()
    model = _model("tiny_glm", "full", True, PinnedTransport(streams))
    loss = _loss(model)
    loss.backward()
    assert float(loss) == loss0
    _assert_same(_grads(model), grads0)
    offloader = off.offloader_of(model)
    offloader.flush()
    assert off.offload_stats().host_bytes == 0


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("stop_gradient", (False, True))
def test_a_tensor_back_from_the_host_keeps_its_values_and_stop_gradient(
    stop_gradient: bool, dtype: str
) -> None:
    """Sent to the host, its device buffer freed, taken back: the tensor returns bitwise, with
    its shape, dtype and `stop_gradient` (a recompute's input takes a gradient: the replay
    must see it so; a frozen one must stay frozen)."""
    values = np.random.default_rng(4).standard_normal((2, 5, 3)).astype("float32")
    x = paddle.to_tensor(values).astype(dtype)
    x.stop_gradient = stop_gradient
    want = x.astype("float32").numpy()
    transport = NumpyTransport()
    saved = off.SavedTensor(x)
    saved.send(transport)
    saved.release_device()
    assert not x._is_initialized()
    back, _ = saved.take(transport)
    assert (back.stop_gradient, back.dtype, back.shape) == (stop_gradient, x.dtype, [2, 5, 3])
    np.testing.assert_array_equal(back.astype("float32").numpy(), want)


@pytest.mark.parametrize("mode", ("full", "refined"))
def test_restored_tensors_reach_backward_with_their_flags(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every tensor the unpack hook hands back to Paddle carries the `stop_gradient` its
    original had (checked as Paddle receives it: a layer input restored as a constant makes
    Paddle's recompute crash, not fail), and the gradients - the stage input's included - are
    bitwise those without offload."""
    restore = off.LayerOffload.restore
    flags: list[tuple[bool, bool]] = []

    def checked(self: off.LayerOffload, saved: off.SavedTensor) -> paddle.Tensor:
        tensor = restore(self, saved)
        flags.append((saved.stop_gradient, tensor.stop_gradient))
        if tensor.stop_gradient != saved.stop_gradient:  # stop here, before Paddle uses it
            raise AssertionError(f"restored with stop_gradient={tensor.stop_gradient}, "
                                 f"saved with {saved.stop_gradient}")  # fmt: skip
        return tensor

    monkeypatch.setattr(off.LayerOffload, "restore", checked)
    ids, pos, ctx = packed_batch()
    results = []
    for offload in (False, True):
        model = _model("tiny_glm", mode, offload)
        h = model.model.embed(ids, pos).detach()
        h.stop_gradient = False
        hidden = model.model.run_layers(h, pos, ctx)
        F.cross_entropy(model.logits(hidden), ids.unsqueeze(-1)).mean().backward()
        results.append((h.grad.numpy(), _grads(model)))
    assert flags and (False, False) in flags, flags  # the layer inputs, restored trainable
    np.testing.assert_array_equal(results[1][0], results[0][0])
    _assert_same(results[1][1], results[0][1])


def test_default_transport_on_cpu_is_numpy() -> None:
    assert isinstance(default_transport(), NumpyTransport)


# ------------------------------------------------------------------------- pipeline stages


@pytest.mark.parametrize("offload", (False, True))
def test_stage_input_and_sent_output_are_released(offload: bool) -> None:
    """What the runner keeps per micro-batch in flight on a middle stage: the received input
    (for its gradient) and the sent output (the root of backward). Under offload both device
    buffers go (the input to the host as layer 0's kept input, the output dropped once sent)
    and backward still gives the same gradients and input gradient."""
    args = preset("tiny_glm", num_layers=3, recompute="full")
    ids, pos, ctx = packed_batch()
    first = build_stage(args, 0, 3, seed=0)
    with paddle.no_grad():
        received = first(ids, pos, ctx).numpy()

    def run(offload: bool):
        middle = build_stage(args, 1, 3, seed=0)
        off.apply_activation_offload(middle, offload)
        x = paddle.to_tensor(received)  # what recv_tensor hands the runner
        x.stop_gradient = False
        out = middle(x, pos, ctx)
        off.release_sent(middle, out)  # the runner, after send_act
        assert x._is_initialized() is not offload
        assert out._is_initialized() is not offload
        grad = paddle.to_tensor(np.random.default_rng(3).standard_normal(out.shape, "float32"))
        paddle.autograd.backward([out], [grad])
        return x.grad.numpy(), _grads(middle)

    want_x, want = run(False)
    got_x, got = run(offload)
    np.testing.assert_array_equal(got_x, want_x)
    _assert_same(got, want)
