"""The trainer in one process: schedule, learning, bitwise resume, accumulation, NaN handling."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import pytest
from safetensors.numpy import load_file

from bench import numerics
from flashcp import cli, fa_dispatch, faults
from flashcp.checkpoint.checkpointer import GRADS_DIR
from flashcp.checkpoint.format import CheckpointError
from flashcp.config import TrainConfig, to_dict
from flashcp.data.records import DataError
from flashcp.launch import outcome, worker
from flashcp.log import reset_once
from flashcp.metrics.writer import read_metrics
from flashcp.models import estimate_parameters
from flashcp.optim.lr import build_scheduler, lr_at
from flashcp.recipes.lm import LMData
from flashcp.trainer import NonFiniteError, Trainer
from helpers.configs import TINY_LM, TinyCfg, merged, tiny_config
from helpers.trainruns import Fit, losses, nan_model

# -- schedule ---------------------------------------------------------------------------------


def test_lr_schedule_values() -> None:
    t = TrainConfig(steps=12, lr=1.0, min_lr=0.1, warmup_steps=4)
    got = [lr_at(i, t) for i in range(14)]
    assert got[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert got[4] == pytest.approx(1.0)  # cosine starts at the peak
    assert got[11] == pytest.approx(0.1)  # and ends at min_lr on the last step
    mid = 4 + (11 - 4) / 2
    assert lr_at(int(mid), t) > 0.55 > lr_at(int(mid) + 1, t)
    assert got[12:] == pytest.approx([0.1, 0.1])
    assert all(a >= b for a, b in zip(got[4:], got[5:], strict=False))
    assert lr_at(0, TrainConfig(steps=3, lr=2.0, warmup_steps=0)) == pytest.approx(2.0)


def test_paddle_scheduler_follows_lr_at() -> None:
    t = TrainConfig(steps=9, lr=0.5, min_lr=0.05, warmup_steps=3)
    sched = build_scheduler(t)
    for i in range(11):
        assert sched.get_lr() == pytest.approx(lr_at(i, t))
        sched.step()


# -- training ---------------------------------------------------------------------------------


def test_twenty_steps_learn(tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit) -> None:
    cfg = tiny_cfg(tmp_path, train={"steps": 20, "warmup_steps": 3})
    _, result, out = fit(cfg)
    losses = [m.loss for m in result.metrics]
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(260), abs=0.3)  # ~uniform at init
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.8
    assert "step 20/20 | loss" in out and "tok/s" in out and "mem" in out
    records = read_metrics(cfg.run.output_dir)
    assert [r["step"] for r in records] == list(range(1, 21))
    assert set(records[0]) >= {"loss", "lr", "grad_norm", "tokens_per_s", "peak_memory_gib"}
    assert records[0]["tokens"] == 2 * 64 and records[0]["targets"] <= 2 * 63
    assert cli.main(["plot", cfg.run.output_dir]) == 0
    assert (Path(cfg.run.output_dir) / "metrics.png").stat().st_size > 1000
    saved = (Path(cfg.run.output_dir) / "config.yaml").read_text()
    assert "hidden_size: 64" in saved
    # what the run built (run_info.json) and its memory, from Paddle's allocator
    info = json.loads((Path(cfg.run.output_dir) / "run_info.json").read_text())
    n = estimate_parameters(cfg.model)
    assert info["world"] == 1 and info["degrees"] == {"dp": 1, "pp": 1, "cp": 1, "ep": 1}
    assert info["param_dtype"] == "float32"
    # the memory plan (flashcp.plan) of this config on this device: its parameter bytes are
    # what the rank built, its items sum to its total
    planned = info["plan"]
    assert planned["device"] == "cpu" and planned["budget_bytes"] is None and planned["fits"]
    (mine,) = planned["ranks"]
    assert mine["total_bytes"] == sum(mine["items"].values()) == planned["peak_bytes"]
    assert mine["items"]["params_trained"] == 4 * n and mine["items"]["params_frozen"] == 0
    assert planned["moments"]["0"] in {"forward: loss", "backward: head", "backward: layer"}
    (rank,) = info["ranks"]
    assert rank["rank"] == 0 and rank["stage"] == 0 and rank["layers"] == [0, 2]
    assert rank["params_local"] == rank["trainable_params_local"] == n
    assert rank["param_bytes_local"] == 4 * n and rank["reference_params_local"] == 0
    assert rank["allocated_bytes"] >= 4 * n
    peaks = [r["peak_memory_gib"] for r in records]
    assert all(r["peak_memory_rank"] == 0 for r in records)
    assert peaks == sorted(peaks) and peaks[-1] * 2**30 >= 3 * 4 * n  # + AdamW's two moments
    assert records[-1]["peak_rss_gib"] > peaks[-1]


def test_epochs_give_the_steps_and_the_start_line_counts_passes(
    tmp_path: Path, fit: Fit
) -> None:
    """`train.epochs` (no `train.steps`): the run takes ceil(E × rows per pass / rows per
    step) steps of this data, its LR decays to min_lr on the last of them, and the start line
    says so; a run of steps states the passes it makes."""
    raw = merged(TINY_LM, train={"epochs": 0.1}, checkpoint={"every": 0})
    del raw["train"]["steps"]
    cfg = tiny_config(tmp_path / "epochs", base=raw)
    trainer, result, out = fit(cfg)
    rows = LMData(cfg).rows_per_epoch
    want = math.ceil(0.1 * rows / 2)  # micro-batches of 2 rows, one per step
    assert trainer.cfg.train.steps == want == result.final_step > 2
    records = read_metrics(cfg.run.output_dir)
    assert len(records) == want and records[-1]["lr"] == pytest.approx(cfg.train.min_lr)
    assert f"{want} steps for train.epochs 0.1 ({want * 2 / rows:.2g} passes over the data)" in out
    plain = fit(tiny_config(tmp_path / "steps", base=TINY_LM, checkpoint={"every": 0})).out
    assert f"6 steps ≈ {6 * 2 / rows:.2g} epochs of the data" in plain


def test_resume_reproduces_losses_bitwise(tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit) -> None:
    full = tiny_cfg(tmp_path / "a")
    fit(full)
    ck = {"every": 2}
    first = tiny_cfg(tmp_path / "b", checkpoint=ck, run={"stop_after_steps": 3})
    _, r1, _ = fit(first)
    assert r1.final_step == 3 and (Path(first.run.output_dir) / "checkpoints/step_3").is_dir()
    second = tiny_cfg(tmp_path / "b", checkpoint=ck)
    t2, r2, out = fit(second)
    assert r2.start_step == 3 and r2.resumed_from is not None and "resumed from" in out
    assert losses(second) == losses(full)  # exact
    assert [m.step for m in r2.metrics] == [4, 5, 6]


def test_preemption_saves_the_step_and_the_run_resumes_bitwise(
    tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit
) -> None:
    """A rank's stop request (`stop`, a signal's number) is exchanged with the step's numbers:
    the step ends, is saved (no checkpoint was due), `fit` returns preempted; the run then
    resumes to the losses of an uninterrupted one, and the goodput ledger carries on."""
    full = tiny_cfg(tmp_path / "a")
    fit(full)
    cfg = tiny_cfg(tmp_path / "b", checkpoint={"every": 4})
    calls = [0]

    def stop() -> int:  # asked after step 2's exchange: it is seen at step 3's
        calls[0] += 1
        return int(signal.SIGUSR1) if calls[0] >= 3 else 0

    t1, r1, out1 = fit(cfg, stop=stop)
    assert r1.preempted and r1.final_step == 3 and t1.stop_ranks == {0: signal.SIGUSR1}
    assert "pre-emption requested on rank(s) 0 (SIGUSR1): saving step 3" in out1
    run = Path(cfg.run.output_dir)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_3"]
    ledger = json.loads((run / "goodput.json").read_text())
    assert not ledger["complete"] and ledger["step"] == 3 and set(ledger["saves"]) == {"3"}
    _, r2, _ = fit(cfg)
    assert not r2.preempted and r2.start_step == 3 and r2.final_step == 6
    assert losses(cfg) == losses(full)  # exact
    end = json.loads((run / "goodput.json").read_text())
    assert end["complete"] and end["step"] == 6 and end["restarts"] == 0
    assert end["productive_s"] > ledger["productive_s"] and end["wall_s"] > ledger["wall_s"]
    record = read_metrics(run)[-1]
    assert record["goodput/productive_s"] == pytest.approx(end["productive_s"])
    # negative control: a request on the last step finishes the run as it is
    asked = iter([0, int(signal.SIGTERM)])
    last = fit(tiny_cfg(tmp_path / "c", train={"steps": 2}), stop=lambda: next(asked))
    assert not last.result.preempted and last.result.final_step == 2


@pytest.mark.equivalence
def test_grad_accumulation_matches_one_big_batch(
    tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit
) -> None:
    """2 micro-batches of 1 row accumulated == 1 micro-batch of 2 rows: the same sums in
    another order, so within the float32 rule of `bench.numerics` (not bitwise)."""
    debug = {"dump_grads": True}
    big = tiny_cfg(tmp_path / "big", train={"steps": 2}, debug=debug)
    acc = tiny_cfg(
        tmp_path / "acc", data={"micro_batch_size": 1}, train={"steps": 2, "grad_accum": 2},
        debug=debug,
    )  # fmt: skip
    fit(big)
    fit(acc)
    want = read_metrics(big.run.output_dir)
    for a, b in zip(read_metrics(acc.run.output_dir), want, strict=True):
        step = b["step"]
        assert a["targets"] == b["targets"]
        for key in ("loss", "grad_norm"):
            n, scale = numerics.metric_basis(b, key)
            numerics.assert_close(a[key], b[key], n=n, scale=scale, steps=step, what=key)
        got = load_file(str(Path(acc.run.output_dir) / GRADS_DIR / f"step_{step}.safetensors"))
        exp = load_file(str(Path(big.run.output_dir) / GRADS_DIR / f"step_{step}.safetensors"))
        assert set(got) == set(exp) and len(exp) > 5
        for name in exp:
            numerics.assert_close(
                got[name], exp[name], n=b["targets"], steps=step, norm="l2", what=f"grad {name}"
            )


def test_nonfinite_loss_stops_with_step_and_rank(
    tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit
) -> None:
    cfg = tiny_cfg(tmp_path)
    with pytest.raises(NonFiniteError, match=r"non-finite loss on rank\(s\) 0 and gradients"
                                             r" on rank\(s\) 0 at step 2"):  # fmt: skip
        fit(cfg, model_factory=lambda c, s: nan_model(c, at=2))
    assert len(read_metrics(cfg.run.output_dir)) == 1  # step 1 was recorded before the stop


def test_nonfinite_step_can_be_skipped(tmp_path: Path, tiny_cfg: TinyCfg) -> None:
    cfg = tiny_cfg(tmp_path, train={"steps": 3, "on_nonfinite": "skip"})
    trainer = Trainer(cfg, stream=io.StringIO(), model_factory=lambda c, s: nan_model(c, at=2))
    trainer.train_step()
    before = {n: p.numpy().copy() for n, p in trainer.params}
    skipped = trainer.train_step()
    assert skipped.skipped and math.isnan(skipped.loss)
    for n, p in trainer.params:
        np.testing.assert_array_equal(p.numpy(), before[n], err_msg=n)
    assert not trainer.train_step().skipped
    assert "update skipped" in trainer.stream.getvalue()


def test_resume_policies(tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit) -> None:
    cfg = tiny_cfg(tmp_path, train={"steps": 2}, checkpoint={"every": 1})
    fit(cfg)
    never = tiny_cfg(tmp_path, train={"steps": 2}, checkpoint={"every": 1, "resume": "never"})
    with pytest.raises(RuntimeError, match=r"already holds checkpoints \(step_2\) and "
                       r"checkpoint\.resume is never: set checkpoint\.resume=auto to continue "
                       r"that run, run\.overwrite=true to move it aside and start over, or "
                       r"choose another run\.output_dir"):  # fmt: skip
        Trainer(never, stream=io.StringIO()).fit()
    # the Trainer never moves a run aside (that is `flashcp train`'s job, before launch)
    overwrite = tiny_cfg(tmp_path, train={"steps": 2}, run={"overwrite": True})
    with pytest.raises(RuntimeError, match=r"run\.output_dir: .* holds an earlier "
                       r"run \(checkpoints, config\.yaml, goodput\.json, metrics\.jsonl, "
                       r"run_info\.json\) and run\.overwrite is true"):  # fmt: skip
        Trainer(overwrite, stream=io.StringIO()).fit()
    step1 = Path(cfg.run.output_dir) / "checkpoints" / "step_1"
    (step1 / "model.safetensors").write_bytes(b"broken")
    explicit = tiny_cfg(tmp_path, checkpoint={"resume": str(step1)})
    with pytest.raises(CheckpointError, match="broken and was not loaded"):
        Trainer(explicit, stream=io.StringIO()).fit()
    changed = tiny_cfg(tmp_path, train={"steps": 3, "lr": 1e-3})
    _, result, out = fit(changed)
    assert result.start_step == 2 and "changed config (train.lr)" in out
    assert "train.steps changed from 2 to 3" in out


@pytest.mark.usefixtures("isolated_environ")  # the rank entry sets the runtime flags
def test_the_run_directory_is_checked_once_per_process(
    tmp_path: Path, tiny_cfg: TinyCfg, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank (`worker.main`) checks the run directory before building and its Trainer does
    not check again; a library `Trainer(cfg).fit()` checks it itself, every run."""
    from flashcp import runstart

    calls: list[str] = []
    check = runstart.check_start

    def counted(output_dir: Any, resume: str, overwrite: bool) -> None:
        calls.append(str(output_dir))
        check(output_dir, resume, overwrite)

    monkeypatch.setattr(runstart, "check_start", counted)
    path = _yaml(tmp_path, train={"steps": 1})
    assert worker.main(["--config", path, f"run.output_dir={tmp_path / 'w'}"]) == 0
    assert calls == [str(tmp_path / "w")]
    calls.clear()
    for name in ("a", "b"):  # two library runs in one process: each is checked
        cfg = tiny_cfg(tmp_path, train={"steps": 1}, run={"output_dir": str(tmp_path / name)})
        Trainer(cfg, stream=io.StringIO()).fit()
    assert calls == [str(tmp_path / "a"), str(tmp_path / "b")]


