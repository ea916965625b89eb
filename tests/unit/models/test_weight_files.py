"""`flashcp.models.weight_files`: the one reader of a model's weights on disk (a file, a
single-file directory, a sharded directory) and the multi-token-prediction rules."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from flashcp.models.hf_mtp import missing_mtp_layers, mtp_layers_in
from flashcp.models.weight_files import (
    INDEX_FILE,
    SINGLE_FILE,
    checkpoint_keys,
    is_weight_file,
    locate,
    shard_file,
    write_index,
)

ONE = np.zeros(2, np.float32)


def _sharded(directory: Path, write: tuple[str, ...] = ("a", "b")) -> None:
    directory.mkdir()
    shards = {"a": ["model.embed_tokens.weight", "model.layers.0.x.weight"],
              "b": ["model.layers.1.x.weight", "model.norm.weight"]}  # fmt: skip
    weight_map = {k: f"model-{s}.safetensors" for s, keys in shards.items() for k in keys}
    for s in write:
        save_file({k: ONE for k in shards[s]}, str(directory / f"model-{s}.safetensors"))
    (directory / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))


def test_a_sharded_directory(tmp_path: Path) -> None:
    d = tmp_path / "m"
    _sharded(d)
    found = locate(d)
    assert found.path == str(d) and found.index == d / INDEX_FILE and found.single is None
    assert found.files == [d / "model-a.safetensors", d / "model-b.safetensors"]
    assert found.key_files["model.norm.weight"] == d / "model-b.safetensors"


def test_written_shard_names_and_index_read_back_by_locate(tmp_path: Path) -> None:
    """The writers' names (`shard_file`, `write_index`) are the ones `locate` reads, and the
    stale-file sweep (`is_weight_file`) takes exactly a save's weight files."""
    names = [shard_file(i, 3) for i in range(3)]
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    weight_map = {f"model.layers.{i}.x.weight": names[i] for i in range(3)}
    for key, name in weight_map.items():
        save_file({key: ONE}, str(tmp_path / name))
    write_index(tmp_path, weight_map, 3 * ONE.nbytes)
    found = locate(tmp_path)
    assert found.index == tmp_path / INDEX_FILE
    assert found.files == [tmp_path / n for n in names]
    assert {k: p.name for k, p in found.key_files.items()} == weight_map
    assert json.loads(found.index.read_text())["metadata"] == {"total_size": 3 * ONE.nbytes}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*names, INDEX_FILE])  # no .tmp
    assert all(is_weight_file(n) for n in [SINGLE_FILE, *names, shard_file(99998, 99999)])
    kept = [INDEX_FILE, "model-1-of-2.safetensors", f"{names[0]}.tmp", "model-a.safetensors",
            "optimizer-00001-of-00001.safetensors", "peft_model-00001-of-00001.safetensors"]
    assert not any(is_weight_file(n) for n in kept)


def test_a_missing_shard_is_named_for_a_load_and_ignored_for_the_key_list(tmp_path: Path) -> None:
    d = tmp_path / "m"
    _sharded(d, write=("a",))
    with pytest.raises(FileNotFoundError) as info:
        locate(d)
    assert str(info.value) == (
        f"{d / INDEX_FILE} maps 2 tensors (e.g. model.layers.1.x.weight) to model-b.safetensors, "
        f"which does not exist in {d}: download the missing shard, or point at a complete "
        "checkpoint"
    )
    assert checkpoint_keys(d) == sorted(json.loads((d / INDEX_FILE).read_text())["weight_map"])


def test_a_single_file_its_header_read_and_closed(tmp_path: Path) -> None:
    save_file({"model.norm.weight": ONE, "lm_head.weight": ONE}, str(tmp_path / SINGLE_FILE))
    found = locate(tmp_path)
    assert found.path == str(tmp_path) and found.index is None
    assert found.files == [tmp_path / SINGLE_FILE] and found.single is not None
    found.single.close()
    before = len(os.listdir("/proc/self/fd"))
    assert checkpoint_keys(tmp_path) == ["lm_head.weight", "model.norm.weight"]
    assert len(os.listdir("/proc/self/fd")) == before  # the header's file is closed again
    assert locate(tmp_path / SINGLE_FILE).key_files.keys() == found.key_files.keys()


def test_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError) as info:
        locate(empty)
    assert str(info.value) == (
        f"{empty} has no {SINGLE_FILE} or {INDEX_FILE}: point at one file or add the index (or "
        "download the weights)"
    )
    for name in ("x", "y"):
        save_file({"w": ONE}, str(empty / f"{name}.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"index.json and 2 other .safetensors files: "):
        locate(empty)
    with pytest.raises(FileNotFoundError, match="checkpoint .*nowhere does not exist"):
        locate(tmp_path / "nowhere")


def test_the_mtp_rules() -> None:
    keys = ["model.layers.3.eh_proj.weight", "model.layers.3.mlp.w", "model.layers.5.mlp.w",
            "model.layers.1.mlp.w"]  # fmt: skip
    assert missing_mtp_layers(keys, 3, 2) == [4]  # layer 3 is there, layer 4 is not
    assert missing_mtp_layers(keys, 2, 2) == [2]
    assert mtp_layers_in(keys, 3) == {3}  # layer 5 has no eh_proj: a plain deeper layer
    assert mtp_layers_in(keys, 4) == set()
