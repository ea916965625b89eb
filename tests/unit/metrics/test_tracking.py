"""Tracking (`run.report_to`), the MFU estimate, consumed tokens and `flashcp plot`'s groups.

* VisualDL: a run asked to report there writes a VisualDL log whose scalars, read back with
  VisualDL's own `LogReader`, are exactly metrics.jsonl's numeric values, tag for tag.
* wandb / tensorboard (not installed here): a missing package is a config error naming
  `run.report_to` and the pip package; with stand-in modules the reporters make the calls
  those libraries document, with the same scalars.
* MFU: the parameter count behind it against the built model's own matmul weights; the
  metric against its formula.
* `flashcp plot` draws every group present (loss, lr, grad norm, throughput/MFU, memory, DPO,
  eval, MoE).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import struct
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flashcp import cli, rundir
from flashcp.cp.work import matmul_parameters
from flashcp.metrics import tracking
from flashcp.metrics.flops import flops_per_token, mfu
from flashcp.metrics.plot import figure, plot_groups, plot_run
from flashcp.metrics.writer import read_metrics, scalars
from flashcp.models import build_model, preset
from flashcp.problems import ProblemsError
from helpers.configs import TINY_LM, Sections, TinyCfg, merged
from helpers.trainruns import Fit


@pytest.fixture
def tiny_base() -> Sections:
    """Three steps, one of warmup, the schema's `min_lr`."""
    return merged(
        TINY_LM, train={"steps": 3, "warmup_steps": 1, "min_lr": 3e-5}, checkpoint={"every": 0}
    )


def test_visualdl_log_holds_the_metrics_scalars(
    tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit
) -> None:
    from visualdl import LogReader

    evalset = tmp_path / "eval.jsonl"
    evalset.write_text("".join(json.dumps({"text": f"held out line {i}. " * 6}) + "\n"
                               for i in range(6)))  # fmt: skip
    cfg = tiny_cfg(
        tmp_path,
        run={"report_to": ["jsonl", "visualdl"]},
        hardware={"peak_tflops": 0.5},
        eval={"path": str(evalset), "every": 2},
    )
    out = fit(cfg).out
    assert "reporting to jsonl, visualdl" in out and "mfu vs 0.5 TFLOP/s per device" in out
    records = read_metrics(cfg.run.output_dir)
    (log,) = (Path(cfg.run.output_dir) / rundir.VISUALDL_DIR).glob("vdlrecords.*.log")
    reader = LogReader(file_path=str(log))
    want: dict[str, dict[int, float]] = {}
    for record in records:
        for tag, value in scalars(record).items():
            want.setdefault(tag, {})[record["step"]] = value
    assert set(reader.get_tags()["scalar"]) == set(want)
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "consumed_tokens",
            "peak_memory_gib", "eval/loss"} <= set(want)  # fmt: skip
    assert sorted(want["eval/loss"]) == [2, 3]  # eval every 2 steps and after the last
    for tag, values in want.items():
        got = {int(e.id): e.value for e in reader.get_data("scalar", tag)}
        assert got.keys() == values.keys(), tag
        for step, value in values.items():  # VisualDL stores float32
            assert got[step] == pytest.approx(float(np.float32(value)), rel=1e-6, abs=1e-30), tag


def test_consumed_tokens_and_mfu(tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit) -> None:
    cfg = tiny_cfg(tmp_path, hardware={"peak_tflops": 2.0}, checkpoint={"every": 2},
               run={"stop_after_steps": 2})  # fmt: skip
    fit(cfg)
    resumed = tiny_cfg(tmp_path, hardware={"peak_tflops": 2.0}, checkpoint={"every": 2})
    fit(resumed)
    rows = read_metrics(cfg.run.output_dir)
    assert [r["consumed_tokens"] for r in rows] == [128, 256, 384]  # 2 × 64 per step, resumed
    per_token = flops_per_token(cfg.model, 64)
    for r in rows:
        assert r["mfu"] == pytest.approx(per_token * r["tokens_per_s"] / 2e12, rel=1e-12)
    plain = tiny_cfg(tmp_path / "plain")
    assert "mfu not reported (set hardware.peak_tflops)" in fit(plain).out
    assert "mfu" not in read_metrics(plain.run.output_dir)[0]


def _matmul_weights(model: Any) -> int:
    """Elements of every 2-D weight the tokens multiply (the embedding lookups excluded)."""
    return sum(
        int(np.prod(p.shape))
        for n, p in model.named_parameters()
        if len(p.shape) == 2 and "embed" not in n
    )


@pytest.mark.parametrize("name", ["tiny", "tiny_glm"])
def test_matmul_parameters_are_the_models_matmul_weights(name: str) -> None:
    """Dense models: every 2-D weight the token multiplies (not the embedding lookup)."""
    args = preset(name)
    model = build_model(args)
    weights = _matmul_weights(model)
    assert matmul_parameters(args) == weights
    seq = 64
    attention = 12 * args.num_layers * args.num_heads * args.head_size * seq
    assert flops_per_token(args, seq) == 6 * weights + attention
    assert flops_per_token(args, seq, lora=True) == 4 * weights + attention
    dpo = flops_per_token(args, seq, reference=True)
    assert dpo == 8 * weights + attention * 16 / 12


