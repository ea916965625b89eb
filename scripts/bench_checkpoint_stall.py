"""`python scripts/bench_checkpoint_stall.py ...`: the checkpoint stall benchmark, sync vs async,
`bench.checkpoint_stall` (its docstring says what it measures and how)."""

import sys

from bench.checkpoint_stall import main

if __name__ == "__main__":
    sys.exit(main())
