"""Pipeline parallelism: split a model into stages and run them under a 1F1B schedule.

* `split`: which decoder layers each stage runs (pure); `stage`: building one stage alone;
* `schedule`: the order of passes and transfers (pure, unit-tested);
* `runner`: running the schedule on this rank's stage over send / recv;
* `executor`: a step's micro-batches through one process's model or its pipeline stage.
"""