def test_the_last_step_is_saved_by_default(tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit) -> None:
    """Issue 27, defect 10: with checkpoint.every 0 (the default) the last step is still saved,
    also where run.stop_after_steps stops a run; the start line says what is saved and where;
    checkpoint.save_last false saves nothing and says so."""
    cfg = tiny_cfg(tmp_path / "a", train={"steps": 3}, run={"stop_after_steps": 2})
    assert cfg.checkpoint.every == 0 and cfg.checkpoint.save_last
    _, _, out = fit(cfg)
    root = Path(cfg.run.output_dir) / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_2"]
    assert f"checkpoints the last step (2) in {root} (newest 2 kept)" in out
    _, result, out = fit(tiny_cfg(tmp_path / "a", train={"steps": 3}))  # resumes, saves step 3
    assert result.start_step == 2 and (root / "step_3").is_dir()
    periodic = tiny_cfg(tmp_path / "b", train={"steps": 3}, checkpoint={"every": 2})
    _, _, out = fit(periodic)
    assert "checkpoints every 2 steps and the last step (3) in" in out
    assert sorted(p.name for p in (tmp_path / "b" / "run" / "checkpoints").iterdir()) == [
        "step_2", "step_3"
    ]  # fmt: skip
    never = tiny_cfg(tmp_path / "c", train={"steps": 1}, checkpoint={"save_last": False})
    _, _, out = fit(never)
    assert "no checkpoints (checkpoint.every 0, checkpoint.save_last false)" in out
    assert not (tmp_path / "c" / "run" / "checkpoints").exists()


