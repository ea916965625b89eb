"""One table of bad inputs: each gives a clear error naming the problem, before any compute.

Every row is (id, where the input enters, the input, the exception or exit code, a regex the
message must match). Entry points, all public:

* `cli`: `flashcp train CONFIG OVERRIDES` (`flashcp.cli.main`) with an environment; the job is
  never launched (`launch_command` would fail the test).
* `worker`: one rank of a launched job (`flashcp.launch.worker.main`) under a fake launcher
  environment; it must return before the distributed runtime starts (`init_distributed` would
  fail the test).
* For both, `run.output_dir` already holds a real earlier run (trained once per module: a
  checkpoint, metrics.jsonl, config.yaml, its log), and nothing may be lost: after the refusal
  it and everything else in the test's directory are byte-identical to before, no file or
  directory added. The current directory is the test's (`{tmp}` in patterns; `{out}`: the run).
* `call`: a library call (masks, attention, CP attention, dispatch, fault specs); the kernel and
  the FlashAttention dispatch must not be reached (both replaced by failing stand-ins).
"""

from __future__ import annotations

import re
import shutil
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import pytest

import flashcp.distributed
from flashcp import cli as flashcp_cli
from flashcp import fa_dispatch, faults, mask_indices, masks
from flashcp.attention.allgather_kv import flashmask_attention_cp
from flashcp.attention.flashmask import flashmask_attention
from flashcp.checkpoint.format import verify_checkpoint
from flashcp.config import load_config
from flashcp.kernels import registry
from flashcp.launch import job
from flashcp.launch import worker as rank_entry
from flashcp.metrics.writer import read_metrics
from flashcp.trainer import Trainer
from helpers.paths import ROOT

CONFIG = str(ROOT / "configs" / "gpt" / "tiny_cp2.yaml")
PORT = "@port"
"""Placeholder in a row's environment: a port some socket is listening on."""


@dataclass(frozen=True)
class Row:
    """One bad input and what it must produce."""

    id: str
    entry: str
    """`cli`, `worker` or `call`."""
    args: Any
    """cli/worker: overrides (`{tmp}`: the test's directory, `{out}`: the default
    run.output_dir); call: a zero-argument callable."""
    expect: type[BaseException] | int
    """The exception (call) or exit code (cli, worker)."""
    match: str
    """Regex the error message must match."""
    env: dict[str, str] = field(default_factory=dict)
    config: str | None = None
    """cli/worker: config file text (written to `{tmp}/config.yaml`), `missing`, `@<path>` (a
    shipped config, relative to the repository), or the tiny GPT config when None."""


# -- inputs for `call` rows -------------------------------------------------------------------


def _idx(*shape: int, fill: int = 0, dtype: Any = np.int32, at: tuple | None = None,
         value: int = 0) -> np.ndarray:  # fmt: skip
    out = np.full(shape, fill, dtype=dtype)
    if at is not None:
        out[at] = value
    return out


def _validate(idx: np.ndarray, **kw: Any) -> Callable[[], Any]:
    return lambda: mask_indices.validate(idx, **kw)


def _qkv(
    hq: int = 4, hkv: int = 2, s: int = 8, d: int = 8, dtype: str = "float32", b: int = 2
) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    rng = np.random.default_rng(0)
    return tuple(
        paddle.to_tensor(rng.standard_normal((b, s, h, d)).astype("float32")).astype(dtype)
        for h in (hq, hkv, hkv)
    )


def _attn(
    q_: dict | None = None,
    k_: dict | None = None,
    mask: np.ndarray | None = None,
    **kw: Any,
) -> Callable[[], Any]:
    def call() -> Any:
        q, _, _ = _qkv(**(q_ or {}))
        _, k, v = _qkv(**(k_ or {}))
        m = None if mask is None else paddle.to_tensor(mask)
        return flashmask_attention(q, k, v, m, causal=kw.pop("causal", True), **kw)

    return call


def _cp(q_: dict | None = None, k_: dict | None = None, mask: Any = "causal",
        **kw: Any) -> Callable[[], Any]:  # fmt: skip
    def call() -> Any:
        q, _, _ = _qkv(**(q_ or {}))
        _, k, v = _qkv(**(k_ or {}))
        m = masks.causal_mask(2, 8).indices if isinstance(mask, str) else mask
        return flashmask_attention_cp(q, k, v, m, causal=True, **kw)

    return call


def _explain(requested: Any = 2, policy: str = "error", head_dim: int = 64) -> Callable[[], Any]:
    return lambda: fa_dispatch.explain_fa_version(
        requested,
        fa4_available=False,
        block_mask_api=False,
        deterministic=True,
        head_dim=head_dim,
        fa4_unavailable=policy,
    )


# -- the table --------------------------------------------------------------------------------

E = 2  # exit code of a bad config / a job that cannot launch


def cli(id: str, overrides: list[str], match: str, env: dict[str, str] | None = None,
        config: str | None = None) -> Row:  # fmt: skip
    """`flashcp train CONFIG OVERRIDES` must exit 2 before launching."""
    return Row(id, "cli", overrides, E, match, env or {}, config)


