"""The `flashcp` command: sub-commands for users (`explain-dispatch`, more as they land)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _explain_dispatch(args: argparse.Namespace) -> int:
    from flashcp import dispatch

    inputs = dispatch.probe_inputs(
        policy=args.fa4_unavailable, deterministic=True if args.deterministic else None
    )
    print("Inputs probed:")
    rows = [
        (dispatch.FLAG_VERSION, inputs.requested, inputs.sources[dispatch.FLAG_VERSION]),
        (
            dispatch.FLAG_DETERMINISTIC,
            inputs.deterministic,
            inputs.sources[dispatch.FLAG_DETERMINISTIC],
        ),
        ("fa4_available", inputs.fa4_available, inputs.sources["fa4_available"]),
        ("block_mask_api", inputs.block_mask_api, inputs.sources["block_mask_api"]),
        ("device", inputs.device, inputs.sources["device"]),
        ("fa4_unavailable policy", inputs.fa4_unavailable, inputs.sources["fa4_unavailable"]),
        ("head_dim", args.head_dim, "--head-dim"),
    ]
    for name, value, source in rows:
        print(f"  {name:<28} {value!s:<8} ({source})")
    try:
        res = dispatch.explain_fa_version(
            inputs.requested,
            fa4_available=inputs.fa4_available,
            block_mask_api=inputs.block_mask_api,
            deterministic=inputs.deterministic,
            head_dim=args.head_dim,
            device=inputs.device,
            fa4_unavailable=inputs.fa4_unavailable,
        )
    except (ValueError, NotImplementedError) as exc:
        print(f"Effective fa_version: none: {exc}")
        return 2
    print(f"Effective fa_version: {res.version}")
    print(f"Why: {res.reason}")
    if inputs.device.startswith("cpu"):
        print("Kernel: flashcp's CPU reference FlashMask kernel (no GPU on this machine); the")
        print("version above is what a GPU with these flags would run, and is checked the same.")
    return 0


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
        help="policy when FA4 is requested but unavailable "
        "(default: $FLASHCP_FA4_UNAVAILABLE, else error)",
    )
    explain.set_defaults(func=_explain_dispatch)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
