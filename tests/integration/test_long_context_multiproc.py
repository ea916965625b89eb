"""Issue 20's mechanisms together through the trainer, launched: activation offload, sequence
tiling, chunked attention and gradient sharding (ZeRO-2) train as the plain run does.

Tiny GLM-4 (`configs/glm/tiny_cp2.yaml`, 256-token rows, full recompute), 4 steps of two
micro-batches, on CP = 2 and on PP = 2 × CP = 2 (1F1B). The plain run shards the optimizer
(ZeRO-1, untiled, nothing offloaded); the other adds `train.offload_activations`,
`model.tile_tokens` 48 (local rows of 128 tokens: tiles of 48, 48, 32), `attention.query_chunk`
/ `attention.kv_chunk` and `parallel.shard_gradients`. Offload moves bytes only; tiling and
chunking change the rows a kernel sees and the order weight gradients are summed, ZeRO-2 the
order of the ranks' and micro-batches' sums: the losses and gradient norms agree within
`bench.numerics`'s rule (n = the step's targets, scale = the value, steps = k), and a run
one step out of phase is rejected by the same rule (negative control).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import numerics
from flashcp.metrics.writer import read_metrics
from helpers.paths import ROOT
from helpers.trainruns import train_launched

pytestmark = pytest.mark.integration

GLM = ROOT / "configs" / "glm" / "tiny_cp2.yaml"
STEPS = 4
PLAIN = [
    f"train.steps={STEPS}",
    "train.warmup_steps=1",
    "train.grad_accum=2",
    "checkpoint.every=0",
    "model.recompute=full",
    "parallel.shard_optimizer=true",
]
MECHANISMS = [
    "train.offload_activations=true",
    "model.tile_tokens=48",
    "attention.query_chunk=64",
    "attention.kv_chunk=128",
    "parallel.shard_gradients=true",
]
LAYOUTS = {"cp2": (2, []), "pp2_cp2": (4, ["parallel.pp=2"])}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_all_mechanisms_train_as_the_plain_run(layout: str, tmp_path: Path) -> None:
    nproc, extra = LAYOUTS[layout]
    plain = read_metrics(train_launched(GLM, tmp_path / "plain", nproc, [*PLAIN, *extra]))
    run_dir = train_launched(GLM, tmp_path / "all", nproc, [*PLAIN, *extra, *MECHANISMS])
    got = read_metrics(run_dir)
    assert len(got) == len(plain) == STEPS
    for a, b in zip(got, plain, strict=True):
        assert a["targets"] == b["targets"] and a["tokens"] == b["tokens"]
        for key in ("loss", "grad_norm"):
            n, scale = numerics.metric_basis(b, key)
            numerics.assert_close(a[key], b[key], n=n, scale=scale, steps=int(b["step"]),
                                  what=f"{layout} {key} step {b['step']}")  # fmt: skip
        assert a["offload/host_peak_gib"] > 0  # the layer inputs did move
    log = (run_dir.parent / "all_logs" / "workerlog.0").read_text()
    assert "ZeRO-2" in log
    # negative control: the same rule rejects the plain run's next step
    for a, b in zip(got[1:], plain[:-1], strict=False):
        n, scale = numerics.metric_basis(b, "loss")
        numerics.assert_rejects(a["loss"], b["loss"], n=n, scale=scale, steps=int(b["step"]))
