"""Worker: flashcp's rank entry (`flashcp.launch.worker.run`) where one rank builds its model
slowly, as a rank reading its weights from slow shared storage would, for
`tests/integration/test_startup_multiproc.py`.

`FLASHCP_TEST_SLOW_RANK` (global rank) sleeps `FLASHCP_TEST_SLOW_SECONDS` after building its
model; everything else is the real job.

    python -m paddle.distributed.launch --nproc_per_node 2 slow_build_train.py --config ... [k=v]
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from flashcp import parallelize
from flashcp.log import process_rank

_build = parallelize.default_model_factory


def slow_factory(cfg: Any, stage: Any = None) -> Any:
    """The default model, built `FLASHCP_TEST_SLOW_SECONDS` late on the slow rank."""
    model = _build(cfg, stage)
    if process_rank() == int(os.environ["FLASHCP_TEST_SLOW_RANK"]):
        time.sleep(float(os.environ["FLASHCP_TEST_SLOW_SECONDS"]))
    return model


parallelize.default_model_factory = slow_factory

if __name__ == "__main__":
    from flashcp.launch.worker import run

    sys.exit(run(sys.argv[1:]))
