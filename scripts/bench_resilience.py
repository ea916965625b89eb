"""`python scripts/bench_resilience.py ...`: a long job under injected faults, `bench.resilience`
(its docstring says what it measures and how)."""

import sys

from bench.resilience import main

if __name__ == "__main__":
    sys.exit(main())
