"""Training recipes on top of the flashcp models: what a step computes (data, model setup,
loss, metrics); the trainer (`flashcp.trainer`) runs them under any dp × pp × cp layout.

* `flashcp.recipes.base`: the `Recipe` interface the trainer calls, `StepPlan`.
* `flashcp.recipes.lm`: `pretrain` / `sft` (next-token cross-entropy on packed documents).
* `flashcp.recipes.dpo`: `dpo` (share-question packed preference pairs, DPO losses, reference
  log-probs from a frozen copy or the LoRA model with adapters off, CP-summed answer log-probs).
* `flashcp.recipes.dpo_data` / `dpo_stream`: preference JSONL -> packed share-question rows
  (or the unpacked prompt-repeated baseline); the resumable per-epoch stream of rows.
* `flashcp.recipes.dpo_loss`: answer log-prob sums over packed spans and the DPO losses.
* `flashcp.recipes.lora` / `adapters`: PaddleFormers LoRA on a flashcp `CausalLM` (apply,
  save/load, merge, disable); the trainer's side (config, per-stage adapter shards, export).

Submodules are imported explicitly (``from flashcp.recipes.lora import apply_lora``) so that
importing this package does not pull in PaddleFormers.
"""
