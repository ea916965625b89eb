"""`python scripts/bench_cp.py --part ...`: the context-parallel benchmarks, `bench.cp` (its
docstring says what each part measures and how)."""

import sys

from bench.cp import main

if __name__ == "__main__":
    sys.exit(main())
