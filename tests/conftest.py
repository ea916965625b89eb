"""Suite-wide wiring: gpu tests skip cleanly without a GPU; integration jobs run one at a time;
the shared fixtures: `tiny_cfg` and `fit` (a tiny config trained in this process), and
`isolated_environ` for tests that run a process's entry in this one."""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Iterator

import pytest

from helpers import trainruns
from helpers.configs import TINY_LM, Sections, TinyCfg, tiny_config

warnings.filterwarnings("ignore", message="No ccache found")


def _has_cuda_gpu() -> bool:
    import paddle

    return bool(paddle.is_compiled_with_cuda()) and paddle.device.cuda.device_count() > 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    have_gpu: bool | None = None
    for item in items:
        if item.get_closest_marker("integration") is not None:
            # One xdist group: multi-process jobs don't compete with each other for 2 cores.
            item.add_marker(pytest.mark.xdist_group("integration"))
        if item.get_closest_marker("gpu") is not None:
            if have_gpu is None:
                have_gpu = _has_cuda_gpu()
            if not have_gpu:
                item.add_marker(
                    pytest.mark.skip(
                        reason="needs a CUDA GPU and paddlepaddle-gpu (CPU build here)"
                    )
                )


@pytest.fixture
def isolated_environ() -> Iterator[None]:
    """`os.environ` as it was, after the test: for tests that run a process's entry here (one
    rank, `flashcp.launch.worker`), which sets process-wide runtime flags."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def tiny_base() -> Sections:
    """The config sections `tiny_cfg` starts from; a test module overrides this fixture to give
    its runs another base (`helpers.configs.merged(TINY_LM, train={...})`)."""
    return TINY_LM


@pytest.fixture
def tiny_cfg(tiny_base: Sections) -> TinyCfg:
    """`tiny_cfg(tmp, **sections)`: the module's `tiny_base` with `sections` merged over it,
    writing to `tmp/run` (`helpers.configs.tiny_config`)."""
    return functools.partial(tiny_config, base=tiny_base)


@pytest.fixture
def fit() -> trainruns.Fit:
    """`fit(cfg, **trainer_kwargs)`: the config trained here; `.trainer`, `.result`, `.out`
    (what it printed), `.records` (its metrics rows) (`helpers.trainruns.fit`)."""
    return trainruns.fit
