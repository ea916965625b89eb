"""Interleaved rounds: each side of a comparison runs once per round, in an order rotated by
one every round, so a slow period of a shared machine falls on every side alike and per-round
ratios compare runs made next to each other."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Round(Generic[T]):
    """One round: its index (warm-up rounds first), whether it is timed, the order to run."""

    index: int
    timed: bool
    order: list[T]


def interleave(
    sides: Sequence[T], rounds: int, *, warmup: int = 0, rotate: bool = True
) -> Iterator[Round[T]]:
    """`warmup` untimed then `rounds` timed rounds over `sides`.

    Round i runs the sides rotated by i (two sides: A, B, then B, A, ...); `rotate=False` keeps
    the given order every round (for pairs that must run in one order, e.g. a baseline first).
    """
    n = len(sides)
    for i in range(warmup + rounds):
        shift = i % n if rotate and n else 0
        yield Round(i, i >= warmup, [*sides[shift:], *sides[:shift]])
