"""Deterministic, layout-independent parameter initialisation.

Every parameter's initial value is a function of (seed, its full structured name) only: the
values of ``model.layers.7.mlp.down_proj.weight`` come from
``np.random.default_rng([seed, crc32(name)])`` under the rule recorded when the parameter was
created (normal(std), zeros, ones, or uniform(-b, b)). So a pipeline stage built alone holds
bitwise the same weights as the same slice of a one-process model, whatever pp is, and no rank
ever needs the full model to get them.

A stacked parameter (the routed experts' `[E, in, out]` weights, `flashcp.models.experts`) keys
each leading-axis slice on its own: slice `e` of ``model.layers.1.mlp.experts.down_proj``
comes from the stream of ``model.layers.1.mlp.experts.down_proj.<first + e>``
(`InitRule.keyed_rows`, `first` = `InitRule.first_row`, the global index of the first expert
held), so a rank holding only some experts builds exactly their slices of the whole tensor.

Rules are recorded by the initializers the layers use (`normal_attr`, `zeros_attr`,
`ones_attr`, `uniform_attr`): at creation each one tags the parameter with its `InitRule`.
Inside `deferred_init()` (what `flashcp.models.build_model` uses) the creation fill is a cheap
constant, because `init_parameters` then writes the keyed values; a layer built outside it
(e.g. directly in a test) is filled by Paddle's own initializer from Paddle's global seed, as
before. Random values are generated in float32, in blocks of at most `INIT_BLOCK` elements
(one stream per parameter, consumed in order, so the block size does not change the values),
cast to the parameter's storage dtype and written in place: building a huge tensor never needs
a float32 copy of it.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle
from paddle import nn

INIT_BLOCK = 1 << 22
"""Elements generated per block (16 MiB of float32)."""
RULE_ATTR = "_flashcp_init"
"""Attribute of a parameter holding its `InitRule`."""
KINDS = ("normal", "uniform", "zeros", "ones")

_DEFERRED = [0]


@dataclass(frozen=True)
class InitRule:
    """How a parameter starts: normal(0, scale²), uniform(-scale, scale), zeros or ones.

    `keyed_rows`: each leading-axis slice `i` draws from its own stream, keyed by the name
    suffixed with `.<first_row + i>` (stacked expert weights; see the module docstring).
    """

    kind: str
    scale: float = 0.0
    keyed_rows: bool = False
    first_row: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"init rule kind {self.kind!r} is not one of {KINDS}")

    @property
    def constant(self) -> float | None:
        """The value of a constant rule (zeros / ones), else None."""
        return {"zeros": 0.0, "ones": 1.0}.get(self.kind)


@contextlib.contextmanager
def deferred_init() -> Iterator[None]:
    """Parameters created inside get a constant fill (random rules are applied afterwards by
    `init_parameters`), so building costs no random numbers twice."""
    _DEFERRED[0] += 1
    try:
        yield
    finally:
        _DEFERRED[0] -= 1


class RecordedInitializer(nn.initializer.Initializer):
    """Tags the parameter with `rule`, then fills it (see the module docstring)."""

    def __init__(self, rule: InitRule) -> None:
        super().__init__()
        self.rule = rule

    def _paddle(self) -> nn.initializer.Initializer:
        rule = self.rule
        constant = rule.constant
        if constant is not None or _DEFERRED[0]:
            return nn.initializer.Constant(constant or 0.0)
        if rule.kind == "normal":
            return nn.initializer.Normal(mean=0.0, std=rule.scale)
        return nn.initializer.Uniform(low=-rule.scale, high=rule.scale)

    def forward(self, var: Any, block: Any = None) -> Any:
        setattr(var, RULE_ATTR, self.rule)
        return self._paddle()(var, block)


def rule_attr(rule: InitRule) -> paddle.ParamAttr:
    return paddle.ParamAttr(initializer=RecordedInitializer(rule))


def normal_attr(std: float, *, keyed_rows: bool = False, first_row: int = 0) -> paddle.ParamAttr:
    """Weights drawn from N(0, std²) (the HF `initializer_range` convention); `keyed_rows`
    keys every leading-axis slice on its own (stacked expert weights, see `InitRule`)."""
    return rule_attr(InitRule("normal", float(std), keyed_rows, int(first_row)))


def uniform_attr(bound: float) -> paddle.ParamAttr:
    return rule_attr(InitRule("uniform", float(bound)))


def zeros_attr() -> paddle.ParamAttr:
    return rule_attr(InitRule("zeros"))


def ones_attr() -> paddle.ParamAttr:
    return rule_attr(InitRule("ones"))


def name_key(name: str) -> int:
    """The 32-bit key of a structured parameter name (its CRC-32)."""
    return zlib.crc32(name.encode("utf-8"))


def generator(seed: int, name: str) -> np.random.Generator:
    """The random stream of parameter `name` under `seed`."""
    return np.random.default_rng([int(seed) % 2**64, name_key(name)])


def _draw(rng: np.random.Generator, rule: InitRule, n: int) -> np.ndarray:
    scale = np.float32(rule.scale)
    if rule.kind == "normal":
        return rng.standard_normal(n, dtype=np.float32) * scale
    return rng.random(n, dtype=np.float32) * (scale + scale) - scale


def initial_values(seed: int, name: str, rule: InitRule, shape: list[int]) -> Iterator[np.ndarray]:
    """The float32 initial values of `name`, as consecutive blocks of leading-axis rows (each
    at most `INIT_BLOCK` elements, or one row), in order. With `rule.keyed_rows` every block
    is one row, drawn from that row's own stream."""
    rows = int(shape[0]) if shape else 1
    row = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    per = 1 if rule.keyed_rows else max(1, INIT_BLOCK // max(row, 1))
    rng = generator(seed, name)
    for start in range(0, rows, per):
        stop = min(rows, start + per)
        if rule.constant is not None:
            block = np.full((stop - start) * row, rule.constant, dtype=np.float32)
        elif rule.keyed_rows:
            block = _draw(generator(seed, f"{name}.{rule.first_row + start}"), rule, row)
        else:
            block = _draw(rng, rule, (stop - start) * row)
        yield block.reshape([stop - start, *shape[1:]] if shape else [])


@paddle.no_grad()
def fill_parameter(param: paddle.Tensor, seed: int, name: str, rule: InitRule) -> None:
    """Write `name`'s initial values into `param` in place, block by block (cast on the way)."""
    constant = rule.constant
    if constant is not None:
        param.fill_(constant)
        return
    shape = [int(s) for s in param.shape]
    start = 0
    for block in initial_values(seed, name, rule, shape):
        value = paddle.to_tensor(block, place=param.place).astype(param.dtype)
        if start == 0 and (not shape or block.shape[0] == shape[0]):
            paddle.assign(value, output=param)
        else:
            param[start : start + block.shape[0]] = value
        start += block.shape[0] if shape else 1


def init_parameters(module: nn.Layer, seed: int, *, prefix: str = "") -> int:
    """Initialise every parameter of `module` from (seed, its structured name) under its
    recorded rule; returns how many were set. `prefix` is prepended to the names (for a
    sublayer initialised on its own). A parameter without a rule is an error (it would start
    from an undefined value)."""
    count = 0
    for name, param in module.named_parameters(prefix=prefix.rstrip(".")):
        rule = getattr(param, RULE_ATTR, None)
        if rule is None:
            raise ValueError(
                f"parameter {name} has no recorded init rule: create it with one of "
                "flashcp.models.init's attrs (normal_attr, zeros_attr, ones_attr, uniform_attr)"
            )
        fill_parameter(param, seed, name, rule)
        count += 1
    return count


def draw_seed() -> int:
    """A model seed drawn from Paddle's global generator (so `paddle.seed(k)` then
    `build_model(args)` is reproducible, as Paddle's own initializers were)."""
    return int(paddle.randint(0, 2**31 - 1, [1]).numpy()[0])


@contextlib.contextmanager
def default_dtype(dtype: str) -> Iterator[None]:
    """Create parameters in `dtype` inside the block (Paddle's default dtype), then restore."""
    previous = paddle.get_default_dtype()
    paddle.set_default_dtype(dtype)
    try:
        yield
    finally:
        paddle.set_default_dtype(previous)
