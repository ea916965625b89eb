"""Suite-wide wiring: gpu tests skip cleanly without a GPU; integration jobs run one at a time;
`isolated_environ` for tests that run a process's entry in this one."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator

import pytest

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
