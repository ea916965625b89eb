"""Chat data: tokenizer directories, the chat template, SFT loss on assistant turns only, DPO
from strings and from messages. Expected tokens are built by hand from the template's known
output (GLM-4's layout), not by the code under test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.hfdir import (
    GLM4_CHAT_TEMPLATE,
    chat_records,
    preference_records,
    write_chatml_tokenizer,
    write_tokenizer_files,
)
from flashcp.config import IGNORE_INDEX
from flashcp.data import ByteTokenizer, HFTokenizer, PackedSequence, build_tokenizer, collate
from flashcp.data.chat import chat_segments
from flashcp.data.dataset import DocumentBuilder
from flashcp.data.dpo_records import DPORecords
from flashcp.data.records import BadRecordError
from helpers.dpo import plain_dpo_examples

SYSTEM = {"role": "system", "content": "Answer briefly."}
CONV = [
    SYSTEM,
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "How many legs does a spider have?"},
    {"role": "assistant", "content": "A spider has eight legs."},
]


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return HFTokenizer(write_tokenizer_files(tmp_path_factory.mktemp("glm")))


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return HFTokenizer(write_chatml_tokenizer(tmp_path_factory.mktemp("chatml")))


def _id(tok: HFTokenizer, token: str) -> int:
    tid = tok._tok.token_to_id(token)
    assert tid is not None, token
    return int(tid)


# -- the tokenizer directory ------------------------------------------------------------------


def test_directory_tokenizer_takes_special_tokens_and_template_from_its_config(
    tmp_path: Path, glm: HFTokenizer
) -> None:
    assert isinstance(build_tokenizer(str(glm.path)), HFTokenizer)
    assert glm.eos_id == glm.pad_id == _id(glm, "<|endoftext|>") and glm.bos_id is None
    assert glm.vocab_size == 384 and glm.chat_template == GLM4_CHAT_TEMPLATE
    # GLM-4's layout, written out by hand (independent of the template's code)
    assert glm.render_chat(CONV) == (
        "[gMASK]<sop><|system|>\nAnswer briefly.<|user|>\nWhat is the capital of France?"
        "<|assistant|>\nThe capital of France is Paris.<|user|>\nHow many legs does a spider "
        "have?<|assistant|>\nA spider has eight legs."
    )
    assert glm.render_chat(CONV[:2], add_generation_prompt=True).endswith("?<|assistant|>")
    ids = glm.encode("[gMASK]<sop><|user|>\nhello")
    assert ids[:3] == [_id(glm, t) for t in ("[gMASK]", "<sop>", "<|user|>")]
    assert glm.decode(ids) == "\nhello"
    # the config's names win over the file alone (which guesses by spelling)
    config = json.loads((glm.path / "tokenizer_config.json").read_text())
    other = tmp_path / "other"
    write_tokenizer_files(other, eos_token="<eop>", pad_token=None, bos_token="<sop>")
    tok = HFTokenizer(other)
    assert (tok.eos_id, tok.pad_id, tok.bos_id) == (_id(glm, "<eop>"),) * 2 + (_id(glm, "<sop>"),)
    plain = HFTokenizer(glm.path / "tokenizer.json")
    assert plain.chat_template is None and plain.eos_id == glm.eos_id
    assert repr(plain).endswith("tokenizer.json', vocab_size=384)")
    assert repr(ByteTokenizer()) == "ByteTokenizer(vocab_size=259)"
    assert config["chat_template"] == GLM4_CHAT_TEMPLATE


def test_directory_tokenizer_leaves_the_environment_alone(
    glm: HFTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    monkeypatch.setenv("TRANSFORMERS_NO_ADVISORY_WARNINGS", "0")
    HFTokenizer(glm.path)
    assert os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] == "0"
    monkeypatch.delenv("TRANSFORMERS_NO_ADVISORY_WARNINGS")
    HFTokenizer(glm.path)
    assert "TRANSFORMERS_NO_ADVISORY_WARNINGS" not in os.environ


def test_directory_tokenizer_errors(tmp_path: Path, glm: HFTokenizer) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json.*save_pretrained"):
        HFTokenizer(empty)
    with pytest.raises(FileNotFoundError, match="no tokenizer file or directory"):
        build_tokenizer(str(tmp_path / "nope"))
    no_eos = tmp_path / "no_eos"
    write_tokenizer_files(no_eos)
    cfg = json.loads((no_eos / "tokenizer_config.json").read_text())
    del cfg["eos_token"]
    (no_eos / "tokenizer_config.json").write_text(json.dumps(cfg))
    (no_eos / "special_tokens_map.json").unlink()
    with pytest.raises(ValueError, match="names no eos_token"):
        HFTokenizer(no_eos)
    with pytest.raises(ValueError, match="token '<nope>' is not in"):
        HFTokenizer(glm.path, eos="<nope>")
    for tok in (ByteTokenizer(), HFTokenizer(glm.path / "tokenizer.json")):
        with pytest.raises(ValueError, match="has no chat template.*tokenizer directory"):
            tok.render_chat(CONV)


# -- SFT on messages: loss on assistant turns only ---------------------------------------------


def _glm_expected(tok: HFTokenizer, conv: list[dict[str, str]]) -> tuple[list[int], list[bool]]:
    """GLM-4 tokens by hand: [gMASK] <sop>, then per turn <|role|> + encode("\\n" + content);
    targets = the assistant's "\\n" + content tokens, then the closing EOS."""
    ids = [_id(tok, "[gMASK]"), _id(tok, "<sop>")]
    flags = [False, False]
    for m in [m for m in conv if m["role"] == "system"] + [
        m for m in conv if m["role"] != "system"
    ]:
        body = tok.encode("\n" + m["content"])
        ids += [_id(tok, f"<|{m['role']}|>"), *body]
        flags += [False] + [m["role"] == "assistant"] * len(body)
    return [*ids, tok.eos_id], [*flags, True]


