"""Streaming HF loading: each pipeline stage reads only its own tensors from a sharded
safetensors checkpoint, cast on read; the bytes it reads are counted at the read call.

The checkpoints are written by flashcp's HF save (split into shards so stages straddle shard
boundaries); the expected values come from `safetensors.safe_open` and Paddle's own cast, the
expected byte counts from the safetensors headers as read by `struct` here.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import paddle
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file as np_load_file
from safetensors.numpy import save_file as np_save_file

from flashcp.models import ModelArgs, build_model
from flashcp.models.hf_check import CheckpointMismatchError
from flashcp.models.hf_config import args_from_hf_config
from flashcp.models.hf_load import Float32Source, load_hf_checkpoint, read_hf_float32
from flashcp.models.hf_save import save_hf_checkpoint
from flashcp.models.hf_state import hf_state_map
from flashcp.models.safetensors_io import SafetensorsFormatError
from flashcp.pipeline.stage import stage_spec

DIMS = dict(
    vocab_size=256,
    hidden_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    qkv_bias=True,
    max_seq_len=64,
)
MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    num_shared_experts=1,
    first_k_dense_replace=1,
)
ITEMSIZE = {"F32": 4, "BF16": 2}
BOUND = 1.2  # bytes read per stage at most this × the stage's share (issue 11)


def _args(arch: str) -> ModelArgs:
    return ModelArgs(arch=arch, **DIMS, **(MOE if arch == "glm_moe" else {})).check()


def _stage(args: ModelArgs, stage: int, pp: int, dtype: str, seed: int = 1) -> paddle.nn.Layer:
    """One stage's module as the trainer places it (the full model's slice, its names)."""
    return build_model(args, stage=stage_spec(args, stage, pp), param_dtype=dtype, seed=seed)


def _write(root: Path, arch: str, file_dtype: str) -> tuple[Path, ModelArgs]:
    args = _args(arch)
    paddle.seed(123)
    source = build_model(args)
    if arch == "glm_moe":
        bias = source.model.layers[1].mlp.gate.e_score_correction_bias
        paddle.assign(paddle.to_tensor([0.1, -0.2, 0.3, 0.05]), output=bias)
    directory = root / f"{arch}-{file_dtype}"
    shard = 60_000 if file_dtype == "float32" else 30_000
    files = save_hf_checkpoint(source, directory, max_shard_bytes=shard, dtype=file_dtype)
    assert len(files) >= 5
    return directory, args


@pytest.fixture(scope="module", params=["glm", "glm_moe"])
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, arch: str) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {d: _write(root, arch, d)[0] for d in ("float32", "bfloat16")}


def _file_index(directory: Path) -> dict[str, tuple[Path, str, list[int]]]:
    """key → (file, dtype code, shape), from the index and safetensors itself."""
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())
    out = {}
    for key, name in weight_map["weight_map"].items():
        with safe_open(str(directory / name), framework="paddle") as f:
            piece = f.get_slice(key)
            out[key] = (directory / name, piece.get_dtype(), list(piece.get_shape()))
    return out


def _header_bytes(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def _expected(path: Path, key: str, dtype: paddle.dtype) -> np.ndarray:
    """The file's tensor in Paddle layout, cast by Paddle to `dtype` (bf16 as uint16 bits)."""
    with safe_open(str(path), framework="paddle") as f:
        t = f.get_tensor(key)
    if t.ndim == 2 and "embed_" not in key:  # HF Linear / router weights are [out, in]
        t = t.transpose([1, 0])
    return t.astype(dtype).numpy()


# ------------------------------------------------------------------------ per stage


