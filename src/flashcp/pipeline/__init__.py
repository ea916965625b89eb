"""Pipeline parallelism: split a model into stages and run a step's micro-batches on them.

* `split`: which decoder layers each stage runs (pure); `stage`: building one stage alone;
* `schedule`: the order of passes and transfers (pure, unit-tested);
* `runner`: the ONE runner of a step's micro-batches (forward, loss, backward) on this rank's
  stage over send / recv; one process's whole model is a one-stage pipeline.
"""
