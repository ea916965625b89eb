"""`python scripts/bench_offload_memory.py ...`: the activation-offload memory benchmark,
`bench.offload_memory` (its docstring says what it measures and how)."""

import sys

from bench.offload_memory import main

if __name__ == "__main__":
    sys.exit(main())
