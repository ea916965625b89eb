"""One rank of a flashcp job: what `src/flashcp/train.py` does in every launched process.

    python -m paddle.distributed.launch --nproc_per_node 2 src/flashcp/train.py \\
        --config configs/gpt/tiny_cp2.yaml train.steps=10

`main` loads the config (once: this process's own copy; world size and node count from the
launcher's environment), runs the preflight `flashcp train` and `flashcp validate` run
(`flashcp.preflight.preflight_problems`: device, FlashAttention dispatch, memory plan,
model directory, a sample of the data), checks that the run directory is its job's
(`run_dir_lock`: the lock its `flashcp train` holds, or, for ranks started by
`paddle.distributed.launch` directly, the lock the job's first rank takes), that the run may
start there (`flashcp.runstart`; a rank never moves an earlier run aside for `run.overwrite`,
`flashcp train` does) and `FLASHCP_FAULT`, sets the
process's runtime flags (`set_runtime_flags`: the `Trainer` writes no environment variable),
initialises the distributed runtime, builds the process groups and the `Trainer`, installs
injected faults (`flashcp.faults`) and fits. With `--eval` (`flashcp eval`) it builds a
`flashcp.evaluation.command.Evaluation` instead and evaluates (no run directory check: nothing of a
run is written but `eval_results.json`).

Exit codes (`flashcp.launch.outcome`): 0 done, 2 bad config, a run directory another job holds
or one the run may not start in (every problem printed by rank 0, before the distributed
runtime starts), 3 non-finite
loss or gradients, 4 a broken checkpoint was asked for, 5 bad data, 75 pre-empted (SIGTERM or
`run.preempt_signal`: the step finished and a checkpoint saved, `flashcp.launch.preempt`), 1
anything else. `run` prints every rank's last line, `[flashcp] rank R exit CODE` (after the
process groups are torn down), so a supervisor can tell a rank that finished from one that was
killed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence

import paddle

from flashcp import distributed, fa_dispatch, faults, runlock, runstart
from flashcp.checkpoint.format import CheckpointError
from flashcp.config import Config
from flashcp.data.records import DataError
from flashcp.evaluation.command import EvalError, Evaluation, eval_problems
from flashcp.launch.outcome import (
    EXIT_CHECKPOINT,
    EXIT_CONFIG,
    EXIT_DATA,
    EXIT_LINE,
    EXIT_NONFINITE,
    EXIT_PREEMPTED,
)
from flashcp.launch.preempt import StopSignals, preempt_signals
from flashcp.log import own_console_format, process_rank, quiet_third_party
from flashcp.preflight import check_config_file
from flashcp.problems import ProblemsError
from flashcp.run_info import command_line
from flashcp.trainer import NonFiniteError, Trainer

DETERMINISTIC_FLAGS = (fa_dispatch.FLAG_DETERMINISTIC, "FLAGS_embedding_deterministic")
"""The runtime flags `train.deterministic` turns on in a rank's process."""


def set_runtime_flags(cfg: Config) -> None:
    """In deterministic mode (`train.deterministic`), turn on this process's cuDNN / embedding
    determinism flags.

    They go both to `paddle.set_flags` (GPU builds read them there) and to the environment (the
    CPU build refuses set_flags for them; `flashcp.fa_dispatch` then reads the environment), so
    Paddle's kernels and the FlashAttention dispatch see one deterministic mode. A process-wide
    setting, hence made here by the process's entry and not by the `Trainer`.
    """
    if not cfg.train.deterministic:
        return
    for name in DETERMINISTIC_FLAGS:
        os.environ[name] = "1"
        # A flag unknown to this build (CPU) raises; the environment value is what counts then.
        with contextlib.suppress(ValueError, RuntimeError):
            paddle.set_flags({name: True if name == fa_dispatch.FLAG_DETERMINISTIC else 1})


