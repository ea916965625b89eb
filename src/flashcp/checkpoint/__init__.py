"""Checkpoints: the only code that reads or writes a run's checkpoint files, and its exports.

* `checkpointer`: `Checkpointer`, what one rank of a training job saves, resumes and exports
  (the trainer's one entry point).
* `format`: atomic, checksummed step directories, the manifest and its reader; `parts`: the same
  written in parts by several ranks (pipeline stages, adapters, optimizer shards); `saving`: how
  every rank saves — the host snapshot, the writer (inline, or in the background with
  `checkpoint.async`), the agreement and the commit, and a failed save.
* `state`: the model's state and the RNGs <-> plain data; `optimizer_state`: the optimizer's
  state in either saved form (unsharded arrays, per-rank shard files) and any layout;
  `experts`: expert-parallel tensors whole on disk, sliced in memory; `adapters`: LoRA adapter
  files in PaddleFormers' format.
* `export` / `merge_export`: a run as a Hugging Face directory (streamed, stage by stage).
"""