def worker(id: str, env: dict[str, str], match: str, overrides: list[str] | None = None,
           config: str | None = None) -> Row:  # fmt: skip
    """One launched rank (`flashcp/train.py`) must exit 2 before distributed init."""
    return Row(id, "worker", overrides or [], E, match, env, config)


def call(id: str, fn: Callable[[], Any], exc: type[BaseException], match: str) -> Row:
    """A library call must raise `exc` before the kernel or the dispatch run."""
    return Row(id, "call", fn, exc, match)


W2 = {"PADDLE_TRAINERS_NUM": "2"}

# fmt: off
ROWS = [
    # -- configs: keys, types, values ----------------------------------------------------------
    cli("unknown_key", ["train.stepz=3"],
        r"train\.stepz: unknown key \(did you mean steps\?\) "
        r"\[set on the command line: train\.stepz=3\]"),
    cli("unknown_section", ["trian.steps=3"],
        r"trian: unknown section \(did you mean train\?\)"),
    cli("type_number", ["train.lr=fast"],
        r"train\.lr: expected a number, got 'fast' \(a string\) "
        r"\[set on the command line: train\.lr=fast\]"),
    cli("type_integer", ["train.steps=2.5"],
        r"train\.steps: expected an integer, got 2\.5 \(a number\) "
        r"\[set on the command line: train\.steps=2\.5\]"),
    cli("type_bool", ["train.deterministic=maybe"],
        r"train\.deterministic: expected true or false, got 'maybe' \(a string\)"),
    cli("bad_cp_mode", ["parallel.cp_mode=ring"],
        r"parallel\.cp_mode: expected one of 'dualchunk_allgather', 'contiguous_allgather', "
        r"'workload_balanced', got 'ring'"),
    cli("seq_len_vs_2cp", ["data.seq_len=250"],
        r"data\.seq_len: 250 is not a multiple of 2·cp = 4 \(parallel\.cp_mode "
        r"dualchunk_allgather, parallel\.cp 2\): set data\.seq_len=252, or set "
        r"parallel\.pad=true"),
    cli("seq_len_vs_4cp_balanced", ["parallel.cp_mode=workload_balanced", "data.seq_len=252"],
        r"data\.seq_len: 252 is not a multiple of 4·cp = 8 \(parallel\.cp_mode workload_balanced, "
        r"parallel\.cp 2\): set data\.seq_len=256, or set parallel\.pad=true"),
    cli("seq_len_vs_cp_contiguous", ["parallel.cp_mode=contiguous_allgather", "parallel.cp=3"],
        r"data\.seq_len: 256 is not a multiple of cp = 3 \(parallel\.cp_mode contiguous_allgather, "
        r"parallel\.cp 3\): set data\.seq_len=255\n"),  # 258 (or padding) > max_seq_len 256
    cli("heads_vs_gqa", ["model.num_heads=8", "model.num_kv_heads=3"],
        r"model\.num_heads: num_heads 8 is not a multiple of num_kv_heads 3: grouped-query "
        r"attention shares each KV head among num_heads / num_kv_heads query heads"),
    cli("layers_vs_stages", ["parallel.pp=3"],
        r"model\.num_layers: 2 layers cannot fill parallel\.pp = 3 pipeline stages: set "
        r"parallel\.pp=2, or set model\.num_layers=3"),
    cli("bad_fa_policy", ["attention.fa4_unavailable=maybe"],
        r"attention\.fa4_unavailable: expected one of 'error', 'fallback' or null, got 'maybe'"),
    cli("bad_on_nonfinite", ["train.on_nonfinite=ignore"],
        r"train\.on_nonfinite: expected one of 'stop', 'skip', got 'ignore'"),
    cli("negative_lr", ["train.lr=-1"],
        r"train\.lr: must be > 0, got -1\.0 \[set on the command line: train\.lr=-1\]"),
    cli("min_lr_above_lr", ["train.min_lr=1.0"],
        r"train\.min_lr: 1\.0 is above train\.lr 0\.003 \(the decay's floor\): set "
        r"train\.min_lr=null, or set train\.min_lr=0\.003"),
    cli("zero_dp", ["parallel.dp=0"],
        r"parallel\.dp: must be an integer >= 1, got 0 "
        r"\[set on the command line: parallel\.dp=0\]"),
    cli("zero_micro_batch", ["data.micro_batch_size=0"],
        r"data\.micro_batch_size: must be >= 1, got 0"),
    cli("vocab_vs_tokenizer", ["model.vocab_size=100"],
        r"model\.vocab_size: 100 is smaller than the byte tokenizer's 259 ids: set "
        r"model\.vocab_size=259"),
    cli("seq_len_vs_max", ["data.seq_len=4096"],
        r"data\.seq_len: data\.seq_len 4096 exceeds model\.max_seq_len 256: set "
        r"data\.seq_len=256, or set model\.max_seq_len=4096"),
    cli("bf16_on_cpu", ["train.dtype=bfloat16", "run.device=cpu"],
        r"train\.dtype: bfloat16 needs a GPU \(run\.device is cpu\): set train\.dtype=auto, or "
        r"set train\.dtype=float32 \[set on the command line"),  # no GPU here: not run.device=gpu
    cli("core_section_null", ["train=null"],
        r"train: train=null: the train section is not optional and cannot be removed \(null "
        r"would silently reset every train\.\* key to its default\): set the train\.\* keys you "
        r"want to change instead"),
    cli("unknown_recipe", ["run.recipe=pretrian"],
        r"run\.recipe: unknown recipe 'pretrian' \(did you mean pretrain\?\)"),
    cli("unknown_preset", ["model.preset=huge"],
        r"model\.preset: unknown preset 'huge' \(presets: ernie45_0p3b, .*\btiny\b"),
    cli("malformed_override", ["train.steps"],
        r"train\.steps: override 'train\.steps' is not of the form key\.sub=value "
        r"\(e\.g\. train\.steps=10\)"),
    cli("resume_missing", ["checkpoint.resume={tmp}/no_ckpt"],
        r"checkpoint\.resume: '{tmp}/no_ckpt' is not 'auto', 'never' or an existing checkpoint "
        r"directory"),
    cli("tokenizer_missing", ["data.tokenizer={tmp}/tok.json"],
        r"data\.tokenizer: '{tmp}/tok\.json' is neither 'byte', a tokenizer\.json file nor a "
        r"directory holding one"),
    cli("config_missing", [],
        r"<file>: cannot read {tmp}/missing\.yaml: No such file or directory", config="missing"),
    cli("config_not_yaml", [],
        r"\Aconfig problem in {tmp}/config\.yaml: <file>: not valid YAML: while parsing a "
        r"flow node", config="model: [1,\n"),
    cli("config_not_mapping", [],
        r"<file>: the top level must be a mapping of sections, got a list", config="- 1\n"),
    cli("config_no_model", [],
        r"model: required section is missing: give model\.preset \(one of .*\btiny\b.*\) and/or "
        r"every ModelArgs field", config="train:\n  steps: 2\n"),
    cli("shard_optimizer_vs_dump_grads",
        ["parallel.shard_optimizer=true", "debug.dump_grads=true"],
        r"debug\.dump_grads: needs the full summed gradients, but under "
        r"parallel\.shard_optimizer: true each rank keeps only its shard of them: set "
        r"debug\.dump_grads=false, or set parallel\.shard_optimizer=false"),
    cli("overwrite_not_bool", ["run.overwrite=maybe"],
        r"run\.overwrite: expected true or false, got 'maybe' \(a string\)"),
    cli("overwrite_resume_inside_output_dir",
        ["run.overwrite=true", "checkpoint.resume={out}/checkpoints/step_2"],
        r"run\.overwrite: true moves run\.output_dir {out} aside before the run, but "
        r"checkpoint\.resume '{out}/checkpoints/step_2' is inside it: set run\.overwrite=false, "
        r"or resume from a checkpoint outside run\.output_dir"),
    # -- launch: data file, output dir, port, FlashAttention flags (before launching) ----------
    cli("missing_data_file", ["data.path={tmp}/no_such.jsonl"],
        r"data\.path: no file or directory at '{tmp}/no_such\.jsonl': give a JSON Lines or "
        r"Parquet file \(or a directory of them\), or null for the built-in data"),
    cli("data_path_is_dir", ["data.path={tmp}"],
        r"data\.path: the directory '{tmp}' holds no \.jsonl, \.json or \.parquet files: give a "
        r"data file or a directory of them, or null for the built-in data"),
    cli("data_path_not_jsonl_or_parquet", ["data.path={tmp}/a_file"],
        r"data\.path: '{tmp}/a_file' is not a JSON Lines \(\.jsonl, \.json\) or Parquet "
        r"\(\.parquet\) file: give one of those, a directory of them, or null for the built-in "
        r"data"),
    cli("data_in_no_format", ["data.path={tmp}/data/no_text.jsonl"],
        r"data\.path: {tmp}/data/no_text\.jsonl: none of the 2 rows sampled is in a format "
        r"run\.recipe pretrain reads \(`text`: a string\): the rows' fields are txt \(string\); "
        r"to read them set data\.text_field=txt"),
    cli("bf16_without_a_gpu", ["train.dtype=bfloat16"],
        r"train\.dtype: bfloat16 needs a GPU and this run is on CPU: set train\.dtype=auto, or "
        r"set train\.dtype=float32"),
    cli("gpu_device_without_a_gpu", ["run.device=gpu"],
        r"run\.device: gpu, but Paddle sees no GPU here \(CPU build or no device\): set "
        r"run\.device=auto, or set run\.device=cpu"),
    cli("on_bad_record_unknown", ["data.on_bad_record=ignore"],
        r"data\.on_bad_record: expected one of"),
    cli("output_dir_under_a_file", ["run.output_dir={tmp}/a_file/out"],
        r"run\.output_dir: {tmp}/a_file/out is not a writable directory: Not a directory "
        r"\({tmp}/a_file/out/logs\): set run\.output_dir to a directory you can write"),
    cli("output_dir_is_a_file", ["run.output_dir={tmp}/a_file"],
        r"run\.output_dir: {tmp}/a_file is not a writable directory: Not a directory "
        r"\({tmp}/a_file/logs\): set run\.output_dir to a directory you can write"),
    cli("output_dir_read_only_fs", ["run.output_dir=/proc/flashcp-out"],
        r"run\.output_dir: /proc/flashcp-out is not a writable directory: [^\n]+: set "
        r"run\.output_dir to a directory you can write"),
    cli("fresh_run_over_checkpoints", ["checkpoint.resume=never"],
        r"\Aflashcp: cannot launch: run\.output_dir: {out} already holds checkpoints \(step_2\) "
        r"and checkpoint\.resume is never: set checkpoint\.resume=auto to continue that run, "
        r"run\.overwrite=true to move it aside and start over, or choose another "
        r"run\.output_dir\n\Z"),
    cli("overwrite_would_move_the_cwd", ["run.overwrite=true", "run.output_dir={tmp}"],
        r"\Aflashcp: cannot launch: run\.output_dir: {tmp} holds the current directory, so "
        r"run\.overwrite=true cannot move it: run from another directory or choose another "
        r"run\.output_dir\n\Z"),
    cli("port_in_use", [],
        r"FLASHCP_MASTER_PORT: binding 127\.0\.0\.1:(\d+) is already in use \(another job or "
        r"service holds it\): pick a free port or unset FLASHCP_MASTER_PORT",
        env={"FLASHCP_MASTER_PORT": PORT}),
    cli("port_not_a_number", [],
        r"FLASHCP_MASTER_PORT: 'http' is not a port number \(1-65535\): set a free port or unset "
        r"it", env={"FLASHCP_MASTER_PORT": "http"}),
    cli("port_out_of_range", [],
        r"FLASHCP_MASTER_PORT: '70000' is not a port number \(1-65535\): set a free port or unset "
        r"it", env={"FLASHCP_MASTER_PORT": "70000"}),
    cli("fa_version_unknown", [],
        r"FlashAttention dispatch: FLAGS_flash_attn_version=7 is not a FlashAttention version: "
        r"set it to 2, 3 or 4", env={"FLAGS_flash_attn_version": "7"}),
    cli("fa_version_not_int", [],
        r"FLAGS_flash_attn_version='three' is not an integer: set it to 2, 3 or 4",
        env={"FLAGS_flash_attn_version": "three"}),
    cli("fa4_unavailable", [],
        r"FLAGS_flash_attn_version=4 asks for FA4, which is unavailable: it needs an SM100 GPU "
        r"with the paddlefleet_ops CuTe FlashMask kernels .*, and this machine has no CUDA "
        r"device\. Set FLAGS_flash_attn_version=2 \(FA2, Paddle's default\): FA3 is unavailable "
        r"too .*; or set FLASHCP_FA4_UNAVAILABLE=fallback \(or attention\.fa4_unavailable: "
        r"fallback\) to fall back to FA2 with a warning \(the policy is 'error', from the default",
        env={"FLAGS_flash_attn_version": "4"}),
    # -- conventions, evaluation, tracking ------------------------------------------------------
    cli("alias_and_key", ["max_steps=3", "train.steps=4"],
        r"max_steps: is an alias of train\.steps, which is also set on the command line: keep "
        r"one of max_steps and train\.steps"),
    cli("alias_and_key_in_file", [],
        r"learning_rate: is an alias of train\.lr, which is also set: keep one of "
        r"learning_rate and train\.lr",
        config="model:\n  preset: tiny\ntrain:\n  lr: 0.001\nlearning_rate: 0.002\n"),
    cli("alias_inside_a_section", ["train.max_steps=3"],
        r"train\.max_steps: unknown key: max_steps is an alias of train\.steps, accepted at the "
        r"top level of the file or as the override max_steps=VALUE, not inside a section"),
    cli("eval_path_missing", ["eval.path={tmp}/no_eval.jsonl"],
        r"eval\.path: no file at '{tmp}/no_eval\.jsonl': give a file in the training data's "
        r"format, or null for no evaluation"),
    cli("eval_every_negative", ["eval.every=-1"],
        r"eval\.every: must be >= 0 \(0 = only after the last step\), got -1"),
    cli("eval_max_batches_zero", ["eval.max_batches=0"],
        r"eval\.max_batches: must be >= 1 or null \(one pass\), got 0"),
    cli("report_to_missing_package", ["run.report_to=[jsonl,wandb]"],
        r"run\.report_to: 'wandb' needs the wandb package, which is not installed here: pip "
        r"install wandb, or remove 'wandb' from run\.report_to"),
    cli("report_to_unknown", ["run.report_to=[mlflow]"],
        r"run\.report_to: unknown backend 'mlflow' \(backends: jsonl, tensorboard, visualdl, "
        r"wandb\)"),
    cli("peak_tflops_zero", ["hardware.peak_tflops=0"],
        r"hardware\.peak_tflops: must be > 0 or null \(no MFU\), got 0\.0"),
    # -- shipped GPU recipes: their /path/to/... placeholders, still to fill in ----------------
    cli("recipe_model_placeholder", [],
        r"model\.from_pretrained: '/path/to/GLM-4-9B-0414' is a placeholder still to fill in "
        r"\(in the file, or as model\.from_pretrained=DIR on the command line\) with a Hugging "
        r"Face model directory holding config\.json, the safetensors weights "
        r"\(model\.safetensors, or model\.safetensors\.index\.json and its shards\) and "
        r"tokenizer\.json \+ tokenizer_config\.json", config="@configs/glm/glm4_9b_cp8.yaml"),
    cli("recipe_sft_data_placeholder", [],
        r"data\.path: '/path/to/sft_messages\.jsonl' is a placeholder still to fill in \(in the "
        r"file, or as data\.path=PATH on the command line\) with a JSON Lines \(\.jsonl\) or "
        r"Parquet \(\.parquet\) file \(or a directory of them\) of conversations, a 'messages' "
        r"list of \{\"role\", \"content\"\} messages per record \(loss on the assistant turns",
        config="@configs/glm/glm45_air_cp8.yaml"),
    cli("recipe_dpo_data_placeholder_override", ["data.path=/path/to/my_prefs.jsonl"],
        r"data\.path: '/path/to/my_prefs\.jsonl' is a placeholder still to fill in .* of "
        r"preference records, 'prompt', 'chosen' and 'rejected' strings .* \[set on the command "
        r"line: data\.path=/path/to/my_prefs\.jsonl\]",
        config="@configs/glm/glm4_9b_dpo_lora_pp2_cp4.yaml"),
    cli("eval_path_placeholder", ["eval.path=/path/to/heldout.jsonl"],
        r"eval\.path: '/path/to/heldout\.jsonl' is a placeholder still to fill in .* with "
        r"held-out data in the training data's format \(a JSON Lines .* of documents with a "
        r"'text' field\), or null"),
    # -- more than one node (before launching) -------------------------------------------------
    cli("nnodes_indivisible", ["--nnodes", "3", "--master", "127.0.0.1:29500"],
        r"parallel: dp\(1\) × pp\(1\) × cp\(2\) = 2 processes cannot be split over --nnodes 3 "
        r"nodes \(dp·pp·cp must equal nnodes × nproc_per_node, a multiple of 3\): set "
        r"parallel\.dp=3, or use another --nnodes"),
    cli("node_rank_out_of_range", ["--nnodes", "2", "--node-rank", "2", "--master", "h:1"],
        r"flashcp train: --node-rank 2 is not in 0\.\.1 \(--nnodes 2\): number the nodes 0, 1, "
        r"\.\.\. and start node 0 first"),
    cli("nnodes_without_master", ["--nnodes", "2"],
        r"flashcp train: --nnodes 2 needs --master HOST:PORT: node 0's address and a free port, "
        r"given the same on every node"),
    cli("master_not_host_port", ["--nnodes", "2", "--master", "node0"],
        r"flashcp: cannot launch: --master: 'node0' is not HOST:PORT \(a port 1-65535; a "
        r"hostname or IPv4 address, as Paddle's launcher reads it\): give node 0's address and "
        r"a free port, the same on every node"),
    cli("master_unreachable", ["--nnodes", "2", "--node-rank", "1", "--master", "127.0.0.1:1"],
        r"flashcp: cannot launch: --master: node 1: node 0's launcher \(--master "
        r"127\.0\.0\.1:1\) at 127\.0\.0\.1:1 did not accept connections within 0\.5 s .*: "
        r"start node 0 first "
        r"\(`flashcp train CONFIG --nnodes 2 --node-rank 0 --master 127\.0\.0\.1:1`\)",
        env={"FLASHCP_INIT_TIMEOUT": "0.5"}),
    # -- one rank of a launched job ------------------------------------------------------------
    worker("world_size_mismatch", {"PADDLE_TRAINERS_NUM": "4"},
           r"parallel: dp\(1\) × pp\(1\) × cp\(2\) = 2 but the job has 4 processes: set "
           r"parallel\.cp=4, or set parallel\.dp=2, or launch with --nproc_per_node 2"),
    worker("world_size_vs_nodes", {"PADDLE_TRAINERS_NUM": "4", "PADDLE_NNODES": "2"},
           r"parallel: dp\(1\) × pp\(1\) × cp\(2\) = 2 but the job has 4 processes \(2 nodes × 2 "
           r"per node\): set parallel\.cp=4, or set parallel\.dp=2, or launch with --nnodes "
           r"2 --nproc_per_node 1"),
    worker("world_size_indivisible", {"PADDLE_TRAINERS_NUM": "3"},
           r"parallel: dp\(1\) × pp\(1\) × cp\(2\) = 2 but the job has 3 processes: set "
           r"parallel\.cp=3 data\.seq_len=252, or launch with --nproc_per_node 2"),
    worker("worker_bad_override", W2,
           r"train\.lr: expected a number, got 'fast' \(a string\) \[set on the command line: "
           r"train\.lr=fast\]", ["train.lr=fast"]),
    worker("fault_unknown_kind", {**W2, "FLASHCP_FAULT": "explode@step1"},
           r"FLASHCP_FAULT: unknown fault kind 'explode' in 'explode@step1': use one of "
           r"nan_loss, inf_loss, nan_grad, sigkill, crash_in_checkpoint_write"),
    worker("fault_bad_syntax", {**W2, "FLASHCP_FAULT": "nan_loss:step3"},
           r"FLASHCP_FAULT: cannot parse 'nan_loss:step3': expected "
           r"KIND@stepN\[:rankR\]\[:attemptA\] \(e\.g\. nan_loss@step3:rank1\)"),
    worker("worker_fresh_run_over_checkpoints", W2,
           r"\Arun\.output_dir: {out} already holds checkpoints \(step_2\) and checkpoint\.resume "
           r"is never: set checkpoint\.resume=auto to continue that run, run\.overwrite=true to "
           r"move it aside and start over, or choose another run\.output_dir\n\Z",
           ["checkpoint.resume=never"]),
    worker("worker_overwrite_over_an_earlier_run", W2,
           r"\Arun\.output_dir: {out} holds an earlier run "
           r"\(checkpoints, config\.yaml, goodput\.json, metrics\.jsonl, run_info\.json\) and "
           r"run\.overwrite is true: "
           r"`flashcp train` "
           r"moves it aside before launching, the ranks of a job started by "
           r"paddle\.distributed\.launch do not: run "
           r"`flashcp train CONFIG run\.overwrite=true`, or move {out} away yourself\n\Z",
           ["run.overwrite=true"]),
    worker("worker_fa4_unavailable", {**W2, "FLAGS_flash_attn_version": "4"},
           r"FlashAttention dispatch: FLAGS_flash_attn_version=4 asks for FA4, which is "
           r"unavailable: .*the policy is 'error', from the default"),
    worker("worker_data_in_no_format", W2,
           r"data\.path: {tmp}/data/no_text\.jsonl: none of the 2 rows sampled is in a format",
           ["data.path={tmp}/data/no_text.jsonl"]),
    worker("worker_recipe_placeholder", {"PADDLE_TRAINERS_NUM": "16"},
           r"model\.from_pretrained: '/path/to/GLM-4\.5-Air' is a placeholder still to fill in",
           config="@configs/glm/glm45_air_dpo_lora_pp_cp.yaml"),
    # -- masks (flashcp.mask_indices.validate, CP attention's global mask) ---------------------
    call("mask_int64", _validate(_idx(1, 1, 8, 1, dtype=np.int64), causal=True),
         ValueError, r"startend_row_indices must be int32, got int64; cast it with "
                     r"\.astype\(np\.int32\)"),
    call("mask_float", _validate(_idx(1, 1, 8, 1, dtype=np.float32), causal=True),
         ValueError, r"startend_row_indices must be int32, got float32; cast it with "
                     r"\.astype\(np\.int32\)"),
    call("mask_rank3", _validate(_idx(1, 8, 1), causal=True),
         ValueError, r"startend_row_indices must be rank 4 \[B, Hm, Sk, C\], got shape "
                     r"\(1, 8, 1\); add the missing axes"),
    call("mask_rank5", _validate(_idx(1, 1, 8, 1, 1), causal=True),
         ValueError, r"startend_row_indices must be rank 4 \[B, Hm, Sk, C\], got shape "
                     r"\(1, 1, 8, 1, 1\)"),
    call("mask_batch", _validate(_idx(1, 1, 8, 1), causal=True, batch=2),
         ValueError, r"startend_row_indices has batch 1 \(shape \(1, 1, 8, 1\)\) but the query "
                     r"batch is 2; build one mask row per sequence"),
    call("mask_key_len", _validate(_idx(1, 1, 8, 1), causal=True, k_len=12),
         ValueError, r"has Sk=8 key columns \(shape \(1, 1, 8, 1\)\) but the key length is 12; "
                     r"it needs one entry per key position"),
    call("mask_heads", _validate(_idx(1, 3, 8, 1), causal=True, num_q_heads=8, num_kv_heads=2),
         ValueError, r"has Hm=3 mask heads \(shape \(1, 3, 8, 1\)\); it must be one of "
                     r"\[1, 2, 8\]"),
    call("mask_causal_4_columns", _validate(_idx(1, 1, 8, 4), causal=True),
         ValueError, r"has C=4 columns \(shape \(1, 1, 8, 4\)\), which is not valid with "
                     r"causal=True: it needs C in \(1, 2\)"),
    call("mask_noncausal_1_column", _validate(_idx(1, 1, 8, 1), causal=False),
         ValueError, r"has C=1 columns \(shape \(1, 1, 8, 1\)\), which is not valid with "
                     r"causal=False: it needs C in \(2, 4\)\..*\(to_noncausal converts\)"),
    call("mask_range_unordered_beyond_sq",  # 300 reads as Sq = 8 (upstream), still > LTE 5
         _validate(_idx(1, 1, 8, 2, fill=5, at=(0, 0, 3, 0), value=300), causal=True),
         ValueError, r"LTS > LTE \(300 > 5, first at \[b, h, j, c\] = \[0, 0, 3, 0\], 1 bad "
                     r"entries in all\); a masked range is \[LTS, LTE\), write an empty one as "
                     r"LTS = LTE"),
    call("mask_value_negative",
         _validate(_idx(1, 1, 8, 2, at=(0, 0, 1, 1), value=-1), causal=False),
         ValueError, r"value -1 is negative \(first at \[b, h, j, c\] = \[0, 0, 1, 1\], 1 bad "
                     r"entries in all\); values are query-row thresholds >= 0 .*: write 0 for "
                     r"the first row"),
    call("mask_range_unordered",
         _validate(_idx(1, 1, 8, 2, fill=5, at=(0, 0, 2, 0), value=7), causal=True),
         ValueError, r"has LTS > LTE \(7 > 5, first at \[b, h, j, c\] = \[0, 0, 2, 0\], 1 bad "
                     r"entries in all\); a masked range is \[LTS, LTE\), write an empty one as "
                     r"LTS = LTE"),
    call("cp_mask_local_not_global", _cp(mask=masks.causal_mask(2, 4).indices),
         ValueError, r"covers 4 keys but the global sequence is 8 \(local 8 × cp 1\): pass the "
                     r"GLOBAL mask on every rank"),
    call("cp_mask_missing", _cp(mask=None),
         ValueError, r"flashmask_attention_cp needs the global startend_row_indices .*build one "
                     r"with flashcp\.masks\.causal_mask\(batch, seq_len\)"),
    # -- tensors (flashmask_attention, flashmask_attention_cp) ---------------------------------
    call("fp16_on_cpu", _attn(q_={"dtype": "float16"}, k_={"dtype": "float16"}),
         TypeError, r"q, k, v dtypes \{'q': 'float16', 'k': 'float16', 'v': 'float16'\} on "
                    r"cpu: they must share one dtype from \('float32', 'float64'\) \(the CPU "
                    r"reference kernel\); cast with x\.astype"),
    call("gqa_heads", _attn(q_={"hq": 4}, k_={"hkv": 3}),
         ValueError, r"q has 4 heads and k/v have 3: the query heads must be a multiple of the "
                     r"KV heads \(GQA\)"),
    call("head_dim_mismatch", _attn(k_={"d": 4}),
         ValueError, r"q and k head_dim differ: q \(2, 8, 4, 8\), k \(2, 8, 2, 4\) \(axis 3 must "
                     r"match\)"),
    call("batch_mismatch", _attn(k_={"b": 1}),
         ValueError, r"batch sizes differ: q \(2, 8, 4, 8\), k \(1, 8, 2, 8\), v \(1, 8, 2, 8\) "
                     r"\(axis 0 must match\)"),
    call("attention_mask_int64", _attn(mask=_idx(2, 1, 8, 1, fill=8, dtype=np.int64)),
         ValueError, r"startend_row_indices must be int32, got int64; cast it with "
                     r"\.astype\(np\.int32\)"),
    call("attention_dropout", _attn(dropout=0.1),
         NotImplementedError, r"dropout=0\.1: flashcp's FlashMask attention does not implement "
                              r"attention dropout .*Use dropout=0\.0"),
    call("cp_gqa_heads", _cp(q_={"hq": 4}, k_={"hkv": 3}),
         ValueError, r"query heads \(4\) must be a multiple of key/value heads \(3\) for GQA"),
    call("cp_dropout", _cp(dropout=0.1),
         NotImplementedError, r"dropout=0\.1: attention dropout is not supported under context "
                              r"parallelism \(set the attention dropout to 0\)"),
    # -- FlashAttention dispatch, fault specs --------------------------------------------------
    call("fa_version_5", _explain(5),
         ValueError, r"FLAGS_flash_attn_version=5 is not a FlashAttention version: set it to "
                     r"2, 3 or 4"),
    call("fa_policy_unknown", _explain(policy="maybe"),
         ValueError, r"fa4_unavailable='maybe' is not a policy: use one of error, fallback"),
    call("fa_head_dim_zero", _explain(head_dim=0),
         ValueError, r"head_dim=0 must be a positive int \(q\.shape\[-1\]\)"),
    call("fault_step_zero", lambda: faults.parse_faults("nan_loss@step0"),
         faults.FaultSpecError, r"FLASHCP_FAULT: 'nan_loss@step0': steps count from 1 "
                                r"\(use @step1 or later\)"),
]
# fmt: on


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port with a listening socket on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield int(sock.getsockname()[1])


