"""`flashcp plot` (`flashcp.metrics.plot`): what a panel shows, read from the matplotlib figure's
artists — every panel names its lines in a legend, and a metric with one value (an eval that
ran only after the last step) is drawn as a visible point, not an invisible one-point line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flashcp import cli
from flashcp.metrics.plot import figure, plot_groups

STEPS = 5


def _sft_rows(eval_steps: tuple[int, ...]) -> list[dict[str, Any]]:
    """An SFT run's records (no DPO, no MoE), evaluated after `eval_steps`."""
    rows = []
    for step in range(1, STEPS + 1):
        row: dict[str, Any] = {"step": step, "loss": 3.0 - 0.2 * step, "lr": 1e-3,
                               "grad_norm": 1.5, "tokens_per_s": 900.0}  # fmt: skip
        if step in eval_steps:
            row.update({"eval/loss": 2.9 - 0.1 * step, "eval/perplexity": 18.0 - step,
                        "eval/targets": 122.0, "eval/batches": 1.0, "eval/rows": 2.0,
                        "eval/time_s": 0.05})  # fmt: skip
        rows.append(row)
    return rows


def _visible_marker(line: Any) -> bool:
    return line.get_marker() not in (None, "None", "", " ") and line.get_markersize() > 0


def _panels(fig: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The figure's axes by panel name (its title)."""
    axes = {ax.get_title(loc="left"): ax for ax in fig.axes if ax.get_title(loc="left")}
    assert list(axes) == list(plot_groups(rows))
    return axes


def test_an_eval_only_at_the_end_is_a_labelled_visible_point() -> None:
    """The SFT eval panel (perplexity alone) has a legend and a y label naming the metric; its
    single value is a marker at the last step; so is the loss panel's eval/loss."""
    import matplotlib.pyplot as plt

    rows = _sft_rows((STEPS,))
    fig = figure(rows, "sft")
    try:
        axes = _panels(fig, rows)
        ax = axes["eval"]
        (line,) = ax.get_lines()
        assert line.get_label() == "eval/perplexity"
        assert list(line.get_xdata()) == [STEPS] and list(line.get_ydata()) == [18.0 - STEPS]
        assert _visible_marker(line)
        legend = ax.get_legend()
        assert legend is not None
        assert [t.get_text() for t in legend.get_texts()] == ["eval/perplexity"]
        assert ax.get_ylabel() == "perplexity"
        loss = {ln.get_label(): ln for ln in axes["loss"].get_lines()}
        assert _visible_marker(loss["eval/loss"]) and not _visible_marker(loss["loss"])
        for name, panel in axes.items():  # every panel names its lines
            names = [t.get_text() for t in panel.get_legend().get_texts()]
            assert names == [ln.get_label() for ln in panel.get_lines()], name
    finally:
        plt.close(fig)


def test_a_one_step_run_shows_its_points() -> None:
    """A run of one step: every series has one value, each drawn as a marker."""
    import matplotlib.pyplot as plt

    rows = _sft_rows((1,))[:1]
    fig = figure(rows, "one step")
    try:
        lines = [ln for ax in fig.axes for ln in ax.get_lines()]
        assert lines and all(_visible_marker(ln) for ln in lines)
    finally:
        plt.close(fig)


@pytest.mark.parametrize("every", [1, STEPS])
def test_flashcp_plot_writes_the_png(tmp_path: Path, every: int,
                                     capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """Through the CLI: eval after every step or only after the last, a PNG either way."""
    run = tmp_path / "run"
    run.mkdir()
    rows = _sft_rows(tuple(range(every, STEPS + 1, every)))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli.main(["plot", str(run)]) == 0
    assert f"wrote {run / 'metrics.png'}" in capsys.readouterr().out
    assert (run / "metrics.png").stat().st_size > 1000


def test_the_step_axis_counts_whole_steps() -> None:
    import matplotlib.pyplot as plt

    fig = figure(_sft_rows((1,))[:1], "one step")
    try:
        fig.canvas.draw()
        ticks = [t for t in fig.axes[-1].get_xticks() if 0 < t < 2]
        assert ticks == [1.0] and fig._suptitle.get_text() == "one step: 1 step"
    finally:
        plt.close(fig)


def test_a_resume_and_a_layout_change_are_marked_on_the_step_axis(tmp_path: Path) -> None:
    """Each start writes where it began into its first record; `flashcp plot` draws a line
    there, labelled `resumed` or, across a layout change, from what to what (issue 37: the
    throughput jumps at a CP 2 → DP 2 resume with no explanation)."""
    from flashcp.metrics.plot import start_marks
    from flashcp.metrics.writer import read_metrics
    from helpers.configs import tiny_config
    from helpers.trainruns import fit

    def cfg(steps: int) -> Any:
        return tiny_config(tmp_path, train={"steps": steps}, checkpoint={"every": 1})

    fit(cfg(2))
    fit(cfg(4))  # resumes at step 3, same layout
    records = read_metrics(tmp_path / "run")
    starts = {r["step"]: r["start"] for r in records if "start" in r}
    assert starts == {1: {"layout": "dp 1 × pp 1 × cp 1", "resumed": False},
                      3: {"layout": "dp 1 × pp 1 × cp 1", "resumed": True}}  # fmt: skip
    assert start_marks(records) == [(3, "resumed")]
    rows = _sft_rows(())
    rows[0]["start"] = {"layout": "dp 1 × pp 1 × cp 2", "resumed": False}
    rows[2]["start"] = {"layout": "dp 2 × pp 1 × cp 1", "resumed": True}
    label = "resumed: dp 1 × pp 1 × cp 2 → dp 2 × pp 1 × cp 1"
    assert start_marks(rows) == [(3, label)]
    fig = figure(rows, "run")
    for ax in fig.axes:
        if ax.get_title(loc="left"):
            assert any(list(line.get_xdata()) == [2.5, 2.5] for line in ax.get_lines())
    assert [t.get_text() for t in fig.axes[0].texts] == [label]
