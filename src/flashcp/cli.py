"""The `flashcp` command: train, eval, validate, plan, data-stats, plot, export,
explain-dispatch, --version.

Each subcommand imports what it runs when it runs: PaddlePaddle is an optional extra, and
`flashcp --version` and the missing-Paddle message must work without it."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from flashcp.launch.outcome import EXIT_CHECKPOINT, EXIT_CONFIG, EXIT_NO_FIT, EXIT_OK
from flashcp.rundir import CONFIG_FILE

CONFIG_DIR = Path("configs")


def _parse_capability(text: str) -> tuple[int, int]:
    major, sep, minor = text.strip().partition(".")
    if not (major.isdigit() and (not sep or minor.isdigit())):
        raise argparse.ArgumentTypeError(f"{text!r} is not a compute capability such as 9.0")
    return int(major), int(minor or 0)


def _explain_dispatch(args: argparse.Namespace) -> int:
    from flashcp import dispatch

    inputs = dispatch.probe_inputs(
        policy=args.fa4_unavailable,
        policy_source="--fa4-unavailable",
        deterministic=True if args.deterministic else None,
        capability=args.capability,
    )
    print("Inputs probed:")
    rows = [
        (dispatch.FLAG_VERSION, inputs.requested, inputs.sources[dispatch.FLAG_VERSION]),
        (
            dispatch.FLAG_DETERMINISTIC,
            inputs.deterministic,
            inputs.sources[dispatch.FLAG_DETERMINISTIC],
        ),
        (
            "compute capability",
            "none" if inputs.capability is None else "{}.{}".format(*inputs.capability),
            inputs.sources["capability"],
        ),
        ("fa3_available", inputs.fa3_available, inputs.sources["fa3_available"]),
        ("fa4_available", inputs.fa4_available, inputs.sources["fa4_available"]),
        ("block_mask_api", inputs.block_mask_api, inputs.sources["block_mask_api"]),
        ("device", inputs.device, inputs.sources["device"]),
        ("fa4_unavailable policy", inputs.fa4_unavailable, inputs.sources["fa4_unavailable"]),
        ("head_dim", args.head_dim, "--head-dim"),
    ]
    limit = None
    if args.mask_columns is not None:
        heads = args.mask_heads
        rows.append(("mask [B, Hm, S, C]", f"Hm={heads} C={args.mask_columns}", "--mask-*"))
        rows.append(("kv heads", args.kv_heads, "--kv-heads"))
        limit = dispatch.fa4_call_limit(
            mask_shape=(1, heads, 1, args.mask_columns),
            num_kv_heads=args.kv_heads,
            head_dim=args.head_dim,
        )
        rows.append(("FA4 limit for this call", limit or "none", "fa4_call_limit"))
    for name, value, source in rows:
        print(f"  {name:<28} {value!s:<8} ({source})")
    try:
        res = dispatch.explain_inputs(inputs, args.head_dim, fa4_limit=limit)
    except (ValueError, NotImplementedError) as exc:
        print(f"Effective fa_version: none: {exc}")
        return EXIT_CONFIG
    print(f"Effective fa_version: {res.version}")
    print(f"Why: {res.reason}")
    if inputs.device.startswith("cpu"):
        print("Kernel: flashcp's CPU reference FlashMask kernel (no GPU on this machine); the")
        print("version above is what a GPU with these flags (and this compute capability)")
        print("would run, and is checked the same.")
    return EXIT_OK


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


def _validate(args: argparse.Namespace) -> int:
    """`flashcp train`'s checks without the launch: the config, then the preflight every
    launch and every rank runs (`flashcp.launch.preflight.preflight_problems`). A shipped
    recipe with `/path/to/...` placeholders is checked as shipped: its machine checks wait for
    the placeholders (it says what is left to fill in). Exit 2 when any config is refused."""
    from flashcp.config import read_yaml
    from flashcp.config.errors import ConfigValidationError
    from flashcp.config.placeholders import find_placeholders
    from flashcp.launch.preflight import EXIT_PREFLIGHT, check_raw

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
        except ConfigValidationError as exc:
            cfg, errors = None, exc.errors
        if errors or cfg is None:
            failed += 1
            print(f"FAIL  {ConfigValidationError(errors, str(path))}")
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


def _node_problem(args: argparse.Namespace) -> str | None:
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


def _train(args: argparse.Namespace) -> int:
    from flashcp.config import ConfigValidationError
    from flashcp.launch.job import run_job
    from flashcp.launch.preflight import EXIT_PREFLIGHT, Nodes, check_config_file

    problem = _node_problem(args)
    if problem is not None:
        print(f"flashcp train: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    try:  # the one load in this process, with the preflight `flashcp validate` runs
        cfg, problems = check_config_file(args.config, args.overrides, nnodes=args.nnodes)
    except ConfigValidationError as exc:
        print(exc, file=sys.stderr)
        return EXIT_PREFLIGHT
    if problems or cfg is None:
        print(ConfigValidationError(problems, args.config), file=sys.stderr)
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


def _eval(args: argparse.Namespace) -> int:
    from flashcp import runlock
    from flashcp.checkpoint.format import CheckpointError
    from flashcp.config import ConfigValidationError, load_config
    from flashcp.evaluation.command import EvalError, Evaluation, check
    from flashcp.launch.job import run_job
    from flashcp.launch.preflight import Nodes
    from flashcp.launch.worker import set_runtime_flags

    problem = _node_problem(args)
    if problem is not None:
        print(f"flashcp eval: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        config, overrides = _eval_target(args.config, list(args.overrides))
        cfg = load_config(config, overrides, nnodes=args.nnodes)
        check(cfg)
    except ConfigValidationError as exc:
        print(exc, file=sys.stderr)
        return EXIT_CONFIG
    except (EvalError, FileNotFoundError) as exc:
        print(f"flashcp eval: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if cfg.parallel.world_size > 1 or args.nnodes > 1:  # the same launcher as training
        nodes = Nodes(count=args.nnodes, rank=args.node_rank, master=args.master)
        return run_job(cfg, config, overrides, nodes=nodes, command=args.command_line,
                       evaluate=True)  # fmt: skip
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


def _plan(args: argparse.Namespace) -> int:
    import json

    from flashcp.config import ConfigValidationError, load_config
    from flashcp.plan import plan
    from flashcp.plan.longest import longest, with_seq_len
    from flashcp.plan.report import format_longest, format_plan, format_step_time, format_summary
    from flashcp.plan.steptime import DEFAULT_MFU, estimate

    mfu = DEFAULT_MFU if args.mfu is None else args.mfu
    if not 0 < mfu <= 1:
        print(f"flashcp plan: --mfu must be in (0, 1], got {mfu}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        cfg = load_config(args.config, args.overrides, allow_placeholders=True)
    except ConfigValidationError as exc:
        print(exc, file=sys.stderr)
        return EXIT_CONFIG
    budgets = {"device": args.device, "budget_gib": args.device_memory,
               "host_budget_gib": args.host_memory}  # fmt: skip
    docs = None
    if args.docs is not None:
        from flashcp.plan.documents import load_documents

        try:
            docs = load_documents(args.docs, cfg)
        except (ValueError, OSError) as exc:
            print(f"flashcp plan --docs: {exc}", file=sys.stderr)
            return EXIT_CONFIG
    if args.longest:
        try:
            result = longest(cfg, **budgets)
        except ValueError as exc:
            print(f"flashcp plan --longest: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        at = with_seq_len(cfg, max(result.seq_len, result.granularity))
        est = estimate(at, mfu=mfu, device=args.device, docs=docs)
        if args.json:
            print(json.dumps({**result.to_json(), "step_time": est.to_json()}))
        else:
            print(format_longest(result, cfg, source=str(args.config)))
            if result.plan is not None:
                print(format_step_time(est))
        return EXIT_OK if result.seq_len else EXIT_NO_FIT
    p = plan(cfg, **budgets)
    est = estimate(cfg, mfu=mfu, device=args.device, docs=docs)
    if args.json:
        print(json.dumps({**p.to_json(), "step_time": est.to_json()}))
    elif args.summary:
        print(format_summary(p, cfg, source=str(args.config)))
    else:
        print(format_plan(p, cfg, source=str(args.config)))
        print(format_step_time(est))
    return EXIT_OK if p.fits else EXIT_NO_FIT


def _data_stats(args: argparse.Namespace) -> int:
    import json

    from flashcp.config import ConfigValidationError, load_config
    from flashcp.data.stats import data_stats, format_stats
    from flashcp.recipes import recipe_class

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigValidationError as exc:
        print(exc, file=sys.stderr)
        return EXIT_CONFIG
    data = recipe_class(cfg.run.recipe).data_class(cfg, dp_rank=0, dp_size=cfg.parallel.dp)
    report = data_stats(data, args.steps)  # type: ignore[arg-type]  # LM or DPO data
    print(json.dumps(report) if args.json else format_stats(report))
    return EXIT_OK


def _plot(args: argparse.Namespace) -> int:
    from flashcp.metrics.plot import plot_run

    try:
        out = plot_run(args.run_dir, args.out)
    except (FileNotFoundError, ValueError) as exc:
        print(f"flashcp plot: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"wrote {out}")
    return EXIT_OK


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10,
               "MIB": 2**20, "GIB": 2**30}  # fmt: skip


def _parse_size(text: str) -> int:
    """Bytes of `5GB`, `500MB`, `2GiB` or a plain integer."""
    t = text.strip().upper()
    digits = t.rstrip("KMGIB")
    unit = t[len(digits) :]
    try:
        value = float(digits)
    except ValueError:
        value = -1.0
    if unit not in _SIZE_UNITS or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 5GB or 500MB")
    return int(value * _SIZE_UNITS[unit])


def _export(args: argparse.Namespace) -> int:
    from flashcp.checkpoint.export import ExportError, export_run
    from flashcp.config import ConfigValidationError
    from flashcp.log import readable_count
    from flashcp.models.hf_check import CheckpointMismatchError

    try:
        report = export_run(
            args.run_dir,
            args.out,
            merge_lora=args.merge_lora,
            dtype=args.dtype,
            checkpoint=args.checkpoint,
            max_shard_bytes=args.max_shard_size,
            adapters_for=args.adapters_for,
        )
    except (ExportError, ConfigValidationError, CheckpointMismatchError, OSError) as exc:
        print(f"flashcp export: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.adapters_for is not None:
        print(f"wrote {report.out}: {args.adapters_for} LoRA adapters from {report.source}")
        for note in report.notes:
            print(f"  note: {note}")
        return EXIT_OK
    print(
        f"wrote {report.out}: {len(report.shards)} shard(s) in {report.dtype} from "
        f"{report.source} (at most {readable_count(report.max_shard_parameters)} parameters held "
        "at once)"
    )
    extras = report.tokenizer_files + (["generation_config.json"] if report.generation_config
                                       else [])  # fmt: skip
    if extras:
        print(f"  with {', '.join(extras)}")
    for note in report.notes:
        print(f"  note: {note}")
    return EXIT_OK


def _add_node_arguments(parser: argparse.ArgumentParser) -> None:
    """`--nnodes`, `--node-rank`, `--master` of `flashcp train` and `flashcp eval`."""
    nodes = parser.add_argument_group(
        "more than one node",
        "Run the same command on every node, each with its --node-rank; the dp·pp·cp "
        "processes are split evenly over the nodes. run.output_dir should be one shared "
        "directory (checkpoints are written by rank 0 and read by every rank on resume).",
    )
    nodes.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    nodes.add_argument(
        "--node-rank", type=int, default=0, help="this node's index, 0..nnodes-1 (default 0)"
    )
    nodes.add_argument(
        "--master",
        default=None,
        metavar="HOST:PORT",
        help="node 0's address and a free port where the nodes' launchers meet",
    )


def _add_run_commands(sub) -> None:  # type: ignore[no-untyped-def]
    train = sub.add_parser(
        "train",
        help="run a config as a paddle.distributed.launch job (dp×pp×cp processes)",
        description="Validate CONFIG, launch dp×pp×cp processes of flashcp/train.py with "
        "logs in <run.output_dir>/logs, stream rank 0, exit with the job's code.",
    )
    train.add_argument("config", help="YAML run config, e.g. configs/gpt/tiny_cp2.yaml")
    train.add_argument(
        "overrides",
        nargs="*",
        help="key.sub=value overrides (train.steps=10; aliases such as max_steps=10 too)",
    )
    _add_node_arguments(train)
    train.set_defaults(func=_train)
    evaluate = sub.add_parser(
        "eval",
        help="evaluate a model directory or a run's checkpoint on eval.path, without training",
        description="Evaluate on eval.path (one pass, or eval.max_batches) what CONFIG points "
        "at: the newest checkpoint of run.output_dir (or checkpoint.resume=PATH), else "
        "model.from_pretrained / checkpoint.init_from. RUN_DIR (a run's output_dir) reads its "
        "config.yaml. Runs under the config's dp×pp×cp layout (launched like flashcp train; "
        "in this process when that is 1); prints loss, perplexity and targets (DPO: rewards, "
        "margin, accuracy) and writes <run.output_dir>/eval_results.json.",
    )
    evaluate.add_argument("config", help="YAML run config, or a run directory (RUN_DIR)")
    evaluate.add_argument(
        "overrides", nargs="*", help="key.sub=value overrides (eval.path=FILE, parallel.cp=2)"
    )
    _add_node_arguments(evaluate)
    evaluate.set_defaults(func=_eval)
    validate = sub.add_parser(
        "validate",
        help="check configs (default: every configs/**/*.yaml); lists every problem",
    )
    validate.add_argument(
        "files",
        nargs="*",
        help="config files (default: all under configs/), and key.sub=value overrides applied "
        "to each, as flashcp train takes them",
    )
    validate.add_argument(
        "--world-size", type=int, default=None, help="also check dp×pp×cp against this"
    )
    validate.add_argument(
        "--nnodes", type=int, default=1, help="also check that dp×pp×cp splits over this many nodes"
    )
    validate.set_defaults(func=_validate)
    plan = sub.add_parser(
        "plan",
        help="memory plan: bytes per rank (stage) at its peak against the device budget, host "
        "memory per node, a step-time estimate; --longest: the longest seq_len that fits",
        description="Plan CONFIG's memory per rank before launch: parameters, gradients, "
        "master weights, optimizer states, activations, logits/loss, communication buffers, "
        "against hardware.memory_gib (or --device-memory) less hardware.memory_headroom; host "
        "memory per node (offloaded activations, staging buffers, checkpoint arrays, "
        "processes) against hardware.host_memory_gib (or --host-memory) less "
        "hardware.host_memory_reserve; and a step-time estimate: model and executed FLOPs at "
        "hardware.peak_tflops and --mfu, for one document per row or --docs. Exit 1 when a "
        "rank or a node does not fit.",
    )
    plan.add_argument("config", help="YAML run config")
    plan.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    plan.add_argument(
        "--device-memory",
        type=float,
        default=None,
        metavar="GiB",
        help="per-device budget in GiB (default: hardware.memory_gib)",
    )
    plan.add_argument(
        "--device",
        choices=["cpu", "gpu"],
        default=None,
        help="plan for this device (default: run.device; auto counts as cpu)",
    )
    plan.add_argument(
        "--host-memory",
        type=float,
        default=None,
        metavar="GiB",
        help="per-node host budget in GiB (default: hardware.host_memory_gib)",
    )
    plan.add_argument(
        "--summary",
        action="store_true",
        help="one line per pipeline stage (peak, fits, largest item) and for the host, then "
        "whether it fits and, when not, the changes that would (as flashcp validate prints)",
    )
    plan.add_argument(
        "--longest",
        action="store_true",
        help="find the longest data.seq_len (a multiple of the layout's granularity) whose "
        "plan fits both budgets less their margins (and, apart, without them), everything "
        "else as configured",
    )
    plan.add_argument(
        "--mfu",
        type=float,
        default=None,
        help="model-FLOPs utilisation the step-time estimate assumes (default 0.4: stated, "
        "not measured; flashcp.plan.steptime.DEFAULT_MFU)",
    )
    plan.add_argument(
        "--docs",
        default=None,
        metavar="SAMPLE",
        help="the documents packed into each row, for the step-time estimate (default: one "
        "causal document per row): a data sample in the config's format (JSON Lines / "
        "Parquet, tokenized as training would), a file of document lengths (.txt, or .json: "
        "a list or a `flashcp data-stats --json` report), or a built-in mix (long_tail, chat)",
    )
    plan.add_argument(
        "--json",
        action="store_true",
        help='print {"ranks": [{"rank", "stage", "total_bytes", "items"}], "budget_bytes", '
        '"headroom", "usable_budget_bytes", "fits", "host", "features", "step_time"}; with '
        '--longest {"longest_seq_len", "without_margins_seq_len", "granularity", "assumed", '
        '"limit", "plan", "step_time"}',
    )
    plan.set_defaults(func=_plan)
    stats = sub.add_parser(
        "data-stats",
        help="pack a config's first steps as training would: rows, modelled work, imbalance",
        description="Plan CONFIG's first N optimizer steps exactly as training does, without "
        "training: per step, dp rank and micro-batch the document (DPO: example) lengths of "
        "each row, the modelled work (model FLOPs: attention pairs from the row's mask plus "
        "linear work per token) and the step's imbalance over dp ranks and micro-batches. "
        "Add data.balance=none to compare with first-fit packing.",
    )
    stats.add_argument("config", help="YAML run config")
    stats.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    stats.add_argument("--steps", type=int, default=4, help="steps to plan (default 4)")
    stats.add_argument(
        "--json",
        action="store_true",
        help='print {"steps": [{"step", "ranks": [{"dp_rank", "micro_batches": [{"rows": '
        '[[lengths]], ...}]}], ...}], "mean": {...}}',
    )
    stats.set_defaults(func=_data_stats)
    plot = sub.add_parser(
        "plot",
        help="PNG of a run's metrics.jsonl: loss (and eval), lr, grad norm, throughput/MFU, "
        "memory, DPO, eval, MoE panels, as present",
    )
    plot.add_argument("run_dir", help="a run's output_dir (holding metrics.jsonl)")
    plot.add_argument("--out", default=None, help="PNG path (default RUN_DIR/metrics.png)")
    plot.set_defaults(func=_plot)
    export = sub.add_parser(
        "export",
        help="write a run's model as a Hugging Face directory (config.json, safetensors)",
        description="Stream a run's newest checkpoint into OUT as a Hugging Face model "
        "directory (config.json, sharded safetensors + index, tokenizer files, "
        "generation_config.json), one shard built at a time.",
    )
    export.add_argument("run_dir", help="a run's output_dir (config.yaml + checkpoints/)")
    export.add_argument("out", help="the new directory to write (must not exist or be empty)")
    export.add_argument(
        "--merge-lora", action="store_true", help="fold a LoRA run's adapters into the weights"
    )
    export.add_argument(
        "--adapters-for",
        choices=["paddleformers"],
        default=None,
        help="write a LoRA run's adapters alone, loadable by PaddleFormers' GLM-4.5 class "
        "(LoRAModel.from_pretrained): its fused qkv_proj / up_gate_proj layout, the same "
        "function exactly (block-diagonal, rank padded)",
    )
    export.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="dtype of the exported weights (default: the run's train.param_dtype)",
    )
    export.add_argument(
        "--checkpoint", default=None, help="a checkpoint directory (default: the newest intact)"
    )
    export.add_argument(
        "--max-shard-size",
        type=_parse_size,
        default="5GB",
        help="largest shard, e.g. 5GB (default) or 500MB; one shard is built at a time",
    )
    export.set_defaults(func=_export)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashcp", description="Context-parallel FlashMask training on PaddlePaddle."
    )
    parser.add_argument("--version", action="version", version=f"flashcp {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    explain = sub.add_parser(
        "explain-dispatch",
        help="show the probed inputs, the effective FlashAttention version, and why",
    )
    explain.add_argument(
        "--head-dim", type=int, default=128, help="attention head dim (q.shape[-1])"
    )
    explain.add_argument(
        "--deterministic",
        action="store_true",
        help="resolve as if FLAGS_cudnn_deterministic=1",
    )
    explain.add_argument(
        "--fa4-unavailable",
        choices=["error", "fallback"],
        default=None,
        help="policy when the requested FA4 (or FA3) is unavailable on this card or call "
        "(default: $FLASHCP_FA4_UNAVAILABLE, else error)",
    )
    explain.add_argument(
        "--capability",
        type=_parse_capability,
        default=None,
        help="resolve as if the card had this compute capability, e.g. 8.0 (A100), 9.0 "
        "(H100/H20), 10.0 (B200); default: the probed card",
    )
    explain.add_argument(
        "--mask-columns",
        type=int,
        choices=[1, 2, 4],
        default=None,
        help="check a call whose startend_row_indices has this many columns against FA4's "
        "limits (under CP a causal 2-column mask becomes 4 columns)",
    )
    explain.add_argument(
        "--mask-heads", type=int, default=1, help="mask heads Hm of that call (default 1)"
    )
    explain.add_argument(
        "--kv-heads", type=int, default=1, help="key/value heads of that call (default 1)"
    )
    explain.set_defaults(func=_explain_dispatch)
    _add_run_commands(sub)
    return parser


NO_PADDLE = (
    "flashcp needs PaddlePaddle, which is an extra: install flashcp with "
    'pip install -e ".[cpu]" (CPU, from PyPI) or pip install -e ".[gpu]" --extra-index-url '
    "https://www.paddlepaddle.org.cn/packages/stable/cu126/ (CUDA; cu129 for SM100 cards)"
)


def package_version() -> str:
    """flashcp's version from the installed package's metadata."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flashcp")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed; pip install -e .)"


def main(argv: Sequence[str] | None = None) -> int:
    from flashcp.log import own_console_format, quiet_third_party

    quiet_third_party()  # before any command imports Paddle or PaddleFormers
    own_console_format()
    parser = build_parser()
    # `flashcp train CONFIG --nnodes 2 key=value`: overrides may follow the options too (as
    # for plan, validate and data-stats)
    args, extra = parser.parse_known_args(argv)
    args.command_line = shlex.join(["flashcp", *(sys.argv[1:] if argv is None else argv)])
    if extra:
        takes = ("train", "eval", "plan", "validate", "data-stats")
        if args.command not in takes or any(a.startswith("-") for a in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if args.command == "validate":
            args.files = [*args.files, *extra]
        else:
            args.overrides = [*args.overrides, *extra]
    if importlib.util.find_spec("paddle") is None:
        print(f"flashcp: {NO_PADDLE}", file=sys.stderr)
        return EXIT_CONFIG
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
