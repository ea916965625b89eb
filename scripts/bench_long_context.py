"""`python scripts/bench_long_context.py ...`: the longest sequence per node by the plan,
`bench.long_context` (its docstring says what it plans and how)."""

import sys

from bench.long_context import main

if __name__ == "__main__":
    sys.exit(main())
