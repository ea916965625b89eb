"""Training recipes: what a step computes (data, loss, metrics); the trainer
(`flashcp.trainer`) runs them under any dp × pp × cp layout.

* `flashcp.recipes.base`: the `Recipe` interface the trainer calls, `StepPlan`.
* `flashcp.recipes.lm`: `pretrain` / `sft` (next-token cross-entropy on packed documents).
* `flashcp.recipes.dpo`: `dpo` (share-question packed preference pairs, DPO losses, reference
  log-probs from a frozen copy or the LoRA model with adapters off, CP-summed answer log-probs);
  its data is `flashcp.data.dpo` / `flashcp.data.dpo_stream`.
* `flashcp.recipes.dpo_loss`: answer log-prob sums over packed spans and the DPO losses.
"""
