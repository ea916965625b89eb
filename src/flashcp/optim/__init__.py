"""The optimizer step: AdamW and its LR schedule, gradient sync, THE global norm, ZeRO sharding.

* `adamw`: the one builder of Paddle's AdamW, and the one map of its accumulators' names;
* `lr`: the warmup + cosine learning-rate schedule;
* `grads`: bucketed gradient all-reduce over cp / dp;
* `clip`: the global gradient norm of every layout, computed once per step, and the clip;
* `optimizer`: the interface the trainer drives and `build_distributed_optimizer`, which picks
  `param_optimizer` (the default: AdamW on the float32 parameters) or `master_optimizer`
  (float32 master weights, optionally sharded: ZeRO-1, ZeRO-2), each rank's masters a
  `master_shard`; `trainable`: what they know of the model's parameters;
* `grad_shard`: ZeRO-2's gradient reduce-scatter during backward, bucket by bucket;
* `layout`: which slice of the parameters each optimizer shard owns (pure arithmetic).
"""