@pytest.mark.parametrize("pp", [2, 3])
@pytest.mark.parametrize("file_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_each_stage_reads_only_its_tensors(
    checkpoints: dict[str, Path], arch: str, pp: int, file_dtype: str, param_dtype: str
) -> None:
    directory = checkpoints[file_dtype]
    files = _file_index(directory)
    index_bytes = (directory / "model.safetensors.index.json").stat().st_size
    all_files = {f for f, _, _ in files.values()}
    whole = index_bytes + sum(f.stat().st_size for f in all_files)
    stage_files: list[set[Path]] = []
    for s in range(pp):
        module = _stage(_args(arch), s, pp, param_dtype)
        # checkpoint keys: state-dict names, and per-expert keys of the stacked expert weights
        state = hf_state_map(module)
        report = load_hf_checkpoint(module, directory)
        assert sorted(report.loaded) == sorted(state)
        mine = {files[k][0] for k in state}
        stage_files.append(mine)
        params = {n for n, _ in module.named_parameters()}
        for key, entry in state.items():
            tensor = entry.value()
            want = _expected(files[key][0], key, tensor.dtype)
            # parameters in the storage dtype; buffers (the router's correction bias) stay
            # float32, as in HF's Glm4Moe, whatever the storage dtype
            stored = param_dtype if entry.name in params else "float32"
            assert str(tensor.dtype) == f"paddle.{stored}", key
            np.testing.assert_array_equal(tensor.numpy(), want, err_msg=key)
        share = sum(int(np.prod(files[k][2])) * ITEMSIZE[files[k][1]] for k in state)
        headers = sum(_header_bytes(f) for f in mine)
        assert report.share_bytes == share
        # Exactly: the index, the headers of the files holding this stage, this stage's data.
        assert report.bytes_read == index_bytes + headers + share
        ratio = report.bytes_read / share
        print(f"{arch} {file_dtype}->{param_dtype} pp={pp} stage={s}: read/share {ratio:.4f}")
        assert ratio <= BOUND, (s, ratio)
        assert whole > BOUND * share  # the bound would catch a stage reading everything
        assert set(report.foreign) == set(files) - set(state)
    # The shards really cut across stages: some stage spans files, some file serves two stages.
    assert any(len(f) > 1 for f in stage_files)
    assert any(len({i for i, f in enumerate(stage_files) if p in f}) > 1 for p in all_files)


def test_whole_model_reads_the_whole_checkpoint(checkpoints: dict[str, Path], arch: str) -> None:
    """Negative control: the counter sees every byte when a module needs every tensor."""
    directory = checkpoints["float32"]
    paddle.seed(5)
    model = build_model(_args(arch))
    report = load_hf_checkpoint(model, directory)
    sizes = [p.stat().st_size for p in directory.glob("model*.safetensors*")]
    assert report.bytes_read == sum(sizes) and report.foreign == []
    assert sorted(report.bytes_by_file) == sorted(str(p) for p in directory.glob("model*"))


