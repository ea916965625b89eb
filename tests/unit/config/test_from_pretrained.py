"""`model.from_pretrained: DIR`: the model section from DIR's config.json (validated statically),
the weights from DIR (as `checkpoint.init_from`), the tokenizer from DIR by default; every
contradiction refused naming both values."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import pytest
import yaml

from flashcp import cli, masks
from flashcp.attention.context import AttentionContext
from flashcp.config import build_config, collect, config_hash, load_config, to_yaml
from flashcp.models import build_model, preset
from flashcp.models.hf_config import hf_config
from flashcp.models.hf_save import save_hf_checkpoint
from flashcp.parallelize import default_model_factory
from flashcp.problems import ProblemsError
from helpers.paths import ROOT

ARGS = preset(
    "tiny_glm_moe", vocab_size=300, use_qk_norm=True, rotary_base=50_000.0, max_seq_len=64
)


def as_5x(config: dict[str, Any]) -> dict[str, Any]:
    """config.json as transformers 5.x writes it: RoPE only inside `rope_parameters`."""
    return {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling")}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("glm45")
    source = build_model(ARGS, seed=11)
    save_hf_checkpoint(source, directory, max_shard_bytes=200_000)
    assert (directory / "model.safetensors.index.json").is_file()
    (directory / "config.json").write_text(json.dumps(as_5x(hf_config(ARGS)), indent=1))
    return directory


def _raw(model_dir: Path, model: dict[str, Any] | None = None, **sections: Any) -> dict:
    raw: dict[str, Any] = {
        "model": {"from_pretrained": str(model_dir), **(model or {})},
        "data": {"seq_len": 32, "tokenizer": "byte"},
        "train": {"steps": 2},
        "run": {"device": "cpu"},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return raw


def _errors(raw: dict[str, Any]) -> dict[str, str]:
    _, errors = collect(raw)
    return {e.key: e.message for e in errors}


def _logits(model: paddle.nn.Layer, ids: np.ndarray) -> np.ndarray:
    b, s = ids.shape
    pos = paddle.arange(s, dtype="int64").unsqueeze(0).expand([b, s])
    ctx = AttentionContext(mask=masks.causal_mask(b, s).indices, causal=True)
    return model.logits(model(paddle.to_tensor(ids), pos, ctx)).numpy()


def test_model_section_weights_and_tokenizer_come_from_the_directory(model_dir: Path) -> None:
    cfg = build_config(_raw(model_dir, {"recompute": "full"}))
    assert cfg.model.rotary_base == 50_000.0 and cfg.model.use_qk_norm
    assert cfg.model.recompute == "full"  # training-side: set freely
    assert cfg.model_from_pretrained == str(model_dir)
    assert cfg.checkpoint.init_from == str(model_dir)  # implied
    loaded = default_model_factory(cfg)
    source = build_model(ARGS, seed=11)
    for name, p in source.named_parameters():
        np.testing.assert_array_equal(loaded.state_dict()[name].numpy(), p.numpy(), err_msg=name)
    ids = np.random.default_rng(0).integers(0, 300, (2, 16))
    np.testing.assert_array_equal(_logits(loaded, ids), _logits(source, ids))
    # negative control: what the old reader built (rope_theta falls back to 10000)
    wrong = build_model(preset("tiny_glm_moe", vocab_size=300, use_qk_norm=True, max_seq_len=64))
    wrong.set_state_dict(source.state_dict())
    assert np.abs(_logits(wrong, ids) - _logits(source, ids)).max() > 1e-3


def test_tokenizer_defaults_to_the_directory(model_dir: Path) -> None:
    raw = _raw(model_dir)
    del raw["data"]["tokenizer"]
    cfg, _ = collect(raw, check=False)
    assert cfg is not None and cfg.data.tokenizer == str(model_dir)
    cfg, _ = collect(raw, overrides=["data.tokenizer=byte"], check=False)
    assert cfg is not None and cfg.data.tokenizer == "byte"
    raw = _raw(model_dir)
    raw.pop("data")
    cfg, _ = collect(raw, check=False)
    assert cfg is not None and cfg.data.tokenizer == str(model_dir)


def test_contradicting_keys_are_refused_naming_both_values(model_dir: Path) -> None:
    errors = _errors(_raw(model_dir, {"hidden_size": 32, "rotary_base": 10000.0}))
    assert errors["model.hidden_size"].startswith(
        f"32 contradicts config.json hidden_size 64 in {model_dir}; config.json defines the "
        "model: set model.hidden_size=null, or remove model.hidden_size from the file"
    )
    assert "10000.0 contradicts config.json rope_theta 50000.0" in errors["model.rotary_base"]
    errors = _errors(_raw(model_dir, {"num_layers": 3, "rotary_interleaved": True}))
    assert (
        f"3 contradicts config.json num_hidden_layers 2 in {model_dir}"
        in errors["model.num_layers"]
    )
    assert "architectures ['Glm4MoeForCausalLM']" in errors["model.rotary_interleaved"]
    assert _errors(_raw(model_dir, {"num_layers": 2, "arch": "glm_moe"})) == {}  # agreeing
    assert "unknown key" in _errors(_raw(model_dir, {"num_layer": 2}))["model.num_layer"]


def test_a_null_removes_any_restated_key(model_dir: Path) -> None:
    """`model.X=null` (the printed fix, validated before it is printed) removes a key the file
    restates, for every key — `head_dim` too, whose type takes None (issue 37): the model is
    config.json's."""
    restated = {"hidden_size": 64, "head_dim": 16, "rotary_base": 50000}
    want = build_config(_raw(model_dir)).model
    assert build_config(_raw(model_dir, {k: None for k in restated})).model == want
    wrong = _errors(_raw(model_dir, {"head_dim": 8}))["model.head_dim"]
    assert "set model.head_dim=null" in wrong


