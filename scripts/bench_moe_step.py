"""`python scripts/bench_moe_step.py ...`: the MoE step benchmark, `bench.moe_step` (its
docstring says what it measures and how)."""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread, before numpy / Paddle load BLAS
os.environ.setdefault("MKL_NUM_THREADS", "1")

from bench.moe_step import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
