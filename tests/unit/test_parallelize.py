"""`flashcp.parallelize`: expert parallel → recompute → LoRA on a built stage, in one place.

* expert parallel: the stage's MoE layers get the ep group (none at ep = 1);
* recompute: the mode applied to a model built without it runs every decoder layer under it
  (bitwise the gradients of the model built with it), and a wrong mode is refused;
* LoRA: the adapters alone train, and the configured recompute still holds under them;
* `parallelize` applies all three in that order, activation offload right after recompute.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from flashcp.attention.context import AttentionContext
from flashcp.masks import causal_document_mask
from flashcp.models import base as models_base
from flashcp.models import build_model, preset
from flashcp.models.base import DecoderStack, StageSpec
from flashcp.models.offload import offloader_of
from flashcp.models.recompute import checkpoint
from flashcp.parallelize import apply_expert_parallel, apply_lora, apply_recompute, parallelize
from helpers.configs import Sections, TinyCfg
from helpers.fakegroups import ep_groups


@pytest.fixture
def tiny_base() -> Sections:
    """The tiny GLM, every other section the schema's defaults."""
    return {"model": {"preset": "tiny_glm"}}


def _grads(mode: str, *, apply: str | None = None) -> dict[str, np.ndarray]:
    """Gradients of one step of tiny_glm built with recompute `mode` (then `apply`'d)."""
    model = build_model(preset("tiny_glm", recompute=mode), seed=0)
    if apply is not None:
        apply_recompute(model, apply)
    ids = paddle.to_tensor(np.random.default_rng(1).integers(0, 200, (2, 32)))
    pos = paddle.arange(32).reshape([1, 32]).tile([2, 1])
    attn = AttentionContext(mask=causal_document_mask([[32], [12, 20]]).indices, causal=True)
    model.logits(model(ids, pos, attn)).sum().backward()
    return {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", ["full", "refined"])
def test_applied_recompute_equals_the_built_mode_bitwise(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    calls: list[str] = []

    def recorded(fn, h, how, offload=None):  # type: ignore[no-untyped-def]
        calls.append(how)
        return checkpoint(fn, h, how, offload)

    monkeypatch.setattr(models_base, "checkpoint", recorded)
    want = _grads(mode)
    assert calls == [mode] * 2  # tiny_glm's two layers
    got = _grads("none", apply=mode)
    assert calls == [mode] * 4  # the applied mode, not the args' "none"
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_recompute_mode_is_set_on_every_decoder_stack_and_checked() -> None:
    model = build_model(preset("tiny_glm"), seed=0)
    stacks = [m for m in model.sublayers(include_self=True) if isinstance(m, DecoderStack)]
    assert stacks and all(s.recompute == "none" for s in stacks)  # the args' mode by default
    apply_recompute(model, "refined")
    assert all(s.recompute == "refined" for s in stacks)
    with pytest.raises(ValueError, match="recompute 'partial': use one of"):
        apply_recompute(model, "partial")


def test_expert_parallel_attaches_the_ep_group_only_when_split() -> None:
    args = preset("tiny_glm_moe", num_layers=3)
    whole = build_model(args, seed=0)
    assert apply_expert_parallel(whole, ep_groups()) == 0  # ep = 1: nothing to attach
    stage = build_model(args, stage=StageSpec(0, 1, range(3), 1, 2), seed=0)
    assert apply_expert_parallel(stage, ep_groups(ep_rank=1, ep=2)) == 2  # its two MoE layers
    assert stage.model.layers[1].mlp.exchange.rank == 1


def test_lora_is_applied_from_the_config_section(tiny_cfg: TinyCfg) -> None:
    model = build_model(preset("tiny_glm"), seed=0)
    assert apply_lora(model, tiny_cfg(), ep_groups()) is None  # no `lora` section: nothing
    assert all(not p.stop_gradient for p in model.parameters())
    cfg = tiny_cfg(run={"recipe": "sft"}, lora={"rank": 4, "target_modules": [".*q_proj"]})
    setup = apply_lora(model, cfg, ep_groups())
    assert setup is not None and setup.lora_config.r == 4
    trained = [n for n, p in model.named_parameters() if not p.stop_gradient]
    assert trained and all(n.endswith(("lora_A", "lora_B")) for n in trained)


def test_parallelize_applies_recompute_and_lora(tiny_cfg: TinyCfg) -> None:
    cfg = tiny_cfg(
        model={"preset": "tiny_glm", "recompute": "full"},
        run={"recipe": "sft"},
        lora={"rank": 4, "target_modules": [".*v_proj"]},
    )
    model = build_model(preset("tiny_glm"), seed=0)  # built without recompute
    setup = parallelize(model, cfg, ep_groups())
    assert setup is not None
    assert model.model.recompute == "full"
    assert all(n.endswith(("lora_A", "lora_B")) for n, p in model.named_parameters()
               if not p.stop_gradient)  # fmt: skip


def test_parallelize_applies_offload_after_recompute(tiny_cfg: TinyCfg) -> None:
    """`train.offload_activations` needs the recompute mode parallelize sets first (the model
    here is built without one); off, no offloader is attached."""
    on = tiny_cfg(model={"preset": "tiny_glm", "recompute": "full"},
                  train={"offload_activations": True})  # fmt: skip
    model = build_model(preset("tiny_glm"), seed=0)  # built without recompute
    parallelize(model, on, ep_groups())
    assert model.model.recompute == "full"
    assert offloader_of(model) is not None and model.model.offloader is offloader_of(model)
    off = tiny_cfg(model={"preset": "tiny_glm", "recompute": "full"})
    plain = build_model(preset("tiny_glm"), seed=0)
    parallelize(plain, off, ep_groups())
    assert offloader_of(plain) is None
