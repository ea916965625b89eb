"""`python scripts/bench_loss_memory.py ...`: the LM-loss memory benchmark, `bench.loss_memory`
(its docstring says what it measures and how)."""

import sys

from bench.loss_memory import main

if __name__ == "__main__":
    sys.exit(main())
