"""The `flashcp` CLI: explain-dispatch prints its inputs, the version and the reason."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flashcp import cli, fa_dispatch


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = (fa_dispatch.FLAG_VERSION, fa_dispatch.FLAG_DETERMINISTIC, fa_dispatch.ENV_FA4_POLICY)
    for key in flags:
        monkeypatch.delenv(key, raising=False)


def test_explain_dispatch_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["explain-dispatch"]) == 0
    out = capsys.readouterr().out
    assert "FLAGS_flash_attn_version" in out and "(default)" in out
    assert "Effective fa_version: 2" in out
    assert "CPU reference" in out


def test_explain_dispatch_deterministic_downgrade(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(fa_dispatch.FLAG_VERSION, "3")
    args = ["explain-dispatch", "--head-dim", "192", "--deterministic", "--capability", "9.0"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "Effective fa_version: 2" in out
    assert "head_dim <= 128" in out
    assert "compute capability" in out and "9.0" in out and "(argument)" in out


def test_explain_dispatch_fa3_needs_hopper(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """FA3 on an A100 (or with no card at all) is refused, naming the compute capability."""
    monkeypatch.setenv(fa_dispatch.FLAG_VERSION, "3")
    assert cli.main(["explain-dispatch", "--capability", "8.0"]) == 2
    out = capsys.readouterr().out
    assert "Effective fa_version: none" in out and "compute capability 8.0" in out
    assert "SM90" in out and "FLAGS_flash_attn_version" in out
    assert cli.main(["explain-dispatch"]) == 2  # this CPU machine: no CUDA device
    assert "no CUDA device" in capsys.readouterr().out
    assert cli.main(["explain-dispatch", "--capability", "8", "--fa4-unavailable", "fallback"]) == 0
    out = capsys.readouterr().out
    assert "Effective fa_version: 2" in out and "FA3 unavailable" in out


def test_explain_dispatch_fa4_unavailable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(fa_dispatch.FLAG_VERSION, "4")
    assert cli.main(["explain-dispatch"]) == 2
    out = capsys.readouterr().out
    assert "paddlefleet_ops CuTe FlashMask kernels" in out and "no CUDA device" in out
    # no card: FA3 is unavailable too, so the advice is FA2 (issue 27, defect 2)
    assert "FLAGS_flash_attn_version=2 (FA2" in out and "=3 (" not in out
    assert "the default, neither attention.fa4_unavailable nor FLASHCP_FA4_UNAVAILABLE" in out
    assert cli.main(["explain-dispatch", "--fa4-unavailable", "fallback"]) == 0
    out = capsys.readouterr().out
    assert "Effective fa_version: 2" in out  # no card: no FA3 either
    assert "policy 'fallback', from --fa4-unavailable fallback" in out
    args = ["explain-dispatch", "--fa4-unavailable", "fallback", "--capability", "9.0"]
    assert cli.main(args) == 0
    assert "Effective fa_version: 3" in capsys.readouterr().out
    # the environment's policy, named as such (defect 1)
    monkeypatch.setenv(fa_dispatch.ENV_FA4_POLICY, "fallback")
    assert cli.main(["explain-dispatch", "--capability", "9.0"]) == 0
    out = capsys.readouterr().out
    assert "Effective fa_version: 3" in out and "from FLASHCP_FA4_UNAVAILABLE=fallback" in out
    # on an SM100 card without the CuTe kernels: name them, never "needs SM100 ... has SM100"
    monkeypatch.delenv(fa_dispatch.ENV_FA4_POLICY)
    assert cli.main(["explain-dispatch", "--capability", "10.0"]) == 2
    out = capsys.readouterr().out
    assert "which this SM100 (compute capability 10.0) card does not have" in out
    assert "needs an SM100" not in out and "FLAGS_flash_attn_version=2 (FA2" in out


def test_explain_dispatch_fa4_mask_limit(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 4-column mask is beyond the SM100 CuTe kernel: FA4 is unavailable for that call."""
    monkeypatch.setenv(fa_dispatch.FLAG_VERSION, "4")
    monkeypatch.setattr(fa_dispatch, "_probe_cute", lambda: (True, "CuTe FlashMask importable"))
    base = ["explain-dispatch", "--capability", "10.0", "--kv-heads", "2"]
    assert cli.main([*base, "--mask-columns", "2"]) == 0
    out = capsys.readouterr().out
    assert "Effective fa_version: 4" in out and "FA4 limit for this call" in out
    assert cli.main([*base, "--mask-columns", "4"]) == 2
    out = capsys.readouterr().out
    assert "Effective fa_version: none" in out and "4-column" in out
    assert cli.main([*base, "--mask-columns", "2", "--mask-heads", "4", "--fa4-unavailable",
                     "fallback"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "Effective fa_version: 2" in out and "4 mask heads" in out


def test_explain_dispatch_bad_capability(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["explain-dispatch", "--capability", "hopper"])
    assert "not a compute capability" in capsys.readouterr().err


def test_python_dash_m_flashcp() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "flashcp", "explain-dispatch", "--head-dim", "64"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Effective fa_version" in proc.stdout


def test_no_subcommand_is_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2


def test_missing_paddle_names_the_extras(monkeypatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Paddle is an extra ([cpu] / [gpu]): without it the CLI says how to install it."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "paddle" else real(name, *a)
    )
    assert cli.main(["explain-dispatch"]) == 2
    err = capsys.readouterr().err
    assert '".[cpu]"' in err and '".[gpu]"' in err and "paddlepaddle.org.cn" in err


def test_validate_warns_of_the_bad_records_its_data_sample_holds(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`flashcp validate` reads a sample of data.path as training does: the bad records in it
    (which training skips) are a warning saying how many and why, not a silent `ok`
    (issue 37)."""
    import json

    from helpers.paths import ROOT

    lines = [json.dumps({"text": f"good row {i}"}) for i in range(20)]
    lines[3], lines[9] = "{oops", "[1, 2]"
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(lines) + "\n")
    config = str(ROOT / "configs/gpt/tiny_cp2.yaml")
    assert cli.main(["validate", config, f"data.path={data}"]) == 0
    out = capsys.readouterr().out
    assert ("      warning: data.path: 2 bad record(s) in a sample of 64 rows, which training "
            "skips (data.on_bad_record: skip): ") in out  # fmt: skip
    assert f"not valid JSON ×1 ({data}:4)" in out and f"not a JSON object ×1 ({data}:10)" in out
    clean = tmp_path / "clean.jsonl"
    clean.write_text("\n".join(json.dumps({"text": f"row {i}"}) for i in range(20)) + "\n")
    assert cli.main(["validate", config, f"data.path={clean}"]) == 0
    assert "warning" not in capsys.readouterr().out


def test_conversation_rows_without_a_chat_template_are_named_by_their_format(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """PaddleFormers `src` / `tgt` rows with the byte tokenizer: the refusal names the rows'
    own format, not "records with a `messages` list" (issue 37)."""
    from helpers.paths import ROOT

    data = tmp_path / "st.jsonl"
    data.write_text('{"src": "Translate: hi", "tgt": "bonjour"}\n' * 4)
    config = str(ROOT / "configs/gpt/tiny_sft_packed_cp2.yaml")
    assert cli.main(["validate", config, f"data.path={data}"]) != 0
    out = capsys.readouterr().out
    assert "the byte tokenizer has no chat template, so `paddleformers` rows (PaddleFormers" in out
    assert "`messages` list" not in out
