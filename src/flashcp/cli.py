"""The `flashcp` command: `train`, `validate`, `plan`, `plot` and `explain-dispatch`."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

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
        return 2
    print(f"Effective fa_version: {res.version}")
    print(f"Why: {res.reason}")
    if inputs.device.startswith("cpu"):
        print("Kernel: flashcp's CPU reference FlashMask kernel (no GPU on this machine); the")
        print("version above is what a GPU with these flags (and this compute capability)")
        print("would run, and is checked the same.")
    return 0


def _config_summary(cfg) -> str:  # type: ignore[no-untyped-def]
    from flashcp.models import estimate_parameters

    n = estimate_parameters(cfg.model)
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    p = cfg.parallel
    recipe = cfg.run.recipe + (" + LoRA" if "lora" in cfg.extras else "")
    memory = ""
    if cfg.hardware.memory_gib is not None:
        from flashcp.plan import GIB, plan

        peak = plan(cfg).peak.total_bytes / GIB
        memory = f", planned peak {peak:.1f} of {cfg.hardware.memory_gib:g} GiB per device"
    return (
        f"{recipe}, {cfg.model.arch} ~{size} params, dp={p.dp} pp={p.pp} cp={p.cp} ({p.cp_mode}, "
        f"world {p.world_size}), seq_len {cfg.data.seq_len}, {cfg.train.dtype} on "
        f"{cfg.run.device}{memory}"
    )


def _memory_refusal(cfg) -> str | None:  # type: ignore[no-untyped-def]
    """The over-budget message of `cfg`'s memory plan (None: fits, or no hardware.memory_gib)."""
    if cfg.hardware.memory_gib is None:
        return None
    from flashcp.plan import plan
    from flashcp.plan.report import refusal

    return refusal(cfg, plan(cfg))


def _validate(args: argparse.Namespace) -> int:
    from flashcp.config import ConfigError, collect, read_yaml
    from flashcp.config.errors import ConfigValidationError

    files = [Path(f) for f in args.files]
    if not files:
        if not CONFIG_DIR.is_dir():
            print(f"no files given and no {CONFIG_DIR}/ directory here", file=sys.stderr)
            return 2
        files = sorted(CONFIG_DIR.rglob("*.yaml"))
    failed = 0
    for path in files:
        try:
            cfg, errors = collect(read_yaml(path), source=str(path), world_size=args.world_size)
        except ConfigValidationError as exc:
            cfg, errors = None, exc.errors
        if not errors and cfg is not None and (message := _memory_refusal(cfg)) is not None:
            errors = [ConfigError("hardware.memory_gib", message)]
        if errors or cfg is None:
            failed += 1
            print(f"FAIL  {ConfigValidationError(errors, str(path))}")
        else:
            print(f"ok    {path}: {_config_summary(cfg)}")
    total = len(files)
    print(f"{total - failed} of {total} config(s) valid")
    return 1 if failed else 0


def _train(args: argparse.Namespace) -> int:
    from flashcp.config import ConfigValidationError, load_config
    from flashcp.trainer.job import run_job

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigValidationError as exc:
        print(exc, file=sys.stderr)
        return 2
    return run_job(
        args.config,
        args.overrides,
        nproc=cfg.parallel.world_size,
        output_dir=cfg.run.output_dir,
        resume=cfg.checkpoint.resume,
        overwrite=cfg.run.overwrite,
    )


def _plan(args: argparse.Namespace) -> int:
    import json

    from flashcp.config import ConfigValidationError, load_config
    from flashcp.plan import plan
    from flashcp.plan.report import format_plan

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigValidationError as exc:
        print(exc, file=sys.stderr)
        return 2
    p = plan(cfg, device=args.device, budget_gib=args.device_memory)
    if args.json:
        print(json.dumps(p.to_json()))
    else:
        print(format_plan(p, cfg, source=str(args.config)))
    return 0 if p.fits else 1


def _plot(args: argparse.Namespace) -> int:
    from flashcp.trainer.plot import plot_run

    try:
        out = plot_run(args.run_dir, args.out)
    except (FileNotFoundError, ValueError) as exc:
        print(f"flashcp plot: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def _add_run_commands(sub) -> None:  # type: ignore[no-untyped-def]
    train = sub.add_parser(
        "train",
        help="run a config as a paddle.distributed.launch job (dp×pp×cp processes)",
        description="Validate CONFIG, launch dp×pp×cp processes of flashcp/train.py with "
        "logs in <run.output_dir>/logs, stream rank 0, exit with the job's code.",
    )
    train.add_argument("config", help="YAML run config, e.g. configs/gpt/tiny_cp2.yaml")
    train.add_argument("overrides", nargs="*", help="key.sub=value overrides (train.steps=10)")
    train.set_defaults(func=_train)
    validate = sub.add_parser(
        "validate",
        help="check configs (default: every configs/**/*.yaml); lists every problem",
    )
    validate.add_argument("files", nargs="*", help="config files (default: all under configs/)")
    validate.add_argument(
        "--world-size", type=int, default=None, help="also check dp×pp×cp against this"
    )
    validate.set_defaults(func=_validate)
    plan = sub.add_parser(
        "plan",
        help="memory plan: bytes per rank (stage) at its peak, against the device budget",
        description="Plan CONFIG's memory per rank before launch: parameters, gradients, "
        "master weights, optimizer states, activations, logits/loss, communication buffers, "
        "against hardware.memory_gib (or --device-memory). Exit 1 when a rank does not fit.",
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
        "--json",
        action="store_true",
        help='print {"ranks": [{"rank", "stage", "total_bytes", "items"}], "budget_bytes", "fits"}',
    )
    plan.set_defaults(func=_plan)
    plot = sub.add_parser("plot", help="PNG of a run's loss and throughput (metrics.jsonl)")
    plot.add_argument("run_dir", help="a run's output_dir (holding metrics.jsonl)")
    plot.add_argument("--out", default=None, help="PNG path (default RUN_DIR/metrics.png)")
    plot.set_defaults(func=_plot)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashcp", description="Context-parallel FlashMask training on PaddlePaddle."
    )
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if importlib.util.find_spec("paddle") is None:
        print(f"flashcp: {NO_PADDLE}", file=sys.stderr)
        return 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
