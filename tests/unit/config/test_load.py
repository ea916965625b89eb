"""Config loading: types, unknown keys, overrides, cross-field checks — every error at once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from flashcp import cli
from flashcp.attention import registry as cp_modes
from flashcp.config import (
    RECIPES,
    RecipeSpec,
    build_config,
    collect,
    config_changes,
    config_hash,
    hashed_dict,
    load_config,
    parse_override,
    register_recipe,
    to_dict,
    to_yaml,
)
from flashcp.problems import Problem, ProblemsError
from helpers.paths import ROOT

BASE: dict[str, Any] = {
    "model": {"preset": "tiny"},
    "parallel": {"cp": 2},
    "data": {"seq_len": 64},
    "train": {"steps": 5},
}


def _raw(**sections: Any) -> dict[str, Any]:
    raw = {k: dict(v) for k, v in BASE.items()}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return raw


def _errors(raw: dict[str, Any], overrides: tuple[str, ...] = (), **kw: Any) -> list[Problem]:
    _, errors = collect(raw, overrides=overrides, **kw)
    return errors


def _by_key(errors: list[Problem]) -> dict[str, str]:
    return {e.key: e.message for e in errors}


def test_valid_config_types_and_preset() -> None:
    cfg = build_config(_raw(model={"hidden_size": 32}), world_size=2)
    assert cfg.model.hidden_size == 32 and cfg.model.num_layers == 2  # preset + override
    assert cfg.model_preset == "tiny"
    assert cfg.parallel.world_size == 2 and cfg.parallel.seq_divisor == 4
    assert cfg.train.lr == pytest.approx(3e-4) and isinstance(cfg.train.lr, float)


def test_every_problem_is_reported_at_once() -> None:
    raw = {
        "model": {"preset": "tiny", "hiden_size": 3},
        "parallel": {"cp": 2, "cp_mode": "dualchunk"},
        "data": {"seq_len": 64, "micro_batch_size": "two"},
        "train": {"steps": True, "lr": "fast", "dtype": "float16"},
        "checkpoint": {"every": 1.5},
        "trian": {},
    }
    with pytest.raises(ProblemsError) as info:
        build_config(raw, source="x.yaml")
    errors = _by_key(info.value.problems)
    assert set(errors) == {
        "model.hiden_size",
        "parallel.cp_mode",
        "data.micro_batch_size",
        "train.steps",
        "train.lr",
        "train.dtype",
        "checkpoint.every",
        "trian",
    }
    text = str(info.value)
    assert text.startswith("8 config problems in x.yaml:")
    assert "did you mean hidden_size?" in errors["model.hiden_size"]
    assert "did you mean train?" in errors["trian"]
    assert "one of 'dualchunk_allgather'" in errors["parallel.cp_mode"]
    assert "expected an integer, got 'two' (a string)" in errors["data.micro_batch_size"]
    assert "expected an integer, got True (a boolean)" in errors["train.steps"]
    assert "expected a number" in errors["train.lr"]
    assert "expected an integer, got 1.5" in errors["checkpoint.every"]


@pytest.mark.parametrize(
    ("section", "values", "key", "needle"),
    [
        ("train", {"lr": -1.0}, "train.lr", "must be > 0"),
        ("train", {"min_lr": 1.0, "lr": 0.1}, "train.min_lr", "set train.min_lr=null"),
        ("train", {"beta2": 1.0}, "train.beta2", "[0, 1)"),
        ("train", {"grad_accum": 0}, "train.grad_accum", ">= 1"),
        ("train", {"steps": 0}, "train.steps", ">= 1"),
        ("train", {"grad_clip": -1.0}, "train.grad_clip", ">= 0"),
        ("train", {"log_every": 0}, "train.log_every", ">= 1"),
        ("train", {"loss_chunk_tokens": -1}, "train.loss_chunk_tokens", "0 = unchunked"),
        ("hardware", {"memory_gib": 0}, "hardware.memory_gib", "> 0 GiB or null"),
        ("data", {"seq_len": 1}, "data.seq_len", ">= 2"),
        ("data", {"micro_batch_size": 0}, "data.micro_batch_size", ">= 1"),
        ("data", {"path": "/no/such.jsonl"}, "data.path", "no file or directory at"),
        ("data", {"tokenizer": "/no/tok.json"}, "data.tokenizer", "neither 'byte'"),
        ("data", {"tokenizer": "/"}, "data.tokenizer", "the directory '/' has no tokenizer.json"),
        ("checkpoint", {"keep_last": 0}, "checkpoint.keep_last", ">= 1"),
        ("checkpoint", {"every": -1}, "checkpoint.every", "0 = no periodic saves"),
        ("checkpoint", {"resume": "/no/ckpt"}, "checkpoint.resume", "'auto', 'never'"),
        ("run", {"recipe": "pretrian"}, "run.recipe", "did you mean pretrain?"),
        ("run", {"output_dir": " "}, "run.output_dir", "non-empty"),
        ("run", {"stop_after_steps": -2}, "run.stop_after_steps", ">= 0"),
        ("run", {"max_restarts": -1}, "run.max_restarts", "0 = no automatic restart"),
        ("run", {"restart_backoff_s": -1.0}, "run.restart_backoff_s", ">= 0"),
        ("run", {"preempt_grace_s": 0.0}, "run.preempt_grace_s", "> 0"),
        ("run", {"preempt_signal": "SIGKILL"}, "run.preempt_signal", "SIGUSR1, SIGUSR2"),
        ("run", {"straggler_ratio": 1.0}, "run.straggler_ratio", "must be > 1"),
        ("run", {"straggler_window": -1}, "run.straggler_window", "0 = no straggler"),
        (
            "hardware",
            {"checkpoint_write_gb_per_s": 0.0},
            "hardware.checkpoint_write_gb_per_s",
            "judged from the first save",
        ),
        ("parallel", {"dp": 0}, "parallel.dp", ">= 1"),
        ("parallel", {"grad_bucket_mb": 0}, "parallel.grad_bucket_mb", "> 0"),
        ("parallel", {"pp": 2}, "train.grad_accum", "set train.grad_accum=2"),
        ("parallel", {"pp": 2, "pp_layers": [2, 1]}, "parallel.pp_layers", "sums to 3"),
        ("parallel", {"pp_layers": [1, 1]}, "parallel.pp_layers", "has 2 entries"),
        ("model", {"num_heads": 6, "num_kv_heads": 4}, "model.num_heads", "multiple of"),
        ("model", {"vocab_size": 100}, "model.vocab_size", "byte tokenizer"),
        ("model", {"max_seq_len": 32}, "data.seq_len", "exceeds model.max_seq_len 32"),
    ],
)
def test_value_checks_name_key_and_fix(
    section: str, values: dict[str, Any], key: str, needle: str
) -> None:
    errors = _by_key(_errors(_raw(**{section: values})))
    assert key in errors, errors
    assert needle in errors[key]


def test_bfloat16_needs_gpu_device() -> None:
    errors = _by_key(_errors(_raw(train={"dtype": "bfloat16"}, run={"device": "cpu"})))
    assert "bfloat16 needs a GPU" in errors["train.dtype"]
    assert "set train.dtype=float32" in errors["train.dtype"]
    assert _errors(_raw(train={"dtype": "bfloat16"}, run={"device": "gpu"})) == []


def test_float32_refused_on_gpu_naming_train_dtype(tmp_path: Path, capsys) -> None:
    """Static (no GPU needed): float32 with run.device gpu cannot reach the FlashAttention
    kernels, which exist for fp16/bf16 only; auto and bfloat16 are fine there."""
    errors = _by_key(_errors(_raw(train={"dtype": "float32"}, run={"device": "gpu"})))
    message = errors["train.dtype"]
    assert "float32 cannot run on a GPU" in message
    assert "FlashAttention" in message and "set train.dtype=auto" in message
    for dtype in ("auto", "bfloat16"):
        assert _errors(_raw(train={"dtype": dtype}, run={"device": "gpu"})) == []
    for device in ("cpu", "auto"):
        assert _errors(_raw(train={"dtype": "float32"}, run={"device": device})) == []
    assert build_config(_raw()).train.dtype == "auto"  # the default
    path = tmp_path / "fp32_gpu.yaml"
    path.write_text(yaml.safe_dump(_raw(train={"dtype": "float32"}, run={"device": "gpu"})))
    assert cli.main(["validate", str(path)]) == 2
    out = capsys.readouterr().out
    assert "FAIL" in out and "train.dtype" in out and "float16/bfloat16 only" in out


@pytest.mark.parametrize(
    ("dtype", "device", "want"),
    [
        ("auto", "cpu", "float32"),
        ("auto", "gpu", "bfloat16"),
        ("float32", "cpu", "float32"),
        ("bfloat16", "gpu", "bfloat16"),
        ("float32", "gpu", "float16/bfloat16 only"),
        ("bfloat16", "cpu", "needs a GPU"),
    ],
)
def test_compute_dtype(dtype: str, device: str, want: str) -> None:
    from flashcp.config.device_rule import compute_dtype

    cfg = build_config(_raw(train={"dtype": dtype}))
    if want in ("float32", "bfloat16"):
        assert compute_dtype(cfg, device) == want
    else:
        with pytest.raises(RuntimeError, match=want) as info:
            compute_dtype(cfg, device)
        assert "train.dtype" in str(info.value)
        assert compute_dtype(cfg, device, check=False) == dtype  # the planner's what-if


def test_resolve_device_for_the_trainer_and_the_planner() -> None:
    """The trainer passes whether Paddle sees a GPU; the planner (None) cannot see the machine."""
    from flashcp.config.device_rule import resolve_device

    auto, gpu = build_config(_raw()), build_config(_raw(run={"device": "gpu"}))
    assert [resolve_device(auto, seen) for seen in (True, False, None)] == ["gpu", "cpu", "cpu"]
    assert resolve_device(gpu, True) == resolve_device(gpu, None) == "gpu"
    with pytest.raises(RuntimeError, match="run.device: gpu, but Paddle sees no GPU"):
        resolve_device(gpu, False)


def test_resolve_device_auto_on_a_gpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """run.device auto + a visible GPU: auto dtype runs bf16, an explicit float32 is refused."""
    import paddle

    from flashcp.rank_setup import resolve_runtime

    class _Cuda:
        @staticmethod
        def device_count() -> int:
            return 1

    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    monkeypatch.setattr(paddle.device, "cuda", _Cuda)
    assert resolve_runtime(build_config(_raw())) == ("gpu", "bfloat16")
    with pytest.raises(RuntimeError, match="train.dtype: float32 cannot run"):
        resolve_runtime(build_config(_raw(train={"dtype": "float32"})))


def test_num_layers_vs_pipeline_stages() -> None:
    errors = _by_key(_errors(_raw(model={"num_layers": 2}, parallel={"pp": 3})))
    assert "cannot fill parallel.pp = 3" in errors["model.num_layers"]


@pytest.mark.parametrize(
    ("mode", "cp", "good", "bad"),
    [
        ("dualchunk_allgather", 2, 64, 66),
        ("contiguous_allgather", 3, 63, 64),
        ("workload_balanced", 2, 64, 68),
    ],
)
def test_seq_len_divisibility_per_mode(mode: str, cp: int, good: int, bad: int) -> None:
    def errs(seq: int, pad: bool = False) -> dict[str, str]:
        raw = _raw(parallel={"cp": cp, "cp_mode": mode, "pad": pad}, data={"seq_len": seq})
        return _by_key(_errors(raw))

    assert "data.seq_len" not in errs(good)
    msg = errs(bad)["data.seq_len"]
    divisor = cp * cp_modes.get(mode).chunks_per_rank
    assert f"= {divisor}" in msg and "set parallel.pad=true" in msg
    assert "data.seq_len" not in errs(bad, pad=True)


def test_padding_counts_against_max_seq_len() -> None:
    raw = _raw(parallel={"pad": True}, data={"seq_len": 255})
    assert _errors(raw) == []
    raw = _raw(parallel={"pad": True, "cp": 2}, data={"seq_len": 255}, model={"max_seq_len": 255})
    assert "padded to 256" in _by_key(_errors(raw))["data.seq_len"]


def test_world_size_mismatch_suggests_fixes() -> None:
    msg = _by_key(_errors(_raw(), world_size=4))["parallel"]
    assert "dp(1) × pp(1) × cp(2) = 2 but the job has 4 processes" in msg
    assert "set parallel.cp=4" in msg and "--nproc_per_node 2" in msg
    assert _errors(_raw(), world_size=2) == []


def test_type_errors_suppress_dependent_checks() -> None:
    errors = _errors(_raw(parallel={"cp_mode": "nope"}, data={"seq_len": 66}))
    assert [e.key for e in errors] == ["parallel.cp_mode"]


def test_sections_must_be_mappings_and_model_required() -> None:
    errors = _by_key(_errors({"train": 3}))
    assert "must be a mapping" in errors["train"]
    assert "model.preset" in errors["model"]


def test_unknown_preset_lists_choices() -> None:
    errors = _by_key(_errors(_raw(model={"preset": "tinyy"})))
    assert "did you mean tiny" in errors["model.preset"]


def test_yaml_one_point_one_float_strings_are_numbers(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(BASE) + "\n")
    with path.open("a") as f:
        f.write("run: {output_dir: out}\n")
    text = path.read_text().replace("steps: 5", "steps: 5\n  lr: 1e-4")
    path.write_text(text)
    assert yaml.safe_load(text)["train"]["lr"] == "1e-4"  # what PyYAML really reads
    assert load_config(path).train.lr == pytest.approx(1e-4)


# -- overrides --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "key", "value"),
    [
        ("train.steps=3", "train.steps", 3),
        ("train.lr=1e-3", "train.lr", "1e-3"),
        ("train.lr=0.001", "train.lr", 0.001),
        ("parallel.pad=true", "parallel.pad", True),
        ("data.path=null", "data.path", None),
        ("data.path=", "data.path", None),
        ("run.output_dir=runs/a b", "run.output_dir", "runs/a b"),
    ],
)
def test_parse_override_yaml_scalars(text: str, key: str, value: Any) -> None:
    ov = parse_override(text)
    assert (ov.key, ov.value) == (key, value)


@pytest.mark.parametrize("text", ["train.steps", "=3", "train..steps=1", "a.b={x: 1}", "t.s=[1"])
def test_malformed_overrides(text: str) -> None:
    with pytest.raises(ValueError):
        parse_override(text)


def test_overrides_are_type_checked_and_marked() -> None:
    raw = _raw()
    cfg = build_config(raw, overrides=["train.steps=7", "train.lr=2e-3", "model.hidden_size=32"])
    assert (cfg.train.steps, cfg.train.lr, cfg.model.hidden_size) == (7, 2e-3, 32)
    assert cfg.overrides == ("train.steps=7", "train.lr=2e-3", "model.hidden_size=32")
    errors = _by_key(
        _errors(raw, overrides=("train.stpes=3", "train.steps=many", "train.steps.x=1", "bad"))
    )
    assert "did you mean steps" in errors["train.stpes"]
    assert "[set on the command line: train.stpes=3]" in errors["train.stpes"]
    assert "train.steps is a str, not a section" in errors["train.steps.x"]
    assert errors["train.steps.x"].endswith("[set on the command line: train.steps.x=1]")
    assert "not of the form key.sub=value" in errors["bad"]
    assert "expected an integer, got 'many'" in errors["train.steps"]


def test_override_can_add_a_section() -> None:
    cfg = build_config({"model": {"preset": "tiny"}}, overrides=["checkpoint.every=5"])
    assert cfg.checkpoint.every == 5


# -- registry, serialisation, hashing ---------------------------------------------------------


def test_recipe_registry_adds_sections() -> None:
    @dataclass(kw_only=True)
    class LoraConfig:
        rank: int = 8

    register_recipe(RecipeSpec("lora_test", "test recipe", sections={"adapter": LoraConfig}))
    try:
        cfg = build_config(_raw(run={"recipe": "lora_test"}, adapter={"rank": 4}))
        assert cfg.extras["adapter"].rank == 4
        errors = _by_key(_errors(_raw(adapter={"rank": "x"})))
        assert "expected an integer" in errors["adapter.rank"]
        errors = _by_key(_errors(_raw(adapter={"rank": 2})))
        assert "read only by recipe(s) lora_test" in errors["adapter"]
    finally:
        del RECIPES["lora_test"]
    assert "adapter" in _by_key(_errors(_raw(adapter={})))  # unknown again
    # the shipped `lora` section belongs to sft and dpo
    assert "read only by recipe(s) sft, dpo" in _by_key(_errors(_raw(lora={})))["lora"]


def test_sft_recipe_defaults_to_the_builtin_instruction_set() -> None:
    from flashcp.data import TrainData

    cfg = build_config(_raw(run={"recipe": "sft"}))
    data = TrainData(cfg)
    assert data.num_documents == 52  # the built-in preference set's prompts + chosen answers
    batch = data.next_step()[0]
    assert 0 < batch.num_targets < batch.input_ids.size


def test_lora_and_dpo_sections_are_checked() -> None:
    errors = _by_key(
        _errors(
            _raw(
                run={"recipe": "dpo"},
                lora={"rank": 0, "alpha": -1.0, "dropout": 1.0, "target_modules": ["(bad"]},
                dpo={"beta": 0.0, "label_smoothing": 0.6, "max_prompt_len": 1},
            )
        )
    )
    assert ">= 1" in errors["lora.rank"] and "> 0" in errors["lora.alpha"]
    assert "[0, 1)" in errors["lora.dropout"]
    assert "not a regular expression" in errors["lora.target_modules"]
    assert "> 0" in errors["dpo.beta"] and "[0, 0.5)" in errors["dpo.label_smoothing"]
    assert ">= 2" in errors["dpo.max_prompt_len"]
    ipo = {"loss_type": "ipo", "label_smoothing": 0.1}
    errors = _by_key(_errors(_raw(run={"recipe": "dpo"}, dpo=ipo)))
    assert "sigmoid loss only" in errors["dpo.label_smoothing"]
    assert (
        "expected a list of strings"
        in _by_key(_errors(_raw(run={"recipe": "sft"}, lora={"target_modules": "q_proj"})))[
            "lora.target_modules"
        ]
    )
    cfg = build_config(_raw(run={"recipe": "dpo"}, lora={"rank": 4}, dpo={"beta": 0.2}))
    assert cfg.extras["lora"].target_modules == [".*q_proj", ".*v_proj"]
    assert cfg.extras["dpo"].beta == 0.2 and cfg.extras["dpo"].loss_type == "sigmoid"
    overrides = ["parallel.pp=2", "train.grad_accum=2", "parallel.pp_layers=[1,1]"]
    assert build_config(_raw(), overrides=overrides).parallel.pp_layers == [1, 1]


def test_to_yaml_round_trip_and_hash() -> None:
    cfg = build_config(_raw())
    again = build_config(yaml.safe_load(to_yaml(cfg)))
    assert to_dict(again) == to_dict(cfg)
    assert config_hash(again) == config_hash(cfg)
    longer = build_config(
        _raw(), overrides=["train.steps=50", "run.output_dir=elsewhere", "hardware.memory_gib=80"]
    )
    assert config_hash(longer) == config_hash(cfg)  # steps / run / budget do not bind checkpoints
    other = build_config(_raw(), overrides=["train.lr=0.5"])
    assert config_hash(other) != config_hash(cfg)


def test_a_key_that_is_a_python_keyword() -> None:
    """`checkpoint.async` is the field `async_`: read, written back and suggested as `async`
    (file, override, config.yaml), never as the field's own name."""
    cfg = build_config(_raw(checkpoint={"async": True}))
    assert cfg.checkpoint.async_ is True and to_dict(cfg)["checkpoint"]["async"] is True
    assert "async_" not in to_dict(cfg)["checkpoint"]
    assert build_config(yaml.safe_load(to_yaml(cfg))).checkpoint.async_ is True
    assert build_config(_raw(), overrides=["checkpoint.async=true"]).checkpoint.async_ is True
    assert build_config(_raw()).checkpoint.async_ is False
    errors = _by_key(_errors(_raw(checkpoint={"async_": True, "fail_on_error": 1})))
    assert errors["checkpoint.async_"] == "unknown key (did you mean async?)"
    assert "expected true or false" in errors["checkpoint.fail_on_error"]
    bad = _by_key(_errors(_raw(), ("checkpoint.async=3",)))
    assert bad["checkpoint.async"].startswith("expected true or false, got 3")
    # async and fail_on_error do not change what a step computes: a checkpoint binds neither
    assert config_hash(
        build_config(_raw(checkpoint={"async": True, "fail_on_error": True}))
    ) == config_hash(build_config(_raw()))


