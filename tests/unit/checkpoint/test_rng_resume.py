"""RNG state in checkpoints: this device's generator as plain numbers, never a pickle (issue 21
item 9).

`paddle.get_rng_state()` on a GPU holds one state per VISIBLE device and `paddle.set_rng_state`
refuses a list of another length, so a job resumed with another number of visible GPUs crashed;
and the state was pickled, so reading a checkpoint could run code. Now the checkpoint holds the
current device's generator (seed, offset; the CPU generator's engine as text), and the earlier
format is read from its plain entries only.

No GPU here: the CUDA generators are faked (`FakeCuda`), with the GPU build's binding of
`GeneratorState` pickling (`paddle/fluid/pybind/generator_py.cc`: `__getstate__` gives
`(device, seed, offset)`, `__setstate__` takes exactly that 3-tuple).
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import pytest

from flashcp.checkpoint import state as rng
from flashcp.checkpoint.state import rng_state, set_rng_state
from flashcp.config import build_config
from flashcp.metrics.writer import read_metrics
from flashcp.trainer import Trainer
from helpers.paths import FIXTURES as FIXTURES_DIR

FIXTURES = FIXTURES_DIR / "checkpoints"


@pytest.fixture
def no_unpickling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any unpickling fails the test."""

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("a checkpoint was unpickled")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)


