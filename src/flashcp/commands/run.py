"""`flashcp validate`, `flashcp train` and `flashcp eval`: a config checked (the preflight
every launch and every rank runs), then launched or evaluated."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from flashcp.launch.outcome import EXIT_CHECKPOINT, EXIT_CONFIG, EXIT_OK
from flashcp.rundir import CONFIG_FILE

CONFIG_DIR = Path("configs")
"""What `flashcp validate` checks when given no file."""


def _config_summary(cfg, nnodes: int | None = None) -> str:  # type: ignore[no-untyped-def]
    from flashcp.log import readable_count
    from flashcp.models import estimate_parameters

    size = readable_count(estimate_parameters(cfg.model))
    p = cfg.parallel
    recipe = cfg.run.recipe + (" + LoRA" if "lora" in cfg.extras else "")
    memory = ""
    hw = cfg.hardware
    if hw.memory_gib is not None or hw.host_memory_gib is not None:
        from flashcp.plan import GIB, plan

        planned = plan(cfg, nnodes=nnodes)
        if hw.memory_gib is not None:
            peak = planned.peak.total_bytes / GIB
            memory = f", planned peak {peak:.1f} of {hw.memory_gib:g} GiB per device"
            if hw.memory_headroom:
                memory += f" ({hw.memory_headroom * 100:g} % kept free)"
        if hw.host_memory_gib is not None and planned.host is not None:
            host = planned.host.peak.total_bytes / GIB
            memory += f", host {host:.1f} of {hw.host_memory_gib:g} GiB per node"
            if hw.host_memory_reserve:
                memory += f" ({hw.host_memory_reserve * 100:g} % reserved)"
    source = f" from {cfg.model_from_pretrained}" if cfg.model_from_pretrained else ""
    return (
        f"{recipe}, {cfg.model.arch} ~{size} params{source}, dp={p.dp} pp={p.pp} cp={p.cp} "
        + (f"ep={p.ep} " if p.ep > 1 else "")
        + f"({p.cp_mode}, world {p.world_size}), seq_len {cfg.data.seq_len}, {cfg.train.dtype} on "
        f"{cfg.run.device}{memory}"
    )


def _split_overrides(items: Sequence[str]) -> tuple[list[str], list[str]]:
    """`flashcp validate`'s positional arguments as (files, key=value overrides): an argument
    with `=` that is not an existing file is an override, as `flashcp train` takes them."""
    files, overrides = [], []
    for item in items:
        if "=" in item and not Path(item).exists():
            overrides.append(item)
        else:
            files.append(item)
    return files, overrides


def validate_command(args: argparse.Namespace) -> int:
    """`flashcp train`'s checks without the launch: the config, then the preflight every
    launch and every rank runs (`flashcp.preflight.check_raw`). A shipped
    recipe with `/path/to/...` placeholders is checked as shipped: its machine checks wait for
    the placeholders (it says what is left to fill in). Exit 2 when any config is refused."""
    from flashcp.config import read_yaml
    from flashcp.config.placeholders import find_placeholders
    from flashcp.launch.preflight import EXIT_PREFLIGHT
    from flashcp.preflight import check_raw
    from flashcp.problems import ProblemsError

    names, overrides = _split_overrides(args.files)
    files = [Path(f) for f in names]
    nnodes = args.nnodes if args.nnodes > 1 else None
    if not files:
        if not CONFIG_DIR.is_dir():
            print(f"no files given and no {CONFIG_DIR}/ directory here", file=sys.stderr)
            return EXIT_CONFIG
        files = sorted(CONFIG_DIR.rglob("*.yaml"))
    failed = 0
    for path in files:
        unfilled: list[tuple[str, str]] = []
        try:
            raw = read_yaml(path)
            unfilled = find_placeholders(_with_overrides(raw, overrides))
            cfg, errors = check_raw(
                raw, source=str(path), overrides=overrides, world_size=args.world_size,
                nnodes=args.nnodes, machine=not unfilled, allow_placeholders=True,
            )  # fmt: skip
        except ProblemsError as exc:
            cfg, errors = None, exc.problems
        if errors or cfg is None:
            failed += 1
            print(f"FAIL  {ProblemsError(errors, str(path))}")
            continue
        print(f"ok    {path}: {_config_summary(cfg, nnodes)}")
        if cfg.model_from_pretrained is not None:
            from flashcp.models.hf_config import directory_notes

            for note in directory_notes(cfg.model_from_pretrained, cfg.model.mtp_layers):
                print(f"      note: {note}")
        for note in cfg.notes:  # the data sample's bad records come as "warning: ..."
            print(f"      {note}" if note.startswith("warning: ") else f"      note: {note}")
        if unfilled:  # a recipe's /path/to/... values: `flashcp train` refuses them unfilled
            keys = ", ".join(f"{k} ({v})" for k, v in unfilled)
            print(f"      fill in before training: {keys}")
    total = len(files)
    print(f"{total - failed} of {total} config(s) valid")
    return EXIT_PREFLIGHT if failed else EXIT_OK


def _with_overrides(raw: dict, overrides: Sequence[str]) -> dict:  # type: ignore[type-arg]
    """A copy of the file's mapping with the `key=value` overrides set (what is left to fill
    in is what neither gives)."""
    import copy

    from flashcp.config import apply_overrides, parse_overrides

    parsed, _ = parse_overrides(overrides)
    out = copy.deepcopy(raw)
    apply_overrides(out, parsed)
    return out


def node_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with `--nnodes/--node-rank/--master` (None when they fit together)."""
    if args.nnodes < 1:
        return f"--nnodes must be >= 1, got {args.nnodes}"
    if not 0 <= args.node_rank < args.nnodes:
        return (
            f"--node-rank {args.node_rank} is not in 0..{args.nnodes - 1} (--nnodes "
            f"{args.nnodes}): number the nodes 0, 1, ... and start node 0 first"
        )
    if args.nnodes > 1 and not args.master:
        return (
            f"--nnodes {args.nnodes} needs --master HOST:PORT: node 0's address and a free "
            "port, given the same on every node"
        )
    return None


