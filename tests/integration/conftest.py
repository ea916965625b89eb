"""Make the `launch` helper importable as `from launch import run_launch` in any import mode,
and the shared helpers of tests/ (`numerics`, ...) as top-level modules too."""

from __future__ import annotations

import sys
from pathlib import Path

for _dir in (Path(__file__).resolve().parents[1], Path(__file__).resolve().parent):
    if str(_dir) not in sys.path:
        sys.path.insert(0, str(_dir))
