"""`bench.moe_step`: the step's GEMM list counts exactly the matmul weights the family's
inventory counts (the FLOP counter's one source), the phase shares add up to the step, and the
page is rendered from its JSON alone."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from bench import moe_step
from flashcp.models import preset
from helpers.paths import ROOT


@pytest.mark.parametrize("name", list(moe_step.SHAPES))
def test_the_gemms_are_the_inventory_s_matmul_weights(name: str) -> None:
    """Forward GEMM FLOPs = 2 × tokens × the weights a token multiplies (`matmul_weights`), at
    any routing that sends each token to top-k experts."""
    spec = dict(moe_step.SHAPES[name])
    args = preset(spec.pop("preset"), **spec)
    tokens = 256
    rng = np.random.default_rng(0)
    counts = []
    for _ in range(args.num_layers):
        picks = np.stack([rng.choice(args.num_experts, args.num_experts_per_tok, replace=False)
                          for _ in range(tokens)])  # fmt: skip
        counts.append(np.bincount(picks.ravel(), minlength=args.num_experts).tolist())
    gemms = moe_step.gemm_shapes(args, tokens, counts)
    assert sum(g.flops for g in gemms) == 3 * 2 * tokens * args.matmul_weights()
    fewer = [c[:-1] + [0] for c in counts]  # control: an expert's rows lost
    assert sum(g.flops for g in moe_step.gemm_shapes(args, tokens, fewer)) < 6 * tokens * (
        args.matmul_weights()
    )


def test_the_shares_add_up_to_the_step() -> None:
    got = moe_step.shares({"a": 2.0, "b": 1.0}, 4.0)
    assert got == {"a": 0.5, "b": 0.25, "unattributed": 0.25}


def test_the_page_is_its_json() -> None:
    rec = json.loads((ROOT / "docs" / "moe_step.json").read_text())
    assert (ROOT / "docs" / "moe_step.md").read_text() == moe_step.PAGE.render(rec)
    changed = copy.deepcopy(rec)
    changed["cases"][0]["step_over_floor"] += 1.0
    assert moe_step.PAGE.render(changed) != moe_step.PAGE.render(rec)
    for case in rec["cases"]:
        assert sum(case["shares"].values()) == pytest.approx(1.0)