def test_save_decision() -> None:
    """`CheckpointConfig.due`: every N steps and the last one; neither when both are off."""
    from flashcp.config import CheckpointConfig

    due = lambda ck, last: [s for s in range(1, last + 1) if ck.due(s, last)]  # noqa: E731
    assert due(CheckpointConfig(), 7) == [7]
    assert due(CheckpointConfig(every=3), 7) == [3, 6, 7]
    assert due(CheckpointConfig(every=3, save_last=False), 7) == [3, 6]
    assert due(CheckpointConfig(save_last=False), 7) == []
    assert not CheckpointConfig(save_last=False).saves and CheckpointConfig(every=5).saves
    text = CheckpointConfig(every=3).describe(6, "d")  # the last step is a multiple of 3
    assert text == "checkpoints every 3 steps in d (newest 2 kept)"


def test_the_trainer_writes_no_environment_variable(
    tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit
) -> None:
    """Deterministic mode's runtime flags are the process's, set by its entry before the
    trainer is built (`flashcp.launch.worker.set_runtime_flags`); the trainer only seeds."""
    before, seen = dict(os.environ), fa_dispatch.probe_deterministic()
    fit(tiny_cfg(tmp_path, train={"steps": 1, "deterministic": True}))
    assert dict(os.environ) == before
    assert fa_dispatch.probe_deterministic() == seen


