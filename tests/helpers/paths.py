"""Where the suite finds what it reads by path: the repository root, the shipped configs, the
kept fixtures. One place, so a test file can move between directories without its
`parents[n]` going wrong."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
"""`tests/`: on `sys.path` (pytest's `pythonpath`, and `PYTHONPATH` of launched workers)."""
ROOT = TESTS.parent
"""The repository root."""
CONFIGS = ROOT / "configs"
FIXTURES = TESTS / "fixtures"