def test_config_changes_since_a_checkpoint_ignore_new_keys_at_their_default() -> None:
    """A checkpoint saved before a key existed lacks it: at its default (today's behaviour)
    the key is no change; set to anything else it is one, as is any changed value."""
    cfg = build_config(_raw())
    saved = hashed_dict(cfg)
    del saved["model"]["tile_tokens"], saved["attention"]["kv_chunk"]
    assert config_changes(saved, cfg) == []
    tiled = build_config(_raw(), overrides=["model.tile_tokens=64", "train.lr=0.5"])
    assert config_changes(saved, tiled) == ["model.tile_tokens", "train.lr"]
    assert config_changes(hashed_dict(cfg), tiled) == ["model.tile_tokens", "train.lr"]
    # a key since left out of the hash (the FA4 policy changes no step) is no change either
    older = {**saved, "attention": {**saved["attention"], "fa4_unavailable": "error"}}
    assert config_changes(older, cfg) == [] and "fa4_unavailable" not in str(hashed_dict(cfg))


def test_cp_modes_come_from_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """One list of CP modes: a mode registered in flashcp.attention.registry is a valid
    parallel.cp_mode, and its chunks_per_rank sets the seq_len rule; the error lists them."""
    toy = cp_modes.CPMode("toy_three", 3, lambda world, k, mask, causal: None)
    monkeypatch.setitem(cp_modes.MODES, toy.name, toy)
    cfg = build_config(_raw(parallel={"cp": 2, "cp_mode": "toy_three"}, data={"seq_len": 66}))
    assert cfg.parallel.seq_divisor == 6
    msg = _by_key(_errors(_raw(parallel={"cp": 2, "cp_mode": "toy_three"})))["data.seq_len"]
    assert "is not a multiple of 3·cp = 6 (parallel.cp_mode toy_three" in msg
    bad = _by_key(_errors(_raw(parallel={"cp_mode": "ring"})))["parallel.cp_mode"]
    assert bad == f"expected one of {', '.join(map(repr, cp_modes.MODES))}, got 'ring'"
    assert "'toy_three'" in bad


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ProblemsError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1,\n")
    with pytest.raises(ProblemsError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- 1\n")
    with pytest.raises(ProblemsError, match="top level must be a mapping"):
        load_config(bad)


# -- flashcp validate -------------------------------------------------------------------------


def test_cli_validate_reports_every_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(_raw()))
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_raw(train={"lr": "x", "stepz": 1})))
    assert cli.main(["validate", str(good)]) == 0
    assert "ok    " in capsys.readouterr().out
    assert cli.main(["validate", str(good), str(bad)]) == 2
    out = capsys.readouterr().out
    assert "train.lr: expected a number" in out and "did you mean steps" in out
    assert "1 of 2 config(s) valid" in out
    assert cli.main(["validate", "--world-size", "3", str(good)]) == 2
    assert "the job has 3 processes" in capsys.readouterr().out


