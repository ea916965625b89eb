"""Checkpoints: the on-disk format, model/optimizer/RNG state, expert slices, HF export.

* `format`: atomic, checksummed step directories (one writer); `parts`: the same written in
  parts by several ranks (pipeline stages, adapters, optimizer shards).
* `state`: Paddle objects <-> plain arrays; `optimizer_state`: optimizer state of any layout;
  `experts`: expert-parallel tensors whole on disk, sliced in memory.
* `export` / `merge_export`: a run as a Hugging Face directory (streamed, stage by stage).
"""