def test_trained_mtp_layers_count_one_more_layer_and_head_per_depth() -> None:
    """Trained MTP depths (`model.mtp_loss_weight` > 0) run a block, eh_proj and a head per
    token: every 2-D weight of the built model, and attention over L + D layers; frozen
    ones never run: the count without them (negative control: the built weights exceed it)."""
    trained = preset("tiny_glm", mtp_layers=2, mtp_loss_weight=0.3)
    model = build_model(trained)
    weights = _matmul_weights(model)
    assert matmul_parameters(trained) == weights
    seq = 64
    layers = trained.num_layers + 2
    attention = 12 * layers * trained.num_heads * trained.head_size * seq
    assert flops_per_token(trained, seq) == 6 * weights + attention
    frozen = preset("tiny_glm", mtp_layers=2)
    assert matmul_parameters(frozen) == matmul_parameters(preset("tiny_glm")) < weights
    assert flops_per_token(frozen, seq) == flops_per_token(preset("tiny_glm"), seq)


def test_moe_counts_only_the_experts_a_token_uses() -> None:
    """An MoE layer: the router, the shared expert and top-k of the routed experts."""
    args = preset("tiny_glm_moe")
    model = build_model(args)
    weights = routed = 0
    for n, p in model.named_parameters():
        if len(p.shape) >= 2 and "embed" not in n:
            weights += int(np.prod(p.shape))
            if ".experts" in n:
                routed += int(np.prod(p.shape))
    assert routed > 0 and args.num_experts_per_tok < args.num_experts
    active = routed * args.num_experts_per_tok // args.num_experts
    assert matmul_parameters(args) == weights - routed + active
    assert mfu(1e9, 1000.0, 1.0, 4) == pytest.approx(1e12 / 4e12)


# -- backends ----------------------------------------------------------------------------------


def test_missing_backend_is_a_config_error_naming_key_and_package(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    tiny_cfg: TinyCfg,
) -> None:
    with pytest.raises(ProblemsError) as info:
        tiny_cfg(tmp_path, run={"report_to": ["jsonl", "wandb", "tensorboard", "mlflow"]})
    text = str(info.value)
    assert "run.report_to: 'wandb' needs the wandb package, which is not installed here: " \
           "pip install wandb, or remove 'wandb' from run.report_to" in text  # fmt: skip
    assert "'tensorboard' needs the tensorboardX package" in text
    assert "pip install tensorboardX" in text
    assert "unknown backend 'mlflow' (backends: jsonl, tensorboard, visualdl, wandb)" in text
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "visualdl" else real(n, *a)
    )
    with pytest.raises(ProblemsError, match="pip install visualdl"):
        tiny_cfg(tmp_path, run={"report_to": ["visualdl"]})
    with pytest.raises(ValueError, match="unknown backend 'csv'"):
        tracking.build_reporters(tiny_cfg(tmp_path), ["csv"])


