"""The float32 tolerance rule (`bench.numerics`): its arithmetic, its reports, and that it
rejects real bugs at the scale of the golden jobs.

The training-level negative controls run `configs/gpt/tiny_cp2.yaml` (the golden config) in
this process for 4 steps three times: as shipped, with labels shifted after a CP = 2
dual-chunk sharding (wrong only at the chunk boundaries: 4 tokens in 256 per row), and with
the two CP ranks' positions swapped (a wrong shard). Both bugs must fail the comparisons the
equivalence and golden tests make, by a wide margin.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

import numerics_report  # scripts/numerics_report.py (pytest's pythonpath)
from bench import jobs, numerics
from flashcp.attention.registry import make_assignment
from flashcp.checkpoint.checkpointer import GRADS_DIR
from flashcp.config import load_config
from flashcp.metrics.writer import read_metrics
from flashcp.pipeline import runner as pipeline_runner
from flashcp.trainer import Trainer
from helpers.paths import ROOT

GOLDEN_CONFIG = ROOT / "configs" / "gpt" / "tiny_cp2.yaml"
STEPS = 4


@pytest.fixture(autouse=True)
def _log_only_the_controls(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule's own arithmetic tests compare made-up numbers: keep them out of a
    `FLASHCP_NUMERICS_LOG` (the golden-scale negative controls stay in)."""
    if request.node.get_closest_marker("equivalence") is None:
        monkeypatch.delenv(numerics.LOG_ENV, raising=False)


# -- the rule ---------------------------------------------------------------------------------


def test_tolerance_is_factor_eps_sqrt_n_scale_steps() -> None:
    assert numerics.EPS32 == 2.0**-23
    got = numerics.tolerance(400, 3.0, steps=2)
    assert got == pytest.approx(numerics.FACTOR * 2.0**-23 * 20 * 3.0 * 2)
    assert numerics.tolerance(1, 1.0, factor=1.0) == 2.0**-23
    assert numerics.tolerance(4, 0.0) == 0.0
    for bad in ({"n": 0, "scale": 1.0}, {"n": 4, "scale": -1.0}, {"n": 4, "scale": math.nan}):
        with pytest.raises(ValueError, match="tolerance needs"):
            numerics.tolerance(**bad)
    with pytest.raises(ValueError, match="steps >= 1"):
        numerics.tolerance(4, 1.0, steps=0)


def test_compare_max_and_l2_with_default_scales() -> None:
    want = np.array([3.0, -4.0, 0.0])
    got = want + np.array([1e-6, 0.0, -2e-6])
    m = numerics.compare(got, want, n=16, what="x")
    assert m.error == pytest.approx(2e-6) and m.scale == 4.0 and m.norm == "max"
    assert m.allowed == pytest.approx(numerics.tolerance(16, 4.0)) and m.ok
    l2 = numerics.compare(got, want, n=16, norm="l2")
    assert l2.error == pytest.approx(math.sqrt(5e-12)) and l2.scale == pytest.approx(5.0)
    assert l2.units == pytest.approx(l2.error / (numerics.EPS32 * 4 * 5.0))
    with pytest.raises(ValueError, match="norm must be"):
        numerics.compare(got, want, n=4, norm="l1")


def test_compare_infinities_nan_and_shapes() -> None:
    lse = np.array([1.0, -np.inf, 2.0])
    assert numerics.compare(lse, lse.copy(), n=4).error == 0.0  # matching -inf is fine
    assert numerics.compare(lse, np.array([1.0, 0.0, 2.0]), n=4).error == math.inf
    assert numerics.compare(np.array([1.0, np.inf]), np.array([1.0, 2.0]), n=4).error == math.inf
    assert numerics.compare(np.array([np.nan]), np.array([1.0]), n=4).error == math.inf
    assert numerics.compare(np.zeros(2), np.zeros(3), n=4).error == math.inf
    empty = numerics.compare(np.zeros(0), np.zeros(0), n=1)
    assert empty.error == 0.0 and empty.scale == 0.0 and empty.units == 0.0
    assert numerics.compare(1.0, 0.0, n=1).units == math.inf  # zero allowance, non-zero error


def test_assert_close_reports_error_allowance_and_basis() -> None:
    assert numerics.assert_close(1.0, 1.0 + 1e-7, n=100).ok
    with pytest.raises(AssertionError) as err:
        numerics.assert_close(5.5, 5.6, n=512, scale=5.5, steps=2, what="loss step 2")
    text = str(err.value)
    assert "loss step 2: max error 1.000e-01 vs allowed" in text
    assert f"{numerics.FACTOR:g}·eps32·√512·5.5·2" in text and "units" in text


