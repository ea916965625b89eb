"""Pipeline links (`flashcp.distributed.p2p`) without a peer: argument checks, and links built
without gloo use the pp group."""

from __future__ import annotations

import paddle
import pytest

from flashcp.distributed import NamedGroup
from flashcp.distributed.p2p import (
    PipelineLinks,
    pipeline_links,
    recv_tensor,
    send_tensor,
    swap_tensor,
)
from helpers.fakegroups import pp_groups


def test_p2p_argument_errors() -> None:
    solo = NamedGroup("pp", 0, -1, [0], pg=None)
    x = paddle.ones([2])
    with pytest.raises(ValueError, match="peer rank 3 is not in group pp\\[0\\]"):
        send_tensor(x, 3, solo)
    with pytest.raises(ValueError, match="cannot exchange a tensor with itself"):
        recv_tensor([2], "float32", 0, solo)
    with pytest.raises(TypeError, match="needs an explicit group"):
        swap_tensor(x, 1, None, send_first=True)  # type: ignore[arg-type]
    outsider = NamedGroup("pp", -1, 5, [2, 3], pg=None)
    with pytest.raises(ValueError, match="rank 0 is not a member of group pp\\[2,3\\]"):
        send_tensor(x, 2, outsider)


def test_pipeline_links_without_gloo_use_the_pp_group() -> None:
    g = pp_groups(3, 1)
    links = pipeline_links(g)
    assert links.prev is g.pp and links.next is g.pp and links.ends is None
    first = pp_groups(3, 0)
    tied = pipeline_links(first, tied=True)
    assert tied.prev is None and tied.next is first.pp and tied.ends is first.pp
    assert pipeline_links(pp_groups(1, 0)) == PipelineLinks(None, None, None)