def train_command(args: argparse.Namespace) -> int:
    from flashcp.launch.job import run_job
    from flashcp.launch.preflight import EXIT_PREFLIGHT, Nodes
    from flashcp.preflight import check_config_file
    from flashcp.problems import ProblemsError

    problem = node_problem(args)
    if problem is not None:
        print(f"flashcp train: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    try:  # the one load in this process, with the preflight `flashcp validate` runs
        cfg, problems = check_config_file(args.config, args.overrides, nnodes=args.nnodes)
    except ProblemsError as exc:
        print(exc, file=sys.stderr)
        return EXIT_PREFLIGHT
    if problems or cfg is None:
        print(ProblemsError(problems, args.config), file=sys.stderr)
        return EXIT_PREFLIGHT
    nodes = Nodes(count=args.nnodes, rank=args.node_rank, master=args.master)
    return run_job(cfg, args.config, args.overrides, nodes=nodes, command=args.command_line,
                   checked=True)  # fmt: skip


def _eval_target(config: str, overrides: list[str]) -> tuple[str, list[str]]:
    """`flashcp eval`'s CONFIG and overrides: a run directory is read through its
    `config.yaml`, with `run.output_dir` pointing at it (the user's overrides after it)."""
    path = Path(config)
    if not path.is_dir():
        return config, overrides
    saved = path / CONFIG_FILE
    if not saved.is_file() and (path / "config.json").is_file():
        return _model_dir_config(path), overrides
    if not saved.is_file():
        raise FileNotFoundError(
            f"{path} is a directory without {CONFIG_FILE} or config.json: give a run directory "
            "(what `flashcp train` wrote), a Hugging Face model directory or a config file"
        )
    return str(saved), [f"run.output_dir={path}", *overrides]


def _model_dir_config(path: Path) -> str:
    """A Hugging Face model directory evaluated as it is (as `lm-eval` / transformers do): a
    config of its model, its weights and its tokenizer (`model.from_pretrained`), written to a
    file the launched ranks read too; `eval.path`, `run.recipe` and the rest come from the
    command line. Results go to `runs/eval_<directory name>` unless `run.output_dir` says."""
    import tempfile

    import yaml

    raw = {
        "model": {"from_pretrained": str(path.resolve())},
        "run": {"output_dir": f"runs/eval_{path.resolve().name}"},
    }
    handle = tempfile.NamedTemporaryFile(  # noqa: SIM115 (kept for the job's ranks)
        "w", prefix="flashcp-eval-", suffix=".yaml", delete=False
    )
    with handle:
        yaml.safe_dump(raw, handle)
    return handle.name


def eval_command(args: argparse.Namespace) -> int:
    """`flashcp eval`: the config's preflight (`flashcp.preflight`, as an evaluation reads it)
    and the evaluation's own checks (`eval_problems`), all refused at once before anything is
    built or launched; then the launched job, or this process when the world is 1."""
    from flashcp import runlock
    from flashcp.checkpoint.format import CheckpointError
    from flashcp.evaluation.command import EvalError, Evaluation, eval_problems
    from flashcp.launch.job import run_job
    from flashcp.launch.preflight import EXIT_PREFLIGHT, Nodes
    from flashcp.launch.worker import set_runtime_flags
    from flashcp.preflight import check_config_file
    from flashcp.problems import ProblemsError

    problem = node_problem(args)
    if problem is not None:
        print(f"flashcp eval: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        config, overrides = _eval_target(args.config, list(args.overrides))
        cfg, problems = check_config_file(config, overrides, nnodes=args.nnodes,
                                          evaluating=True)  # fmt: skip
    except ProblemsError as exc:
        print(exc, file=sys.stderr)
        return EXIT_PREFLIGHT
    except FileNotFoundError as exc:
        print(f"flashcp eval: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if cfg is not None:
        problems += eval_problems(cfg)
    if problems or cfg is None:
        print(ProblemsError(problems, config), file=sys.stderr)
        return EXIT_PREFLIGHT
    if cfg.parallel.world_size > 1 or args.nnodes > 1:  # the same launcher as training
        nodes = Nodes(count=args.nnodes, rank=args.node_rank, master=args.master)
        return run_job(cfg, config, overrides, nodes=nodes, command=args.command_line,
                       evaluate=True, checked=True)  # fmt: skip
    set_runtime_flags(cfg)  # one process: here, as a launched rank would
    try:  # it writes eval_results.json there: not into a run directory another job holds
        lock = runlock.acquire(cfg.run.output_dir, runlock.Holder(
            "flashcp eval", os.getpid(), command=args.command_line))  # fmt: skip
    except (runlock.RunLockError, OSError) as exc:
        print(f"flashcp eval: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if lock.note:
        print(f"flashcp eval: {lock.note}", file=sys.stderr)
    try:
        Evaluation(cfg, stream=sys.stdout).run()
    except EvalError as exc:
        print(f"flashcp eval: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except CheckpointError as exc:
        print(f"flashcp eval: {exc}", file=sys.stderr)
        return EXIT_CHECKPOINT
    finally:
        lock.release()
    return EXIT_OK
