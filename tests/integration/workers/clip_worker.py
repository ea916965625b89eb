"""Worker: THE global gradient norm under expert parallelism (and ZeRO-1) on 2 gloo processes.

Run under `paddle.distributed.launch` (layout dp=1, pp=1, cp=2, ep=2; edp trivial). A toy
model: dense `w` [8, 5] and `b` [5], and a stacked-experts layer of 4 experts (`gate`
[4, 6, 3], `down` [4, 3, 6]) of which each rank holds 2 (rows [2r, 2r + 2): the layout
`flashcp.models.expert_parallel.expert_tensors` reads, handed to the optimizer as the trainer
hands it, `flashcp.trainer.expert_rows`). Gradients come from one seeded full set
G: half of the dense ones on each rank (the cp sum gives G exactly), each rank its experts'
rows. Two optimizer steps, gradients 3·G then 0.02·G (the first clipped, the second not: Adam
ignores a scale common to every step, so only the clip shows), with `ParamOptimizer` and with
the ZeRO-1 `MasterOptimizer` (`w` split between the two ranks' shards), each also as the
NEGATIVE CONTROL: its norm built without the ep sum of the experts' squares (the mutant the EP
parity test let through while the logged norm came from another code path).

Reference, in every rank, without groups: the whole model under Paddle's AdamW with Paddle's
own `ClipGradByGlobalNorm`; its norms the float64 norms of the full gradients. Each rank writes
`<out>/rank<r>.json`: per run, the comparisons (the rule of `bench.numerics`) of the two
logged norms and of the parameters after the two steps (this rank's rows of the experts).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import paddle

from bench.numerics import compare
from flashcp.config import TrainConfig
from flashcp.distributed import (
    ParallelDims,
    barrier,
    build_groups,
    destroy_groups,
    init_distributed,
    shutdown,
)
from flashcp.optim import master_optimizer, param_optimizer
from flashcp.optim.clip import GlobalNorm
from flashcp.optim.optimizer import build_distributed_optimizer
from flashcp.trainer import expert_rows

TOTAL, HELD = 4, 2
SHAPES = {"w": [8, 5], "b": [5], "experts.gate": [TOTAL, 6, 3], "experts.down": [TOTAL, 3, 6]}
FACTORS = (3.0, 0.02)
TRAIN = TrainConfig(lr=0.05, grad_clip=1.0)


def _param(layer: paddle.nn.Layer, value: np.ndarray) -> paddle.Tensor:
    p = layer.create_parameter(list(value.shape), dtype="float32")
    p.set_value(value)
    return p


class Experts(paddle.nn.Layer):
    """Rows [first, first + count) of the stacked expert tensors."""

    STACKED_EXPERTS = True

    def __init__(self, first: int, count: int, values: dict[str, np.ndarray]) -> None:
        super().__init__()
        self.first_expert, self.num_experts, self.total_experts = first, count, TOTAL
        self.gate = _param(self, values["experts.gate"][first : first + count])
        self.down = _param(self, values["experts.down"][first : first + count])


class Toy(paddle.nn.Layer):
    def __init__(self, first: int, count: int, values: dict[str, np.ndarray]) -> None:
        super().__init__()
        self.w = _param(self, values["w"])
        self.b = _param(self, values["b"])
        self.experts = Experts(first, count, values)


def full_grads(factor: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {n: (factor * rng.normal(size=s)).astype(np.float32) for n, s in SHAPES.items()}


def reference(values: dict[str, np.ndarray]) -> tuple[list[float], dict[str, np.ndarray]]:
    """One process, the whole model: Paddle's AdamW with Paddle's own clip."""
    model = Toy(0, TOTAL, values)
    decay = {p.name for p in model.parameters() if len(p.shape) >= 2}
    opt = paddle.optimizer.AdamW(
        learning_rate=TRAIN.lr, parameters=model.parameters(), beta1=TRAIN.beta1,
        beta2=TRAIN.beta2, epsilon=TRAIN.eps, weight_decay=TRAIN.weight_decay,
        apply_decay_param_fun=lambda name: name in decay,
        grad_clip=paddle.nn.ClipGradByGlobalNorm(TRAIN.grad_clip),
    )  # fmt: skip
    norms = []
    for factor in FACTORS:
        grads = full_grads(factor)
        norms.append(float(np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads.values()))))
        for n, p in model.named_parameters():
            p.grad = paddle.to_tensor(grads[n])
        opt.step()
        opt.clear_grad()
    return norms, {n: p.numpy() for n, p in model.named_parameters()}


@contextmanager
def without_ep_sum(ep: Any) -> Iterator[None]:
    """Optimizers built inside leave the ep group out of every norm's `partial` groups."""

    class Mutant(GlobalNorm):
        def __init__(self, order: Any, *, partial: Any = None, **kw: Any) -> None:
            partial = {n: [g for g in gs if g is not ep] for n, gs in (partial or {}).items()}
            super().__init__(order, partial=partial, **kw)

    for module in (param_optimizer, master_optimizer):
        module.GlobalNorm = Mutant  # type: ignore[misc]
    try:
        yield
    finally:
        for module in (param_optimizer, master_optimizer):
            module.GlobalNorm = GlobalNorm  # type: ignore[misc]


