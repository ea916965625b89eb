"""`python scripts/memory_check.py ...`: the memory planner against the allocator,
`bench.memory_check` (its docstring says what it measures and how)."""

import sys

from bench.memory_check import main

if __name__ == "__main__":
    sys.exit(main())