def test_sft_messages_train_only_assistant_turns(glm: HFTokenizer) -> None:
    build = DocumentBuilder(glm, recipe="sft")
    doc = build({"messages": CONV})
    ids, flags = _glm_expected(glm, CONV)
    assert doc.tokens.tolist() == ids and doc.targets.tolist() == flags
    assert glm.decode(doc.tokens[doc.targets].tolist()) == (
        "\nThe capital of France is Paris.\nA spider has eight legs."
    )
    # labels: exactly the next token where it is an assistant token (or the final EOS)
    labels = collate([PackedSequence(doc.tokens, doc.targets, [len(doc)])]).labels[0]
    want = [ids[i + 1] if flags[i + 1] else IGNORE_INDEX for i in range(len(ids) - 1)]
    assert labels.tolist() == [*want, IGNORE_INDEX]
    # each <|assistant|> token predicts its answer's first token; nothing else is trained
    answers = [glm.encode("\n" + m["content"]) for m in CONV if m["role"] == "assistant"]
    assistant = np.flatnonzero(doc.tokens == _id(glm, "<|assistant|>"))
    assert [int(labels[i]) for i in assistant] == [a[0] for a in answers]
    assert int((labels != IGNORE_INDEX).sum()) == sum(map(len, answers)) + 1  # + EOS
    # prompt/response strings keep the plain layout (no template): [BOS?] prompt response EOS
    plain = build({"prompt": "Q?", "response": "A."})
    assert plain.tokens.tolist() == [*glm.encode("Q?"), *glm.encode("A."), glm.eos_id]


def test_template_that_closes_turns_with_eos_gets_no_second_eos(chatml: HFTokenizer) -> None:
    doc = DocumentBuilder(chatml, recipe="sft")({"messages": CONV[1:3]})
    im_end, im_start = _id(chatml, "<|im_end|>"), _id(chatml, "<|im_start|>")
    answer = [*chatml.encode("The capital of France is Paris."), im_end, *chatml.encode("\n")]
    assert doc.tokens.tolist()[-len(answer) :] == answer
    assert doc.targets.tolist()[-len(answer) - 1 :] == [False] + [True] * len(answer)
    assert chatml.eos_id == im_end and doc.tokens.tolist().count(im_end) == 2
    assert doc.tokens[0] == im_start


