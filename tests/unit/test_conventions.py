"""The ecosystem's conventions: flat aliases of flashcp keys, the global batch, `--version`."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from flashcp import cli
from flashcp.config import ALIASES, build_config, to_yaml
from flashcp.problems import ProblemsError
from flashcp.trainer import Trainer

BASE = {"model": {"preset": "tiny", "max_seq_len": 64}, "data": {"seq_len": 64}}


VALUES = {
    "max_steps": 7,
    "learning_rate": 2e-4,
    "per_device_train_batch_size": 3,
    "gradient_accumulation_steps": 4,
    "max_grad_norm": 0.5,
    "save_steps": 5,
    "save_total_limit": 3,
}


def _get(cfg: object, dotted: str) -> object:
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def test_every_alias_sets_its_key_in_the_file_and_as_an_override() -> None:
    assert set(VALUES) == set(ALIASES)
    from_file = build_config({**BASE, **VALUES})
    from_cli = build_config(BASE, overrides=[f"{k}={v}" for k, v in VALUES.items()])
    for alias, dotted in ALIASES.items():
        assert _get(from_file, dotted) == VALUES[alias], alias
        assert _get(from_cli, dotted) == VALUES[alias], alias
    # the run's config.yaml is written with the canonical keys only
    saved = yaml.safe_load(to_yaml(from_file))
    assert not set(saved) & set(ALIASES) and saved["train"]["steps"] == 7


def test_alias_and_key_in_one_layer_are_refused_naming_both() -> None:
    with pytest.raises(ProblemsError) as info:
        build_config({**BASE, "train": {"lr": 1e-3}, "learning_rate": 1e-4, "save_steps": 2,
                      "checkpoint": {"every": 3}})  # fmt: skip
    text = str(info.value)
    assert "learning_rate: is an alias of train.lr, which is also set: keep one of " \
           "learning_rate and train.lr" in text  # fmt: skip
    assert "save_steps: is an alias of checkpoint.every, which is also set" in text
    with pytest.raises(ProblemsError, match=r"max_steps: is an alias of train\.steps, "
                       r"which is also set on the command line: keep one of max_steps and "
                       r"train\.steps"):  # fmt: skip
        build_config(BASE, overrides=["train.steps=3", "max_steps=4"])


def test_the_command_line_overrides_the_file_across_spellings() -> None:
    cfg = build_config({**BASE, "train": {"steps": 60}}, overrides=["max_steps=10"])
    assert cfg.train.steps == 10
    cfg = build_config({**BASE, "max_steps": 60}, overrides=["train.steps=10"])
    assert cfg.train.steps == 10


def test_errors_say_which_spelling_was_used() -> None:
    with pytest.raises(ProblemsError, match=r"train\.steps: expected an integer, got "
                       r"2\.5 \(a number\) \[given as max_steps\]"):  # fmt: skip
        build_config({**BASE, "max_steps": 2.5})
    fast = r"train\.lr: expected a number, got 'fast' \(a string\) \[set on the command line: "
    with pytest.raises(ProblemsError, match=fast + r"learning_rate=fast\]"):
        build_config(BASE, overrides=["learning_rate=fast"])
    # aliases live at the top level only: inside a section the name is unknown
    with pytest.raises(ProblemsError, match=r"train\.max_steps: unknown key: max_steps "
                       r"is an alias of train\.steps, accepted at the top level of the file or "
                       r"as the override max_steps=VALUE, not inside a section: write "
                       r"train\.steps \(or a top-level max_steps\)"):  # fmt: skip
        build_config({**BASE, "train": {"max_steps": 3}})
    # a malformed section is reported once, the alias does not hide it
    with pytest.raises(ProblemsError, match=r"train: must be a mapping"):
        build_config({**BASE, "train": 3, "max_steps": 4})


def test_global_batch_in_the_start_line_and_run_info(tmp_path: Path) -> None:
    cfg = build_config(
        {**BASE, "max_steps": 1, "per_device_train_batch_size": 3,
         "gradient_accumulation_steps": 2, "run": {"output_dir": str(tmp_path / "run")}},
    )  # fmt: skip
    out = io.StringIO()
    Trainer(cfg, stream=out).fit()
    assert ("global batch 6 seq × 64 = 384 tokens/step (micro-batch 3 × accum 2 × dp 1)"
            in out.getvalue())  # fmt: skip
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())
    assert info["global_batch"] == {"sequences": 6, "seq_len": 64, "tokens": 384,
                                    "micro_batch_size": 3, "grad_accum": 2, "dp": 1}  # fmt: skip
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["tokens"] == 384


def test_version_from_package_metadata(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"flashcp {version('flashcp')}"
    proc = subprocess.run([sys.executable, "-m", "flashcp", "--version"], capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip() == f"flashcp {version('flashcp')}"


def test_version_outside_an_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert cli.package_version().startswith("unknown (not installed")


def test_overrides_may_follow_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["plot", "runs/x", "--bogus"])
    assert info.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err
