"""The script `paddle.distributed.launch` runs on every rank (`flashcp.launch.worker.run`).

    python -m paddle.distributed.launch --nproc_per_node 2 src/flashcp/train.py \\
        --config configs/gpt/tiny_cp2.yaml train.steps=10

(Paddle's launcher takes a script path, not `-m module`: `-m` abbreviates its `--master`
flag. `flashcp train CONFIG` runs this file too, `flashcp.launch.launcher.train_script`.) On
several nodes, each runs the launcher with `--nnodes N --rank R --master HOST:PORT
--nproc_per_node dp·pp·cp/N`; the launcher's `PADDLE_NNODES` makes the degree check name the
node count. What a rank does, its exit codes and its last line: `flashcp.launch.worker`.
Without `--log_dir` the launcher writes its logs to `./log/` (git-ignored here); `flashcp
train` puts them in `<run.output_dir>/logs`.

First of all, before its imports (Paddle's take seconds), a rank ties itself to its launcher
(`flashcp.launch.lifeline.hold`): it ends when the launcher does, however that ends.
"""

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: don't let this package's dir shadow top-level names
    _here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if str(Path(p or ".").resolve()) != _here]

from flashcp.launch.lifeline import hold  # noqa: E402

if __name__ == "__main__":
    hold()

from flashcp.launch.worker import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run())
