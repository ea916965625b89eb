"""`flashcp.log`: the known third-party notices the entry points silence (by message: every
other warning still shows), and counts in readable units."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings

import pytest

from flashcp.log import python_warnings, quiet_third_party, readable_count

PADDLEFORMERS_NOTICE = "Due to potential compatibility issues between PaddlePaddle and PyTorch"


def _import_paddleformers(quiet: bool) -> subprocess.Popen[str]:
    """A fresh Python importing PaddleFormers (as LoRA does), with or without
    `quiet_third_party` first, then logging a warning of its own through PaddleFormers' logger."""
    code = "from flashcp.log import quiet_third_party; quiet_third_party(); " if quiet else ""
    code += "import paddleformers, logging; "
    code += "logging.getLogger('PaddleFormers').warning('a real one')"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def test_paddleformers_notice_is_silenced_and_real_warnings_are_not() -> None:
    """A fresh process importing PaddleFormers prints its torch notice in raw ANSI colour
    codes (control: without the filter); after `quiet_third_party` it does not, and another
    warning on the same logger still prints."""
    loud_proc, quiet_proc = _import_paddleformers(False), _import_paddleformers(True)
    loud, quiet = (p.communicate(timeout=300)[1] for p in (loud_proc, quiet_proc))
    assert loud_proc.returncode == quiet_proc.returncode == 0, quiet
    assert PADDLEFORMERS_NOTICE in loud and "\x1b[" in loud  # the noise is real
    assert PADDLEFORMERS_NOTICE not in quiet and "No ccache found" not in quiet
    assert "a real one" in quiet


def test_filters_are_by_message(caplog: pytest.LogCaptureFixture) -> None:
    quiet_third_party()
    quiet_third_party()  # idempotent: one filter per logger
    assert sum(type(f).__name__ == "_DropMessages"
               for f in logging.getLogger("transformers").filters) == 1  # fmt: skip
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        quiet_third_party()  # re-installs its filters over the "default" one
        warnings.warn("No ccache found. Please be aware ...", UserWarning, stacklevel=1)
        warnings.warn("Setuptools is replacing distutils.", UserWarning, stacklevel=1)
        warnings.warn("a real problem", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["a real problem"]
    tf = logging.getLogger("transformers")
    kept: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: kept.append(record.getMessage())  # type: ignore[method-assign]
    tf.addHandler(handler)
    try:
        tf.warning("PyTorch was not found. Models won't be available ...")
        tf.warning("tokenizer config has an unknown key")
    finally:
        tf.removeHandler(handler)
    assert kept == ["tokenizer config has an unknown key"]


def test_python_warnings_for_launched_processes() -> None:
    value = python_warnings("error::ResourceWarning")
    assert value.split(",")[0] == "error::ResourceWarning"
    assert "ignore:No ccache found" in value.split(",")
    assert python_warnings(None).startswith("ignore:")


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0"), (7, "7"), (950, "950"), (7168, "7.2K"), (3584, "3.6K"), (118_528, "118.5K"),
     (999_999, "1M"), (12_300_000, "12.3M"), (9.4e9, "9.4B"), (110.5e9, "110.5B"),
     (1.5e12, "1.5T")],
)  # fmt: skip
def test_readable_count(n: float, text: str) -> None:
    assert readable_count(n) == text


def _paddle_then_log(own_format: bool) -> str:
    """A fresh Python importing Paddle (which installs a root handler) and then logging one
    flashcp line, with or without the entry points' `own_console_format`; its stderr."""
    code = "import paddle; from flashcp import log; "
    code += "log.own_console_format(); " if own_format else ""
    code += "log.log_once('k', 'fa_version=2 (the reason)')"
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                          text=True, timeout=300, check=True)  # fmt: skip
    return proc.stderr


def test_flashcp_lines_have_one_format_after_paddle_installs_its_handler() -> None:
    """Paddle's root handler would print `[date] [    INFO] log.py:NN - …` (control); the entry
    points' format prints `[flashcp INFO] …`, once, with no file and line of the helper."""
    loud = _paddle_then_log(False)
    assert "log.py:" in loud and "fa_version=2" in loud  # the problem is real
    own = _paddle_then_log(True)
    assert own.strip().splitlines() == ["[flashcp INFO] fa_version=2 (the reason)"]


def test_own_console_format_is_idempotent() -> None:
    from flashcp import log

    log.own_console_format()
    log.own_console_format()
    assert sum(h.get_name() == "flashcp-console" for h in log.logger.handlers) == 1
    assert log.logger.propagate is False
