"""One rank of the MoE benchmark's expert-parallel part, `bench.moe_ep_worker` (launched by
`bench.moe` under `paddle.distributed.launch`)."""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before numpy / Paddle load their BLAS

from bench.moe_ep_worker import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
