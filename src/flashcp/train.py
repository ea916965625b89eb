"""The training entry point `paddle.distributed.launch` runs on every rank.

    python -m paddle.distributed.launch --nproc_per_node 2 src/flashcp/train.py \\
        --config configs/gpt/tiny_cp2.yaml train.steps=10

(Paddle's launcher takes a script path, not `-m module`: `-m` abbreviates its `--master`
flag. `flashcp train CONFIG` finds this file through `flashcp.train.__file__`.) On several
nodes, each runs the launcher with `--nnodes N --rank R --master HOST:PORT --nproc_per_node
dp·pp·cp/N`; the launcher's `PADDLE_NNODES` makes the degree check name the node count.

Exit codes: 0 done, 2 bad config or a run directory the run may not start in (every problem
printed by rank 0, before the distributed runtime starts: `flashcp.launch.rundir`; this path
never moves an earlier run aside for `run.overwrite`, `flashcp train` does), 3 non-finite loss or
gradients, 4 a broken checkpoint was asked for, 1 anything else. Every rank's last line is
`[flashcp] rank R exit CODE` (after the process groups are torn down), so a supervisor can tell
a rank that finished from one that was killed (`flashcp.launch.job` reads it after a failure).
`FLASHCP_FAULT` injects faults for reliability tests (`flashcp.faults`).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: don't let this package's dir shadow top-level names
    _here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if str(Path(p or ".").resolve()) != _here]

import argparse  # noqa: E402
from collections.abc import Sequence  # noqa: E402

EXIT_CONFIG = 2
EXIT_NONFINITE = 3
EXIT_CHECKPOINT = 4
EXIT_LINE = "[flashcp] rank {rank} exit {code}"
"""Each rank's last line in its log (see the module docstring)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashcp.train",
        description="Train one rank of a flashcp job (run under paddle.distributed.launch).",
    )
    parser.add_argument("--config", required=True, help="YAML run config")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run this rank's share of the job; returns the process exit code."""
    args = build_parser().parse_args(argv)

    from flashcp import faults
    from flashcp.checkpoint.format import CheckpointError
    from flashcp.config import ConfigValidationError, load_config
    from flashcp.distributed import ParallelDims, build_groups, init_distributed, shutdown
    from flashcp.launch import rundir
    from flashcp.log import process_rank
    from flashcp.trainer import NonFiniteError, Trainer

    rank = process_rank()
    try:
        from flashcp.distributed import launch_env

        launched = launch_env()
        cfg = load_config(
            args.config, args.overrides, world_size=launched.world_size, nnodes=launched.nnodes
        )
        injected = faults.active_faults()
        rundir.check_start(cfg.run.output_dir, cfg.checkpoint.resume, cfg.run.overwrite)
    except (ConfigValidationError, faults.FaultSpecError, rundir.RunDirError) as exc:
        if rank == 0:
            print(exc, file=sys.stderr, flush=True)
        return EXIT_CONFIG
    env = init_distributed()
    p = cfg.parallel
    dims = ParallelDims(dp=p.dp, pp=p.pp, cp=p.cp, world_size=env.world_size, ep=p.ep)
    groups = build_groups(dims)
    code = 0
    try:
        trainer = Trainer(cfg, groups)
        faults.install(trainer, injected)  # FLASHCP_FAULT (tests); nothing when unset
        trainer.fit()
    except NonFiniteError as exc:
        print(f"[rank {env.rank}] error: {exc}", file=sys.stderr, flush=True)
        code = EXIT_NONFINITE
    except CheckpointError as exc:
        print(f"[rank {env.rank}] error: {exc}", file=sys.stderr, flush=True)
        code = EXIT_CHECKPOINT
    # Reached on success and on the errors above, which every rank raises at the same step;
    # any other exception propagates (exit 1) and the launcher stops the other ranks.
    shutdown()
    return code


def run(argv: Sequence[str] | None = None) -> int:
    """`main`, then this rank's exit line (also when `main` raises: code 1, then the traceback)."""
    from flashcp.log import process_rank

    code = 1
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse errors
        code = exc.code if isinstance(exc.code, int) else 1
        raise
    finally:
        print(EXIT_LINE.format(rank=process_rank(), code=code), flush=True)
    return code


if __name__ == "__main__":
    # Run the importable `flashcp.train` rather than this `__main__` copy, so there is one
    # module identity (and coverage, which matches by module name, measures the workers).
    from flashcp.train import run as _run

    sys.exit(_run())