def test_cli_train_rejects_bad_config_before_launching(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_raw(run={"output_dir": str(tmp_path / "out")})))
    assert cli.main(["train", str(bad), "train.stepz=3"]) == 2
    assert "did you mean steps" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_required_and_rejected_fields_in_recipe_sections() -> None:
    @dataclass(kw_only=True)
    class NeedsBeta:
        beta: float

        def __post_init__(self) -> None:
            if self.beta > 1:
                raise ValueError("beta must be <= 1")

    register_recipe(RecipeSpec("dpo_test", "test recipe", sections={"pref": NeedsBeta}))
    try:
        raw = _raw(run={"recipe": "dpo_test"})
        assert "required key is missing" in _by_key(_errors({**raw, "pref": {}}))["pref.beta"]
        assert "beta must be <= 1" in _by_key(_errors({**raw, "pref": {"beta": 2}}))["pref"]
        errors = _by_key(_errors({**raw, "pref": {"beta": None}}))
        assert "expected a number" in errors["pref.beta"]
    finally:
        del RECIPES["dpo_test"]


def test_min_lr_follows_lr_unless_set() -> None:
    """Issue 27, defect 11: an unset train.min_lr is a fraction of train.lr, so a full
    fine-tune's train.lr=1e-5 is valid as it is; an explicit min_lr keeps its exact ratio (the
    golden losses' schedules)."""
    from flashcp.optim.lr import lr_at

    cfg = build_config(_raw(train={"steps": 5, "lr": 1e-5, "warmup_steps": 1}))
    assert cfg.train.min_lr is None and cfg.train.final_ratio == 0.1
    assert lr_at(4, cfg.train) == pytest.approx(1e-6, rel=1e-12)  # the last step's rate
    ratio = build_config(_raw(train={"lr": 1e-5, "min_lr_ratio": 0.05})).train
    assert ratio.final_lr == pytest.approx(5e-7, rel=1e-12)
    explicit = build_config(_raw(train={"lr": 3e-3, "min_lr": 3e-4})).train
    assert explicit.final_ratio == 3e-4 / 3e-3 and explicit.final_lr == 3e-4
    assert (
        "must be in [0, 1]"
        in _by_key(_errors(_raw(train={"min_lr_ratio": 1.5})))["train.min_lr_ratio"]
    )


