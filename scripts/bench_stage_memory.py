"""`python scripts/bench_stage_memory.py ...`: what building one pipeline stage costs,
`bench.stage_memory` (its docstring says what it measures and how)."""

import sys

from bench.stage_memory import main

if __name__ == "__main__":
    sys.exit(main())
