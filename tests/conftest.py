"""Suite-wide wiring: gpu tests skip cleanly without a GPU; integration jobs run in two lanes;
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


SECOND_LANE = frozenset({
    "test_attention_chunked_multiproc", "test_cp_default_group", "test_cp_registry_multiproc",
    "test_dpo_multiproc", "test_eval_multiproc", "test_expert_parallel", "test_groups_multiproc",
    "test_long_context_multiproc", "test_multinode", "test_pipeline_multiproc",
    "test_resume_fixture_cp2", "test_smoke_job", "test_stress_quick", "test_tiling_multiproc",
    "test_train_multiproc", "test_zero2_multiproc",
})  # fmt: skip
"""Integration modules of the second lane (xdist group `integration_2`); the rest are the first
(`integration`). Under `-n 2 --dist loadgroup` each lane runs its launched jobs one after
another on its own worker, and the unit tests fill in. Two lanes, not one: a launched job waits
on process start-up, rendezvous, polls and timeouts, and one lane left a core idle (main pass
1,939 s against 1,557 s in two lanes, runs on one machine). Balanced on measured durations in
both passes of scripts/test.sh (the main and the `equivalence` pass), to within seconds."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Puts each integration item in its lane's xdist group; skips gpu items without a GPU.
    `tryfirst`: xdist's worker plugin turns the group marker into the `@group` node-id suffix its
    `loadgroup` scheduler reads, in this same hook, and pluggy would call that plugin (registered
    after the initial conftests) first otherwise."""
    have_gpu: bool | None = None
    for item in items:
        if item.get_closest_marker("integration") is not None and (
            item.get_closest_marker("xdist_group") is None  # a one-process test names its own
        ):
            second = item.module.__name__.split(".")[-1] in SECOND_LANE
            item.add_marker(pytest.mark.xdist_group("integration_2" if second else "integration"))
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


@pytest.fixture(autouse=True)
def _flashcp_logger_as_a_library() -> Iterator[None]:
    """Undoes an in-process entry point's `own_console_format` after each test, so `caplog` (on
    the root logger) sees flashcp's records in the next one whatever ran before."""
    import logging

    flashcp_logger = logging.getLogger("flashcp")
    handlers, propagate = list(flashcp_logger.handlers), flashcp_logger.propagate
    yield
    flashcp_logger.handlers[:] = handlers
    flashcp_logger.propagate = propagate
