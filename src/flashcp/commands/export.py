"""`flashcp export`: a run's model as a Hugging Face directory."""

from __future__ import annotations

import argparse
import sys

from flashcp.launch.outcome import EXIT_CONFIG, EXIT_OK

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10,
               "MIB": 2**20, "GIB": 2**30}  # fmt: skip


def parse_size(text: str) -> int:
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


def export_command(args: argparse.Namespace) -> int:
    from flashcp.checkpoint.export import ExportError, export_run
    from flashcp.log import readable_count
    from flashcp.models.hf_check import CheckpointMismatchError
    from flashcp.problems import ProblemsError

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
    except (ExportError, ProblemsError, CheckpointMismatchError, OSError) as exc:
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
