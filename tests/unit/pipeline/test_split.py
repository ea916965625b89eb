"""Which layers each pipeline stage runs (`flashcp.pipeline.split.split_layers`): the default
split, explicit counts, and validation messages that name the config keys."""

from __future__ import annotations

import pytest

from flashcp.pipeline.stage import split_layers


@pytest.mark.parametrize(
    ("num_layers", "pp"), [(n, pp) for pp in (1, 2, 3, 4) for n in range(pp, 13)]
)
def test_default_split_is_even_with_extras_first(num_layers: int, pp: int) -> None:
    ranges = split_layers(num_layers, pp)
    sizes = [len(r) for r in ranges]
    assert len(ranges) == pp
    assert [i for r in ranges for i in r] == list(range(num_layers))  # contiguous, in order
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # extras on the earliest stages
    assert all(r.step == 1 for r in ranges)


def test_default_split_examples() -> None:
    assert split_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert split_layers(4, 3) == [range(0, 2), range(2, 3), range(3, 4)]
    assert split_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert split_layers(3, 1) == [range(0, 3)]


def test_explicit_split() -> None:
    assert split_layers(4, 2, [1, 3]) == [range(0, 1), range(1, 4)]
    assert split_layers(6, 3, (1, 2, 3)) == [range(0, 1), range(1, 3), range(3, 6)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((4, 2, [2, 1]), "parallel.pp_layers [2, 1] sums to 3 but model.num_layers is 4"),
        ((1, 2, None), "num_layers 1 < pp 2: each stage needs at least one layer"),
        ((3, 2, [1, 1, 1]), "parallel.pp_layers [1, 1, 1] has 3 entries but parallel.pp is 2"),
        ((4, 2, [4, 0]), "parallel.pp_layers [4, 0]: stage 1 has 0 layers"),
        ((4, 2, [2.0, 2]), "stage 0 has 2.0 layers; each stage needs an integer >= 1"),
        ((4, 2, [True, 3]), "stage 0 has True layers"),
        ((4, 0, None), "parallel.pp must be an integer >= 1, got 0"),
        ((0, 1, None), "model.num_layers must be an integer >= 1, got 0"),
    ],
)
def test_split_errors_name_the_config_key(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", "\\[").replace("]", "\\]")):
        split_layers(*args)


def test_too_few_layers_suggests_a_fix() -> None:
    with pytest.raises(ValueError, match="lower parallel.pp to at most 2"):
        split_layers(2, 3)