def run_dir_lock(output_dir: str, environ: dict[str, str] | None = None) -> runlock.Held | None:
    """Make sure `output_dir` is this rank's job's: under `flashcp train` (or `flashcp eval`)
    its lock still carries the job's token (`runlock.ENV_TOKEN`); ranks started by
    `paddle.distributed.launch` directly take the lock for their job (the first of them to
    come holds it, returned; the others find their job's token in it). Raises
    `runlock.RunLockError` when another job holds it; None outside a launch (a process run by
    hand or in a test takes no lock)."""
    env = dict(os.environ) if environ is None else environ
    if token := env.get(runlock.ENV_TOKEN):
        runlock.check_token(output_dir, token)
        return None
    if (token := runlock.paddle_token(env)) is None:
        return None
    holder = runlock.Holder("paddle.distributed.launch", os.getppid(), command=command_line(),
                            token=token)  # fmt: skip
    return runlock.join(output_dir, holder)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashcp.train",
        description="Train one rank of a flashcp job (run under paddle.distributed.launch).",
    )
    parser.add_argument("--config", required=True, help="YAML run config")
    parser.add_argument(
        "--eval",
        action="store_true",
        help="evaluate on eval.path instead of training (`flashcp eval`, flashcp.evaluation)",
    )
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run this rank's share of the job; returns the process exit code."""
    quiet_third_party()  # before PaddleFormers is imported (LoRA, HF tokenizers)
    own_console_format()
    args = build_parser().parse_args(argv)
    rank = process_rank()
    lock: runlock.Held | None = None
    try:
        launched = distributed.launch_env()
        # the checks `flashcp train` and `flashcp validate` run (config, device, dispatch, data)
        cfg, problems = check_config_file(
            args.config, args.overrides, world_size=launched.world_size, nnodes=launched.nnodes,
            evaluating=args.eval,
        )  # fmt: skip
        if args.eval and cfg is not None:  # the checks `flashcp eval` ran (`eval_problems`)
            problems += eval_problems(cfg)
        if problems or cfg is None:
            raise ProblemsError(problems, args.config)
        injected = faults.active_faults()
        lock = run_dir_lock(cfg.run.output_dir)  # before anything may write there
        if not args.eval:  # evaluating writes no checkpoint or metrics: any run dir will do
            runstart.check_start(cfg.run.output_dir, cfg.checkpoint.resume, cfg.run.overwrite)
    except (ProblemsError, faults.FaultSpecError, runstart.RunDirError, EvalError,
            runlock.RunLockError) as exc:  # fmt: skip
        if lock is not None:
            lock.release()
        if rank == 0:
            print(exc, file=sys.stderr, flush=True)
        return EXIT_CONFIG
    try:
        return _run(args, cfg, injected, rank)
    finally:
        if lock is not None:
            lock.release()


def _run(args: argparse.Namespace, cfg: Config, injected: list[faults.Fault], rank: int) -> int:
    """`main` once the checks passed: initialise, build, train (or evaluate), tear down."""
    # From here a pre-emption signal is a request to stop at the next step boundary.
    stop = StopSignals(preempt_signals(cfg.run.preempt_signal), rank).install()
    try:
        code = _train_or_evaluate(args, cfg, injected, stop)
    finally:
        stop.uninstall()  # also when the init fails: the process's handlers are put back
    # Reached on success and on the errors `_train_or_evaluate` reports, which every rank
    # raises at the same step; any other exception propagates (exit 1) and the launcher stops
    # the other ranks.
    distributed.shutdown()
    return code


def _train_or_evaluate(
    args: argparse.Namespace, cfg: Config, injected: list[faults.Fault], stop: StopSignals
) -> int:
    """Initialise the process group, build and train (or evaluate); the exit code of the
    errors every rank meets alike."""
    env = distributed.init_distributed()
    p = cfg.parallel
    dims = distributed.ParallelDims(dp=p.dp, pp=p.pp, cp=p.cp, world_size=env.world_size, ep=p.ep)
    groups = distributed.build_groups(dims)
    set_runtime_flags(cfg)
    code = 0
    try:
        if args.eval:
            Evaluation(cfg, groups).run()
        else:
            # `main` checked the run directory (check_start): the Trainer does not again
            trainer = Trainer(cfg, groups, stop=stop, start_checked=True)
            # FLASHCP_FAULT (tests); nothing when unset
            faults.install(trainer.model, trainer.params, lambda: trainer.step, injected)
            if trainer.fit().preempted:
                code = EXIT_PREEMPTED
    except NonFiniteError as exc:
        print(f"[rank {env.rank}] error: {exc}", file=sys.stderr, flush=True)
        code = EXIT_NONFINITE
    except CheckpointError as exc:
        print(f"[rank {env.rank}] error: {exc}", file=sys.stderr, flush=True)
        code = EXIT_CHECKPOINT
    except DataError as exc:
        print(f"[rank {env.rank}] error: {exc}", file=sys.stderr, flush=True)
        code = EXIT_DATA
    return code


def run(argv: Sequence[str] | None = None) -> int:
    """`main`, then this rank's exit line (also when `main` raises: code 1, then the traceback)."""
    code = 1
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse errors
        code = exc.code if isinstance(exc.code, int) else 1
        raise
    finally:
        print(EXIT_LINE.format(rank=process_rank(), code=code), flush=True)
    return code
