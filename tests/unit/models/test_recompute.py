"""Activation recompute: none / full / refined agree bitwise; refined runs attention forward once
per layer per step, full twice; the version resolved in the first forward is the one every
later kernel call uses, even if the flags change before backward (upstream's refined-recompute
bug); micro-batches may be back-propagated in any order."""

from __future__ import annotations

from collections import Counter

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from flashcp import fa_dispatch
from flashcp.attention import allgather_kv as cp_attention
from flashcp.attention import registry as cp_modes
from flashcp.attention.context import AttentionContext
from flashcp.kernels import registry
from flashcp.models import build_model, preset
from flashcp.models.recompute import checkpoint
from helpers.batches import packed_batch

MODES = ("none", "full", "refined")
ARCHS = ("tiny", "tiny_glm", "tiny_glm_moe")
B, S = 2, 32


def force_cp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the context's CP mode implementation at one rank (plan, gather, scatter)."""
    monkeypatch.setattr(cp_modes, "implementation_for", _cp_implementation)


def _cp_implementation(ctx: AttentionContext):
    return cp_modes.implementation(ctx.mode)


def _step(model, seq: int = S, seed: int = 0):
    ids, pos, ctx = packed_batch(seq, seed)
    logits = model.logits(model(ids, pos, ctx))
    return F.cross_entropy(logits, ids.unsqueeze(-1)).mean()


def _grads(model) -> dict[str, np.ndarray]:
    return {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}


def _run(name: str, mode: str, **overrides):
    paddle.seed(0)
    model = build_model(preset(name, recompute=mode, **overrides))
    loss = _step(model)
    loss.backward()
    return float(loss), _grads(model)


@pytest.mark.parametrize("name", ARCHS)
def test_modes_agree_bitwise(name: str) -> None:
    loss0, grads0 = _run(name, "none")
    for mode in ("full", "refined"):
        loss, grads = _run(name, mode)
        assert loss == loss0, mode
        assert grads.keys() == grads0.keys(), mode
        for key in grads0:
            np.testing.assert_array_equal(grads[key], grads0[key], err_msg=f"{mode} {key}")


def test_modes_agree_on_the_forced_cp_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """At one rank the CP machinery (plan, gather, scatter) runs; recompute must match."""
    force_cp(monkeypatch)
    loss0, grads0 = _run("tiny_glm", "none")
    for mode in ("full", "refined"):
        loss, grads = _run("tiny_glm", mode)
        assert loss == loss0
        for key in grads0:
            np.testing.assert_array_equal(grads[key], grads0[key], err_msg=f"{mode} {key}")


def test_frozen_embeddings_still_train_the_layers() -> None:
    """The layer input takes no gradient (LoRA-style): recompute must not drop layer grads."""
    results = {}
    for mode in MODES:
        paddle.seed(0)
        model = build_model(preset("tiny_glm", recompute=mode))
        model.model.embed_tokens.weight.stop_gradient = True
        _step(model).backward()
        results[mode] = _grads(model)
    assert "model.layers.0.self_attn.q_proj.weight" in results["none"]
    for mode in ("full", "refined"):
        assert results[mode].keys() == results["none"].keys()
        for key, g in results["none"].items():
            np.testing.assert_array_equal(results[mode][key], g)


# ---------------------------------------------------------------- kernel calls and versions


class _Recorder:
    """A backend table recording (phase, version) of every kernel call, running the CPU one."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self._real = registry.get_backend

    def __call__(self, version: int, device: str):
        real, calls = self._real(version, device), self.calls

        class Recording:
            name = f"recording-fa{version}"

            def forward(self, *args, **kwargs):
                calls.append(("forward", version))
                return real.forward(*args, **kwargs)

            def backward(self, *args, **kwargs):
                calls.append(("backward", version))
                return real.backward(*args, **kwargs)

        return Recording()


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    rec = _Recorder()
    monkeypatch.setattr(registry, "get_backend", rec)
    monkeypatch.setattr(cp_attention, "get_backend", rec)
    return rec


@pytest.fixture
def resolutions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    seen: list[int] = []
    real = fa_dispatch.resolve_current

    def counting(head_dim: int, *, policy=None, **call_shape):
        res = real(head_dim, policy=policy, **call_shape)
        seen.append(res.version)
        return res

    monkeypatch.setattr(fa_dispatch, "resolve_current", counting)
    return seen


@pytest.mark.parametrize("cp", [False, True])
@pytest.mark.parametrize(("mode", "forwards"), [("none", 1), ("full", 2), ("refined", 1)])
def test_kernel_calls_per_layer(
    recorder, resolutions, monkeypatch: pytest.MonkeyPatch, mode: str, forwards: int, cp: bool
) -> None:
    if cp:
        force_cp(monkeypatch)
    paddle.seed(0)
    model = build_model(preset("tiny_glm", recompute=mode, num_layers=3))
    loss = _step(model)
    first_pass = Counter(phase for phase, _ in recorder.calls)
    assert first_pass == {"forward": 3}
    loss.backward()
    counts = Counter(phase for phase, _ in recorder.calls)
    assert counts == {"forward": 3 * forwards, "backward": 3}
    assert len(resolutions) == 1  # the flags are read once per micro-batch (one plan)


@pytest.mark.parametrize("cp", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_backward_uses_the_first_forwards_version(
    recorder, resolutions, monkeypatch: pytest.MonkeyPatch, mode: str, cp: bool
) -> None:
    if cp:
        force_cp(monkeypatch)
    monkeypatch.setenv(fa_dispatch.FLAG_VERSION, "3")
    monkeypatch.setenv(fa_dispatch.FLAG_DETERMINISTIC, "0")
    monkeypatch.setattr(fa_dispatch, "probe_fa3", lambda: (True, "test"))  # an FA3 card
    paddle.seed(0)
    model = build_model(preset("tiny_glm", recompute=mode))
    loss = _step(model)
    # Between forward and backward the flags change: a re-read would give version 2.
    monkeypatch.setenv(fa_dispatch.FLAG_VERSION, "2")
    monkeypatch.setenv(fa_dispatch.FLAG_DETERMINISTIC, "1")
    loss.backward()
    assert recorder.calls and {v for _, v in recorder.calls} == {3}, recorder.calls
    assert resolutions == [3]  # one plan for both layers, forward and backward


# --------------------------------------------------------------------------- micro-batches


@pytest.mark.parametrize("mode", ("full", "refined"))
def test_micro_batches_backward_in_any_order(mode: str) -> None:
    def grads(mode: str, reverse: bool) -> dict[str, np.ndarray]:
        paddle.seed(0)
        model = build_model(preset("tiny_glm_moe", recompute=mode))
        losses = [_step(model, seq=32, seed=1), _step(model, seq=16, seed=2)]
        for loss in reversed(losses) if reverse else losses:
            loss.backward()
        return _grads(model)

    want = grads("none", reverse=False)
    for reverse in (False, True):
        got = grads(mode, reverse)
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{reverse} {key}")


def test_no_grad_forward_skips_recompute(recorder) -> None:
    paddle.seed(0)
    model = build_model(preset("tiny_glm", recompute="refined"))
    ids, pos, ctx = packed_batch()
    with paddle.no_grad():
        a = model(ids, pos, ctx).numpy()
    paddle.seed(0)
    b = build_model(preset("tiny_glm"))(ids, pos, ctx).numpy()
    np.testing.assert_array_equal(a, b)


def test_checkpoint_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="'full' or 'refined'"):
        checkpoint(lambda h: h, paddle.ones([1]), "none")
