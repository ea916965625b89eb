#!/usr/bin/env python
"""Summarise a `FLASHCP_NUMERICS_LOG` file: how close each equivalence test came to the rule.

Every comparison made through `scripts/bench/numerics.py` while `FLASHCP_NUMERICS_LOG=path` is set
appends one JSON line (test, quantity, error, allowance, units). This prints, per test file and
quantity, the number of comparisons and the largest error in units of the rule (which allows
`FACTOR`), and, per negative control (wrong shard, label shift, ...), the weakest rejection:
the smallest over the test cases of the control's largest error in that case.

    FLASHCP_NUMERICS_LOG=/tmp/n.jsonl python -m pytest tests -m equivalence -n 2 --dist loadgroup
    python scripts/numerics_report.py /tmp/n.jsonl [more.jsonl ...] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

NEGATIVE = ("wrong shard", "label-shift", "negative control")
"""Prefixes of the `what` of negative-control comparisons (rejections, not agreements)."""


def quantity(what: str) -> str:
    """`grad model.layers.0.q_proj.weight step 2` -> `grad step 2`, etc."""
    what = re.sub(r"^(.*?\b(grad|adapter)) \S+", r"\1", what)
    return what.strip()


def summarise(rows: list[dict]) -> tuple[dict, dict]:
    """({(file, quantity): [count, max units]}, {(file, control): [tests, min units]}).

    A negative control is rejected by a test when its largest error there is far beyond the
    allowance (parameters or rows the bug does not reach agree, of course): per control, the
    weakest rejection is the smallest over test cases (pytest node ids) of that largest error.
    The workers also assert it per case and rank."""
    agree: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    per_node: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for r in rows:
        node = r.get("test", "") or "?"
        # the file below its tier, e.g. `kernels/test_cpu_reference.py`, `test_jobs.py`
        test = re.sub(r"^.*?tests/(unit|integration|hf)/", "", node.split("::")[0])
        what = re.sub(r" step \d+$", "", quantity(r["what"]))
        if what.startswith(NEGATIVE):
            seen = per_node[(test, what)]
            seen[node] = max(seen.get(node, 0.0), r["units"])
        else:
            slot = agree[(test, what)]
            slot[0] += 1
            slot[1] = max(slot[1], r["units"])
    reject = {key: [len(v), min(v.values())] for key, v in per_node.items()}
    return agree, reject


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    args = parser.parse_args(argv)
    rows = [json.loads(line) for p in args.logs for line in p.read_text().splitlines() if line]
    agree, reject = summarise(rows)
    bar = "|" if args.markdown else " "
    print(f"{bar} test file {bar} quantity {bar} comparisons {bar} max units {bar}")
    if args.markdown:
        print("|---|---|---:|---:|")
    for (test, what), (count, worst) in sorted(agree.items()):
        print(f"{bar} {test} {bar} {what} {bar} {count} {bar} {worst:.3g} {bar}")
    print()
    print(
        f"{bar} test file {bar} negative control {bar} tests {bar} weakest rejection, units {bar}"
    )
    if args.markdown:
        print("|---|---|---:|---:|")
    for (test, what), (count, least) in sorted(reject.items()):
        print(f"{bar} {test} {bar} {what} {bar} {count} {bar} {least:.3g} {bar}")
    bad = [r for r in rows if not r["ok"] and not quantity(r["what"]).startswith(NEGATIVE)]
    worst = max((r["units"] for r in rows if not quantity(r["what"]).startswith(NEGATIVE)),
                default=0.0)  # fmt: skip
    print(f"\n{len(rows)} comparisons, largest agreement error {worst:.3g} units, "
          f"{len(bad)} beyond the allowance")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