def test_fa4_policy_from_the_environment_reaches_the_rank(
    tmp_path: Path,
    tiny_cfg: TinyCfg,
    fit: Fit,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 27, defect 1: a rank resolves the FA4 policy as preflight does (config >
    FLASHCP_FA4_UNAVAILABLE > error): the environment's fallback reaches its attention when the
    config sets none, the config's own value wins over it, and every message names where the
    policy came from."""
    monkeypatch.setenv(fa_dispatch.FLAG_VERSION, "4")  # no FA4 (nor FA3) on this CPU machine
    monkeypatch.setenv(fa_dispatch.ENV_FA4_POLICY, "fallback")
    reset_once("dispatch:")
    with caplog.at_level(logging.WARNING, logger="flashcp"):
        fit(tiny_cfg(tmp_path / "env", train={"steps": 1}))
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "to FA3 (policy 'fallback', from FLASHCP_FA4_UNAVAILABLE=fallback)" in warned
    error = tiny_cfg(
        tmp_path / "config", train={"steps": 1}, attention={"fa4_unavailable": "error"}
    )
    with pytest.raises(fa_dispatch.FlashAttnUnavailableError) as info:
        fit(error)
    assert "the policy is 'error', from attention.fa4_unavailable: error" in str(info.value)
    assert "set attention.fa4_unavailable: fallback" in str(info.value)  # the env cannot help
    monkeypatch.delenv(fa_dispatch.ENV_FA4_POLICY)
    reset_once("dispatch:")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flashcp"):
        fit(tiny_cfg(tmp_path / "fallback", train={"steps": 1},
                     attention={"fa4_unavailable": "fallback"}))  # fmt: skip
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "from attention.fa4_unavailable: fallback" in warned and "FLASHCP_FA4" not in warned


@pytest.mark.parametrize(
    "sections",
    [
        {"parallel": {"cp_mode": "workload_balanced"}},
        {"parallel": {"pad": True}, "data": {"seq_len": 63}},
        {"data": {"packing": False}},
    ],
    ids=["workload_balanced", "pad", "no_packing"],
)
def test_layout_options_run(
    tmp_path: Path, sections: dict[str, Any], tiny_cfg: TinyCfg, fit: Fit
) -> None:
    cfg = tiny_cfg(tmp_path, train={"steps": 2}, **sections)
    _, result, _ = fit(cfg)
    assert [m.step for m in result.metrics] == [1, 2]
    assert all(math.isfinite(m.loss) for m in result.metrics)


def test_sft_recipe_trains_on_responses(tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit) -> None:
    path = tmp_path / "sft.jsonl"
    rows = [{"prompt": f"Question {i}? ", "response": f"Answer {i}."} for i in range(30)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tiny_cfg(tmp_path, data={"path": str(path)}, run={"recipe": "sft"}, train={"steps": 2})
    _, result, _ = fit(cfg)
    m = result.metrics[0]
    assert 0 < m.targets < m.tokens // 2  # prompts carry no loss


def test_the_data_source_is_injectable(tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit) -> None:
    """`Trainer(data=...)` replaces the recipe's step source (here: the same data, counted)."""
    from flashcp.recipes.lm import LMData

    class Counted:
        def __init__(self, inner: LMData) -> None:
            self.inner, self.steps = inner, 0
            self.seq_len = inner.seq_len

        def next_step(self) -> list[Any]:
            self.steps += 1
            return self.inner.next_step()

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    plain = tiny_cfg(tmp_path / "plain", train={"steps": 2})
    fit(plain)
    cfg = tiny_cfg(tmp_path / "stand_in", train={"steps": 2})
    data = Counted(LMData(cfg))
    trainer, _, _ = fit(cfg, data=data)
    assert trainer.data is data and data.steps == 2
    assert losses(cfg) == losses(plain)


def test_multi_rank_config_needs_a_launcher(tmp_path: Path, tiny_cfg: TinyCfg) -> None:
    with pytest.raises(ValueError, match="need a launched job"):
        Trainer(tiny_cfg(tmp_path, parallel={"cp": 2}))


# -- entry point, metrics, helpers ------------------------------------------------------------


def _yaml(tmp: Path, **sections: dict[str, Any]) -> str:
    import yaml

    cfg = tiny_config(tmp, **sections)
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(json.loads(json.dumps(to_dict(cfg)))))
    return str(path)