def test_assert_rejects_needs_a_wide_margin() -> None:
    control = numerics.assert_rejects(1.0, 2.0, n=4)
    assert control.units > 10 * numerics.FACTOR
    with pytest.raises(AssertionError, match="negative control not rejected"):
        numerics.assert_rejects(1.0, 1.0 + 1e-6, n=4)


def test_comparisons_are_logged_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "n.jsonl"
    monkeypatch.setenv(numerics.LOG_ENV, str(log))
    numerics.compare(1.0, 1.0, n=4, what="a")
    numerics.compare([1.0], [2.0], n=4, what="b")
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["what"], r["ok"]) for r in rows] == [("a", True), ("b", False)]
    assert rows[1]["units"] > numerics.FACTOR and rows[0]["test"].startswith("tests/unit/")


def test_metric_basis() -> None:
    row = {"targets": 400, "loss": 5.5, "grad_norm": 2.0, "examples": 4.0,
           "logps/chosen": -120.0, "logps/rejected": -80.0}  # fmt: skip
    assert numerics.metric_basis(row, "loss") == (400.0, 5.5)
    assert numerics.metric_basis(row, "grad_norm") == (400.0, 2.0)
    assert numerics.metric_basis(row, "loss", beta=0.1) == (100.0, pytest.approx(20.0))
    assert numerics.metric_basis(row, "grad_norm", beta=0.1) == (400.0, 2.0)
    # a weight gradient sums over every token row, targets or not
    few = {**row, "targets": 2, "tokens": 128}
    assert numerics.metric_basis(few, "grad_norm") == (128.0, 2.0)
    assert numerics.metric_basis(few, "loss") == (2.0, 5.5)
    with pytest.raises(KeyError, match="rewards/chosen"):
        numerics.metric_basis(row, "rewards/chosen")


def test_labels_shifted_after_sharding_breaks_only_chunk_ends() -> None:
    ids = np.arange(10, 18)[None]  # one row, one document, shard = all of it
    right = np.append(ids[0, 1:], -100)[None]
    wrong = numerics.labels_shifted_after_sharding(ids, right)
    np.testing.assert_array_equal(wrong[0, :-1], right[0, :-1])
    assert wrong[0, -1] == -100  # the document end stays ignored
    shard = np.concatenate([ids[:, :2], ids[:, 6:]], axis=1)  # a dual-chunk shard
    labels = np.concatenate([right[:, :2], right[:, 6:]], axis=1)
    got = numerics.labels_shifted_after_sharding(shard, labels)
    np.testing.assert_array_equal(got, [[11, 16, 17, -100]])  # 16 should be 12
    assert (got != -100).sum() == (labels != -100).sum()


# -- the rule rejects real bugs at the golden jobs' scale --------------------------------------


def _dualchunk_positions(seq: int) -> list[np.ndarray]:
    asg = make_assignment("dualchunk_allgather", 2, None)
    return [asg.positions(seq, r) for r in range(2)]


def _label_shift(local: Any) -> Any:
    """Labels as CP = 2 would build them after sharding (see `labels_shifted_after_sharding`)."""
    for pos in _dualchunk_positions(local.labels.shape[1]):
        local.labels[:, pos] = numerics.labels_shifted_after_sharding(
            local.input_ids[:, pos], local.labels[:, pos]
        )
    return local


def _swapped_positions(local: Any) -> Any:
    """Each CP = 2 rank's tokens get the other rank's positions (a wrong shard)."""
    first, second = _dualchunk_positions(local.positions.shape[1])
    local.positions[:, first], local.positions[:, second] = (
        local.positions[:, second].copy(), local.positions[:, first].copy(),
    )  # fmt: skip
    return local


def _train(out: Path, monkeypatch: pytest.MonkeyPatch, bug: Callable[[Any], Any] | None) -> Path:
    if bug is not None:
        original = pipeline_runner.shard_batch
        monkeypatch.setattr(pipeline_runner, "shard_batch", lambda *a: bug(original(*a)))
    overrides = [f"train.steps={STEPS}", "checkpoint.every=0", "checkpoint.resume=never",
                 "debug.dump_grads=true", "parallel.cp=1", f"run.output_dir={out}"]  # fmt: skip
    Trainer(load_config(GOLDEN_CONFIG, overrides)).fit()
    monkeypatch.undo()
    return out


