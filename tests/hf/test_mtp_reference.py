"""flashcp's MTP (GLM-4.5 "NextN") layers against a reference built from transformers' own
GLM-4.5 modules, forward as the serving engines publish it (SGLang's ``glm4_moe_nextn``,
vLLM's ``glm4_moe_mtp``): for depth 1 at position i,
``eh_proj(cat(enorm(embed_tokens(t[i+1])), hnorm(h[i])))`` with h the main model's final-norm
hidden state (`Glm4MoeModel`'s ``last_hidden_state``), then transformers' `Glm4MoeDecoderLayer`
built at ``layer_idx = num_hidden_layers`` (a MoE layer), then ``shared_head.norm`` and
``shared_head.head``; a second depth chains the first one's block output (DeepSeek-V3). The
reference is ours only in that wiring: every module is transformers'/torch's.

Weights: transformers builds the tiny GLM-4.5 (the MTP layers appended to its
``model.layers``, so its state dict holds them under the checkpoints' names), every tensor
perturbed; the test copies them name by name into a flashcp model of the same shape
(flashcp's names ARE these names; Paddle Linear weights are ``[in, out]``, stacked experts
``[E, in, out]``: transposed on the way). No flashcp loader is involved.

One difference between the engines: vLLM's ``glm4_moe_mtp`` also zeroes the token embedding
at position 0, SGLang's ``glm4_moe_nextn`` does not; flashcp and this reference follow SGLang
(it changes position 0's logits only).

Checked at float32, TOL as in `test_hf_reference`: logits and target log-probs on a whole
sequence, and on packed documents (flashcp's causal-document mask and `mtp_targets` vs the
reference run per document, whose MTP positions stop d tokens before each document's end).
Negative controls: the MTP fed token i instead of i+1, or scored against token i+1 instead of
i+2 (one position too few at every depth), and packed documents under a plain causal mask:
each misses the reference by more than 100 × TOL."""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle
import pytest

from flashcp import masks
from flashcp.attention.context import AttentionContext
from flashcp.models import build_model
from flashcp.models.config import ModelArgs
from flashcp.models.head import IGNORE_INDEX
from flashcp.models.mtp import mtp_targets
from hf.test_hf_reference import COMMON, MOE, _torch, _transformers, perturbed

pytestmark = pytest.mark.hf

TOL = 1e-4
"""float32 logits of O(1) after a few layers: the reference and flashcp differ only by
summation order (as `test_hf_reference.TOL`)."""
LAYERS = 2
DOCS = [11, 3, 14, 12]  # one packed sequence of 40 tokens; a 3-token document has one depth-1
SEQ = sum(DOCS)  # target and none at depth 2


def _args(depths: int) -> ModelArgs:
    """flashcp's shape of the transformers config below."""
    return ModelArgs(
        arch="glm_moe",
        vocab_size=COMMON["vocab_size"],
        hidden_size=COMMON["hidden_size"],
        num_layers=LAYERS,
        num_heads=COMMON["num_attention_heads"],
        num_kv_heads=COMMON["num_key_value_heads"],
        head_dim=COMMON["head_dim"],
        intermediate_size=COMMON["intermediate_size"],
        max_seq_len=COMMON["max_position_embeddings"],
        rotary_base=COMMON["rope_parameters"]["rope_theta"],
        partial_rotary_factor=COMMON["rope_parameters"]["partial_rotary_factor"],
        qkv_bias=MOE["attention_bias"],
        use_qk_norm=MOE["use_qk_norm"],
        norm_eps=COMMON["rms_norm_eps"],
        num_experts=MOE["n_routed_experts"],
        num_experts_per_tok=MOE["num_experts_per_tok"],
        moe_intermediate_size=MOE["moe_intermediate_size"],
        num_shared_experts=MOE["n_shared_experts"],
        first_k_dense_replace=MOE["first_k_dense_replace"],
        routed_scaling_factor=MOE["routed_scaling_factor"],
        norm_topk_prob=MOE["norm_topk_prob"],
        mtp_layers=depths,
        mtp_loss_weight=0.3,
    )


