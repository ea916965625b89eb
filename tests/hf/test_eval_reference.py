"""`flashcp eval` against transformers: the held-out SFT loss of a Hugging Face directory —
a tiny random `Glm4ForCausalLM` / `Glm4MoeForCausalLM` saved by transformers, with a
generated GLM-4-style tokenizer whose chat template marks the assistant's turns
(`{% generation %}`) — equals transformers' own cross-entropy on the assistant tokens of the
same conversations: `AutoTokenizer.apply_chat_template(..., return_assistant_tokens_mask=True)`
for the ids and the targets, the model's float32 logits, `torch.nn.functional.cross_entropy`.
flashcp appends EOS after the last answer as one more target (the model learns to stop;
`flashcp.data.dataset`); the reference does the same. Compared under the float32 rule of
`bench.numerics`, the target count exactly; the cross-entropy over every token of the
conversations (not only the assistant's) is rejected by the same rule (negative control).

Marker `hf`: run with `bash scripts/test.sh hf` (installs torch)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import numerics
from bench.hfdir import GLM4_CHAT_TEMPLATE, chat_records, write_jsonl, write_tokenizer_files
from flashcp import cli
from flashcp.rundir import EVAL_RESULTS_FILE

from .test_hf_reference import COMMON, MOE, _torch, _transformers, perturbed

pytestmark = pytest.mark.hf

VOCAB = 384
"""The generated BPE's vocabulary (`bench.hfdir.DEFAULT_VOCAB`)."""
SEQ_LEN = 256

GENERATION_TEMPLATE = """[gMASK]<sop>
{%- for message in messages if message.role == 'system' %}
<|system|>
{{ message.content }}
{%- endfor %}
{%- for message in messages if message.role != 'system' %}
{%- if message.role == 'assistant' %}
<|assistant|>
{%- generation %}{{ '\\n' + message.content }}{%- endgeneration %}
{%- elif message.role in ('user', 'observation') %}
<|{{ message.role }}|>
{{ message.content }}
{%- else %}
{{ raise_exception('unknown role ' ~ message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|assistant|>
{%- endif %}"""
"""`bench.hfdir.GLM4_CHAT_TEMPLATE` with each answer inside `{% generation %}`: the same text
(checked below), and transformers can return which tokens are the assistant's."""


def _directory(tmp: Path, arch: str) -> tuple[Any, Path]:
    """A tiny random HF model of `arch` saved by transformers, with the tokenizer files."""
    tf, torch = _transformers(), _torch()
    torch.manual_seed(7)
    common = {**COMMON, "vocab_size": VOCAB, "max_position_embeddings": SEQ_LEN,
              "pad_token_id": 0, "eos_token_id": 0}  # fmt: skip
    if arch == "glm":
        model = tf.Glm4ForCausalLM(tf.Glm4Config(**common, attn_implementation="eager"))
    else:
        model = tf.Glm4MoeForCausalLM(
            tf.Glm4MoeConfig(**common, **MOE, attn_implementation="eager")
        )
    model = perturbed(model)
    directory = tmp / arch
    model.save_pretrained(str(directory))
    write_tokenizer_files(directory, chat_template=GENERATION_TEMPLATE)
    return model, directory


def _reference(
    model: Any, directory: Path, records: list[dict[str, Any]]
) -> tuple[float, int, float]:
    """transformers' summed cross-entropy on the assistant tokens (+ EOS), its target count,
    and (the control) the mean cross-entropy over every next token."""
    torch, tf = _torch(), _transformers()
    tok = tf.AutoTokenizer.from_pretrained(str(directory))
    plain = tf.AutoTokenizer.from_pretrained(str(directory))
    plain.chat_template = GLM4_CHAT_TEMPLATE
    assistant, everything, targets, tokens = 0.0, 0.0, 0, 0
    for record in records:
        messages = record["messages"]
        assert tok.apply_chat_template(messages, tokenize=False) == plain.apply_chat_template(
            messages, tokenize=False
        )  # the generation markers change no text
        enc = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)  # fmt: skip
        ids = [*enc["input_ids"], tok.eos_token_id]
        mask = [*enc["assistant_masks"], 1]
        assert len(ids) <= SEQ_LEN and any(mask)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].double()
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
        keep = torch.tensor(mask[1:], dtype=torch.bool)
        assistant += float(nll[keep].sum())
        everything += float(nll.sum())
        targets += int(keep.sum())
        tokens += len(ids) - 1
    return assistant, targets, everything / tokens


@pytest.mark.parametrize("arch", ["glm", "glm_moe"])
def test_flashcp_eval_equals_transformers_cross_entropy_on_assistant_tokens(
    arch: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, directory = _directory(tmp_path, arch)
    records = chat_records(9, start=3)  # one- and two-turn conversations, some with a system
    held_out = write_jsonl(tmp_path / "held_out.jsonl", records)
    config = tmp_path / "eval.yaml"
    config.write_text(json.dumps({
        "model": {"from_pretrained": str(directory)},
        "data": {"seq_len": SEQ_LEN, "micro_batch_size": 2},
        "eval": {"path": str(held_out)},
        "run": {"recipe": "sft", "device": "cpu", "output_dir": str(tmp_path / "out")},
    }))  # fmt: skip
    assert cli.main(["eval", str(config)]) == 0
    assert "flashcp eval sft: loss" in capsys.readouterr().out
    metrics = json.loads((tmp_path / "out" / EVAL_RESULTS_FILE).read_text())["metrics"]
    nll, targets, every = _reference(model, directory, records)
    assert metrics["eval/targets"] == targets
    want = nll / targets
    numerics.assert_close(metrics["eval/loss"], want, n=targets, scale=want, what="eval/loss")
    # control: every token's cross-entropy is another number under the same rule
    numerics.assert_rejects(metrics["eval/loss"], every, n=targets, scale=want)
