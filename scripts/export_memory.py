"""Peak Paddle memory of `flashcp export` (`flashcp.checkpoint.export.export_run`) by shard size.

Saves one checkpoint of a `small_glm`-width model (8 layers, 32k vocabulary: ~85 MiB of float32
weights) as a run directory, then exports it with one shard (the whole model built at once)
and with shards of 1/8 of the model (one stage built at a time), printing Paddle's allocator
peak (`flashcp.metrics.memory`, exact bytes of Paddle tensors) for each:

    python scripts/export_memory.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from flashcp.checkpoint import saving
from flashcp.checkpoint.checkpointer import FORMAT_META
from flashcp.checkpoint.export import export_run
from flashcp.checkpoint.format import MODEL_FILE, OPTIMIZER_FILE
from flashcp.checkpoint.parts import begin
from flashcp.checkpoint.state import model_arrays
from flashcp.config import build_config, to_yaml
from flashcp.metrics import memory
from flashcp.models import build_model, estimate_parameters, preset


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="export_memory_"))
    args = preset("small_glm", num_layers=8, vocab_size=32000, max_seq_len=256)
    raw = {"model": args.to_dict(), "data": {"seq_len": 64}, "run": {"output_dir": str(tmp)}}
    cfg = build_config(raw)
    model = build_model(args, seed=0)
    root = tmp / "checkpoints"  # written as a one-rank run writes it (checkpoint.saving)
    root.mkdir()
    files = [saving.PartFile(MODEL_FILE, model_arrays(model), FORMAT_META),
             saving.PartFile(OPTIMIZER_FILE, {"unused": np.zeros(1, np.float32)})]  # fmt: skip
    report = saving.write_part(begin(root, 1), saving.Snapshot(1, files), 0)
    if report.error is not None:
        raise SystemExit(f"could not write the checkpoint: {report.error}")
    commit = saving.Commit(state={}, layout=None, expected=[f.name for f in files], keep_last=None)
    saving.commit(root, 1, commit, [report])
    (tmp / "config.yaml").write_text(to_yaml(cfg))
    del model
    total = estimate_parameters(args) * 4
    print(f"model: {total / 2**20:.1f} MiB of float32 weights")
    for shard in (10**12, total // 8):
        memory.reset_peak()
        report = export_run(tmp, tmp / f"out-{shard}", max_shard_bytes=shard)
        print(
            f"max shard {min(shard, total) / 2**20:.1f} MiB: {len(report.shards)} shard(s), "
            f"peak Paddle allocated {memory.peak_bytes() / 2**20:.1f} MiB, largest shard "
            f"{report.max_shard_parameters * 4 / 2**20:.1f} MiB"
        )


if __name__ == "__main__":
    main()