def _max_units(run: Path, ref: Path) -> dict[str, float]:
    """Largest error, in units of the rule, of each quantity the equivalence tests compare."""
    worst = {"loss": 0.0, "grad_norm": 0.0, "grads": 0.0}
    for a, b in zip(read_metrics(run), read_metrics(ref), strict=True):
        step = int(b["step"])
        assert a["targets"] == b["targets"]  # the bugs keep the counts: the tolerance decides
        for key in ("loss", "grad_norm"):
            n, scale = numerics.metric_basis(b, key)
            what = f"negative control {key}"
            cmp = numerics.compare(a[key], b[key], n=n, scale=scale, steps=step, what=what)
            worst[key] = max(worst[key], cmp.units)
        got = load_file(str(run / GRADS_DIR / f"step_{step}.safetensors"))
        want = load_file(str(ref / GRADS_DIR / f"step_{step}.safetensors"))
        for name in want:
            cmp = numerics.compare(
                got[name], want[name], n=b["targets"], steps=step, norm="l2",
                what=f"negative control grad {name}",
            )  # fmt: skip
            worst["grads"] = max(worst["grads"], cmp.units)
    return worst


@pytest.fixture(scope="module")
def golden_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        return _train(tmp_path_factory.mktemp("ref") / "run", mp, None)


@pytest.mark.equivalence
@pytest.mark.parametrize(
    ("bug", "loss_rejects"),
    [(_label_shift, True), (_swapped_positions, False)],
    ids=["label_shift", "wrong_shard"],
)
def test_rule_rejects_cp_bugs_at_golden_scale(
    bug: Callable[[Any], Any], loss_rejects: bool, golden_reference: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Every equivalence test compares gradients: they reject both bugs by orders of magnitude.
    The golden tests compare the losses and gradient norms of 4 steps: they reject the label
    shift (by its gradient norm most of all); the swapped positions move a freshly initialised
    model's loss by ~3e-5 relative (it barely uses positions yet), inside the rule as it was
    inside the former fixed 1e-5 — that bug is the gradient comparisons' to catch."""
    run = _train(tmp_path / "run", monkeypatch, bug)
    worst = _max_units(run, golden_reference)
    assert worst["grads"] > 100 * numerics.FACTOR, worst
    if loss_rejects:
        assert worst["loss"] > numerics.FACTOR, worst  # the losses alone reject it
        assert worst["grad_norm"] > 4 * numerics.FACTOR, worst  # the golden norms, with margin


def test_numerics_report_summarises_agreements_and_controls(tmp_path: Path) -> None:
    """`scripts/numerics_report.py` (the tables of docs/portability.md) from a log."""
    node = "tests/integration/test_x.py::test_a[2]"
    rows = [
        {"test": node, "what": "grad w step 1", "units": 0.5, "ok": True},
        {"test": node, "what": "grad b step 2", "units": 2.0, "ok": True},
        {"test": node, "what": "label-shift grad w", "units": 0.1, "ok": True},
        {"test": node, "what": "label-shift grad b", "units": 900.0, "ok": False},
        {"test": node + "x", "what": "label-shift grad w", "units": 500.0, "ok": False},
    ]
    agree, reject = numerics_report.summarise(rows)
    assert agree == {("test_x.py", "grad"): [2, 2.0]}
    assert reject == {("test_x.py", "label-shift grad"): [2, 500.0]}
    log = tmp_path / "n.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert numerics_report.main([str(log), "--markdown"]) == 0


def test_golden_compare_uses_the_rule_and_its_stored_basis() -> None:
    """`bench.jobs`: goldens carry (n, scale) per step; another dtype has its own relative
    tolerance (a bf16 GPU job against the float32 goldens)."""
    want = {"nproc": 2, "steps": 4, "overrides": [], "losses": {"1": 5.5, "4": 5.0},
            "basis": {"1": [512.0, 5.5], "4": [512.0, 5.0]}}  # fmt: skip
    allowed_4 = numerics.tolerance(512, 5.0, steps=4)
    near = {**want, "losses": {"1": 5.5 + 1e-6, "4": 5.0 + 0.9 * allowed_4}}
    far = {**want, "losses": {"1": 5.5, "4": 5.0 + 1.1 * allowed_4}}
    assert jobs.compare_losses("c", want, near) == []
    (problem,) = jobs.compare_losses("c", want, far)
    assert problem.startswith("c: step 4 loss") and "units" in problem
    assert jobs.close(want, "4", 5.0 + 0.9 * allowed_4) and not jobs.close(want, "4", 5.1)
    old = {k: v for k, v in want.items() if k != "basis"}
    assert "no tolerance basis" in jobs.compare_losses("c", old, near)[-1]
    bf16 = {**want, "losses": {"1": 5.5 * 1.01, "4": 5.0 * 1.03}}
    (problem,) = jobs.compare_losses("c", old, bf16, tol=0.02)
    assert "step 4" in problem and "cross-dtype tolerance 0.02" in problem
