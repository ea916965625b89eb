"""The `flashcp` command: train, eval, validate, plan, data-stats, plot, export,
explain-dispatch, --version. This module is the parser; each subcommand's handler lives in
`flashcp.commands` (`run`: validate, train, eval; `inspect`: explain-dispatch, plan, data-stats,
plot; `export`).

Each subcommand imports what it runs when it runs: PaddlePaddle is an optional extra, and
`flashcp --version` and the missing-Paddle message must work without it."""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import sys
from collections.abc import Sequence

from flashcp.commands.export import export_command, parse_size
from flashcp.commands.inspect import (
    data_stats_command,
    explain_dispatch_command,
    plan_command,
    plot_command,
)
from flashcp.commands.run import eval_command, train_command, validate_command
from flashcp.launch.outcome import EXIT_CONFIG


def _parse_capability(text: str) -> tuple[int, int]:
    major, sep, minor = text.strip().partition(".")
    if not (major.isdigit() and (not sep or minor.isdigit())):
        raise argparse.ArgumentTypeError(f"{text!r} is not a compute capability such as 9.0")
    return int(major), int(minor or 0)


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
    train.set_defaults(func=train_command)
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
    evaluate.set_defaults(func=eval_command)
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
    validate.set_defaults(func=validate_command)
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
    plan.set_defaults(func=plan_command)
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
    stats.set_defaults(func=data_stats_command)
    plot = sub.add_parser(
        "plot",
        help="PNG of a run's metrics.jsonl: loss (and eval), lr, grad norm, throughput/MFU, "
        "memory, DPO, eval, MoE panels, as present",
    )
    plot.add_argument("run_dir", help="a run's output_dir (holding metrics.jsonl)")
    plot.add_argument("--out", default=None, help="PNG path (default RUN_DIR/metrics.png)")
    plot.set_defaults(func=plot_command)
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
        type=parse_size,
        default="5GB",
        help="largest shard, e.g. 5GB (default) or 500MB; one shard is built at a time",
    )
    export.set_defaults(func=export_command)


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
    explain.set_defaults(func=explain_dispatch_command)
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
