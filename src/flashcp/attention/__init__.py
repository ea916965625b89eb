"""Attention: one interface, its implementations, and the one registry of CP modes.

* `flashcp.attention.interface`: `AttentionImpl` (plan → forward → backward, and `apply`, one
  PyLayer for every implementation) and `AttentionPlan`.
* `flashcp.attention.context`: `AttentionContext`, what every layer of a forward pass shares
  (the global mask, the CP group and mode), and the plan cache of a micro-batch.
* `flashcp.attention.registry`: THE table of CP modes (name → chunks per rank, layout,
  implementation); the model asks it which implementation runs for a context.
* `flashcp.attention.local`: the whole sequence on this rank (no CP);
  `flashcp.attention.flashmask`: its public front door, `flashmask_attention`.
* `flashcp.attention.allgather_kv`: all-gather-KV context parallelism (Llama 3 / PaddleFleet
  style) over a CP group; its public function is `flashmask_attention_cp`.

This package module imports nothing: the config layer reads `flashcp.attention.registry`
without paddle. Import what you use from its module.
"""