def test_training_side_keys_are_free_and_equal_keys_fine(model_dir: Path) -> None:
    """How the run trains (recompute, MoE capacity, router balancing) is not in config.json;
    a shape key that restates config.json's value is accepted."""
    free = {"recompute": "full", "moe_capacity_factor": 1.25, "router_bias_update_rate": 0.001,
            "router_aux_loss_coef": 0.0001}  # fmt: skip
    cfg = build_config(_raw(model_dir, free))
    assert {k: getattr(cfg.model, k) for k in free} == free
    same = {"hidden_size": 64, "rotary_base": 50000, "norm_eps": "1e-5", "use_qk_norm": True}
    assert build_config(_raw(model_dir, same)).model == build_config(_raw(model_dir)).model


def test_mtp_layers_come_from_the_directory_and_may_be_dropped(tmp_path: Path) -> None:
    """GLM-4.5's ``num_nextn_predict_layers: 1`` builds the MTP layer and loads it; its loss
    weight is how the run trains (free); ``model.mtp_layers: 0`` drops it (its weights are
    skipped); asking for more than the directory holds is refused before anything is built, in
    one line naming the layer without tensors and the count that fits."""
    args = dataclasses.replace(ARGS, mtp_layers=1)
    directory = tmp_path / "glm45_mtp"
    source = build_model(args, seed=12)
    save_hf_checkpoint(source, directory)
    assert json.loads((directory / "config.json").read_text())["num_nextn_predict_layers"] == 1
    cfg = build_config(_raw(directory, {"mtp_loss_weight": 0.3}))
    assert cfg.model.mtp_layers == 1 and cfg.model.mtp_loss_weight == 0.3
    loaded = default_model_factory(cfg)
    for name, p in source.named_parameters():
        np.testing.assert_array_equal(loaded.state_dict()[name].numpy(), p.numpy(), err_msg=name)
    dropped = default_model_factory(build_config(_raw(directory, {"mtp_layers": 0})))
    assert not dropped.mtp_layers()
    assert not any(n.startswith("model.layers.2.") for n in dropped.state_dict())
    errors = _errors(_raw(directory, {"mtp_layers": 2}))
    assert errors == {
        "model.mtp_layers": f"model.mtp_layers is 2, but the weights in {directory} hold no "
        "tensor of the multi-token-prediction layer model.layers.3.* (transformers' "
        "save_pretrained leaves them out): set model.mtp_layers=1"
    }


