"""Rank-aware logging: one `flashcp` logger, rank-0 and once-per-process helpers; the known
third-party notices flashcp's entry points silence (`quiet_third_party`); counts in readable
units (`readable_count`)."""

from __future__ import annotations

import logging
import os
import warnings

logger = logging.getLogger("flashcp")
_seen: set[str] = set()


def process_rank() -> int:
    """Global rank from the launcher's environment (0 when not launched)."""
    for key in ("PADDLE_TRAINER_ID", "RANK"):
        value = os.environ.get(key)
        if value is not None and value.strip().lstrip("-").isdigit():
            return int(value)
    return 0


CONSOLE_FORMAT = "[flashcp %(levelname)s] %(message)s"
"""The one format of flashcp's own lines, on the console and in every rank's log."""


def _add_console_handler() -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(CONSOLE_FORMAT))
    handler.set_name("flashcp-console")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def _ensure_handler() -> None:
    if not logger.handlers and not logging.getLogger().handlers:
        _add_console_handler()


def own_console_format() -> None:
    """flashcp's lines in `CONSOLE_FORMAT`, not in the root handler Paddle installs on import
    (`[date] [    INFO] log.py:40 - …`, naming this helper's file and line). Called by the
    entry points (the CLI, a launched rank); a library user's logging setup is left alone.
    Idempotent."""
    if not any(h.get_name() == "flashcp-console" for h in logger.handlers):
        _add_console_handler()
    logger.propagate = False


def log_once(key: str, message: str, *, level: int = logging.INFO, rank0_only: bool = True) -> bool:
    """Log `message` the first time `key` is seen in this process; return whether it logged."""
    if key in _seen:
        return False
    _seen.add(key)
    if rank0_only and process_rank() != 0:
        return False
    _ensure_handler()
    logger.log(level, message)
    return True


def reset_once(prefix: str = "") -> None:
    """Forget once-keys starting with `prefix` (tests use this)."""
    for key in [k for k in _seen if k.startswith(prefix)]:
        _seen.discard(key)


NOISE_WARNINGS = (
    "No ccache found",  # Paddle, on import: only matters for building custom C++ ops
    "Setuptools is replacing distutils",  # setuptools' distutils shim, imported by a dependency
)
"""`warnings` messages (their starts) that say nothing about a flashcp run."""
NOISE_LOGS = {
    # PaddleFormers hides torch from transformers (flashcp uses only tokenizers) and says so,
    # in raw ANSI colour codes, on every import
    "PaddleFormers": ("Due to potential compatibility issues between PaddlePaddle and PyTorch",),
    # transformers imported without torch: flashcp uses only its tokenizers
    "transformers": ("PyTorch was not found",),
}
"""Logger name → the starts of its messages that are known noise."""


class _DropMessages(logging.Filter):
    """Drops records whose message starts with one of `starts` (nothing else)."""

    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).lstrip().startswith(self.starts)


def quiet_third_party() -> None:
    """Silence the known third-party notices (`NOISE_WARNINGS`, `NOISE_LOGS`), each by its
    message, so every other warning still shows. Called by flashcp's entry points (the CLI and
    the launched rank's script) before they import Paddle or PaddleFormers; a library user's
    warnings are left alone. Idempotent."""
    for start in NOISE_WARNINGS:
        warnings.filterwarnings("ignore", message=start)
    for name, starts in NOISE_LOGS.items():
        target = logging.getLogger(name)  # the same object the library logs through later
        if not any(isinstance(f, _DropMessages) for f in target.filters):
            target.addFilter(_DropMessages(starts))


def python_warnings(existing: str | None = None) -> str:
    """A `PYTHONWARNINGS` value that adds ignoring `NOISE_WARNINGS` to `existing`: for the
    processes a launched job starts (the launcher imports Paddle before any flashcp code runs)."""
    mine = [f"ignore:{start}" for start in NOISE_WARNINGS]
    return ",".join([*(x for x in (existing or "").split(",") if x), *mine])


def readable_count(n: float) -> str:
    """`n` with a unit and one decimal: 950, 7.2K, 12.3M, 110.5B, 1.2T."""
    value = float(n)
    units = (("", 1.0), ("K", 1e3), ("M", 1e6), ("B", 1e9), ("T", 1e12))
    i = max(k for k, (_, scale) in enumerate(units) if k == 0 or abs(value) >= scale)
    while True:
        unit, scale = units[i]
        scaled = value / scale
        text = f"{scaled:.1f}" if unit else f"{scaled:.0f}"
        if abs(float(text)) < 1000 or i == len(units) - 1:
            return text.removesuffix(".0") + unit
        i += 1  # 999,999 is 1M, not 1000K