def test_single_file_form_stage(tmp_path: Path) -> None:
    args = _args("glm")
    paddle.seed(3)
    save_hf_checkpoint(build_model(args), tmp_path)
    tensors = np_load_file(str(tmp_path / "model.safetensors"))  # + an old export's buffer
    tensors["model.layers.3.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    np_save_file(tensors, str(tmp_path / "model.safetensors"))
    module = _stage(args, 1, 2, "float32")
    report = load_hf_checkpoint(module, tmp_path)
    assert report.skipped == ["model.layers.3.self_attn.rotary_emb.inv_freq"]
    size = (tmp_path / "model.safetensors").stat().st_size
    assert report.bytes_read == _header_bytes(tmp_path / "model.safetensors") + report.share_bytes
    assert report.bytes_read < 0.7 * size
    for key, tensor in module.state_dict().items():
        want = _expected(tmp_path / "model.safetensors", key, tensor.dtype)
        np.testing.assert_array_equal(tensor.numpy(), want, err_msg=key)


# ------------------------------------------------------------------ float32 masters


def test_on_tensor_gives_the_files_float32_values(checkpoints: dict[str, Path], arch: str) -> None:
    """bf16 parameters from a float32 file: the callback sees the unrounded file values."""
    directory = checkpoints["float32"]
    files = _file_index(directory)
    module = _stage(_args(arch), 0, 2, "bfloat16")
    seen: dict[str, np.ndarray] = {}
    rng = np.random.default_rng(0)

    def keep(name: str, source: Float32Source) -> None:
        want = _expected(files[name][0], name, paddle.float32)
        assert source.shape == list(want.shape) and source.size == want.size
        seen[name] = source.float32()
        a = int(rng.integers(0, source.size))
        b = int(rng.integers(a, source.size + 1))
        np.testing.assert_array_equal(source.float32(a, b), want.reshape(-1)[a:b], err_msg=name)
        with pytest.raises(IndexError, match="outside"):
            source.float32(0, source.size + 1)

    load_hf_checkpoint(module, directory, on_tensor=keep)
    state = hf_state_map(module)
    assert sorted(seen) == sorted(state)
    rounded = 0
    for name, values in seen.items():
        want = _expected(files[name][0], name, paddle.float32)
        np.testing.assert_array_equal(values, want.reshape(-1), err_msg=name)
        stored = state[name].value().astype("float32").numpy().reshape(-1)
        rounded += int((values != stored).sum())
    assert rounded > 0  # the parameters are bf16-rounded, the masters are not


def test_read_hf_float32_reads_only_the_named_tensors(checkpoints: dict[str, Path]) -> None:
    """Master-weight slices from the file: values as in the file, only those tensors read."""
    directory = checkpoints["float32"]
    files = _file_index(directory)
    module = _stage(_args(_arch_of(directory)), 1, 2, "bfloat16")
    slices = {
        "model.layers.3.self_attn.q_proj.weight": (100, 3000),  # transposed, cut at both ends
        "model.layers.3.input_layernorm.weight": (0, 64),
        "model.norm.weight": (10, 11),
    }
    before = _untouched(module)
    got, report = read_hf_float32(module, directory, slices)
    assert sorted(got) == sorted(slices) == sorted(report.loaded)
    for name, (a, b) in slices.items():
        want = _expected(files[name][0], name, paddle.float32).reshape(-1)[a:b]
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    opened = {files[k][0] for k in slices}
    share = sum(int(np.prod(files[k][2])) * 4 for k in slices)
    index_bytes = (directory / "model.safetensors.index.json").stat().st_size
    headers = sum(_header_bytes(f) for f in opened)
    assert report.share_bytes == share and report.bytes_read == index_bytes + headers + share
    for k, v in _untouched(module).items():  # nothing assigned
        np.testing.assert_array_equal(v, before[k])
    with pytest.raises(KeyError, match="not tensors of this module"):
        read_hf_float32(module, directory, {"model.layers.0.mlp.down_proj.weight": (0, 1)})


@pytest.mark.parametrize("name", ["gate_up_proj", "down_proj"])
def test_read_hf_float32_assembles_stacked_experts_from_their_keys(
    tmp_path: Path, name: str
) -> None:
    """A flat slice of a stacked expert weight (a ZeRO master shard) is assembled from the
    per-expert HF keys of the experts it touches, and only those are read."""
    directory, args = _write(tmp_path, "glm_moe", "float32")
    files = _file_index(directory)
    module = _stage(args, 1, 2, "bfloat16")  # layers 2, 3 (MoE)
    stacked = f"model.layers.3.mlp.experts.{name}"
    shape = [int(d) for d in dict(module.named_parameters())[stacked].shape]
    per_expert = int(np.prod(shape[1:]))
    # expected: the HF [out, in] pieces transposed and put side by side, expert by expert
    pieces = ["gate_proj", "up_proj"] if name == "gate_up_proj" else ["down_proj"]
    blocks = []
    for e in range(shape[0]):
        keys = [f"model.layers.3.mlp.experts.{e}.{p}.weight" for p in pieces]
        parts = [_expected(files[k][0], k, paddle.float32) for k in keys]
        blocks.append(np.concatenate(parts, axis=1))
    whole = np.stack(blocks).reshape(-1)
    start, stop = per_expert + 37, 2 * per_expert + 5  # experts 1 and 2 only
    got, report = read_hf_float32(module, directory, {stacked: (start, stop)})
    np.testing.assert_array_equal(got[stacked], whole[start:stop])
    read = {k.split(".")[5] for k in report.loaded}
    assert read == {"1", "2"} and len(report.loaded) == 2 * len(pieces)


# ---------------------------------------------------------------------------- errors


def _shards(directory: Path) -> list[Path]:
    return sorted(directory.glob("model-*.safetensors"))


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _rewrite(directory: Path, key: str, value: np.ndarray | None) -> Path:
    """Replace (or drop, value None) tensor `key` in its shard, the index left as it was."""
    files = _file_index(directory)
    path = files[key][0]
    tensors = np_load_file(str(path))
    if value is None:
        del tensors[key]
    else:
        tensors[key] = value
    np_save_file(tensors, str(path))
    return path


def _untouched(module: paddle.nn.Layer) -> dict[str, np.ndarray]:
    return {k: v.numpy().copy() for k, v in module.state_dict().items()}


def test_missing_tensor_is_named_by_the_stage_that_needs_it(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    directory = _copy(checkpoints["float32"], tmp_path / "ck")
    key = "model.layers.3.self_attn.o_proj.weight"
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())
    _rewrite(directory, key, None)
    del weight_map["weight_map"][key]
    (directory / "model.safetensors.index.json").write_text(json.dumps(weight_map))
    args = _args(_arch_of(directory))
    load_hf_checkpoint(_stage(args, 0, 2, "float32"), directory)  # not its tensor
    module = _stage(args, 1, 2, "float32")
    before = _untouched(module)
    with pytest.raises(CheckpointMismatchError) as info:
        load_hf_checkpoint(module, directory)
    text = str(info.value)
    assert "missing from the checkpoint (1)" in text and key in text and "config.json" in text
    for k, v in _untouched(module).items():
        np.testing.assert_array_equal(v, before[k])


def test_index_key_absent_from_its_shard(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    directory = _copy(checkpoints["float32"], tmp_path / "ck")
    key = "model.layers.0.self_attn.q_proj.weight"
    path = _rewrite(directory, key, None)
    with pytest.raises(CheckpointMismatchError) as info:
        load_hf_checkpoint(_stage(_args(_arch_of(directory)), 0, 2, "float32"), directory)
    assert "listed in the index but not in their shard (1)" in str(info.value)
    assert f"{key}: not in {path.name}" in str(info.value)


def _arch_of(directory: Path) -> str:
    return args_from_hf_config(directory).arch


def test_shape_mismatch_names_key_file_and_shapes(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    directory = _copy(checkpoints["float32"], tmp_path / "ck")
    key = "model.layers.2.self_attn.k_proj.weight"
    path = _rewrite(directory, key, np.zeros((16, 64), np.float32))
    with pytest.raises(CheckpointMismatchError) as info:
        load_hf_checkpoint(_stage(_args(_arch_of(directory)), 1, 2, "float32"), directory)
    text = str(info.value)
    assert f"{key}: checkpoint [16, 64] vs model [32, 64] (HF [out, in] layout)" in text
    assert path.name in text


def test_uncastable_dtype_is_refused(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    directory = _copy(checkpoints["float32"], tmp_path / "ck")
    key = "model.norm.weight"
    path = _rewrite(directory, key, np.ones(64, np.int32))
    module = _stage(_args(_arch_of(directory)), 2, 3, "bfloat16")
    before = _untouched(module)
    with pytest.raises(CheckpointMismatchError) as info:
        load_hf_checkpoint(module, directory)
    text = str(info.value)
    assert "dtypes that cannot be loaded (1)" in text
    assert f"{key} in {path.name}: a I32 tensor cannot be loaded into a bfloat16 tensor" in text
    assert "convert the checkpoint" in text
    for k, v in _untouched(module).items():
        np.testing.assert_array_equal(v, before[k])


def test_index_pointing_to_a_missing_shard(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    directory = _copy(checkpoints["float32"], tmp_path / "ck")
    gone = _shards(directory)[1]
    gone.unlink()
    with pytest.raises(FileNotFoundError) as info:
        load_hf_checkpoint(_stage(_args(_arch_of(directory)), 0, 2, "float32"), directory)
    text = str(info.value)
    assert gone.name in text and "model.safetensors.index.json" in text
    assert "download the missing shard" in text


def test_corrupt_shard_names_the_file(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    directory = _copy(checkpoints["float32"], tmp_path / "ck")
    path = _shards(directory)[0]
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(SafetensorsFormatError, match=path.name):
        load_hf_checkpoint(build_model(_args(_arch_of(directory))), directory)


@pytest.mark.parametrize(
    ("text", "match"), [("{oops", "is not JSON"), ('{"metadata": {}}', "no 'weight_map' object")]
)
def test_bad_index_is_named(tmp_path: Path, text: str, match: str) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ValueError, match=match):
        load_hf_checkpoint(build_model(_args("glm")), tmp_path)


def test_tied_last_stage_loads_the_embedding(tmp_path: Path) -> None:
    """Tied embeddings: the last stage holds its own copy of `model.embed_tokens.weight`."""
    args = ModelArgs(arch="glm", **{**DIMS, "tie_embeddings": True}).check()
    paddle.seed(4)
    save_hf_checkpoint(build_model(args), tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "weights.safetensors")  # any one name
    path = tmp_path / "weights.safetensors"
    for stage in (0, 1):
        module = _stage(args, stage, 2, "float32")
        report = load_hf_checkpoint(module, tmp_path)
        assert "model.embed_tokens.weight" in report.loaded
        assert ("model.norm.weight" in report.foreign) == (stage == 0)
        for key, tensor in module.state_dict().items():
            np.testing.assert_array_equal(tensor.numpy(), _expected(path, key, tensor.dtype))
