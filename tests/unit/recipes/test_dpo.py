"""The DPO recipe in one process: learning, metrics, the reference, LoRA checkpoints, data."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import pytest

from bench import numerics
from flashcp.config import build_config
from flashcp.data.dpo_stream import DPOData
from flashcp.lora.model import disable_adapters, load_adapters
from flashcp.models import build_model
from flashcp.models.hf_load import load_hf_checkpoint
from flashcp.pipeline.runner import PipelineRunner
from flashcp.trainer import Trainer
from helpers.configs import TINY_GLM_ACCUM, Sections, TinyCfg, merged
from helpers.trainruns import Fit

LORA = {"rank": 4, "alpha": 8.0, "target_modules": [".*q_proj", ".*v_proj"]}


@pytest.fixture
def tiny_base() -> Sections:
    """DPO (β = 0.1) on the built-in pairs, four steps of two micro-batches."""
    return merged(TINY_GLM_ACCUM, train={"steps": 4}, run={"recipe": "dpo"}, dpo={"beta": 0.1})


def _logits(model: paddle.nn.Layer, batch: Any) -> np.ndarray:
    from flashcp.attention.context import AttentionContext

    attn = AttentionContext(mask=batch.mask.indices, causal=True)
    with paddle.no_grad():
        out = model(paddle.to_tensor(batch.input_ids), paddle.to_tensor(batch.positions), attn)
        return model.logits(out).numpy()


def test_dpo_learns_the_builtin_set_and_logs_rewards(
    tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit
) -> None:
    # two epochs in file order: 25 rows of 256 tokens (52 pairs), one row per step
    cfg = tiny_cfg(
        tmp_path,
        data={"shuffle": False, "seq_len": 256},
        train={"steps": 50, "warmup_steps": 2, "grad_accum": 1},
    )
    records = fit(cfg).records
    losses = [r["loss"] for r in records]
    assert losses[0] == pytest.approx(math.log(2))  # policy == reference at step 1
    assert all(math.isfinite(x) for x in losses)
    first, second = np.mean(losses[:25]), np.mean(losses[25:])
    assert second < first - 0.05, (first, second)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy"):
        assert key in records[-1]
    # the policy's mean answer log-prob sums (tolerance scale of the rewards, bench.numerics)
    assert all(r["logps/chosen"] < 0 and r["logps/rejected"] < 0 for r in records)
    assert records[0]["rewards/margin"] == 0.0 and records[0]["rewards/accuracy"] == 0.0
    assert np.mean([r["rewards/accuracy"] for r in records[25:]]) > 0.7
    assert np.mean([r["rewards/margin"] for r in records[25:]]) > 0.0
    assert sum(r["examples"] for r in records[:25]) == 52  # each pair once per epoch


def test_frozen_reference_copy_stays_the_initial_policy(
    tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit
) -> None:
    trainer = fit(tiny_cfg(tmp_path)).trainer
    reference = trainer.recipe.reference
    assert reference is not None and reference is not trainer.model
    assert all(p.stop_gradient for p in reference.parameters())
    initial = build_model(trainer.cfg.model, seed=trainer.cfg.train.seed)
    ref_state = reference.state_dict()
    moved = 0
    for name, value in initial.state_dict().items():
        np.testing.assert_array_equal(ref_state[name].numpy(), value.numpy(), err_msg=name)
        moved += not np.array_equal(trainer.model.state_dict()[name].numpy(), value.numpy())
    assert moved > 10  # the policy trained


def test_lora_reference_is_the_base_model(tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit) -> None:
    trainer = fit(tiny_cfg(tmp_path, lora=LORA)).trainer
    assert trainer.recipe.reference is None  # no copy: the adapters are switched off
    assert all(n.endswith(("lora_A", "lora_B")) for n, _ in trainer.params)
    batch = trainer.data.next_step()[0]
    base = build_model(trainer.cfg.model, seed=trainer.cfg.train.seed)
    with disable_adapters(trainer.model):
        off = _logits(trainer.model, batch)
    np.testing.assert_array_equal(off, _logits(base, batch))
    assert not np.allclose(_logits(trainer.model, batch), off)  # the adapters did train
    # the recipe's reference log-probs are the base model's
    micro = trainer.runner.micro_batches([batch])
    trainer.recipe.prepare(micro, trainer.runner)
    (ref_c, ref_r) = micro[0].payload["reference"]
    runner = PipelineRunner(base, forward_context=trainer.runner.forward_context)
    (want_c, want_r), = runner.forward_only(micro, trainer.recipe.answer_logps)  # fmt: skip
    np.testing.assert_array_equal(ref_c.numpy(), want_c.numpy())
    np.testing.assert_array_equal(ref_r.numpy(), want_r.numpy())


def test_lora_checkpoints_resume_exactly_and_export(
    tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit
) -> None:
    full = tiny_cfg(tmp_path / "a", lora={**LORA, "merge_at_end": True})
    run = fit(full)
    trainer, want = run.trainer, run.records
    ck = {"every": 2}
    fit(tiny_cfg(tmp_path / "b", lora=LORA, checkpoint=ck, run={"stop_after_steps": 2}))
    step2 = tmp_path / "b" / "run" / "checkpoints" / "step_2"
    files = sorted(p.name for p in (step2 / "adapters").iterdir())
    assert files == [
        "config.json",
        "lora_config.json",
        "peft_model-00001-of-00001.safetensors",
        "peft_model.safetensors.index.json",
    ]
    assert not (step2 / "model.safetensors").exists()  # adapters only, no base weights
    got = fit(tiny_cfg(tmp_path / "b", lora=LORA, checkpoint=ck)).records
    assert [r["loss"] for r in got] == [r["loss"] for r in want]  # bitwise
    # PaddleFormers loads the exported adapters; the merged export equals base + adapters
    out = Path(full.run.output_dir)
    loaded = load_adapters(build_model(full.model, seed=full.train.seed), out / "adapters")
    batch = trainer.data.next_step()[0]
    np.testing.assert_array_equal(_logits(loaded, batch), _logits(trainer.model, batch))
    merged = build_model(full.model)
    load_hf_checkpoint(merged, out / "merged")
    want = _logits(trainer.model, batch)
    # merged W + A·B·s vs the adapted forward, another float32 order: the float32 rule
    # (bench.numerics), n = the hidden size (the reduction a merged weight's rounding enters)
    n = full.model.hidden_size
    numerics.assert_close(_logits(merged, batch), want, n=n, what="merged export logits")
    # negative control: the base model without the adapters
    base = build_model(full.model, seed=full.train.seed)
    numerics.assert_rejects(_logits(base, batch), want, n=n)


def test_frozen_reference_run_resumes_exactly(tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit) -> None:
    want = fit(tiny_cfg(tmp_path / "a")).records
    ck = {"every": 2}
    fit(tiny_cfg(tmp_path / "b", checkpoint=ck, run={"stop_after_steps": 3}))
    got = fit(tiny_cfg(tmp_path / "b", checkpoint=ck)).records
    assert [r["loss"] for r in got] == [r["loss"] for r in want]


@pytest.mark.parametrize("loss_type", ["ipo", "hinge"])
def test_other_losses_train(tmp_path: Path, loss_type: str, tiny_cfg: TinyCfg, fit: Fit) -> None:
    records = fit(tiny_cfg(tmp_path, dpo={"loss_type": loss_type, "beta": 0.5})).records
    assert all(math.isfinite(r["loss"]) for r in records)
    # at step 1 h = 0: ipo (0 - 1/(2·0.5))² = 1, hinge relu(1 - 0) = 1
    assert records[0]["loss"] == pytest.approx(1.0)


def test_dpo_data_stream_splits_over_dp_and_resumes(tmp_path: Path, tiny_cfg: TinyCfg) -> None:
    one = DPOData(tiny_cfg(tmp_path, data={"micro_batch_size": 2}))
    halves = [DPOData(tiny_cfg(tmp_path, data={"micro_batch_size": 1}), dp_rank=r, dp_size=2)
              for r in range(2)]  # fmt: skip
    for _ in range(30):  # past an epoch boundary
        whole = one.next_step()
        parts = [h.next_step() for h in halves]
        for m, batch in enumerate(whole):
            ids = np.concatenate([parts[r][m].input_ids for r in range(2)])
            np.testing.assert_array_equal(ids, batch.input_ids)
    assert one.epoch >= 1
    state = one.state_dict()
    again = DPOData(tiny_cfg(tmp_path, data={"micro_batch_size": 2}))
    again.load_state_dict(state)
    np.testing.assert_array_equal(again.next_step()[0].input_ids, one.next_step()[0].input_ids)
    unpacked = DPOData(tiny_cfg(tmp_path, data={"packing": False}))
    assert unpacked.next_step()[0].num_examples == 1
    assert "52 preference pairs" in one.describe()


def test_the_recipe_keeps_no_step_state(tmp_path: Path, tiny_cfg: TinyCfg) -> None:
    """A step leaves nothing on the recipe: the reference log-probs ride on the micro-batches
    (`payload`), the statistics come back from `loss`, the same on every call, and one
    `finish` makes the metrics of training steps and evaluations."""
    trainer = Trainer(tiny_cfg(tmp_path, train={"steps": 1}), stream=io.StringIO())
    recipe = trainer.recipe
    before = set(vars(recipe))
    trainer.train_step()
    assert set(vars(recipe)) == before == {"cfg", "groups", "dpo", "reference"}
    micro = trainer.runner.micro_batches(trainer.data.next_step())
    recipe.prepare(micro, trainer.runner)
    assert all(set(mb.payload) == {"reference"} for mb in micro)
    passes = [trainer.runner.forward_only(micro, lambda out, mb: recipe.loss(out, mb)[1])
              for _ in range(2)]  # fmt: skip
    assert passes[0] == passes[1] and len(passes[0][0]) == len(recipe.stats)
    sums = np.sum(np.asarray(passes[0], dtype=np.float64), axis=0)
    metrics = recipe.finish(sums)
    assert set(recipe.step_metrics) < set(metrics)  # training reports these of them
    assert metrics["examples"] == sum(int(b.num_examples) for b in (mb.batch for mb in micro))
    assert metrics["targets"] == recipe.count([mb.batch for mb in micro])[1]


def test_only_cp_rank_zero_counts_a_replicated_recipe() -> None:
    from flashcp.distributed import NamedGroup, ParallelDims, ParallelGroups
    from flashcp.recipes.dpo import DPORecipe
    from flashcp.recipes.lm import LMRecipe

    def groups(cp_rank: int) -> ParallelGroups:
        dims = ParallelDims(dp=1, pp=1, cp=2, world_size=2)
        cp = NamedGroup("cp", cp_rank, 5, [0, 1], pg=None)
        solo = NamedGroup("dp", 0, -1, [cp_rank], pg=None)
        world = NamedGroup("world", cp_rank, 0, [0, 1], pg=None)
        return ParallelGroups(dims, cp_rank, world, solo, solo, cp, "none")

    cfg = build_config({"model": {"preset": "tiny_glm"}, "run": {"recipe": "dpo"}})
    assert [DPORecipe(cfg, groups(r)).counted() for r in (0, 1)] == [True, False]
    assert [LMRecipe(cfg, groups(r)).counted() for r in (0, 1)] == [True, True]
