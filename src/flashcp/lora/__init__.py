"""LoRA on flashcp models through PaddleFormers' `LoRAModel`.

* `model`: apply, save/load, merge and disable adapters on a `CausalLM`;
* `experts`: PaddleFormers' `LoRAMoeExperts` over flashcp's stacked routed experts;
* `setup`: the `lora` config section applied to one pipeline stage, and adapter files.

Submodules are imported explicitly (``from flashcp.lora.model import apply_lora``) so that
importing this package does not pull in PaddleFormers.
"""