def test_section_null_on_the_command_line_removes_or_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 27, defect 5: `lora=null` removes the optional section (no adapters), never
    resets it to its defaults; a section that has no "absent" (a core one, or the dpo recipe's
    own settings) is refused, naming the keys to set instead."""
    targets = [".*q_proj", ".*k_proj", ".*v_proj", ".*o_proj"]
    raw = _raw(run={"recipe": "sft"}, lora={"target_modules": targets})
    assert build_config(raw).extras["lora"].target_modules == targets
    assert "lora" not in build_config(raw, overrides=["lora=null"]).extras
    again = build_config(raw, overrides=["lora=null", "lora.rank=4"]).extras["lora"]
    assert again.rank == 4  # the command line's later keys make a new section
    errors = _by_key(_errors(raw, ("train=null", "model=null")))
    assert "train=null: the train section is not optional" in errors["train"]
    assert "set the train.* keys you want to change" in errors["train"]
    assert errors["model"].startswith("required section is missing")
    assert errors["model"].endswith("[set on the command line: model=null]")
    dpo = _raw(run={"recipe": "dpo"}, dpo={"beta": 0.5})
    errors = _by_key(_errors(dpo, ("dpo=null",)))
    assert "run.recipe dpo reads it with or without it" in errors["dpo"]
    assert "dpo" not in build_config(dpo, overrides=["dpo=null", "run.recipe=sft"]).extras
    # as a user would: flashcp validate a shipped DPO + LoRA config without its adapters
    shipped = str(ROOT / "configs" / "glm" / "tiny_dpo_lora_cp2.yaml")
    assert cli.main(["validate", shipped]) == 0
    assert "dpo + LoRA, " in capsys.readouterr().out
    assert cli.main(["validate", shipped, "lora=null"]) == 0
    out = capsys.readouterr().out
    assert "ok    " in out and "dpo, glm" in out and "LoRA" not in out
