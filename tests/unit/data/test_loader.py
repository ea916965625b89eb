"""The per-rank loader (`flashcp.data.loader.TrainData`): DP ranks split the global batch; rows
are padded when configured."""

from __future__ import annotations

import numpy as np

from flashcp.config import build_config
from flashcp.data import TrainData


def test_dp_ranks_split_the_global_batch() -> None:
    def cfg(mbs: int, accum: int = 1):
        return build_config(
            {
                "model": {"preset": "tiny"},
                "data": {"seq_len": 32, "micro_batch_size": mbs},
                "train": {"grad_accum": accum},
            }
        )

    whole = TrainData(cfg(2)).next_step()
    ranks = [TrainData(cfg(1), dp_rank=r, dp_size=2).next_step() for r in range(2)]
    for r in range(2):
        np.testing.assert_array_equal(ranks[r][0].input_ids[0], whole[0].input_ids[r])
    accum = TrainData(cfg(1, accum=2)).next_step()
    assert len(accum) == 2
    np.testing.assert_array_equal(accum[1].input_ids[0], whole[0].input_ids[1])


def test_train_data_pads_when_configured() -> None:
    cfg = build_config(
        {
            "model": {"preset": "tiny"},
            "parallel": {"cp": 2, "pad": True},
            "data": {"seq_len": 30},
        }
    )
    data = TrainData(cfg)
    assert data.seq_len == 32
    (batch,) = data.next_step()
    assert batch.input_ids.shape == (1, 32) and batch.doc_lens[0][-1] == 2
    state = data.state_dict()
    nxt = data.next_step()[0].input_ids
    again = TrainData(cfg)
    again.load_state_dict(state)
    np.testing.assert_array_equal(again.next_step()[0].input_ids, nxt)