def _fake_module(monkeypatch: pytest.MonkeyPatch, name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_wandb_and_tensorboard_reporters_get_the_same_scalars(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    tiny_cfg: TinyCfg,
    fit: Fit,
) -> None:
    calls: list[tuple[str, Any]] = []

    class Run:
        def log(self, values: dict[str, float], step: int) -> None:
            calls.append(("wandb.log", (step, dict(values))))

        def finish(self) -> None:
            calls.append(("wandb.finish", None))

    def init(**kw: Any) -> Run:
        calls.append(("wandb.init", kw))
        return Run()

    class SummaryWriter:
        def __init__(self, logdir: str) -> None:
            calls.append(("tb.init", logdir))

        def add_scalar(self, tag: str, value: float, global_step: int) -> None:
            calls.append(("tb.add_scalar", (global_step, tag, value)))

        def flush(self) -> None:
            pass

        def close(self) -> None:
            calls.append(("tb.close", None))

    _fake_module(monkeypatch, "wandb", init=init)
    _fake_module(monkeypatch, "tensorboardX", SummaryWriter=SummaryWriter)
    monkeypatch.setenv("WANDB_PROJECT", "glm-sft")
    cfg = tiny_cfg(tmp_path, run={"report_to": ["jsonl", "wandb", "tensorboard"]},
               train={"steps": 2})  # fmt: skip
    fit(cfg)
    records = read_metrics(cfg.run.output_dir)
    (init_kw,) = [kw for what, kw in calls if what == "wandb.init"]
    assert init_kw["project"] == "glm-sft" and init_kw["name"] == "run"
    assert init_kw["config"]["train"]["steps"] == 2 and init_kw["dir"] == cfg.run.output_dir
    logged = [v for what, v in calls if what == "wandb.log"]
    assert logged == [(r["step"], scalars(r)) for r in records]
    tb = [v for what, v in calls if what == "tb.add_scalar"]
    assert tb == [(r["step"], k, v) for r in records for k, v in scalars(r).items()]
    assert ("tb.init", str(Path(cfg.run.output_dir) / "tensorboard")) in calls
    assert ("wandb.finish", None) in calls and ("tb.close", None) in calls


def test_scalars_are_the_numeric_values() -> None:
    record = {"step": 3, "loss": 1.5, "tokens": 128, "skipped": False, "note": "x", "mfu": 0.1}
    assert scalars(record) == {"loss": 1.5, "tokens": 128.0, "mfu": 0.1}


# -- plot --------------------------------------------------------------------------------------


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_plot_draws_every_group_present(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = []
    for step in range(1, 6):
        row = {
            "step": step, "loss": 1.0 / step, "lr": 1e-3, "grad_norm": 2.0, "tokens": 512,
            "tokens_per_s": 900.0 + step, "mfu": 0.3, "peak_memory_gib": 1.5,
            "peak_rss_gib": 2.0, "skipped": False, "note": "text", "rewards/chosen": 0.1 * step,
            "rewards/rejected": -0.1 * step, "rewards/accuracy": 0.75,
            "moe/load_max": 1.2, "moe/load_cv": 0.3,
        }  # fmt: skip
        if step % 2 == 0:
            row.update({"eval/loss": 0.9 / step, "eval/rewards/accuracy": 0.5,
                        "eval/batches": 3.0, "eval/time_s": 0.1})  # fmt: skip
        rows.append(row)
    full = tmp_path / "full"
    full.mkdir()
    (full / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    groups = plot_groups(rows)
    assert list(groups) == ["loss", "lr", "grad_norm", "throughput", "memory", "dpo", "eval",
                            "moe"]  # fmt: skip
    assert groups["loss"] == ["loss", "eval/loss"] and groups["throughput"] == [
        "tokens_per_s", "mfu"
    ]  # fmt: skip
    assert groups["eval"] == ["eval/rewards/accuracy"] and groups["moe"] == [
        "moe/load_max", "moe/load_cv"
    ]  # fmt: skip
    assert cli.main(["plot", str(full)]) == 0
    assert "wrote" in capsys.readouterr().out
    width, height = _png_size(full / "metrics.png")
    # a plain run has no DPO, eval or MoE panel: 5 panels, a shorter image
    plain = tmp_path / "plain"
    plain.mkdir()
    keep = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "peak_memory_gib")
    (plain / "metrics.jsonl").write_text(
        "".join(json.dumps({k: r[k] for k in keep}) + "\n" for r in rows)
    )
    assert list(plot_groups(read_metrics(plain))) == ["loss", "lr", "grad_norm", "throughput",
                                                      "memory"]  # fmt: skip
    out = plot_run(plain, tmp_path / "plain.png")
    w2, h2 = _png_size(out)
    assert w2 == width and h2 < height


def test_plot_draws_the_mtp_losses_on_the_loss_panel(tmp_path: Path) -> None:
    """A run with trained MTP layers (`lm_loss`, `mtp_loss` beside `loss`, and their eval
    values) draws them as lines of the loss panel, with their values; a run without has the
    loss alone (negative control: the same file without the keys draws one line)."""
    import matplotlib.pyplot as plt

    rows = []
    for step in range(1, 5):
        row = {"step": step, "loss": 3.0 - 0.1 * step, "lm_loss": 2.0 - 0.1 * step,
               "mtp_loss": 3.5 - 0.2 * step, "lr": 1e-3}  # fmt: skip
        if step % 2 == 0:
            row.update({"eval/loss": 2.9, "eval/lm_loss": 1.9, "eval/mtp_loss": 3.2,
                        "eval/perplexity": 7.0})  # fmt: skip
        rows.append(row)
    run = tmp_path / "mtp"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    groups = plot_groups(read_metrics(run))
    assert groups["loss"] == ["loss", "lm_loss", "mtp_loss", "eval/loss", "eval/lm_loss",
                              "eval/mtp_loss"]  # fmt: skip
    assert groups["eval"] == ["eval/perplexity"]
    fig = figure(read_metrics(run), "mtp")
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert list(lines) == groups["loss"]
    assert list(lines["mtp_loss"].get_ydata()) == [r["mtp_loss"] for r in rows]
    assert list(lines["eval/lm_loss"].get_xdata()) == [2, 4]
    plt.close(fig)
    assert plot_run(run).is_file()
    plain = [{k: v for k, v in r.items() if "lm_loss" not in k and "mtp_loss" not in k}
             for r in rows]  # fmt: skip
    fig = figure(plain, "plain")
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["loss", "eval/loss"]
    plt.close(fig)
