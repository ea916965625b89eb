"""The one registry of CP modes, and a CP mode added from this file alone.

`reversed_contiguous` (rank r holds chunk cp-1-r, `helpers.toy_cp_mode`, with an alias of the
all-gather-KV implementation that counts its calls) is registered here, and nothing in `src/`
is edited: the config
accepts it (its chunks_per_rank sets the seq_len rule), the trainer's layout comes from it,
and the model runs it through the interface, plain and under both recompute modes. The same
mode at CP = 2 over two processes: tests/integration/test_cp_registry_multiproc.py.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import paddle
import pytest

from bench import numerics
from flashcp import masks
from flashcp.attention import registry as cp_modes
from flashcp.attention.allgather_kv import ALLGATHER_KV
from flashcp.attention.context import AttentionContext
from flashcp.attention.local import LOCAL
from flashcp.config import build_config
from flashcp.cp.layout import Assignment
from flashcp.models import build_model, preset
from helpers.toy_cp_mode import IMPLEMENTATION, TOY_IMPL, CountingAllGatherKV, reversed_contiguous

B, S = 2, 32


TOY = cp_modes.CPMode(
    "reversed_contiguous",
    1,
    reversed_contiguous,
    implementation=IMPLEMENTATION,
    summary="rank r holds chunk cp-1-r (a test's mode)",
)


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> CountingAllGatherKV:
    monkeypatch.setitem(cp_modes.MODES, TOY.name, TOY)
    TOY_IMPL.calls.clear()
    return TOY_IMPL


class _Group:
    def __init__(self, nranks: int, rank: int = 0) -> None:
        self.nranks, self.rank = nranks, rank


# ------------------------------------------------------------------------ the built-in modes


def test_builtin_modes() -> None:
    assert cp_modes.names() == ("dualchunk_allgather", "contiguous_allgather", "workload_balanced")
    assert cp_modes.DEFAULT_MODE in cp_modes.MODES
    chunks = {name: mode.chunks_per_rank for name, mode in cp_modes.MODES.items()}
    assert chunks == {"dualchunk_allgather": 2, "contiguous_allgather": 1, "workload_balanced": 4}
    assert cp_modes.make_assignment("dualchunk_allgather", 2).ranks == ((0, 3), (1, 2))
    assert cp_modes.make_assignment("contiguous_allgather", 3).ranks == ((0,), (1,), (2,))
    mask = masks.causal_document_mask([5, 27, 32], batch=1).indices
    balanced = cp_modes.make_assignment("workload_balanced", 2, mask, causal=True)
    assert (balanced.world, balanced.chunks_per_rank) == (2, 4)
    for name in cp_modes.names():
        assert cp_modes.implementation(name) is ALLGATHER_KV


def test_unknown_mode_and_a_layout_that_disagrees(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="cp mode 'ring' is not supported: use one of "):
        cp_modes.get("ring")
    liar = cp_modes.CPMode("liar", 2, lambda world, k, mask, causal: Assignment.contiguous(world))
    monkeypatch.setitem(cp_modes.MODES, liar.name, liar)
    with pytest.raises(ValueError, match="the registry says 2 × 2"):
        cp_modes.make_assignment("liar", 2)
    with pytest.raises(ValueError, match="chunks_per_rank must be >= 1"):
        cp_modes.register(cp_modes.CPMode("none", 0, reversed_contiguous))


def test_the_config_layer_reads_the_registry_without_paddle() -> None:
    """The registry is plain data over flashcp.cp: importing the config (which the launcher
    does before any rank starts) imports no implementation and no paddle."""
    code = (
        "import sys, flashcp.config; "
        "print(sorted(m for m in sys.modules if m.startswith(('paddle', 'flashcp.attention'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['flashcp.attention', 'flashcp.attention.registry']"


def test_implementation_for_a_context() -> None:
    mask = masks.causal_mask(B, S).indices
    assert cp_modes.implementation_for(AttentionContext(mask=mask, causal=True)) is LOCAL
    one = AttentionContext(mask=mask, causal=True, group=_Group(1))
    assert cp_modes.implementation_for(one) is LOCAL
    two = AttentionContext(mask=mask, causal=True, group=_Group(2))
    assert cp_modes.implementation_for(two) is ALLGATHER_KV


# --------------------------------------------------------------------- a mode from this file


def test_toy_mode_is_a_config_value_and_a_layout(toy: CountingAllGatherKV) -> None:
    raw = {
        "model": {"preset": "tiny"},
        "parallel": {"cp": 3, "cp_mode": TOY.name},
        "data": {"seq_len": 63},
        "run": {"output_dir": "unused"},
    }
    cfg = build_config(raw, world_size=3)
    assert cfg.parallel.seq_divisor == 3
    assert cp_modes.make_assignment(TOY.name, 3).ranks == ((2,), (1,), (0,))
    ctx = AttentionContext(mask=None, causal=True, group=_Group(2), mode=TOY.name)
    assert cp_modes.implementation_for(ctx) is toy


@pytest.mark.parametrize("recompute", ["none", "full", "refined"])
def test_toy_mode_runs_through_the_model(
    toy: CountingAllGatherKV, monkeypatch: pytest.MonkeyPatch, recompute: str
) -> None:
    """At one rank (the implementation forced, as with no group it would be local) the toy
    mode's plan, gather and scatter run in every layer and recompute; results match local."""
    rng = np.random.default_rng(0)
    ids = paddle.to_tensor(rng.integers(0, 260, (B, S)), dtype="int64")
    pos = paddle.arange(S, dtype="int64").unsqueeze(0).expand([B, S])
    mask = masks.causal_document_mask([11, 21], batch=B).indices

    def run(mode: str | None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        paddle.seed(0)
        model = build_model(preset("tiny_glm", recompute=recompute, num_layers=3))
        ctx = AttentionContext(mask=mask, causal=True, mode=mode or cp_modes.DEFAULT_MODE)
        with monkeypatch.context() as m:
            if mode is not None:
                m.setattr(cp_modes, "implementation_for", lambda c: cp_modes.implementation(c.mode))
            hidden = model(ids, pos, ctx)
            hidden.sum().backward()
        grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
        return hidden.numpy(), grads

    want, want_grads = run(None)
    got, grads = run(TOY.name)
    forwards = {"none": 3, "full": 6, "refined": 3}[recompute]
    assert toy.calls == {"plan": 1, "forward": forwards, "backward": 3}
    numerics.assert_close(got, want, n=S, what="hidden")
    assert grads.keys() == want_grads.keys()
    for key, g in want_grads.items():
        numerics.assert_close(grads[key], g, n=B * S, norm="l2", what=key)
