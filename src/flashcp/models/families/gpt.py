"""GPT: flashcp's own pre-LN decoder — LayerNorm, rotary or learned positions, a GELU MLP.

Per layer ``h = h + attn(ln1(h)); h = h + mlp(ln2(h))``, then a final LayerNorm and the LM head
(optionally tied to the token embedding). Its parameter names follow the Hugging Face style
(``model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``mlp.fc_in`` / ``mlp.fc_out``,
``model.embed_positions`` with learned positions). No transformers class computes it: an
export's config.json carries the exact `ModelArgs` under ``flashcp_model_args`` and only
flashcp's `model.from_pretrained` reads it back.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from flashcp.models.config import ModelArgs
from flashcp.models.families.hf import HFSide, Reader
from flashcp.models.families.spec import SMALL, TINY, Family, Preset

ARGS_KEY = "flashcp_model_args"
"""Key of the exact `ModelArgs` in a flashcp GPT export's config.json."""


def _read(r: Reader) -> dict[str, Any]:
    own = r.config.get(ARGS_KEY)
    if not isinstance(own, dict):
        r.problem(ARGS_KEY, "a FlashcpGPTForCausalLM config needs its flashcp_model_args")
        return {}
    names = {f.name for f in fields(ModelArgs)}
    return {k: v for k, v in own.items() if k in names}


def _write(args: ModelArgs) -> dict[str, Any]:
    return {
        "attention_bias": args.qkv_bias,
        "layer_norm_eps": args.norm_eps,
        "hidden_act": "gelu",
        "position": args.position,
        ARGS_KEY: args.to_dict(),
    }


FAMILY = Family(
    arch="gpt",
    title="flashcp's GPT",
    norm="layer",
    mlp="gelu",
    learned_positions=True,
    mtp=True,
    fixed={"use_qk_norm": False, "o_bias": False, "mlp_bias": False},
    presets={
        "tiny": Preset(ModelArgs(arch="gpt", intermediate_size=256, **TINY), False, "CPU tests"),
        "small": Preset(ModelArgs(arch="gpt", intermediate_size=1024, **SMALL), False, "CPU runs"),
    },
    hf=HFSide(
        architecture="FlashcpGPTForCausalLM",
        model_type="flashcp_gpt",
        defaults={},
        read=_read,
        write=_write,
        transformers=False,
        activation="gelu",
        own_args=True,
    ),
)
