"""`python scripts/bench_collective_sync.py ...`: what hang detection costs per NCCL collective,
`bench.collective_sync` (its docstring says what it measures and how)."""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread, before numpy / Paddle load BLAS
os.environ.setdefault("MKL_NUM_THREADS", "1")

from bench.collective_sync import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
