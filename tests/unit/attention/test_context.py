"""`AttentionContext.plan`: one plan per implementation and call shape, reused by every layer
of a micro-batch and its recompute (issue 21 item 3: plan once per micro-batch)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import paddle
import pytest

from flashcp import masks
from flashcp.attention import local
from flashcp.attention.context import AttentionContext
from flashcp.attention.local import LOCAL
from flashcp.models import build_model, preset

B, S = 2, 16


@pytest.fixture
def plan_builds(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How often the local implementation planned (validation + version resolution)."""
    builds: Counter[str] = Counter()
    real = local.plan_local

    def counting(*args, **kwargs):
        builds["local"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(local, "plan_local", counting)
    return builds


def _qkv(seq: int = S, dtype: str = "float32") -> list[paddle.Tensor]:
    rng = np.random.default_rng(0)
    return [paddle.to_tensor(rng.standard_normal((B, seq, 2, 8)).astype(dtype)) for _ in range(3)]


def test_one_plan_per_call_shape(plan_builds: Counter[str]) -> None:
    ctx = AttentionContext(mask=masks.causal_mask(B, S).indices, causal=True)
    q, k, v = _qkv()
    first = ctx.plan(LOCAL, q, k, v)
    assert ctx.plan(LOCAL, *_qkv()) is first  # same shapes, dtype, place: the same plan
    assert plan_builds["local"] == 1
    other = ctx.plan(LOCAL, *_qkv(dtype="float64"))
    assert other is not first and plan_builds["local"] == 2
    fresh = AttentionContext(mask=masks.causal_mask(B, S).indices, causal=True)
    assert fresh.plan(LOCAL, q, k, v) is not first and plan_builds["local"] == 3


@pytest.mark.parametrize("recompute", ["none", "full", "refined"])
def test_a_micro_batch_plans_once(plan_builds: Counter[str], recompute: str) -> None:
    """Three layers, forward and backward (and the recompute replays): one plan."""
    paddle.seed(0)
    model = build_model(preset("tiny_glm", recompute=recompute, num_layers=3))
    ids = paddle.to_tensor(np.random.default_rng(1).integers(0, 260, (B, S)), dtype="int64")
    pos = paddle.arange(S, dtype="int64").unsqueeze(0).expand([B, S])
    ctx = AttentionContext(mask=masks.causal_document_mask([5, 11], batch=B).indices, causal=True)
    model(ids, pos, ctx).sum().backward()
    assert plan_builds["local"] == 1
    model(ids, pos, AttentionContext(mask=ctx.mask, causal=True)).sum().backward()
    assert plan_builds["local"] == 2  # the next micro-batch plans again
