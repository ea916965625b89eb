"""`python scripts/bench_kernel.py ...`: the FlashMask kernel benchmark, `bench.kernel` (its
docstring says what it measures and how)."""

import sys

from bench.kernel import main

if __name__ == "__main__":
    sys.exit(main())
