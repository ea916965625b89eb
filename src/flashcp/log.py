"""Rank-aware logging: one `flashcp` logger, rank-0 and once-per-process helpers."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("flashcp")
_seen: set[str] = set()


def process_rank() -> int:
    """Global rank from the launcher's environment (0 when not launched)."""
    for key in ("PADDLE_TRAINER_ID", "RANK"):
        value = os.environ.get(key)
        if value is not None and value.strip().lstrip("-").isdigit():
            return int(value)
    return 0


def _ensure_handler() -> None:
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[flashcp %(levelname)s] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


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
