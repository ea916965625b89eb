"""`python scripts/bench_dpo.py ...`: the DPO packing benchmark, `bench.dpo` (its docstring
says what it measures and how)."""

import sys

from bench.dpo import main

if __name__ == "__main__":
    sys.exit(main())