def _plain(value: Any) -> bool:
    """Only JSON's own types, all the way down."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str)


# -- the CPU generator, for real ---------------------------------------------------------------


def test_cpu_state_is_plain_and_resumes_the_stream_bitwise(no_unpickling: None) -> None:
    paddle.seed(11)
    np.random.seed(11)
    random.seed(11)
    paddle.rand([5])  # move the engine past its seed
    state = json.loads(json.dumps(rng_state()))
    assert _plain(state) and set(state["paddle"]) == {"generators"}  # no pickled copy
    (entry,) = state["paddle"]["generators"]
    assert entry["device"] == -1 and entry["seed"] == 11 and entry["offset"] == 0
    assert len(entry["engine"].split()) == 313  # mt19937_64: 312 words and the position
    want = (paddle.rand([4]).numpy(), np.random.rand(3), random.random())
    paddle.seed(99)
    np.random.seed(99)
    random.seed(99)
    set_rng_state(state)
    got = (paddle.rand([4]).numpy(), np.random.rand(3), random.random())
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert got[2] == want[2]


def test_earlier_format_without_engine_reseeds_the_cpu_generator(no_unpickling: None) -> None:
    """The earlier format kept the engine only in its pickle: its plain entry restores the
    seed, so the stream restarts from the seed (documented), and nothing is unpickled."""
    paddle.seed(11)
    paddle.rand([5])
    state = rng_state()
    continuation = paddle.rand([4]).numpy()
    old = dict(state, paddle={"generators": [{"device": -1, "seed": 11, "offset": 0}],
                              "state": "gASV...not read..."})  # fmt: skip
    set_rng_state(old)
    restarted = paddle.rand([4]).numpy()
    paddle.seed(11)
    np.testing.assert_array_equal(restarted, paddle.rand([4]).numpy())
    assert not np.array_equal(restarted, continuation)  # the engine is what the new format adds


@pytest.mark.parametrize("name", ["plain", "lora", "zero_cp2"])
def test_kept_fixture_states_restore_without_unpickling(name: str, no_unpickling: None) -> None:
    state = json.loads(
        (FIXTURES / name / "run" / "checkpoints" / "step_3" / "trainer_state.json").read_text()
    )["rng"]
    assert "state" in state["paddle"]  # the earlier format, pickled copy and all
    paddle.seed(5)
    set_rng_state(state)
    (entry,) = state["paddle"]["generators"]
    assert paddle.base.core.default_cpu_generator().initial_seed() == entry["seed"]


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        ({"device": -1, "seed": "11", "offset": 0}, "seed='11' is not a valid integer"),
        ({"device": -1, "seed": 11, "offset": -2}, "offset=-2 is not a valid integer"),
        ({"device": -1, "seed": 11, "offset": 0, "engine": "1 2; rm -rf"}, "engine is not the"),
    ],
)
def test_malformed_entries_name_the_key(entry: dict[str, Any], error: str) -> None:
    state = rng_state()
    state["paddle"] = {"generators": [entry]}
    with pytest.raises(ValueError, match=error):
        set_rng_state(state)
    with pytest.raises(ValueError, match="generators is empty"):
        set_rng_state(dict(state, paddle={"generators": []}))


# -- CUDA generators, faked: another number of visible devices --------------------------------


class FakeState:
    """`GeneratorState` as the GPU build binds it: pickled as (device, seed, offset) only."""

    def __init__(self, values: tuple[int, int, int] = (0, 0, 0)) -> None:
        self.values = values

    def __getstate__(self) -> tuple[int, int, int]:
        return self.values

    def __setstate__(self, values: tuple[Any, ...]) -> None:
        if len(values) != 3:
            raise RuntimeError("Invalid Random state. Please check the format(device, "
                               "current_seed, thread_offset).")  # fmt: skip
        self.values = tuple(int(v) for v in values)  # type: ignore[assignment]


class FakeGenerator:
    def __init__(self, device: int, seed: int) -> None:
        self.state = FakeState((device, seed, 0))

    def get_state(self) -> FakeState:
        return FakeState(self.state.values)

    def set_state(self, state: FakeState) -> None:
        self.state = FakeState(state.values)

    def advance(self, n: int) -> None:  # what a random kernel does to a Philox offset
        d, s, o = self.state.values
        self.state = FakeState((d, s, o + n))


class FakeCuda:
    """`paddle.base.core`'s generator functions on a machine with `visible` GPUs, computing
    on `current`; `paddle.get_device()` answers `gpu:<current>`."""

    GeneratorState = FakeState

    def __init__(self, monkeypatch: pytest.MonkeyPatch, visible: int, current: int) -> None:
        self.generators = [FakeGenerator(i, 1234) for i in range(visible)]
        monkeypatch.setattr(rng, "core", self)
        monkeypatch.setattr(paddle, "get_device", lambda: f"gpu:{current}")

    def get_cuda_device_count(self) -> int:
        return len(self.generators)

    def default_cuda_generator(self, index: int) -> FakeGenerator:
        return self.generators[index]  # IndexError past the visible count, as Paddle errs

    def default_cpu_generator(self) -> Any:
        raise AssertionError("a GPU process must not save or restore the CPU generator here")


def test_resume_on_another_visible_device_count(monkeypatch: pytest.MonkeyPatch) -> None:
    saver = FakeCuda(monkeypatch, visible=8, current=5)
    saver.generators[5].advance(4096)
    state = json.loads(json.dumps(rng_state()))
    assert state["paddle"]["generators"] == [{"device": 5, "seed": 1234, "offset": 4096}]
    # resumed by a process that sees 2 GPUs and computes on gpu:1
    resumer = FakeCuda(monkeypatch, visible=2, current=1)
    set_rng_state(state)
    assert resumer.generators[1].state.values == (1, 1234, 4096)
    assert resumer.generators[0].state.values == (0, 1234, 0)  # another device: untouched
    # and by one that sees a single GPU
    single = FakeCuda(monkeypatch, visible=1, current=0)
    set_rng_state(state)
    assert single.generators[0].state.values == (0, 1234, 4096)


def test_earlier_per_device_list_resumes_with_fewer_visible_devices(
    monkeypatch: pytest.MonkeyPatch, no_unpickling: None
) -> None:
    """The earlier format's list (one entry per visible GPU of the saver) restores the entry
    of the current device index, or the first when the saver had fewer devices; the 8-entry
    list could not be handed to `paddle.set_rng_state` on 2 visible devices."""
    old = rng_state()
    old["paddle"] = {
        "generators": [{"device": i, "seed": 7, "offset": 100 * i} for i in range(8)],
        "state": "gASV...not read...",
    }
    two = FakeCuda(monkeypatch, visible=2, current=1)
    set_rng_state(old)
    assert two.generators[1].state.values == (1, 7, 100)
    old["paddle"]["generators"] = old["paddle"]["generators"][:1]
    four = FakeCuda(monkeypatch, visible=4, current=3)
    set_rng_state(old)
    assert four.generators[3].state.values == (3, 7, 0)


# -- through the trainer: LoRA dropout draws from the generator --------------------------------


def _lora_cfg(out: Path, **run: Any) -> Any:
    return build_config(
        {
            "model": {"preset": "tiny", "max_seq_len": 64},
            "data": {"seq_len": 64, "micro_batch_size": 2},
            "train": {"steps": 5, "lr": 3e-3, "warmup_steps": 1, "seed": 0},
            "lora": {"rank": 4, "dropout": 0.3, "target_modules": [".*_proj"]},
            "checkpoint": {"every": 2},
            "run": {"output_dir": str(out), "recipe": "sft", **run},
        }
    )


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out)]


def _strip_engine(step_dir: Path) -> None:
    """Rewrite the checkpoint's RNG as the earlier format's plain entry would restore it (no
    engine), checksum updated so the checkpoint still loads."""
    path = step_dir / "trainer_state.json"
    state = json.loads(path.read_text())
    for entry in state["rng"]["paddle"]["generators"]:
        entry.pop("engine")
    path.write_text(json.dumps(state))
    manifest_path = step_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    data = path.read_bytes()
    manifest["files"]["trainer_state.json"] = {
        "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)
    }
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True))


def test_lora_dropout_run_resumes_bitwise(tmp_path: Path) -> None:
    Trainer(_lora_cfg(tmp_path / "full"), stream=io.StringIO()).fit()
    want = _losses(tmp_path / "full")
    for name, strip in (("resumed", False), ("no_engine", True)):
        out = tmp_path / name
        Trainer(_lora_cfg(out, stop_after_steps=2), stream=io.StringIO()).fit()
        if strip:
            _strip_engine(out / "checkpoints" / "step_2")
        Trainer(_lora_cfg(out), stream=io.StringIO()).fit()
        got = _losses(out)
        assert got[:2] == want[:2]
        if strip:  # negative control: the dropout masks after the resume are other ones
            assert got[2:] != want[2:]
        else:
            assert got == want
