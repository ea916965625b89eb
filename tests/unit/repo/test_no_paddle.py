"""The declarative layers import without Paddle: the config (`flashcp.config`), the model
families and config.json reading (`flashcp.models.families`, `flashcp.models.hf_config`,
`flashcp.models.hf_rope`), the checkpoint's MTP layers (`flashcp.models.hf_mtp`), the weights'
files (`flashcp.models.weight_files`), the experts' row layouts (`flashcp.models.expert_layout`),
the memory planner (`flashcp.plan`) and the layout (`flashcp.distributed.dims`) — checked in a
fresh interpreter in which any import of ``paddle`` fails."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers.paths import ROOT

BLOCKER = """
import importlib, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "paddle" or name.startswith("paddle."):
            raise ImportError("paddle is blocked: " + name)
        return None
sys.meta_path.insert(0, Block())
importlib.import_module(sys.argv[1])
"""
DECLARATIVE = (
    "flashcp.config",
    "flashcp.models.config",
    "flashcp.models.families",
    "flashcp.models.hf_config",
    "flashcp.models.hf_rope",
    "flashcp.models.hf_mtp",
    "flashcp.models.weight_files",
    "flashcp.models.rope",
    "flashcp.models.expert_layout",
    "flashcp.plan",
    "flashcp.distributed.dims",
)


def _import_blocked(module: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKER, module], capture_output=True, text=True, timeout=120,
        cwd=ROOT, env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip


@pytest.mark.parametrize("module", DECLARATIVE)
def test_a_declarative_layer_imports_without_paddle(module: str) -> None:
    result = _import_blocked(module)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_blocker_blocks() -> None:
    """Negative control: a module that needs Paddle fails under the same blocker."""
    result = _import_blocked("flashcp.models.build")
    assert result.returncode != 0 and "paddle is blocked" in result.stderr
