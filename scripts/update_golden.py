#!/usr/bin/env python
"""Regenerate the golden losses of every shipped tiny config and print how they changed.

Each `configs/**/tiny_*.yaml` runs through `flashcp train` (its own dp×pp×cp processes, gloo on
CPU, deterministic, 4 steps); the losses at steps 1, 2 and 4 are read from its `metrics.jsonl`
and compared with `tests/golden/losses.json`. Without `--write` the script only reports: exit 1
when any loss moved beyond the float32 rule of `bench.numerics` (its allowance grows with the
target tokens, the loss and the step; the golden stores that basis), an entry is missing or
stale, or a job was not clean. With `--write` it stores the new values (and drops entries of
configs that are gone).

    python scripts/update_golden.py                 # check, print the diff
    python scripts/update_golden.py --write         # regenerate tests/golden/losses.json
    python scripts/update_golden.py --config configs/gpt/tiny_cp2.yaml --write
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import jobs


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{float(value):.9f}"


def diff_table(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """One line per (config, step) whose golden loss changed, was added or removed."""
    rows = []
    for config in sorted(set(old) | set(new)):
        entry = old.get(config, {})
        a = entry.get("losses", {})
        b = new.get(config, {}).get("losses", {})
        for step in sorted(set(a) | set(b), key=int):
            x, y = a.get(step), b.get(step)
            if x is not None and y is not None and x == y:
                continue
            if x is None or y is None:
                mark = "added" if x is None else "removed"
            else:
                delta = float(y) - float(x)
                within = step in entry.get("basis", {}) and jobs.close(entry, step, float(y))
                mark = f"{delta:+.3e}" + ("" if within else "  BEYOND TOLERANCE")
            rows.append(f"  {config:<44} step {step:>2}  {_fmt(x)} -> {_fmt(y)}  {mark}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="store the new golden losses")
    parser.add_argument(
        "--config", action="append", default=None,
        help="only this config (repeatable; default: every configs/**/tiny_*.yaml)",
    )  # fmt: skip
    parser.add_argument("--golden", type=Path, default=jobs.GOLDEN_FILE, help="golden file")
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    args = parser.parse_args(argv)

    shipped = jobs.discover_configs()
    configs = args.config or shipped
    golden = jobs.load_golden(args.golden)
    old_jobs: dict[str, Any] = dict(golden.get("jobs", {}))
    new_jobs: dict[str, Any] = {} if args.config is None else dict(old_jobs)
    work = Path(tempfile.mkdtemp(prefix="flashcp-golden-"))
    failed: list[str] = []
    problems: list[str] = []
    for config in configs:
        run = jobs.run_flashcp(
            config,
            jobs.golden_overrides(),
            work / Path(config).with_suffix("").as_posix().replace("/", "_"),
        )
        dirty = jobs.hygiene_problems(run)
        if dirty:
            failed.append(f"{config}: " + "; ".join(dirty))
            print(f"FAILED {config} ({run.duration:.1f} s): {'; '.join(dirty)}")
            print(run.summary(15))
            if config in old_jobs:
                new_jobs[config] = old_jobs[config]
            continue
        entry = jobs.golden_entry(run)
        new_jobs[config] = entry
        diff = jobs.compare_losses(config, old_jobs.get(config), entry)
        problems += diff
        status = "ok     " if not diff else "NEW    " if config not in old_jobs else "DIFFERS"
        print(f"{status} {config} ({run.nproc} processes, "
              f"{run.duration:.1f} s): {entry['losses']}")  # fmt: skip
    if args.config is None:
        problems += [f"{c}: stale golden entry (no such tiny config)" for c in old_jobs
                     if c not in shipped]  # fmt: skip
    rows = diff_table(old_jobs, new_jobs)
    path = args.golden
    shown = path.relative_to(jobs.ROOT) if path.is_relative_to(jobs.ROOT) else path
    print(f"\nchanges against {shown}:")
    print("\n".join(rows) if rows else "  none")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"runs kept in {work}")
    if failed:
        print(f"\n{len(failed)} job(s) not clean; golden file left unchanged")
        return 1
    if args.write:
        out = {
            "about": "Golden losses of every configs/**/tiny_*.yaml run through `flashcp train` "
            "(CPU, gloo, deterministic); regenerate with scripts/update_golden.py --write",
            "tolerance": jobs.TOLERANCE_RULE,
            "check_steps": list(jobs.CHECK_STEPS),
            "jobs": dict(sorted(new_jobs.items())),
        }
        args.golden.parent.mkdir(parents=True, exist_ok=True)
        args.golden.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.golden}")
        return 0
    if problems:
        print("\n" + "\n".join(problems))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
