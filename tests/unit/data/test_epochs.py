"""Epochs (`train.epochs`, `flashcp.data.epochs`): the rows one pass over the data takes,
counted by the data sources against stepping them until their epoch turns; the steps of E
epochs; and the config rule that steps and epochs are alternatives."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from flashcp.config import build_config, to_dict, to_yaml
from flashcp.data.dpo_stream import DPOData
from flashcp.data.epochs import epoch_steps, format_passes, passes, steps_for_epochs
from flashcp.problems import ProblemsError
from flashcp.recipes.lm import LMData

TINY = {"model": {"preset": "tiny"}, "data": {"seq_len": 64, "micro_batch_size": 2}}


def _rows_until_next_epoch(stream_next, epoch) -> int:  # type: ignore[no-untyped-def]
    rows = 0
    while epoch() == 0:
        stream_next()
        rows += 1
    return rows


@pytest.mark.parametrize("packing", [True, False])
def test_lm_rows_per_epoch(packing: bool) -> None:
    cfg = build_config({**TINY, "data": {**TINY["data"], "packing": packing}})
    data = LMData(cfg)
    stepped = _rows_until_next_epoch(data.stream.plan_next, lambda: data.stream.state.epoch)
    if packing:  # documents continue across rows: the pass ends inside the last row
        assert math.ceil(data.rows_per_epoch) == stepped
        assert data.rows_per_epoch == data.num_tokens / 64
    else:
        assert data.rows_per_epoch == stepped == data.num_documents


def test_dpo_rows_per_epoch() -> None:
    cfg = build_config({"model": {"preset": "tiny_glm"}, "run": {"recipe": "dpo"},
                        "data": {"seq_len": 256, "micro_batch_size": 1}})  # fmt: skip
    data = DPOData(cfg)
    taken = _rows_until_next_epoch(data.step_rows, lambda: data.epoch)
    # DPO turns its epoch when the next row is asked for: that row is epoch 1's first
    assert data.rows_per_epoch == taken - 1 == data.plan.first_epoch_rows > 5


def test_steps_for_epochs_and_back() -> None:
    assert steps_for_epochs(1, 20.0, 2) == 10 and steps_for_epochs(2, 20.0, 2) == 20
    assert steps_for_epochs(1, 20.5, 2) == 11  # the last, partial step is run
    assert steps_for_epochs(0.01, 20.0, 2) == 1  # at least one step
    assert passes(10, 2, 20.0) == 1.0 and format_passes(passes(23, 2, 20.0)) == "2.3"
    assert format_passes(0.2612) == "0.26" and format_passes(12.4) == "12"
    with pytest.raises(ValueError, match="0 rows per pass"):
        steps_for_epochs(1, 0.0, 2)


def test_whole_step_counts_up_to_float_error_are_not_rounded_up() -> None:
    """1.1 epochs of a 100-step pass are 110 steps: 1.1 × 100 is 110.00000000000001 in
    float64, and a ceil of it alone would run a 111th step. The slack is float error only: a
    real fraction of a step, one row in a million, still adds the step."""
    assert 1.1 * 100.0 / 1 > 110  # the float error the slack absorbs
    assert steps_for_epochs(1.1, 100.0, 1) == 110
    assert steps_for_epochs(1.1, 100.0, 5) == 22  # 22.000000000000004
    assert steps_for_epochs(2.3, 100.0, 1) == 230  # 229.99999999999997: no step lost
    assert steps_for_epochs(1, 1_000_001.0, 10_000) == 101  # 100.0001 steps: the last runs


def test_too_few_epochs_for_one_step_still_run_one() -> None:
    """`train.epochs` > 0 (the config refuses 0) never gives zero steps: a fraction of one
    step runs one, even when the product underflows to 0.0 (5e-324 epochs pass the config's
    > 0 check)."""
    assert steps_for_epochs(1e-6, 20.0, 2) == 1
    assert 5e-324 * 1.0 / 4 == 0.0
    assert steps_for_epochs(5e-324, 1.0, 4) == 1
    cfg = build_config(TINY, overrides=["train.epochs=5e-324"])
    assert cfg.train.epochs is not None and cfg.train.epochs > 0


def test_passes_and_their_text_at_the_edges() -> None:
    """The start line's pass count: no rows counted is infinitely many passes (not a division
    by zero), a fraction of a row per pass still divides; 10 passes and more print whole
    (`123`, not `1.2e+02`); a step of no rows cannot count steps."""
    assert passes(10, 2, 0.0) == math.inf and passes(4, 2, 0.5) == 16.0
    assert format_passes(123.4) == "123" and format_passes(9.96) == "10"
    with pytest.raises(ValueError, match="a step takes 0"):
        steps_for_epochs(1, 20.0, 0)


def test_steps_and_epochs_are_alternatives() -> None:
    both = {**TINY, "train": {"steps": 5, "epochs": 2}}
    with pytest.raises(ProblemsError, match=r"both set in the file: set exactly one"):
        build_config(both)
    with pytest.raises(ProblemsError, match=r"both set on the command line"):
        build_config(TINY, overrides=["train.steps=5", "train.epochs=2"])
    # one in the file, the other on the command line: the command line's wins
    cfg = build_config({**TINY, "train": {"steps": 5}}, overrides=["train.epochs=2"])
    assert cfg.train.epochs == 2.0
    cfg = build_config({**TINY, "train": {"epochs": 2}}, overrides=["max_steps=7"])
    assert (cfg.train.steps, cfg.train.epochs) == (7, None)
    with pytest.raises(ProblemsError, match=r"train\.epochs: must be > 0"):
        build_config(TINY, overrides=["train.epochs=0"])
    # a run's written config (config.yaml) reloads: the epochs, no steps
    cfg = build_config({**TINY, "train": {"epochs": 1.5}})
    assert "steps" not in to_dict(cfg)["train"]
    import yaml

    again = build_config(yaml.safe_load(to_yaml(replace(cfg, train=replace(cfg.train, steps=9)))))
    assert again.train.epochs == 1.5


class _Counted:
    """A data source that counts its rows per pass."""

    rows_per_epoch = 20.0


class _Uncounted:
    """A data source that does not."""


def test_a_config_of_epochs_gets_its_steps_from_the_data() -> None:
    """`epoch_steps` (what the trainer asks before building): `train.steps` from the data's
    rows per pass and a step's rows (micro_batch_size × grad_accum × dp); a config without
    `train.epochs` comes back as it is; a source that cannot count is refused, naming it."""
    cfg = build_config({**TINY, "train": {"epochs": 2, "grad_accum": 3}})
    assert epoch_steps(cfg, _Counted()).train.steps == 7  # 40 rows at 2 × 3 a step: 6.7
    wide = replace(cfg, parallel=replace(cfg.parallel, dp=2))
    assert epoch_steps(wide, _Counted()).train.steps == 4  # 12 rows a step: 3.3
    plain = build_config(TINY)
    assert epoch_steps(plain, _Uncounted()) is plain
    with pytest.raises(ValueError, match="the _Uncounted data source does not count its rows"):
        epoch_steps(cfg, _Uncounted())
