"""Which decoder layers each pipeline stage runs (pure logic; no tensors).

Default split: as even as possible, the extra layers going to the EARLIEST stages, so the last
stage (which also runs the LM head and the loss over the vocabulary) gets the fewest, e.g.
5 layers on 2 stages -> [3, 2]. `parallel.pp_layers` gives the counts explicitly. The config
validator calls `split_layers` too, so a bad split is reported before anything is launched.
"""

from __future__ import annotations

from collections.abc import Sequence


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def split_layers(
    num_layers: int, pp: int, layers_per_stage: Sequence[int] | None = None
) -> list[range]:
    """The global layer indices of each of the `pp` stages, contiguous and in order.

    `layers_per_stage` (config `parallel.pp_layers`) gives the count per stage explicitly;
    None splits evenly with the extras on the earliest stages (see the module docstring).
    Raises `ValueError` naming the config key at fault.
    """
    if not _is_int(pp) or pp < 1:
        raise ValueError(f"parallel.pp must be an integer >= 1, got {pp!r}")
    if not _is_int(num_layers) or num_layers < 1:
        raise ValueError(f"model.num_layers must be an integer >= 1, got {num_layers!r}")
    if layers_per_stage is None:
        if num_layers < pp:
            raise ValueError(
                f"num_layers {num_layers} < pp {pp}: each stage needs at least one layer "
                f"(lower parallel.pp to at most {num_layers} or add layers)"
            )
        base, extra = divmod(num_layers, pp)
        counts = [base + (1 if s < extra else 0) for s in range(pp)]
    else:
        counts = list(layers_per_stage)
        if len(counts) != pp:
            raise ValueError(
                f"parallel.pp_layers {counts} has {len(counts)} entries but parallel.pp is "
                f"{pp}: give one layer count per stage"
            )
        for s, n in enumerate(counts):
            if not _is_int(n) or n < 1:
                raise ValueError(
                    f"parallel.pp_layers {counts}: stage {s} has {n!r} layers; each stage "
                    "needs an integer >= 1"
                )
        if sum(counts) != num_layers:
            raise ValueError(
                f"parallel.pp_layers {counts} sums to {sum(counts)} but model.num_layers is "
                f"{num_layers}"
            )
    ranges, start = [], 0
    for n in counts:
        ranges.append(range(start, start + n))
        start += n
    return ranges
