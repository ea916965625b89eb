"""Bytes each pipeline stage reads when it loads its part of a sharded HF checkpoint.

Writes a synthetic HF-layout checkpoint (flashcp's own HF save, float32 and bfloat16 files,
split into `--shards` shards by size so stages straddle shard boundaries) for each model, then
loads every stage of every `--pp` into bf16 parameters with `load_hf_checkpoint` and prints
the bytes read (measured by the reader at its `readinto` calls: index, headers, tensor data)
against the stage's share (the summed file sizes of the tensors the stage holds). The last row
per checkpoint is the whole model (pp = 1), which must read the whole checkpoint. Bytes are
deterministic, so there are no repeats.

Usage:
    python scripts/hf_load_bytes.py                    # small_glm and a GLM-4.5 MoE, 6 layers
    python scripts/hf_load_bytes.py --pp 2 4 --json /tmp/bytes.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import paddle

from flashcp.models import build_model, preset
from flashcp.models.hf_load import load_hf_checkpoint
from flashcp.models.hf_save import save_hf_checkpoint
from flashcp.pipeline.stage import stage_spec

MODELS = {
    "small_glm(6 layers)": ("small_glm", {"num_layers": 6}),
    "glm45_moe(6 layers, 16 experts)": (
        "tiny_glm_moe",
        {"num_layers": 6, "hidden_size": 128, "num_experts": 16, "moe_intermediate_size": 64},
    ),
}


def _target(args, stage: int, pp: int) -> paddle.nn.Layer:  # type: ignore[no-untyped-def]
    """What a rank of stage `stage` holds (built alone, bf16 storage), from a different seed."""
    return build_model(args, stage=stage_spec(args, stage, pp), param_dtype="bfloat16", seed=1)


def measure(name: str, file_dtype: str, pps: list[int], shards: int, root: Path) -> list[dict]:
    base, overrides = MODELS[name]
    args = preset(base, **overrides)
    paddle.seed(0)
    source = build_model(args)
    itemsize = 2 if file_dtype == "bfloat16" else 4
    total = sum(int(t.numel()) * itemsize for t in source.state_dict().values())
    directory = root / f"{base}-{file_dtype}"
    files = save_hf_checkpoint(source, directory, max_shard_bytes=total // shards, dtype=file_dtype)
    on_disk = sum(p.stat().st_size for p in directory.glob("model*.safetensors*"))
    rows = []
    for pp in pps:
        for stage in range(pp):
            report = load_hf_checkpoint(_target(args, stage, pp), directory)
            rows.append(
                dict(
                    model=name,
                    file_dtype=file_dtype,
                    files=len(files),
                    checkpoint_bytes=on_disk,
                    pp=pp,
                    stage=stage,
                    files_opened=len(report.files),
                    share_bytes=report.share_bytes,
                    bytes_read=report.bytes_read,
                    ratio=report.bytes_read / report.share_bytes,
                    of_checkpoint=report.bytes_read / on_disk,
                )
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--shards", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None)
    opts = parser.parse_args()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            for file_dtype in ("float32", "bfloat16"):
                rows += measure(name, file_dtype, opts.pp, opts.shards, Path(tmp))
    print(
        "| model | file dtype | pp | stage | files opened / total | share bytes | bytes read "
        "| read / share | read / checkpoint |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['file_dtype']} | {r['pp']} | {r['stage']} | "
            f"{r['files_opened']} / {r['files']} | {r['share_bytes']:,} | {r['bytes_read']:,} | "
            f"{r['ratio']:.4f} | {r['of_checkpoint']:.3f} |"
        )
    if opts.json is not None:
        opts.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
