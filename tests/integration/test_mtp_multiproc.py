"""Trained MTP layers (`model.mtp_layers: 2`, `model.mtp_loss_weight: 0.3`) through the trainer:
CP = 2 (contiguous layout), CP = 2 × EP = 2 (dual-chunk layout) and PP = 2 equal one process
(PP = 2 bitwise), and MTP targets cut after sharding do not.

The tiny GLM-4.5-style MoE (2 decoder layers; the MTP blocks, layers 2 and 3, are MoE layers
too) with full recompute and the LM head and MTP heads run in chunks of 16 targets
(`train.loss_chunk_tokens`), on packed documents whose ends sit at, one before and one after
the cp chunk boundaries (`dualchunk_allgather`: 16, 32, 48 of 64 tokens; contiguous: 32):
an MTP target built on a shard instead of the full row would be lost or wrong exactly there.
The reference trains here with cp = pp = ep = 1; the launched jobs go through `flashcp
train` (so `MicroBatch.of` cuts the MTP inputs and targets) and dump their summed gradients.
Compared with `helpers.trainruns.assert_training_matches` (the float32 rule of
`bench.numerics`: the loss, which is the objective main + λ·MTP, the gradient norm, every
gradient norm-wise) plus `lm_loss` and `mtp_loss` under the same rule; the MTP parameters
get gradients (non-zero).

NEGATIVE CONTROL: the same CP = 2 job with the MTP targets built per cp chunk
(`workers/mtp_cut_train.py`: each chunk end a document end, what building them after the cut
does) must fail the MTP loss and the MTP gradients by far.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from bench import numerics
from flashcp.checkpoint.checkpointer import GRADS_DIR
from flashcp.config import load_config
from flashcp.data import TrainData
from flashcp.launch.supervise import LaunchResult
from flashcp.metrics.writer import read_metrics
from helpers.launch import run_launch
from helpers.trainruns import (
    assert_training_matches,
    load_grads,
    train_in_process,
    train_launched,
)

pytestmark = pytest.mark.integration

WORKER = Path(__file__).resolve().parent / "workers" / "mtp_cut_train.py"
SEQ, STEPS, LAYERS, DEPTHS, WEIGHT = 64, 2, 2, 2, 0.3
ROWS = [[15, 18, 16, 15], [17, 14, 3, 14, 16], [16, 16, 16, 16], [47, 17]]
"""Each training row's documents (tokens, BOS and EOS included): their ends at 15, 17, 31,
33, 47, 49 and on 16, 32, 48 — the chunk boundaries of cp = 2 (4 chunks of 16)."""
MTP_PREFIX = tuple(f"model.layers.{LAYERS + d}." for d in range(DEPTHS))
COMMON = [f"train.steps={STEPS}", "checkpoint.every=0", "debug.dump_grads=true"]
ONE = ["parallel.cp=1", "parallel.pp=1", "parallel.ep=1"]


def _is_mtp(name: str) -> bool:
    return name.startswith(MTP_PREFIX)


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's config file and its data: one JSON line per document, its text the length
    that gives the planned token count (byte tokenizer: BOS + one token per byte + EOS)."""
    root = tmp_path_factory.mktemp("mtp")
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz "))
    lines = [json.dumps({"text": "".join(rng.choice(letters, n - 2))}) for r in ROWS for n in r]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    raw = {
        "model": {
            "preset": "tiny_glm_moe",
            "recompute": "full",
            "mtp_layers": DEPTHS,
            "mtp_loss_weight": WEIGHT,
        },
        "parallel": {"dp": 1, "pp": 1, "cp": 2, "cp_mode": "dualchunk_allgather"},
        "data": {
            "path": str(root / "docs.jsonl"),
            "seq_len": SEQ,
            "micro_batch_size": 1,
            "shuffle": False,
            "balance": "none",
        },
        "train": {
            "steps": STEPS,
            "grad_accum": 2,
            "lr": 3e-3,
            "warmup_steps": 0,
            "seed": 0,
            "dtype": "float32",
            "loss_chunk_tokens": 16,
        },
        "checkpoint": {"every": 0, "resume": "never"},
    }
    path = root / "mtp.yaml"
    path.write_text(json.dumps(raw, indent=2))  # YAML reads JSON
    return path


@pytest.fixture(scope="module")
def reference(config: Path) -> Path:
    return train_in_process(config, config.parent / "ref" / "run", [*COMMON, *ONE])


def test_rows_put_document_ends_at_the_cp_chunk_boundaries(config: Path) -> None:
    """The premise: the trainer's rows are exactly `ROWS` (no document split or moved)."""
    data = TrainData(load_config(config, ONE))
    got = [lens for _ in range(STEPS) for batch in data.next_step() for lens in batch.doc_lens]
    assert got == ROWS