@pytest.mark.usefixtures("isolated_environ")  # the rank entry sets the runtime flags
def test_rank_entry_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _yaml(tmp_path, train={"steps": 2})
    assert worker.main(["--config", path, "train.stepz=1"]) == outcome.EXIT_CONFIG
    assert "did you mean steps" in capsys.readouterr().err
    assert worker.main(["--config", path, "checkpoint.every=1"]) == 0
    assert "step 2/2" in capsys.readouterr().out
    # a learning rate this large overflows the weights after one update: loss becomes inf/nan
    run2 = f"run.output_dir={tmp_path / 'nan'}"
    assert worker.main(["--config", path, run2, "train.lr=1e30", "train.steps=4"]) == 3
    assert "non-finite" in capsys.readouterr().err
    step1 = tmp_path / "run" / "checkpoints" / "step_1"
    (step1 / "manifest.json").unlink()
    broken = ["--config", path, f"checkpoint.resume={step1}", f"run.output_dir={tmp_path / 'b'}"]
    assert worker.main(broken) == outcome.EXIT_CHECKPOINT
    assert "manifest.json is missing" in capsys.readouterr().err
    # bad data the ranks meet while building (a bad record under on_bad_record: error is found
    # by the preflight, exit 2; one that only reading every row finds reaches the data's index)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine words here"}\n' * 64 + '{"text": ""}\n')
    data = [f"data.path={bad}", "data.on_bad_record=error", f"run.output_dir={tmp_path / 'd'}"]
    assert worker.main(["--config", path, *data]) == outcome.EXIT_CONFIG
    assert "bad record at" in capsys.readouterr().err

    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise DataError(f"{bad}:65: unreadable row")

    with pytest.MonkeyPatch.context() as patch:  # what the ranks' own index raises
        patch.setattr(worker, "Trainer", broken)
        code = worker.main(["--config", path, f"run.output_dir={tmp_path / 'd'}"])
    assert code == outcome.EXIT_DATA
    assert f"[rank 0] error: {bad}:65: unreadable row" in capsys.readouterr().err
    # pre-empted (SIGTERM to itself after step 2's forward): the step ends, is saved, exit 75
    os.environ[faults.ENV_FAULT] = "sigterm@step2"
    pre = ["--config", path, "train.steps=4", f"run.output_dir={tmp_path / 'p'}"]
    assert worker.main(pre) == outcome.EXIT_PREEMPTED
    assert "pre-emption requested on rank(s) 0 (SIGTERM): saving step 2" in capsys.readouterr().out
    assert (tmp_path / "p" / "checkpoints" / "step_2").is_dir()
    assert [r["step"] for r in read_metrics(tmp_path / "p")] == [1, 2]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # put back after training