def _nextn_class() -> type:
    """A GLM-4.5 MTP layer from transformers' modules: its `Glm4MoeDecoderLayer` (the block,
    its parameters at the layer's top level as the checkpoints store them) plus the
    embedding, the two norms, ``eh_proj`` and ``shared_head``."""
    torch = _torch()
    glm = _transformers().models.glm4_moe.modeling_glm4_moe

    class NextNLayer(glm.Glm4MoeDecoderLayer):
        def __init__(self, config: Any, layer_idx: int) -> None:
            super().__init__(config, layer_idx)
            h, eps = config.hidden_size, config.rms_norm_eps
            self.embed_tokens = torch.nn.Embedding(config.vocab_size, h)
            self.enorm = glm.Glm4MoeRMSNorm(h, eps=eps)
            self.hnorm = glm.Glm4MoeRMSNorm(h, eps=eps)
            self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
            self.shared_head = torch.nn.Module()
            self.shared_head.norm = glm.Glm4MoeRMSNorm(h, eps=eps)
            self.shared_head.head = torch.nn.Linear(h, config.vocab_size, bias=False)

        def block_output(self, previous: Any, next_ids: Any, rotary: Any, mask: Any) -> Any:
            """The block's output (pre-norm) from the previous hidden states and next ids."""
            x = self.eh_proj(
                torch.cat([self.enorm(self.embed_tokens(next_ids)), self.hnorm(previous)], -1)
            )
            return self(x, attention_mask=mask, position_embeddings=rotary)

        def logits(self, y: Any) -> Any:
            return self.shared_head.head(self.shared_head.norm(y))

    return NextNLayer


def _reference_model(depths: int) -> Any:
    """A tiny random `Glm4MoeForCausalLM` with `depths` MTP layers appended to its
    ``model.layers`` (its own forward runs only the first ``num_hidden_layers``), every tensor
    perturbed so no norm, bias or router correction is an identity."""
    torch, tf = _torch(), _transformers()
    torch.manual_seed(7)
    config = tf.Glm4MoeConfig(
        **{**COMMON, "num_hidden_layers": LAYERS},
        **MOE,
        num_nextn_predict_layers=depths,
        attn_implementation="eager",
    )
    model = tf.Glm4MoeForCausalLM(config)
    nextn = _nextn_class()
    for d in range(depths):
        layer = nextn(config, LAYERS + d)
        assert type(layer.mlp).__name__ == "Glm4MoeMoE"  # GLM-4.5's MTP block is a MoE layer
        model.model.layers.append(layer)
    return perturbed(model)


def _flashcp_model(reference: Any, depths: int) -> Any:
    """A flashcp model with `reference`'s tensors, copied name by name: every flashcp
    parameter and buffer from the same-named torch tensor (Linear `[out, in]` → `[in, out]`,
    stacked experts `[E, out, in]` → `[E, in, out]`), and no torch tensor left over."""
    model = build_model(_args(depths), seed=0)
    source = {
        name: tensor.detach().numpy()
        for name, tensor in reference.state_dict().items()
        if not name.endswith("inv_freq")
    }
    targets = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    assert sorted(targets) == sorted(source)
    for name, tensor in targets.items():
        value = source[name]
        if value.ndim == 2 and not name.endswith("embed_tokens.weight"):
            value = value.T
        elif value.ndim == 3:
            value = value.transpose(0, 2, 1)
        assert list(value.shape) == list(tensor.shape), name
        tensor.set_value(np.ascontiguousarray(value, dtype=np.float32))
    return model


@pytest.fixture(scope="module", params=[1, 2], ids=["depth1", "depth2"])
def models(request: pytest.FixtureRequest) -> tuple[int, Any, Any]:
    depths = request.param
    reference = _reference_model(depths)
    return depths, reference, _flashcp_model(reference, depths)


