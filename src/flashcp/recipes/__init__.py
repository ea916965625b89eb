"""Training recipes on top of the flashcp models: LoRA adapters and DPO.

* `flashcp.recipes.lora`: PaddleFormers LoRA on a flashcp `CausalLM` (apply, save/load,
  merge, disable for reference log-probs).
* `flashcp.recipes.dpo_data`: preference JSONL -> packed share-question sequences (one prompt,
  two answers, FlashMask) or the unpacked prompt-repeated baseline.
* `flashcp.recipes.dpo_loss`: answer log-prob sums over packed spans and the DPO losses.

Submodules are imported explicitly (``from flashcp.recipes.lora import apply_lora``) so that
importing this package does not pull in PaddleFormers.
"""
