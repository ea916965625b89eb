"""No rank skips a collective, whatever its data (issue 31): SFT and DPO on random document,
prompt and answer length mixes, launched at CP 2 and CP 4 with PP 2 and EP 2, every collective
fingerprinted (`FLASHCP_CHECK_COLLECTIVES=1`), each run equal to its CP 1 run in this process
within the float32 rule (`bench.numerics`).

The length mixes (seeded) are made so that, over each run's steps, every cp rank holds
micro-batches without a single target (prompt-only chunks: a DPO row whose long prompt fills
the rank's two chunks, an SFT row cut from the middle of a long prompt), answers cut at chunk
boundaries and answers ending exactly on one, and (SFT) whole micro-batches with nothing to
predict, on the last pipeline stage too; `layout_coverage` counts them from the very batches
the runs train on, and the test asserts each kind occurred at every cp position. With the DPO
fix reverted (the span sums of a rank without answer tokens detached from the graph) the
launched job stops at the first such micro-batch, named (`DetachedLossError`), where it used
to hang.

All four runs share ONE 4-process launch (`workers/layouts_worker.py`): start-up once.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest

from bench.jobs import dpo_beta
from flashcp.attention.registry import make_assignment
from flashcp.config import IGNORE_INDEX, Config, load_config
from flashcp.cp.layout import assigned_positions
from flashcp.rank_setup import process_groups
from flashcp.recipes import build_recipe
from helpers.launch import run_launch
from helpers.paths import CONFIGS
from helpers.trainruns import assert_training_matches, train_in_process

pytestmark = pytest.mark.integration

WORKER = Path(__file__).resolve().parent / "workers" / "layouts_worker.py"
STEPS = 6
SEQ = 64
COMMON = [
    f"train.steps={STEPS}", "train.grad_accum=2", "data.micro_batch_size=1", f"data.seq_len={SEQ}",
    "data.balance=none", "checkpoint.every=0", "debug.dump_grads=true", "train.warmup_steps=2",
]  # fmt: skip
ONE_PROCESS = ["parallel.pp=1", "parallel.cp=1", "parallel.ep=1", "parallel.pp_layers=null"]


def text(rng: np.random.Generator, size: int) -> str:
    """`size` random lowercase letters (the byte tokenizer: one token each)."""
    return "".join(chr(c) for c in rng.integers(97, 123, size))


def dpo_records(rng: np.random.Generator, n: int) -> list[dict[str, str]]:
    """Preference pairs of more than half a row each, so every row holds one (byte tokens: a
    packed pair is k + (m1 + 1) + (m2 + 1) tokens for a k-character prompt and m-character
    answers), in three kinds: a mid-length prompt with short answers ending before the last
    quarter (the first and last chunks hold no answer token: CP rank 0's share, and at CP 4
    rank 1's), a prompt filling all but the last chunk with one- or two-token answers (the
    middle ranks hold none), and a short prompt with long answers crossing many chunk
    boundaries."""
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            k = int(rng.integers(16, 29))
            m1 = int(rng.integers(2, 8))
            m2 = int(rng.integers(max(33 - k - m1 - 2, 1), 48 - k - m1 - 2 + 1))
        elif kind == 1:
            k, m1, m2 = int(rng.integers(56, 60)), 1, int(rng.integers(1, 3))
        else:
            k, m1 = int(rng.integers(1, 6)), int(rng.integers(14, 28))
            m2 = int(rng.integers(max(14, 33 - k - m1 - 2), SEQ - 2 - k - m1 + 1))
        assert 32 < k + m1 + m2 + 2 <= SEQ
        out.append({"prompt": text(rng, k), "chosen": text(rng, m1), "rejected": text(rng, m2)})
    return out


def sft_records(rng: np.random.Generator, n: int) -> list[dict[str, str]]:
    """Prompt/response pairs: prompts longer than a row (rows cut from their middle have no
    target at all), responses after long prompts (cut at chunk boundaries, or not reached by
    a row), and long responses. No response is shorter than 8 tokens, so a step that has
    targets has enough of them for the float32 rule's reduction model (a step of two targets
    concentrates every gradient on two rows)."""
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            k, m = int(rng.integers(SEQ + 10, 2 * SEQ + 20)), int(rng.integers(8, 20))
        elif kind == 1:
            k, m = int(rng.integers(30, 60)), int(rng.integers(8, 17))
        else:
            k, m = int(rng.integers(1, 8)), int(rng.integers(20, 90))
        out.append({"prompt": text(rng, k), "response": text(rng, m)})
    return out


def write_jsonl(path: Path, records: Sequence[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@dataclass
class Coverage:
    """What a run's micro-batches put on each cp rank (`layout_coverage`)."""

    empty_on_rank: list[int]
    """Micro-batches in which cp rank r holds no target."""
    empty_batches: int
    """Micro-batches without any target on any rank."""
    cut_spans: int
    """Target spans (consecutive targets of one document/answer) cut by a chunk boundary."""
    ends_on_boundary: int
    """Target spans ending exactly with a chunk (the next chunk starts without a target)."""