def test_a_rank_whose_init_fails_puts_its_signal_handlers_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rank's pre-emption handlers are installed before the process group starts; when
    that start fails (an unreachable master, a lost launcher) they are put back all the same,
    so the process (and a test run after it in the same interpreter) keeps its own handlers."""
    from flashcp import distributed

    def unreachable() -> Any:
        raise RuntimeError("the master is unreachable")

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(distributed, "init_distributed", unreachable)
    with pytest.raises(RuntimeError, match="unreachable"):
        worker.main(["--config", _yaml(tmp_path, train={"steps": 1})])
    assert signal.getsignal(signal.SIGTERM) == before


def test_metrics_writer_progress_and_truncation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flashcp.metrics.writer import METRICS_FILE, MetricsWriter, StepMetrics

    def m(step: int, loss: float = 1.0, skipped: bool = False) -> StepMetrics:
        return StepMetrics(step, loss, 1e-3, 0.5, 64, 60, 100.0, 0.1, 0.2, skipped)

    (tmp_path / METRICS_FILE).write_text('{"step": 1}\nnot json\n{"step": 5}\n')
    monkeypatch.setenv("FLASHCP_PROGRESS", "1")
    out = io.StringIO()
    w = MetricsWriter(tmp_path, enabled=True, total_steps=4, log_every=2, start_step=1, stream=out)
    assert w._bar is not None
    for step in (2, 3):
        w.log(m(step, loss=float("nan") if step == 3 else 1.0, skipped=step == 3))
    w.close()
    records = read_metrics(tmp_path / METRICS_FILE)
    assert [r["step"] for r in records] == [1, 2, 3] and records[2]["loss"] == "nan"
    assert "step 2/4" in out.getvalue() and "SKIPPED" in out.getvalue()
    assert "mem 204.8 MiB (rank 0)" in out.getvalue()  # below 1 GiB in MiB
    from flashcp.metrics.writer import format_memory

    assert format_memory(1.5) == "1.50 GiB" and format_memory(0.0) == "0.0 MiB"
    quiet = MetricsWriter(tmp_path / "q", enabled=False, total_steps=1)
    quiet.log(m(1))
    quiet.echo("x")
    assert not (tmp_path / "q").exists()
    with pytest.raises(FileNotFoundError):
        read_metrics(tmp_path / "q")


def test_plot_needs_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "metrics.jsonl").write_text("")
    assert cli.main(["plot", str(tmp_path)]) == 2
    assert "no steps yet" in capsys.readouterr().err
    assert cli.main(["plot", str(tmp_path / "missing")]) == 2


def test_grad_helpers() -> None:
    from flashcp.optim.grads import buckets, squared_norm, sync_grads

    a = paddle.create_parameter([2, 3], "float32")
    b = paddle.create_parameter([4], "float32")
    c = paddle.create_parameter([5], "float32")
    (a.sum() * 2).backward()
    assert squared_norm([a, b]) == pytest.approx(24.0)  # b has no gradient
    assert squared_norm([b]) == 0.0
    assert [len(x) for x in buckets([a, b, c], bucket_bytes=40)] == [2, 1]
    assert [len(x) for x in buckets([a, b, c], bucket_bytes=8)] == [1, 1, 1]
    # no multi-rank group: nothing to sum, but a parameter without a gradient gets zeros, as
    # in a multi-rank layout (it is stepped alike: weight decay, moments)
    sync_grads([a, b], [None])
    assert b.grad is not None and not b.grad.numpy().any()