def _assert_mtp_matches(run: Path, ref: Path, pp: int = 1) -> None:
    """`run` trained like `ref` under the rule, `lm_loss` and `mtp_loss` included, and every
    MTP parameter got a non-zero gradient."""
    assert_training_matches(run, ref, steps=STEPS, pp=pp)
    for got, want in zip(read_metrics(run), read_metrics(ref), strict=True):
        step, n = int(want["step"]), float(want["targets"])
        for key in ("lm_loss", "mtp_loss"):
            numerics.assert_close(got[key], want[key], n=n, scale=want[key], steps=step,
                                  what=f"{key} step {step}")  # fmt: skip
    grads = load_grads(run, 1, pp)
    mtp = {name: v for name, v in grads.items() if _is_mtp(name)}
    assert {name.split(".")[2] for name in mtp} == {str(LAYERS + d) for d in range(DEPTHS)}
    for part in ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head.head", "self_attn"):
        assert any(f".{part}." in name for name in mtp), part
    for name, value in mtp.items():
        assert np.abs(value).max() > 0, name


def _targets(rows: list[list[int]], depth: int) -> int:
    """Targets at depth `depth` (0: the main labels) of packed rows: n - 1 - depth per
    document of n tokens (none across a document's end)."""
    return sum(max(n - 1 - depth, 0) for row in rows for n in row)


def test_reference_loss_is_main_plus_weighted_mtp(reference: Path) -> None:
    """The objective `loss` = lm_loss + λ/D · (summed MTP cross-entropy) / main targets,
    with the target counts of `ROWS` (`mtp_loss` is the MTP per-token mean over depths)."""
    for row in read_metrics(reference):
        rows = ROWS[2 * (int(row["step"]) - 1) : 2 * int(row["step"])]
        main = _targets(rows, 0)
        mtp = sum(_targets(rows, d) for d in range(1, DEPTHS + 1))
        assert row["targets"] == main
        want = row["lm_loss"] + WEIGHT / DEPTHS * row["mtp_loss"] * mtp / main
        numerics.assert_close(row["loss"], want, n=main, scale=row["loss"], what="objective")
        assert row["mtp_loss"] > 0 and row["lm_loss"] > 0


@pytest.mark.equivalence
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("ep", "mode"), [(1, "contiguous_allgather"), (2, "dualchunk_allgather")], ids=["ep1", "ep2"]
)
def test_cp2_matches_one_process(config: Path, reference: Path, ep: int, mode: str) -> None:
    layout = [f"parallel.ep={ep}", f"parallel.cp_mode={mode}"]
    run = train_launched(config, config.parent / f"cp2ep{ep}" / "run", 2, [*COMMON, *layout])
    _assert_mtp_matches(run, reference)


@pytest.mark.equivalence
@pytest.mark.timeout(200)
def test_pp2_matches_one_process(config: Path, reference: Path) -> None:
    run = train_launched(config, config.parent / "pp2" / "run", 2, [*COMMON, *ONE, "parallel.pp=2"])
    _assert_mtp_matches(run, reference, pp=2)
    # without cp each stage runs one process's operations in its order: bitwise, MTP included
    for step in range(1, STEPS + 1):
        got, want = load_grads(run, step, 2), load_grads(reference, step)
        assert all(np.array_equal(got[name], want[name]) for name in want), step
    assert [r["loss"] for r in read_metrics(run)] == [r["loss"] for r in read_metrics(reference)]
    # the MTP layers live on the last stage only
    stages = [load_file(str(run / GRADS_DIR / f"step_1.stage{s}.safetensors")) for s in (0, 1)]
    assert not any(_is_mtp(name) for name in stages[0])
    assert any(_is_mtp(name) for name in stages[1])


@pytest.mark.timeout(200)
def test_mtp_targets_cut_after_sharding_fail(config: Path, reference: Path) -> None:
    out = config.parent / "cut" / "run"
    result: LaunchResult = run_launch(
        WORKER,
        2,
        ["--config", str(config), *COMMON, f"run.output_dir={out}"],
        timeout=150,
        log_dir=out.parent / "logs",
        env={"MTP_BUG_CHUNK": str(SEQ // 4)},
    )
    assert result.ok and result.leftover == [], result.summary()
    want, got = read_metrics(reference)[0], read_metrics(out)[0]
    n = float(want["targets"])
    assert got["lm_loss"] == pytest.approx(want["lm_loss"], rel=1e-5)  # the main loss is right
    # at random init every token is about as hard (mtp_loss ≈ ln V), so the lost targets move
    # the MTP mean less than the objective, whose MTP sum loses their terms
    for key, margin in (("loss", 50), ("mtp_loss", 5)):
        numerics.assert_rejects(got[key], want[key], n=n, scale=want[key], margin=margin,
                                what=f"{key}, MTP targets cut per chunk")  # fmt: skip
    ref_grads, bad = load_grads(reference, 1), load_grads(out, 1)
    for d in range(DEPTHS):
        for part in ("eh_proj.weight", "shared_head.head.weight"):
            name = f"model.layers.{LAYERS + d}.{part}"
            numerics.assert_rejects(bad[name], ref_grads[name], n=n, norm="l2", margin=100,
                                    what=f"grad {name}, MTP targets cut per chunk")  # fmt: skip
