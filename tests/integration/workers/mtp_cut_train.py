"""Worker: flashcp's rank entry (`flashcp.launch.worker.run`) with one deliberate MTP bug, for
the negative control of `tests/integration/test_mtp_multiproc.py`.

The bug: the MTP targets built per context-parallel CHUNK (as a rank would build them from
its own shard, after the cut) instead of on the full sequence: every multiple of
`MTP_BUG_CHUNK` tokens acts as a document end, so the d positions before each chunk end lose
their depth-d targets. The run is otherwise the real one (same config, same launch); its MTP
loss and MTP gradients must fail the equivalence comparison by a wide margin.

    MTP_BUG_CHUNK=16 python -m paddle.distributed.launch --nproc_per_node 2 mtp_cut_train.py \
        --config ... [k=v ...]
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import numpy as np

from flashcp.models import mtp
from flashcp.pipeline import runner

CHUNK = int(os.environ.get("MTP_BUG_CHUNK", "0"))


def cut_at_chunks(lens: Sequence[int], chunk: int) -> list[int]:
    """Document lengths `lens` with every multiple of `chunk` made a boundary too."""
    total = int(sum(lens))
    ends = set(np.cumsum(lens).tolist()) | set(range(chunk, total, chunk))
    return np.diff([0, *sorted(ends)]).astype(int).tolist()


def targets_per_chunk(
    input_ids: np.ndarray, labels: np.ndarray, doc_lens: Sequence[Sequence[int]], depths: int
) -> tuple[np.ndarray, np.ndarray]:
    """`mtp.mtp_targets` as if each chunk were built on its own (the bug)."""
    cut = [cut_at_chunks(lens, CHUNK) for lens in doc_lens]
    return mtp.mtp_targets(input_ids, labels, cut, depths)


if __name__ == "__main__":
    if CHUNK <= 0:
        raise SystemExit("set MTP_BUG_CHUNK to the cp chunk length (tokens)")
    runner.mtp_targets = targets_per_chunk  # type: ignore[assignment]
    from flashcp.launch.worker import run

    sys.exit(run(sys.argv[1:]))
