"""The install scheme (issue 13 point 9): Paddle is an extra, `.[cpu]` or `.[gpu]`.

`paddlepaddle` (CPU, PyPI) and `paddlepaddle-gpu` (Paddle's wheel index) both provide the
`paddle` module; an exact `paddlepaddle` pin in the base dependencies made pip pull the CPU
build next to an installed `paddlepaddle-gpu`. Now the base dependencies hold everything but
Paddle (so one GPU command gives a complete environment), the `cpu` / `gpu` extras pin the same
Paddle version, nothing the base dependencies pull in requires `paddlepaddle`, and every script
that installs flashcp asks for the right extra.
"""

from __future__ import annotations

import importlib.metadata as md
import re

from packaging.requirements import Requirement

from helpers.paths import ROOT

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]


def _names(reqs: list[str]) -> set[str]:
    return {re.sub(r"[-_.]+", "-", Requirement(r).name).lower() for r in reqs}


def test_paddle_is_an_extra_not_a_base_dependency() -> None:
    base = _names(PROJECT["dependencies"])
    assert not {n for n in base if n.startswith("paddlepaddle")}, base
    # what the old README's GPU install left out is in the base set now
    assert {"paddleformers", "tokenizers", "matplotlib", "numpy", "pyyaml", "safetensors"} <= base
    assert not {n for n in _names(EXTRAS["test"]) if n.startswith("paddlepaddle")}


def test_cpu_and_gpu_extras_pin_the_same_paddle() -> None:
    cpu, gpu = (Requirement(r) for r in (*EXTRAS["cpu"], *EXTRAS["gpu"]))
    assert len(EXTRAS["cpu"]) == len(EXTRAS["gpu"]) == 1
    assert (cpu.name, gpu.name) == ("paddlepaddle", "paddlepaddle-gpu")
    assert str(cpu.specifier) == str(gpu.specifier) == "==3.3.1"
    installed = {d.metadata["Name"].lower(): d.version for d in md.distributions()}
    paddle = installed.get("paddlepaddle") or installed.get("paddlepaddle-gpu")
    assert paddle is not None and cpu.specifier.contains(paddle), paddle


def _requires_paddle(name: str, seen: set[str]) -> list[str]:
    """Chains `name -> ... -> paddlepaddle` among installed unconditional requirements."""
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in seen:
        return []
    seen.add(key)
    try:
        reqs = md.requires(name) or []
    except md.PackageNotFoundError:
        return []
    chains = []
    for raw in reqs:
        req = Requirement(raw)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # only under an extra, or not on this platform
        if req.name.lower().startswith("paddlepaddle"):
            chains.append(f"{name} -> {req.name}")
        chains += [f"{name} -> {c}" for c in _requires_paddle(req.name, seen)]
    return chains


def test_no_base_dependency_pulls_in_cpu_paddle() -> None:
    """A GPU install must not get `paddlepaddle` through a dependency (checked on what is
    installed here: paddleformers and everything below it)."""
    seen: set[str] = set()
    chains = [c for req in PROJECT["dependencies"] for c in _requires_paddle(
        Requirement(req).name, seen)]  # fmt: skip
    assert chains == [], chains


def test_scripts_install_the_right_extra() -> None:
    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    assert '-e ".[cpu,test]"' in test_sh  # CI (.ci/run -> scripts/test.sh): CPU paddle, PyPI
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    assert '-e ".[cpu]"' in (ROOT / "scripts" / "quickstart.sh").read_text()
    gpu_check = (ROOT / "scripts" / "gpu_check.sh").read_text()
    assert '-e ".[gpu,test]" --extra-index-url "$PADDLE_GPU_INDEX"' in gpu_check
    readme = (ROOT / "README.md").read_text()
    assert 'pip install -e ".[cpu]"' in readme and 'pip install -e ".[gpu]"' in readme
    assert "--no-deps" not in readme  # the old workaround for the exact CPU pin is gone