def _fail(what: str) -> Callable[..., Any]:
    def boom(*_a: Any, **_k: Any) -> Any:
        raise AssertionError(f"{what} ran before the bad input was reported")

    return boom


def _tree(root: Path) -> dict[str, bytes | str | None]:
    """Everything under `root` by relative path: a file's bytes, a link's target, None for a
    directory (so a new empty directory counts as a change too)."""
    tree: dict[str, bytes | str | None] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            tree[rel] = str(path.readlink())
        elif path.is_dir():
            tree[rel] = None
        else:
            tree[rel] = path.read_bytes()
    return tree


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real earlier run each refused launch must leave untouched: the tiny GPT config trained
    for 2 steps in this process (cp=1), with its checkpoint (step_2), metrics.jsonl, config.yaml
    and its log (`logs/workerlog.0`: what the run printed)."""
    out = tmp_path_factory.mktemp("earlier") / "run"
    cfg = load_config(
        CONFIG, ["parallel.cp=1", "train.steps=2", "checkpoint.every=2", f"run.output_dir={out}"]
    )
    (out / "logs").mkdir(parents=True)
    with open(out / "logs" / "workerlog.0", "w") as log:
        Trainer(cfg, stream=log).fit()
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert verify_checkpoint(out / "checkpoints" / "step_2") == []
    assert "step 2/2" in (out / "logs" / "workerlog.0").read_text()
    return out


def _config_path(row: Row, tmp: Path) -> str:
    if row.config is None:
        return CONFIG
    if row.config == "missing":
        return str(tmp / "missing.yaml")
    if row.config.startswith("@"):
        return str(ROOT / row.config[1:])
    path = tmp / "config.yaml"
    path.write_text(row.config)
    return str(path)


COUNTS = {"cli": 69, "worker": 11, "call": 26}
"""Rows per entry point (docs/reliability.md quotes the total)."""


def test_table_size_is_exact_and_covers_every_entry() -> None:
    assert len(ROWS) == sum(COUNTS.values()) == 106
    assert {e: sum(r.entry == e for r in ROWS) for e in COUNTS} == COUNTS
    assert len({r.id for r in ROWS}) == len(ROWS)


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
def test_bad_input(
    row: Row,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    busy_port: int,
    earlier_run: Path,
) -> None:
    # nothing may get as far as compute: launching, distributed init, the kernel, dispatch
    monkeypatch.setattr(job, "launch_command", _fail("launching the job"))
    monkeypatch.setattr(flashcp.distributed, "init_distributed", _fail("init_distributed"))
    monkeypatch.setattr(registry, "get_backend", _fail("the attention kernel"))
    monkeypatch.setattr(fa_dispatch, "resolve_current", _fail("the FlashAttention dispatch"))
    for key in ("FLASHCP_MASTER_PORT", "FLAGS_flash_attn_version", "FLASHCP_FAULT",
                "FLASHCP_INIT_TIMEOUT", "PADDLE_NNODES"):
        monkeypatch.delenv(key, raising=False)
    for key, value in row.env.items():
        monkeypatch.setenv(key, str(busy_port) if value == PORT else value)
    (tmp_path / "a_file").write_text("not a directory")
    (tmp_path / "data").mkdir()  # (not in {tmp} itself: data.path={tmp} holds no data file)
    (tmp_path / "data" / "no_text.jsonl").write_text('{"txt": "a"}\n{"txt": "b"}\n')  # no 'text'


    if row.entry == "call":
        with pytest.raises(row.expect, match=row.match):  # type: ignore[arg-type]
            row.args()
        return

    # run.output_dir holds a real earlier run; the job starts in the test's directory
    out = tmp_path / "out"
    shutil.copytree(earlier_run, out, symlinks=True)
    monkeypatch.chdir(tmp_path)
    where = {"{tmp}": str(tmp_path), "{out}": str(out)}
    args = [_fill(a, where) for a in row.args]
    if not any(a.startswith("run.output_dir=") for a in args):
        args.append(f"run.output_dir={out}")
    config = _config_path(row, tmp_path)
    before = _tree(tmp_path)
    if row.entry == "cli":
        code = flashcp_cli.main(["train", config, *args])
    else:
        monkeypatch.setenv("PADDLE_TRAINER_ID", "0")
        code = rank_entry.main(["--config", config, *args])
    captured = capsys.readouterr()
    message = captured.err + captured.out
    assert code == row.expect, message
    pattern = _fill(row.match, {k: re.escape(v) for k, v in where.items()})
    assert re.search(pattern, message), f"{pattern!r} not in:\n{message}"
    assert "Traceback" not in message
    # nothing lost, nothing written: the earlier run (and all else here) byte for byte
    assert _tree(tmp_path) == before
    assert _tree(out) == _tree(earlier_run)


def _fill(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        text = text.replace(key, value)
    return text