def _reference_logits(reference: Any, doc: np.ndarray, depths: int) -> list[np.ndarray]:
    """One document alone through the reference: each depth d's logits `[n - d, V]` (position
    i takes token i+d and predicts token i+d+1; positions past n-d have no token i+d)."""
    torch = _torch()
    n = doc.shape[0]
    ids = torch.tensor(doc[None])
    out: list[np.ndarray] = []
    with torch.no_grad():
        hidden = reference.model(ids).last_hidden_state  # after the final norm
        for d in range(1, depths + 1):
            length = n - d
            positions = torch.arange(length)[None]
            rotary = reference.model.rotary_emb(hidden, positions)
            mask = torch.full((length, length), torch.finfo(torch.float32).min).triu(1)
            layer = reference.model.layers[LAYERS + d - 1]
            hidden = layer.block_output(hidden[:, :length], ids[:, d:], rotary, mask[None, None])
            out.append(layer.logits(hidden)[0].numpy())
    return out


def _labels(ids: np.ndarray, docs: list[int]) -> np.ndarray:
    """Main next-token labels of one packed row: token i+1 inside a document, else none."""
    labels = np.full_like(ids, IGNORE_INDEX)
    start = 0
    for n in docs:
        labels[:, start : start + n - 1] = ids[:, start + 1 : start + n]
        start += n
    return labels


def _flashcp_mtp(
    model: Any, ids: np.ndarray, docs: list[int], mask: Any, lag: str = ""
) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """flashcp's MTP on one packed row: each depth's logits `[S, V]` and target log-probs
    `[S]` (0 where no target), and the targets `mtp_targets` built, `[D, S]`. The negative
    controls, one position too few at every depth: `lag="ids"` feeds depth d the tokens i+d-1
    (token i at depth 1), `lag="targets"` scores it against token i+d (the main label at
    depth 1)."""
    depths = model.args.mtp_layers
    labels = _labels(ids, docs)
    mtp_ids, targets = mtp_targets(ids, labels, [docs], depths)
    if lag == "ids":
        mtp_ids = np.concatenate([ids[None], mtp_ids[:-1]])
    elif lag == "targets":
        targets = np.concatenate([labels[None], targets[:-1]])
    pos = paddle.arange(ids.shape[1], dtype="int64").unsqueeze(0)
    attn = AttentionContext(mask=mask.indices, causal=True)
    with paddle.no_grad():
        hidden = model(paddle.to_tensor(ids), pos, attn)
        outs = model.model.run_mtp(hidden, paddle.to_tensor(mtp_ids), pos, attn)
        logits = [
            layer.shared_head.logits(out)[0].numpy()
            for layer, out in zip(model.mtp_layers(), outs, strict=True)
        ]
        logps = model.mtp_token_logprobs(
            hidden, paddle.to_tensor(mtp_ids), paddle.to_tensor(targets), pos, attn
        )
    return logits, [lp[0].numpy() for lp in logps], targets[:, 0]


def _log_softmax_at(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """log p(target) per row of reference logits (numpy, float64 sums)."""
    x = logits.astype(np.float64)
    top = x.max(-1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(x - top).sum(-1))
    return x[np.arange(x.shape[0]), targets] - lse


def _err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max())


def _allowed(want: np.ndarray) -> float:
    return TOL * max(1.0, float(np.abs(want).max()))


