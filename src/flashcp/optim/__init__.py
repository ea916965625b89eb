"""The optimizer step: AdamW and its LR schedule, gradient sync, clipping, ZeRO sharding.

* `adamw`: Paddle's AdamW and the warmup + cosine schedule;
* `grads`: bucketed gradient all-reduce over cp / dp;
* `clip`: the global gradient norm across pipeline stages;
* `zero`: AdamW on parameters or on float32 masters, optionally sharded (ZeRO-1);
* `layout`: which slice of the parameters each optimizer shard owns (pure arithmetic).
"""
