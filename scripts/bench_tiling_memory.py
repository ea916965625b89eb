"""`python scripts/bench_tiling_memory.py ...`: the sequence-tiling memory benchmark,
`bench.tiling_memory` (its docstring says what it measures and how)."""

import sys

from bench.tiling_memory import main

if __name__ == "__main__":
    sys.exit(main())