def run(groups: Any, values: dict[str, np.ndarray], shard: bool, control: bool) -> Any:
    rank = int(groups.ep.rank)
    model = Toy(HELD * rank, HELD, values)
    experts = expert_rows(model)
    if control:
        with without_ep_sum(groups.ep):
            opt = build_distributed_optimizer(model, TRAIN, TRAIN.lr, groups, shard=shard,
                                              experts=experts)  # fmt: skip
    else:
        opt = build_distributed_optimizer(model, TRAIN, TRAIN.lr, groups, shard=shard,
                                          experts=experts)  # fmt: skip
    assert isinstance(opt, master_optimizer.MasterOptimizer if shard
                      else param_optimizer.ParamOptimizer)  # fmt: skip
    assert set(opt.held.experts) == {"experts.gate", "experts.down"}
    norms = []
    for factor in FACTORS:
        grads = full_grads(factor)
        for n, p in model.named_parameters():
            if n.startswith("experts."):
                p.grad = paddle.to_tensor(grads[n][HELD * rank : HELD * (rank + 1)])
            else:
                p.grad = paddle.to_tensor(grads[n] / np.float32(2))  # the cp sum: exactly G
        opt.reduce_grads()
        norms.append(opt.grad_norm())
        opt.step()
        opt.clear_grad()
    return norms, {n: p.numpy() for n, p in model.named_parameters()}


def report(comparison: Any) -> dict[str, Any]:
    return {
        "ok": comparison.ok,
        "error": comparison.error,
        "allowed": comparison.allowed,
        "describe": comparison.describe(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    env = init_distributed()
    groups = build_groups(ParallelDims(dp=1, pp=1, cp=2, world_size=env.world_size, ep=2))
    rank = int(groups.ep.rank)
    rng = np.random.default_rng(3)
    values = {n: rng.normal(size=s).astype(np.float32) for n, s in SHAPES.items()}
    want_norms, want = reference(values)
    rows = slice(HELD * rank, HELD * (rank + 1))
    want_mine = {n: (v[rows] if n.startswith("experts.") else v) for n, v in want.items()}
    elements = sum(int(np.prod(s)) for s in SHAPES.values())
    out: dict[str, Any] = {"rank": rank, "want_norms": want_norms}
    for shard in (False, True):
        for control in (False, True):
            norms, got = run(groups, values, shard, control)
            name = ("zero" if shard else "param") + ("_control" if control else "")
            got_flat = np.concatenate([got[n].reshape(-1) for n in want_mine])
            want_flat = np.concatenate([v.reshape(-1) for v in want_mine.values()])
            out[name] = {
                "norms": norms,
                "norm_cmp": [
                    report(compare(g, w, n=elements, scale=w, what=f"{name} norm {i + 1}"))
                    for i, (g, w) in enumerate(zip(norms, want_norms, strict=True))
                ],
                "params_cmp": report(
                    compare(got_flat, want_flat, n=elements, steps=2, norm="l2",
                            what=f"{name} parameters after 2 steps")  # fmt: skip
                ),
            }
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(out, indent=1))
    barrier(groups.world)
    destroy_groups(groups)
    shutdown()


if __name__ == "__main__":
    main()
