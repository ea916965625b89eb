"""The commands that look without training: `flashcp explain-dispatch`, `plan`, `data-stats`
and `plot`."""

from __future__ import annotations

import argparse
import sys

from flashcp.launch.outcome import EXIT_CONFIG, EXIT_NO_FIT, EXIT_OK


def explain_dispatch_command(args: argparse.Namespace) -> int:
    from flashcp import fa_dispatch

    inputs = fa_dispatch.probe_inputs(
        policy=args.fa4_unavailable,
        policy_source="--fa4-unavailable",
        deterministic=True if args.deterministic else None,
        capability=args.capability,
    )
    print("Inputs probed:")
    rows = [
        (fa_dispatch.FLAG_VERSION, inputs.requested, inputs.sources[fa_dispatch.FLAG_VERSION]),
        (
            fa_dispatch.FLAG_DETERMINISTIC,
            inputs.deterministic,
            inputs.sources[fa_dispatch.FLAG_DETERMINISTIC],
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
        limit = fa_dispatch.fa4_call_limit(
            mask_shape=(1, heads, 1, args.mask_columns),
            num_kv_heads=args.kv_heads,
            head_dim=args.head_dim,
        )
        rows.append(("FA4 limit for this call", limit or "none", "fa4_call_limit"))
    for name, value, source in rows:
        print(f"  {name:<28} {value!s:<8} ({source})")
    try:
        res = fa_dispatch.explain_inputs(inputs, args.head_dim, fa4_limit=limit)
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


def plan_command(args: argparse.Namespace) -> int:
    import json

    from flashcp.config import load_config
    from flashcp.plan import plan
    from flashcp.plan.longest import longest, with_seq_len
    from flashcp.plan.report import format_longest, format_plan, format_step_time, format_summary
    from flashcp.plan.steptime import DEFAULT_MFU, estimate
    from flashcp.problems import ProblemsError

    mfu = DEFAULT_MFU if args.mfu is None else args.mfu
    if not 0 < mfu <= 1:
        print(f"flashcp plan: --mfu must be in (0, 1], got {mfu}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        cfg = load_config(args.config, args.overrides, allow_placeholders=True)
    except ProblemsError as exc:
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


def data_stats_command(args: argparse.Namespace) -> int:
    import json

    from flashcp.config import load_config
    from flashcp.data.stats import data_stats, format_stats
    from flashcp.problems import ProblemsError
    from flashcp.recipes import recipe_class

    try:
        cfg = load_config(args.config, args.overrides)
    except ProblemsError as exc:
        print(exc, file=sys.stderr)
        return EXIT_CONFIG
    data = recipe_class(cfg.run.recipe).data_class(cfg, dp_rank=0, dp_size=cfg.parallel.dp)
    report = data_stats(data, args.steps)  # type: ignore[arg-type]  # LM or DPO data
    print(json.dumps(report) if args.json else format_stats(report))
    return EXIT_OK


def plot_command(args: argparse.Namespace) -> int:
    from flashcp.metrics.plot import plot_run

    try:
        out = plot_run(args.run_dir, args.out)
    except (FileNotFoundError, ValueError) as exc:
        print(f"flashcp plot: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"wrote {out}")
    return EXIT_OK
