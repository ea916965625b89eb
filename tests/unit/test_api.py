"""The public API (`docs/api.md`): every name importable from `flashcp` and from its documented
module as the same object, loaded lazily so `import flashcp` and the config layer import no
Paddle, and the previous release's paths working with a `DeprecationWarning`."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import warnings

import pytest

import flashcp
from flashcp import attention
from helpers.paths import ROOT

API_DOC = ROOT / "docs" / "api.md"


def _python(code: str) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter (this one has Paddle loaded already), a DeprecationWarning
    attributed to it (what flashcp's own are, at the importing line) an error."""
    return subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning:__main__", "-c", code],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip


def test_a_fresh_interpreter_imports_no_paddle_until_asked_and_no_warning() -> None:
    """The launcher reads configs before any rank starts: `flashcp`, `flashcp.config` and the
    lookup of the lazy names stay Paddle-free. Then what this page's examples import, with
    flashcp's DeprecationWarnings as errors; the model layer does load Paddle (the negative
    control: the check sees it)."""
    run = _python(
        "import sys, flashcp, flashcp.config, flashcp.attention, flashcp.masks\n"
        "assert set(flashcp.PUBLIC) <= set(dir(flashcp))\n"
        "flashcp.load_config, flashcp.causal_document_mask, flashcp.DocumentMasking\n"
        "print('paddle' in sys.modules)\n"
        "from flashcp import flashmask_attention, flashmask_attention_cp, AttentionContext\n"
        "from flashcp import build_model, load_config, Trainer, causal_document_mask\n"
        "from flashcp.attention import flashmask_attention as f\n"
        "assert f is flashmask_attention and flashcp.Trainer is Trainer\n"
        "print('paddle' in sys.modules)\n"
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False", "True"]


@pytest.mark.parametrize("name", sorted(flashcp.PUBLIC))
def test_each_public_name_is_its_documented_modules(name: str) -> None:
    module = flashcp.PUBLIC[name]
    obj = getattr(flashcp, name)
    assert obj is getattr(importlib.import_module(module), name)
    assert obj.__module__ == module or obj.__module__.startswith(module + ".")
    assert name in flashcp.__all__


def test_the_attention_package_exports_its_front_doors() -> None:
    for name in ("flashmask_attention", "flashmask_attention_cp", "AttentionContext"):
        assert getattr(attention, name) is getattr(flashcp, name)
    from flashcp.attention import flashmask_attention_with_version  # the previous module's

    assert flashmask_attention_with_version.__module__ == "flashcp.attention.flashmask"
    with pytest.raises(AttributeError, match="no attribute 'flashmask'"):
        attention.__getattr__("flashmask")  # a submodule is imported, never guessed


def test_unknown_names_raise_attribute_error() -> None:
    with pytest.raises(AttributeError, match="module 'flashcp' has no attribute 'Trainr'"):
        flashcp.Trainr  # noqa: B018
    assert not hasattr(flashcp, "no_such_name")


def test_the_api_page_documents_every_name() -> None:
    """docs/api.md names each public name with its module, and nothing it calls public is
    missing from `flashcp.PUBLIC`."""
    text = API_DOC.read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| `(flashcp[\w.]*)` \|", text, re.MULTILINE))
    assert rows == flashcp.PUBLIC
    for old, new in flashcp.MOVED_MODULES.items():
        assert f"`{old}`" in text and f"`{new}`" in text


def test_previous_release_paths_warn_and_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """`flashcp.cp.attention` (a module before issue 19's move) and
    `flashcp.models.AttentionContext`: the same objects, each with a DeprecationWarning that
    names the new place; the documented paths give none."""
    monkeypatch.delitem(sys.modules, "flashcp.cp.attention", raising=False)
    with pytest.warns(DeprecationWarning, match="flashcp.cp.attention moved to "
                      "flashcp.attention.allgather_kv") as caught:  # fmt: skip
        from flashcp.cp.attention import ALLGATHER_KV, flashmask_attention_cp
    assert caught[0].filename == __file__  # the warning points at the importing line
    assert flashmask_attention_cp is flashcp.flashmask_attention_cp
    assert ALLGATHER_KV is importlib.import_module("flashcp.attention.allgather_kv").ALLGATHER_KV
    import flashcp.models as models

    with pytest.warns(DeprecationWarning, match="moved to flashcp.attention.context"):
        assert models.AttentionContext is flashcp.AttentionContext  # type: ignore[attr-defined]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from flashcp.attention.allgather_kv import flashmask_attention_cp as new  # noqa: F401
        from flashcp.trainer import Trainer  # noqa: F401