EOS_CLOSED_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|endoftext|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""A template whose every turn ends with the EOS token itself (nothing after it)."""


def test_dpo_answers_of_a_template_that_closes_turns_with_eos_get_one_eos(
    glm: HFTokenizer, chatml: HFTokenizer, tmp_path: Path
) -> None:
    """A conversational DPO answer is the text its assistant turn adds, + EOS unless that
    text holds it already: exactly one EOS whether the template closes the turn with EOS
    (then newline: ChatML; or last: `EOS_CLOSED_TEMPLATE`) or not at all (GLM-4)."""
    closed = HFTokenizer(write_tokenizer_files(tmp_path / "closed",
                                               chat_template=EOS_CLOSED_TEMPLATE))  # fmt: skip
    row = {"prompt": [CONV[1]], "chosen": [CONV[2]],
           "rejected": [{"role": "assistant", "content": "Lyon."}]}  # fmt: skip
    good, bad = CONV[2]["content"], "Lyon."
    newline = chatml.encode("\n")
    want = {  # (tokenizer, chosen, rejected), by hand from each template's text
        "chatml": (chatml, [*chatml.encode(good), chatml.eos_id, *newline],
                   [*chatml.encode(bad), chatml.eos_id, *newline]),
        "eos_last": (closed, [*closed.encode(good), closed.eos_id],
                     [*closed.encode(bad), closed.eos_id]),
        "glm4": (glm, [*glm.encode("\n" + good), glm.eos_id],
                 [*glm.encode("\n" + bad), glm.eos_id]),
    }  # fmt: skip
    for name, (tok, chosen, rejected) in want.items():
        example = DPORecords(tok, budget=4096).tokenize(row)
        assert list(example.chosen) == chosen, name
        assert list(example.rejected) == rejected, name
        assert example.chosen.count(tok.eos_id) == example.rejected.count(tok.eos_id) == 1


def test_segments_join_to_the_full_rendering(glm: HFTokenizer, chatml: HFTokenizer) -> None:
    for tok in (glm, chatml):
        for record in chat_records(6):
            segs = chat_segments(tok, record["messages"])
            assert "".join(t for t, _ in segs) == tok.render_chat(record["messages"])
            answers = [t for t, a in segs if a]
            assert len(answers) == sum(m["role"] == "assistant" for m in record["messages"])
    # a conversation ending with a user turn: its rendering after the last answer is context
    segs = chat_segments(glm, CONV[1:4])
    assert segs[-1] == ("<|user|>\nHow many legs does a spider have?", False)


def test_bad_conversations_are_bad_records(tmp_path: Path, glm: HFTokenizer) -> None:
    build = DocumentBuilder(glm, recipe="sft", max_len=16)
    cases: list[tuple[Any, str]] = [
        ({"text": "x"}, "missing field 'messages'"),
        ({"messages": "hi"}, "field 'messages' is not a list of messages"),
        ({"messages": []}, "field 'messages' is not a list of messages"),
        ({"messages": [{"role": "user", "content": 3}]}, "a message's 'content' is not a string"),
        ({"messages": [CONV[1], "hi"]}, "field 'messages' is not a list of messages"),
        ({"messages": CONV[:3] + [{"role": "assistant", "content": " "}]}, "empty answer"),
        ({"messages": CONV[:4]}, "conversation does not end with an assistant turn"),
        ({"messages": [{"role": "tool", "content": "x"}, CONV[2]]},
         "the chat template refused the conversation"),  # fmt: skip
        ({"messages": [SYSTEM, {"role": "user", "content": "long " * 30}, CONV[2]]}, "too long"),
        ({"prompt": "Q", "response": ""}, "empty answer"),
        ({"prompt": "Q", "response": 5}, "field 'response' is not a string"),
    ]
    for record, reason in cases:
        with pytest.raises(BadRecordError) as info:
            build(record)
        assert info.value.reason == reason, (record, info.value)
    # Parquet gives absent struct fields as null: dropped, never rendered as "None"
    doc = DocumentBuilder(glm, recipe="sft")(
        {"messages": [dict(m, metadata=None) for m in CONV[1:3]]}
    )
    assert "None" not in glm.decode(doc.tokens.tolist())
    # a template that rewrites earlier turns once later ones follow: answers cannot be located
    odd = tmp_path / "odd"
    write_tokenizer_files(
        odd,
        chat_template="{% for m in messages %}{% if loop.last %}<|{{ m.role }}|>{% endif %}"
        "{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}",
    )
    with pytest.raises(BadRecordError, match="renders turns inconsistently"):
        DocumentBuilder(HFTokenizer(odd), recipe="sft")({"messages": CONV[1:3]})
    # a template that renders the assistant as nothing, or adds text after the last turn
    silent = tmp_path / "silent"
    write_tokenizer_files(
        silent,
        chat_template="{% for m in messages %}{% if m.role == 'user' %}<|user|>{{ m.content }}"
        "{% endif %}{% endfor %}",
    )
    with pytest.raises(BadRecordError, match="renders message 1 as nothing"):
        DocumentBuilder(HFTokenizer(silent), recipe="sft")({"messages": CONV[1:3]})
    with pytest.raises(BadRecordError, match="renders the answer as nothing"):
        DPORecords(HFTokenizer(silent), budget=64)(preference_records(1, as_messages=True)[0])
    with pytest.raises(BadRecordError, match="renders turns inconsistently"):
        DPORecords(HFTokenizer(odd), budget=64)(preference_records(1, as_messages=True)[0])
    # a template's text after the last turn belongs to that turn's answer (trained)
    tail = tmp_path / "tail"
    write_tokenizer_files(
        tail,
        chat_template=GLM4_CHAT_TEMPLATE.replace(
            "<|assistant|>\n{%- endif %}", "<|assistant|>\n{%- else %}<eop>{%- endif %}"
        ),
    )
    tailed = HFTokenizer(tail)
    doc = DocumentBuilder(tailed, recipe="sft")({"messages": CONV[1:3]})
    assert doc.tokens.tolist()[-2:] == [_id(tailed, "<eop>"), tailed.eos_id]
    assert tailed.decode(doc.tokens[doc.targets].tolist()) == "\nThe capital of France is Paris."
    assert doc.targets.tolist()[-3:] == [True, True, True]
    with pytest.raises(ValueError, match="byte tokenizer has no chat template"):
        DocumentBuilder(ByteTokenizer(), recipe="sft")({"messages": CONV[1:3]})
    broken = tmp_path / "broken"
    write_tokenizer_files(broken, chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match="chat_template is not valid Jinja"):
        DocumentBuilder(HFTokenizer(broken), recipe="sft")({"messages": CONV[1:3]})


# -- DPO records ------------------------------------------------------------------------------


def test_dpo_from_strings_matches_the_plain_tokenization() -> None:
    tok = ByteTokenizer()
    records = preference_records(20, as_messages=False)
    build = DPORecords(tok, budget=4096)
    assert [build(r) for r in records] == plain_dpo_examples(records, tok)


def test_dpo_from_messages_uses_the_template(glm: HFTokenizer) -> None:
    build = DPORecords(glm, budget=4096)
    (record,) = preference_records(1, as_messages=True)
    ex = build(record)
    q, good, bad = (record[k][0]["content"] for k in ("prompt", "chosen", "rejected"))
    ids = [_id(glm, t) for t in ("[gMASK]", "<sop>", "<|user|>")]
    assert list(ex.prompt) == [*ids, *glm.encode("\n" + q), _id(glm, "<|assistant|>")]
    assert list(ex.chosen) == [*glm.encode("\n" + good), glm.eos_id]
    assert list(ex.rejected) == [*glm.encode("\n" + bad), glm.eos_id]
    # the assistant turn as a message, a one-message list or its content: the same example
    for form in (record["chosen"][0], good):
        assert build(dict(record, chosen=form)) == ex
    # a multi-turn prompt renders every turn before the generation prompt
    multi = dict(record, prompt=CONV[:4])
    assert list(build(multi).prompt) == glm.encode(
        glm.render_chat(CONV[:4], add_generation_prompt=True)
    )


def test_bad_dpo_records(glm: HFTokenizer) -> None:
    (record,) = preference_records(1, as_messages=True)
    (plain,) = preference_records(1, as_messages=False)
    build = DPORecords(glm, budget=4096)
    two = [CONV[2], CONV[4]]
    cases: list[tuple[dict[str, Any], str]] = [
        ({k: v for k, v in record.items() if k != "rejected"}, "missing field 'rejected'"),
        (dict(plain, chosen=record["chosen"]), "prompt is a string but an answer is a message"),
        (dict(record, chosen=two), "an answer is not one assistant turn"),
        (dict(record, chosen=[CONV[1]]), "an answer is not one assistant turn"),
        (dict(record, rejected=""), "empty answer"),
        (dict(plain, chosen="  "), "empty answer"),
        (dict(record, prompt="x"), "prompt is a string but an answer is a message"),
        ({"chosen": "a", "rejected": "b"}, "missing field 'prompt'"),
        (dict(record, prompt=5), "field 'prompt' is not a list of messages"),
    ]
    for rec, reason in cases:
        with pytest.raises(BadRecordError) as info:
            build(rec)
        assert info.value.reason == reason, (rec, info.value)
    with pytest.raises(BadRecordError, match="prompt too short"):
        DPORecords(ByteTokenizer(), budget=64)(dict(plain, prompt=""))
    tight = DPORecords(glm, budget=12, max_prompt_len=None)
    with pytest.raises(BadRecordError) as info:
        tight(dict(record, prompt=CONV[:4]))
    assert info.value.reason == "too long"
    strict = DPORecords(glm, budget=12, truncation="error")
    with pytest.raises(ValueError, match="needs .* tokens packed .* data.seq_len is 12"):
        strict(record)
    with pytest.raises(ValueError, match="truncation must be one of"):
        DPORecords(glm, budget=24, truncation="drop")
    fitted = DPORecords(glm, budget=24)(record)
    assert fitted.packed_len <= 24 and fitted.prompt == build(record).prompt