def test_declared_mtp_layer_without_tensors_is_refused_in_one_line(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What transformers' save_pretrained writes for GLM-4.5 (issue 27, defect 9):
    ``num_nextn_predict_layers: 1`` kept, the MTP layer's tensors dropped. `flashcp validate`
    and `flashcp train` refuse it before anything starts, in one line with the fix, which
    itself validates."""
    directory = tmp_path / "saved"
    directory.mkdir()
    for f in model_dir.iterdir():
        (directory / f.name).write_bytes(f.read_bytes())
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    line = (
        f"model.mtp_layers: {directory}/config.json declares num_nextn_predict_layers: 1, but "
        f"the weights in {directory} hold no tensor of the multi-token-prediction layer "
        "model.layers.2.* (transformers' save_pretrained leaves them out): set "
        "model.mtp_layers=0"
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(_raw(directory)))
    assert cli.main(["validate", str(path)]) == 2
    out = capsys.readouterr().out
    assert f": {line}\n" in out and out.count("\n") == 2  # the one line, the count
    assert cli.main(["train", str(path)]) == 2
    captured = capsys.readouterr()
    assert f": {line}\n" in captured.err and "launch" not in captured.out
    assert cli.main(["validate", str(path), "model.mtp_layers=0"]) == 0
    assert _errors(_raw(model_dir)) == {}  # negative control: the layer is not declared there


def test_preset_and_other_init_from_are_refused(model_dir: Path, tmp_path: Path) -> None:
    errors = _errors(_raw(model_dir, {"preset": "tiny"}))
    assert "cannot be combined with model.from_pretrained" in errors["model.preset"]
    errors = _errors(_raw(model_dir, checkpoint={"init_from": str(tmp_path)}))
    assert "contradicts model.from_pretrained" in errors["checkpoint.init_from"]
    same = _raw(model_dir, checkpoint={"init_from": str(model_dir) + "/"})
    assert _errors(same) == {}


def test_directory_problems(model_dir: Path, tmp_path: Path) -> None:
    key = "model.from_pretrained"
    assert "no directory at" in _errors(_raw(tmp_path / "nope"))[key]
    assert "has no config.json" in _errors(_raw(tmp_path))[key]
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    assert (
        "has no model.safetensors or model.safetensors.index.json" in _errors(_raw(tmp_path))[key]
    )
    mistral = {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    (tmp_path / "config.json").write_text(json.dumps(mistral))
    message = _errors(_raw(tmp_path))[key]
    assert "['MistralForCausalLM'] (model_type 'mistral') is not supported" in message
    assert "Glm4MoeForCausalLM" in message
    linear = {**json.loads((model_dir / "config.json").read_text())}
    linear["rope_parameters"] = {**linear["rope_parameters"], "rope_type": "linear"}
    (tmp_path / "config.json").write_text(json.dumps(linear))
    assert "'linear' is not implemented" in _errors(_raw(tmp_path))[key]
    assert "expected a directory path" in _errors(_raw(model_dir, {"from_pretrained": 3}))[key]


def test_resolved_config_reloads_and_hash_ignores_the_path(model_dir: Path, tmp_path: Path) -> None:
    cfg = build_config(_raw(model_dir))
    text = to_yaml(cfg)
    assert yaml.safe_load(text)["model"]["from_pretrained"] == str(model_dir)
    again = build_config(yaml.safe_load(text))
    assert again.model == cfg.model and config_hash(again) == config_hash(cfg)
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in model_dir.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert config_hash(build_config(_raw(copy))) == config_hash(cfg)


def test_validate_reads_config_json_only(model_dir: Path, tmp_path: Path, capsys) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(_raw(model_dir)))
    assert cli.main(["validate", str(path)]) == 0
    assert f"glm_moe ~119.2K params from {model_dir}" in capsys.readouterr().out
    path.write_text(yaml.safe_dump(_raw(model_dir, {"hidden_size": 8})))
    assert cli.main(["validate", str(path)]) == 2
    out = capsys.readouterr().out
    assert "model.hidden_size" in out and "contradicts config.json hidden_size" in out
    with pytest.raises(ProblemsError):
        build_config(_raw(model_dir, {"hidden_size": 8}))


def test_a_directory_on_the_command_line_replaces_the_files_preset(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 32: a shipped config (model.preset) plus `model.from_pretrained=DIR` on the
    command line trains DIR's model (the command line wins over the file), with a note; the
    file's training-side model keys still apply. A preset given on the command line against
    the file's directory is refused naming the override that resolves it."""
    shipped = ROOT / "configs" / "glm" / "tiny_moe_cp2.yaml"
    args = [f"model.from_pretrained={model_dir}", "data.tokenizer=byte", "data.seq_len=64"]
    cfg = load_config(shipped, args)
    assert cfg.model_preset is None and cfg.model_from_pretrained == str(model_dir)
    assert cfg.model.use_qk_norm and cfg.model.rotary_base == 50_000.0  # DIR's config.json
    assert cfg.model.recompute == "full"  # the file's own (training-side) key
    (note,) = cfg.notes
    assert f"model.from_pretrained={model_dir} on the command line replaces the file's " \
           "model.preset 'tiny_glm_moe'" in note  # fmt: skip
    assert cli.main(["validate", str(shipped), *args]) == 0
    assert f"note: {note}" in capsys.readouterr().out
    errors = _errors_of(_raw(model_dir), ["model.preset=tiny_glm"])
    assert "add model.from_pretrained=null to build the preset instead" in errors["model.preset"]
    assert "remove one of them" in _errors(_raw(model_dir, {"preset": "tiny_glm"}))["model.preset"]


def _errors_of(raw: dict[str, Any], overrides: list[str]) -> dict[str, str]:
    _, errors = collect(raw, overrides=overrides)
    return {e.key: e.message for e in errors}