def _compare(model: Any, reference: Any, ids: np.ndarray, docs: list[int], mask: Any) -> float:
    """flashcp's MTP logits and target log-probs on the packed row `ids` against the
    reference on each document alone; asserts TOL; returns the largest error. Also the
    targets: flashcp's are exactly the reference's (token i+d+1 for i < n-d-1 of each
    document, none elsewhere: never across a document's end)."""
    depths = model.args.mtp_layers
    logits, logps, targets = _flashcp_mtp(model, ids, docs, mask)
    worst, start = 0.0, 0
    for n in docs:
        doc = ids[0, start : start + n]
        for d, want in enumerate(_reference_logits(reference, doc, depths), start=1):
            got = logits[d - 1][start : start + n - d]
            assert _err(got, want) <= _allowed(want), (n, d, _err(got, want))
            worst = max(worst, _err(got, want))
            # targets: token i+d+1 of the document, for the n-d-1 positions that have one
            expected = np.full(n, IGNORE_INDEX)
            expected[: n - d - 1] = doc[d + 1 :]
            np.testing.assert_array_equal(targets[d - 1][start : start + n], expected)
            np.testing.assert_array_equal(logps[d - 1][start + n - d - 1 : start + n], 0.0)
            if n - d - 1 > 0:  # a document of d + 1 tokens has no depth-d target
                ref_lp = _log_softmax_at(want[: n - d - 1], doc[d + 1 :])
                got_lp = logps[d - 1][start : start + n - d - 1]
                assert _err(got_lp, ref_lp) <= _allowed(ref_lp), (n, d, _err(got_lp, ref_lp))
                worst = max(worst, _err(got_lp, ref_lp))
        start += n
    return worst


def _row(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, COMMON["vocab_size"], (1, SEQ))


def test_mtp_matches_reference_on_a_whole_sequence(models: tuple) -> None:
    depths, reference, model = models
    ids = _row(11)
    err = _compare(model, reference, ids, [SEQ], masks.causal_mask(1, SEQ))
    assert err > 0.0  # two implementations: equal only up to summation order
    # negative controls: ids, or targets, one position too few (at every depth)
    wants = _reference_logits(reference, ids[0], depths)
    bad_ids, _, _ = _flashcp_mtp(model, ids, [SEQ], masks.causal_mask(1, SEQ), lag="ids")
    _, bad_logps, _ = _flashcp_mtp(model, ids, [SEQ], masks.causal_mask(1, SEQ), lag="targets")
    for d, want in enumerate(wants, start=1):
        assert _err(bad_ids[d - 1][: SEQ - d], want) > 100 * _allowed(want)
        ref_lp = _log_softmax_at(want[: SEQ - d - 1], ids[0, d + 1 :])
        assert _err(bad_logps[d - 1][: SEQ - d - 1], ref_lp) > 100 * _allowed(ref_lp)


def test_mtp_on_packed_documents_matches_each_document_alone(models: tuple) -> None:
    depths, reference, model = models
    ids = _row(12)
    _compare(model, reference, ids, DOCS, masks.causal_document_mask(DOCS, 1))
    # negative control: the packed row under a plain causal mask (documents see each other)
    logits, _, _ = _flashcp_mtp(model, ids, DOCS, masks.causal_mask(1, SEQ))
    start, n = DOCS[0] + DOCS[1], DOCS[2]  # the third document would see the first two
    want = _reference_logits(reference, ids[0, start : start + n], depths)[0]
    got = logits[0][start : start + n - 1]
    assert _err(got, want) > 100 * _allowed(want)


def test_reference_main_model_matches_flashcp(models: tuple) -> None:
    """The premise of the MTP check: the two main models agree (their final-norm hidden
    states feed every depth), so an MTP mismatch above is the MTP layers'."""
    _, reference, model = models
    torch = _torch()
    ids = _row(13)
    with torch.no_grad():
        want = reference.model(torch.tensor(ids)).last_hidden_state.numpy()
    pos = paddle.arange(SEQ, dtype="int64").unsqueeze(0)
    attn = AttentionContext(mask=masks.causal_mask(1, SEQ).indices, causal=True)
    with paddle.no_grad():
        got = model(paddle.to_tensor(ids), pos, attn).numpy()
    assert _err(got, want) <= _allowed(want)