def layout_coverage(cfg: Config) -> Coverage:
    """Count, over the micro-batches `cfg` trains on, the ranks without targets, the
    micro-batches without targets and the spans cut at chunk boundaries, with the recipe's
    own data and the run's own cp layout."""
    one = one_process(cfg)
    data = build_recipe(one, process_groups(one, None)).data()
    cp, mode = cfg.parallel.cp, cfg.parallel.cp_mode
    chunk = SEQ // (2 * cp)
    empty_on_rank, empty, cut, ends = [0] * cp, 0, 0, 0
    for _ in range(cfg.train.steps):
        for batch in data.next_step():
            targets = np.asarray(batch.labels) != IGNORE_INDEX
            assignment = make_assignment(mode, cp, batch.mask.indices, causal=batch.mask.causal)
            for r in range(cp):
                cols = assigned_positions(SEQ, r, assignment)
                empty_on_rank[r] += int(not targets[:, cols].any())
            empty += int(not targets.any())
            # a target at the last column of a chunk followed by one at the next chunk's first
            edges = np.arange(chunk - 1, SEQ - 1, chunk)
            cut += int((targets[:, edges] & targets[:, edges + 1]).sum())
            ends += int((targets[:, edges] & ~targets[:, edges + 1]).sum())
    return Coverage(empty_on_rank, empty, cut, ends)


def one_process(cfg: Config) -> Config:
    """`cfg` as one process runs it (its data is the same for every layout)."""
    return replace(cfg, parallel=replace(cfg.parallel, pp=1, cp=1, ep=1, pp_layers=None))


@pytest.mark.equivalence
@pytest.mark.timeout(600)
def test_random_layouts_train_like_one_process(tmp_path: Path) -> None:
    rng = np.random.default_rng(52)  # a seed whose layouts hold every case (asserted below)
    dpo = write_jsonl(tmp_path / "pairs.jsonl", dpo_records(rng, 60))
    sft = write_jsonl(tmp_path / "sft.jsonl", sft_records(rng, 60))
    runs = {
        "dpo_lora_cp4": (CONFIGS / "glm" / "tiny_dpo_lora_cp2.yaml",
                         ["parallel.cp=4", f"data.path={dpo}"]),
        "sft_pp2_cp2": (CONFIGS / "gpt" / "tiny_sft_packed_cp2.yaml",
                        ["parallel.pp=2", f"data.path={sft}"]),
        "dpo_moe_lora_pp2_cp2_ep2": (CONFIGS / "glm" / "tiny_moe_dpo_lora_pp2_cp2.yaml",
                                     ["parallel.ep=2", f"data.path={dpo}"]),
        "sft_moe_cp4_ep2": (CONFIGS / "glm" / "tiny_moe_ep2_cp2.yaml",
                            ["parallel.cp=4", "run.recipe=sft", f"data.path={sft}"]),
    }  # fmt: skip
    spec = [
        {"name": name, "config": str(config),
         "overrides": [*COMMON, *over, f"run.output_dir={tmp_path / name}"]}
        for name, (config, over) in runs.items()
    ]  # fmt: skip
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    result = run_launch(
        WORKER, 4, [str(tmp_path / "spec.json")], timeout=480,
        env={"FLASHCP_CHECK_COLLECTIVES": "1"}, log_dir=tmp_path / "logs",
    )  # fmt: skip
    assert result.ok and result.leftover == [], result.summary()
    for rank in range(4):
        assert "WORKER DONE" in result.log(rank), result.summary()

    for name, (config, over) in runs.items():
        cfg = load_config(config, [*COMMON, *over], world_size=4)
        cover = layout_coverage(cfg)
        # the layouts the issue names occurred, at every cp position
        assert min(cover.empty_on_rank) >= 1, (name, cover)
        assert cover.cut_spans >= 1 and cover.ends_on_boundary >= 1, (name, cover)
        if cfg.run.recipe == "sft":
            assert cover.empty_batches >= 1, (name, cover)
        ref = train_in_process(config, tmp_path / f"{name}_ref", [*COMMON, *over, *ONE_PROCESS])
        beta = dpo_beta(config) if cfg.run.recipe == "dpo" else None
        assert_training_matches(tmp_path / name, ref, steps=STEPS, pp=cfg.parallel.pp, beta=beta)
