"""`python scripts/bench_balance.py ...`: the work-balanced packing benchmark, `bench.balance`
(its docstring says what it measures and how)."""

import sys

from bench.balance import main

if __name__ == "__main__":
    sys.exit(main())
