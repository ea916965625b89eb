"""The field's data formats (`flashcp.data.formats`), each read from a file laid out as its tool
writes it (`tests/fixtures/data_formats/`, made by `tests/fixtures/make_data_formats.py`):

* TRL's implicit prompt and UltraFeedback: the prompt split off at the longest common message
  prefix, written out by hand, tokenized as the explicit TRL conversation;
* ShareGPT and Alpaca: the conversation each row holds, written out by hand, trained as the
  same `messages` row;
* PaddleFormers' SFT and DPO rows: token for token what PaddleFormers' own readers
  (`MapSFTDataset`, `MapDPODataset`, jinja backend) make of the same file, except where
  PaddleFormers' one-turn encoding repeats `[gMASK]<sop>` before a later turn — exactly there;
* the pre-launch check (`detect`): the format of each file; data in none refused in one line
  naming the fields, the formats and the setting that would read it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.hfdir import write_tokenizer_files
from flashcp.config import Config
from flashcp.data import HFTokenizer, TrainData
from flashcp.data.dataset import Document, DocumentBuilder
from flashcp.data.dpo_records import DPOExample, DPORecords
from flashcp.data.dpo_stream import DPOData
from flashcp.data.formats import (
    FORMATS,
    DataFormatError,
    Fields,
    check_data,
    detect,
    formats_of,
    get,
)
from flashcp.data.records import BadRecordError
from flashcp.data.sources import JsonlSource, SampleSource, open_source
from flashcp.problems import ProblemsError
from helpers.configs import TINY_GLM, merged, tiny_config

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "data_formats"
FILES = {
    "implicit_prompt": FIX / "trl_hh_rlhf_helpful_base.parquet",
    "ultrafeedback": FIX / "ultrafeedback_binarized.parquet",
    "sharegpt": FIX / "sharegpt.json",
    "alpaca": FIX / "alpaca_data.json",
    "paddleformers_sft": FIX / "paddleformers_sft.jsonl",
    "paddleformers_dpo": FIX / "paddleformers_dpo.jsonl",
}
BASE = merged(TINY_GLM, model={"vocab_size": 384}, data={"seq_len": 128})


def _msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_files(tmp_path_factory.mktemp("glm"))


@pytest.fixture(scope="module")
def glm(tok_dir: Path) -> HFTokenizer:
    return HFTokenizer(tok_dir)


def _cfg(tmp: Path, tok_dir: Path, path: Path | None, recipe: str, **data: Any) -> Config:
    files = {"tokenizer": str(tok_dir), "path": None if path is None else str(path),
             "cache_dir": str(tmp / "cache")}  # fmt: skip
    return tiny_config(tmp, base=BASE, data={**files, **data}, run={"recipe": recipe})


def _rows(name: str) -> list[dict[str, Any]]:
    source = open_source(FILES[name], cache_dir=None)
    return [source.row(i) for i in range(len(source))]


def _same_doc(a: Document, b: Document) -> bool:
    return np.array_equal(a.tokens, b.tokens) and np.array_equal(a.targets, b.targets)


# -- TRL's implicit prompt, UltraFeedback -----------------------------------------------------

HH_PROMPTS = [
    [_msg("user", "What is a good way to learn to cook?")],
    [
        _msg("user", "Can you help me plan a trip?"),
        _msg("assistant", "Sure. Where would you like to go?"),
        _msg("user", "Somewhere warm in winter."),
    ],  # fmt: skip
    [_msg("user", "How do I keep my plants alive?")],
]
HH_ANSWERS = [
    ("Start with a few simple dishes and cook them often.", "Just order food instead."),
    ("A beach town in the south is a good choice in winter.", "I do not know any places."),
    ("Water them when the soil is dry and give them light.", "Plants always die, so do not try."),
]


def _explicit(prompt: list[dict[str, str]], good: str, bad: str) -> dict[str, Any]:
    """The same preference as TRL's explicit conversational row (flashcp's `preference`)."""
    return {"prompt": prompt, "chosen": [_msg("assistant", good)],
            "rejected": [_msg("assistant", bad)]}  # fmt: skip


def test_trl_implicit_prompt_rows_split_at_the_longest_common_prefix(
    glm: HFTokenizer, tmp_path: Path, tok_dir: Path
) -> None:
    rows = _rows("implicit_prompt")
    build = DPORecords(glm, budget=4096)
    for row, prompt, (good, bad) in zip(rows, HH_PROMPTS, HH_ANSWERS, strict=True):
        assert set(row) == {"chosen", "rejected"}  # as TRL ships it: no prompt column
        assert build.tokenize(row) == build.tokenize(_explicit(prompt, good, bad))
    # the multi-turn prompt keeps every shared turn (GLM-4's layout, written by hand)
    want = ("[gMASK]<sop><|user|>\nCan you help me plan a trip?<|assistant|>\nSure. Where would "
            "you like to go?<|user|>\nSomewhere warm in winter.<|assistant|>")  # fmt: skip
    assert list(build.tokenize(rows[1]).prompt) == glm.encode(want)
    # through the loader (Parquet, Arrow cache), auto-detected: every row is an example
    data = DPOData(_cfg(tmp_path, tok_dir, FILES["implicit_prompt"], "dpo"))
    assert data.num_examples == 3 and data.index.bad.total == 0


def test_ultrafeedback_rows_take_the_prompt_from_the_conversations(
    glm: HFTokenizer, tmp_path: Path, tok_dir: Path
) -> None:
    rows = _rows("ultrafeedback")
    build = DPORecords(glm, budget=4096)
    answers = [
        ("The sea is wide and blue,\nit sings the whole night through.", "Sea."),
        ("Air scatters blue light from the sun more than red light, so the sky looks blue.",
         "Because it is."),
    ]  # fmt: skip
    for row, (good, bad) in zip(rows, answers, strict=True):
        assert isinstance(row["prompt"], str) and row["chosen"][0]["content"] == row["prompt"]
        want = _explicit([_msg("user", row["prompt"])], good, bad)
        assert build.tokenize(row) == build.tokenize(want)
    for fmt in ("auto", "ultrafeedback"):
        data = DPOData(_cfg(tmp_path, tok_dir, FILES["ultrafeedback"], "dpo", format=fmt))
        assert data.num_examples == 2 and data.index.bad.total == 0, fmt
    # its `messages` column is the chosen conversation: the same file trains SFT
    sft = TrainData(_cfg(tmp_path, tok_dir, FILES["ultrafeedback"], "sft"))
    assert sft.num_documents == 2 and sft.bad_records.total == 0


def test_bad_preference_conversations(glm: HFTokenizer) -> None:
    build = DPORecords(glm, budget=4096)
    u, a, b = _msg("user", "Q?"), _msg("assistant", "A."), _msg("assistant", "B.")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"chosen": [a], "rejected": [b]}, "chosen and rejected share no prompt"),
        ({"chosen": [u, a], "rejected": [u, a]}, "chosen and rejected are the same conversation"),
        ({"chosen": [u, a, u, a], "rejected": [u, b]}, "an answer is not one assistant turn"),
        ({"chosen": [u, a], "rejected": [u]}, "field 'rejected' is not a list of messages"),
        ({"chosen": [u, u], "rejected": [u, a]}, "an answer is not one assistant turn"),
        (
            {"prompt": "Q?", "chosen": [u, a], "rejected": [u, _msg("assistant", " ")]},
            "empty answer",
        ),  # fmt: skip
        # a string prompt with bare answer turns is not UltraFeedback (nothing to split)
        (
            {"prompt": "Q?", "chosen": [a], "rejected": [b]},
            "prompt is a string but an answer is a message",
        ),  # fmt: skip
    ]
    for row, reason in cases:
        with pytest.raises(BadRecordError) as info:
            build.tokenize(row)
        assert info.value.reason == reason, (row, info.value)


# -- ShareGPT, Alpaca -------------------------------------------------------------------------


def test_sharegpt_rows_are_their_conversations(
    glm: HFTokenizer, tmp_path: Path, tok_dir: Path
) -> None:
    rows = _rows("sharegpt")  # one JSON array, as ShareGPT ships
    assert FILES["sharegpt"].read_text(encoding="utf-8").startswith('[\n  {\n    "id": ')
    want = [
        [_msg("user", "What is the capital of France?"),
         _msg("assistant", "The capital of France is Paris.")],
        [_msg("system", "You are a helpful assistant."), _msg("user", "Name a primary color."),
         _msg("assistant", "Red is a primary color."), _msg("user", "And another one?"),
         _msg("assistant", "Blue is another one.")],
    ]  # fmt: skip
    sharegpt = get("sharegpt", "sft")
    assert sharegpt is not None
    build = DocumentBuilder(glm, recipe="sft")
    for row, messages in zip(rows, want, strict=True):
        assert sharegpt.messages is not None and sharegpt.messages(row, Fields()) == messages
        assert _same_doc(build(row), build({"messages": messages}))
    # LLaMA-Factory's `system` column; `from`/`value` or `role`/`content`
    row = {
        "system": "Be brief.",
        "conversations": [
            {"from": "human", "value": "Hi"},
            {"role": "assistant", "content": "Hello"},
        ],
    }
    assert _same_doc(build(row), build({"messages": [_msg("system", "Be brief."),
                                                     _msg("user", "Hi"),
                                                     _msg("assistant", "Hello")]}))  # fmt: skip
    data = TrainData(_cfg(tmp_path, tok_dir, FILES["sharegpt"], "sft"))
    assert data.num_documents == 2 and data.bad_records.total == 0


def test_alpaca_rows_join_instruction_and_input(
    glm: HFTokenizer, tmp_path: Path, tok_dir: Path
) -> None:
    rows = _rows("alpaca")  # one JSON array, indent 4, as Stanford Alpaca's jdump writes
    assert FILES["alpaca"].read_text().startswith('[\n    {\n        "instruction": ')
    want = [
        [_msg("user", "Give three tips for staying healthy."),
         _msg("assistant", "1. Eat a balanced diet.\n2. Exercise regularly.\n3. Get enough "
                           "sleep.")],
        [_msg("user", "Translate the sentence into French.\nThe cat sleeps."),
         _msg("assistant", "Le chat dort.")],
    ]  # fmt: skip
    build = DocumentBuilder(glm, recipe="sft")
    for row, messages in zip(rows, want, strict=True):
        assert _same_doc(build(row), build({"messages": messages}))
    extra = {"system": "Be brief.", "history": [["Hi", "Hello"]], "instruction": "Bye",
             "input": None, "output": "Goodbye"}  # fmt: skip
    assert _same_doc(build(extra), build({"messages": [
        _msg("system", "Be brief."), _msg("user", "Hi"), _msg("assistant", "Hello"),
        _msg("user", "Bye"), _msg("assistant", "Goodbye")]}))  # fmt: skip
    data = TrainData(_cfg(tmp_path, tok_dir, FILES["alpaca"], "sft", format="alpaca"))
    assert data.num_documents == 2 and data.bad_records.total == 0


def test_bad_sharegpt_and_alpaca_rows(glm: HFTokenizer) -> None:
    build = DocumentBuilder(glm, recipe="sft")
    human, gpt = {"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"conversations": [human, {"from": "function_call", "value": "{}"}]},
         "unknown ShareGPT role"),
        ({"conversations": [human, {"from": "gpt"}]},
         "a ShareGPT turn's 'from' or 'value' is not a string"),
        ({"conversations": []}, "field 'conversations' is not a list of turns"),
        ({"conversations": [human, "A"]}, "field 'conversations' is not a list of turns"),
        ({"conversations": [gpt, human]}, "conversation does not end with an assistant turn"),
        ({"conversations": [human, {"from": "gpt", "value": ""}]}, "empty answer"),
        ({"instruction": "Q", "output": 3}, "field 'output' is not a string"),
        ({"instruction": "Q", "input": 1, "output": "A"}, "field 'input' is not a string"),
        ({"instruction": "Q", "output": "A", "history": ["Hi"]},
         "field 'history' is not a list of [instruction, answer] pairs"),
        ({"instruction": "Q", "output": ""}, "empty answer"),
    ]  # fmt: skip
    for row, reason in cases:
        with pytest.raises(BadRecordError) as info:
            build(row)
        assert info.value.reason == reason, (row, info.value)


# -- PaddleFormers ----------------------------------------------------------------------------

PF_CONFIG = dict(task_group_prob="1.0", sub_dataset_type="erniekit", random_seed=0,
                 mix_strategy="concat", template_backend="jinja", is_valid=True,
                 max_seq_len=512, packing=False, num_samples_each_epoch=6000000)  # fmt: skip
"""PaddleFormers' reader as its `sft` / `dpo` workflows configure it for a tokenizer's own
chat template (`template_backend: jinja`), unpacked, one pass in file order."""


@pytest.fixture(scope="module")
def pf_tok(tok_dir: Path) -> Any:
    from paddleformers.transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


def _pf_sft(pf_tok: Any, path: Path, *, one_turn: bool) -> list[tuple[list[int], list[int]]]:
    from paddleformers.datasets.SFTDataset import MapSFTDataset

    ds = MapSFTDataset(tokenizer=pf_tok, task_group=str(path), encode_one_turn=one_turn,
                       **PF_CONFIG)  # fmt: skip
    return [(list(s.token_ids), list(s.labels)) for (s,) in (ds[i] for i in range(len(ds)))]


def _pf_labels(doc: Document) -> list[int]:
    """flashcp's targets in PaddleFormers' SFT labels (shifted: position i holds token i + 1
    when that token is trained, else -100)."""
    t, m = doc.tokens.tolist(), doc.targets.tolist()
    return [t[i + 1] if m[i + 1] else -100 for i in range(len(t) - 1)] + [-100]


def _with_prefix_before(ids: list[int], at: int, prefix: list[int]) -> list[int]:
    return ids[:at] + prefix + ids[at:]


def test_paddleformers_sft_rows_match_paddleformers_own_reader(
    glm: HFTokenizer, pf_tok: Any
) -> None:
    path = FILES["paddleformers_sft"]
    rows = _rows("paddleformers_sft")
    build = DocumentBuilder(glm, recipe="sft")
    docs = [build(r) for r in rows]
    one_turn = _pf_sft(pf_tok, path, one_turn=True)  # PaddleFormers' default
    openai = _pf_sft(pf_tok, path, one_turn=False)  # encode_one_turn: false
    assert len(docs) == len(one_turn) == len(openai) == 3
    for doc, (tokens, labels) in zip(docs, openai, strict=True):
        assert (doc.tokens.tolist(), _pf_labels(doc)) == (tokens, labels)
    # single-turn rows: PaddleFormers' default gives the same tokens and labels
    for k in (0, 2):
        assert one_turn[k] == openai[k]
    # the two-turn row: its default repeats [gMASK]<sop> before the second turn, and only
    # there; `label: [0, 1]` is dropped by its reader, so both answers are trained, as here
    gmask, sop, user = (glm._tok.token_to_id(t) for t in ("[gMASK]", "<sop>", "<|user|>"))
    ids = docs[1].tokens.tolist()
    second = [i for i, t in enumerate(ids) if t == user][1]
    tokens, labels = one_turn[1]
    assert tokens == _with_prefix_before(ids, second, [gmask, sop])
    assert labels == _with_prefix_before(_pf_labels(docs[1]), second, [-100, -100])
    assert ids.count(gmask) == 1 and tokens.count(gmask) == 2
    assert rows[1]["label"] == [0, 1] and sum(docs[1].targets) > sum(docs[0].targets)
    # the conversation flashcp reads, written out (PaddleFormers' convert_txt_data layout)
    assert _same_doc(
        docs[1],
        build(
            {
                "messages": [
                    _msg("system", "You are a small life assistant"),
                    _msg("user", "How can we save water at home?"),
                    _msg("assistant", "Use water-saving shower heads."),
                    _msg("user", "Any other suggestions?"),
                    _msg("assistant", "Fix leaking pipes quickly."),
                ]
            }
        ),
    )


def test_paddleformers_eos_after_a_template_that_closes_turns_with_it(tmp_path: Path) -> None:
    """The documented EOS difference: with a ChatML template (answers end `<|im_end|>\\n`,
    `<|im_end|>` the EOS) PaddleFormers appends a second EOS, flashcp none."""
    from paddleformers.transformers import AutoTokenizer

    from bench.hfdir import write_chatml_tokenizer

    tok_dir = write_chatml_tokenizer(tmp_path / "chatml")
    path = tmp_path / "one.jsonl"
    path.write_text('{"src": "Hi there", "tgt": "Hello friend"}\n')
    ((tokens, labels),) = _pf_sft(AutoTokenizer.from_pretrained(str(tok_dir)), path,
                                  one_turn=True)  # fmt: skip
    tok = HFTokenizer(tok_dir)
    doc = DocumentBuilder(tok, recipe="sft")(json.loads(path.read_text()))
    ids = doc.tokens.tolist()
    assert ids[-2:] == [tok.eos_id, tok.encode("\n")[0]] and tokens == [*ids, tok.eos_id]
    assert labels[:-2] == _pf_labels(doc)[:-1]


def test_paddleformers_dpo_rows_match_paddleformers_own_reader(
    glm: HFTokenizer, pf_tok: Any, tmp_path: Path, tok_dir: Path
) -> None:
    from paddleformers.datasets.DPODataset import MapDPODataset

    path = FILES["paddleformers_dpo"]
    rows = _rows("paddleformers_dpo")
    build = DPORecords(glm, budget=4096)
    examples = [build.tokenize(r) for r in rows]
    ds = MapDPODataset(tokenizer=pf_tok, task_group=str(path), **PF_CONFIG)
    pf = [s for (s,) in ds.new_data[: len(rows)]]

    def packed(ex: DPOExample) -> tuple[list[int], list[int]]:  # PaddleFormers' layout
        p, c, r = list(ex.prompt), list(ex.chosen), list(ex.rejected)
        return p + c[:-1] + [p[-1]] + r[:-1], [-100] * (len(p) - 1) + c + r

    # the single-turn row: the same prompt, answers and layout (sort [1, 0]: the first chosen)
    assert packed(examples[0]) == (pf[0].token_ids, pf[0].response_labels)
    assert examples[0].chosen[:-1] == tuple(glm.encode("\nNeither: both are objects, not food."))
    # the two-turn prompt: PaddleFormers encodes each turn alone (its DPO reader always does),
    # repeating [gMASK]<sop> before the second; sort [0, 1] chooses the second response
    gmask, sop, user = (glm._tok.token_to_id(t) for t in ("[gMASK]", "<sop>", "<|user|>"))
    ex = examples[1]
    assert ex.chosen[:-1] == tuple(glm.encode("\nOats with fruit are a good breakfast."))
    second = [i for i, t in enumerate(ex.prompt) if t == user][1]
    tokens, labels = packed(ex)
    assert pf[1].token_ids == _with_prefix_before(tokens, second, [gmask, sop])
    assert pf[1].response_labels == _with_prefix_before(labels, second, [-100, -100])
    assert ex.prompt.count(gmask) == 1
    want = build.tokenize(_explicit(
        [_msg("system", "You are a small life assistant"), _msg("user", "Hello."),
         _msg("assistant", "Hello, I am your small life assistant."),
         _msg("user", "What should I eat for breakfast?")],
        "Oats with fruit are a good breakfast.", "Nothing."))  # fmt: skip
    assert ex == want
    data = DPOData(_cfg(tmp_path, tok_dir, path, "dpo", format="paddleformers"))
    assert data.num_examples == 2 and data.index.bad.total == 0


def test_bad_paddleformers_rows(glm: HFTokenizer) -> None:
    sft = DocumentBuilder(glm, recipe="sft")
    dpo = DPORecords(glm, budget=4096)
    pair = {"response": ["A", "B"], "sort": [1, 0]}
    cases: list[tuple[Any, dict[str, Any], str]] = [
        (sft, {"src": ["Q1", "Q2"], "tgt": ["A1"]}, "src and tgt differ in length"),
        (sft, {"src": "Q", "tgt": "A", "label": [1, 1]}, "src and tgt differ in length"),
        (sft, {"src": "Q", "tgt": " "}, "empty turn in a PaddleFormers row"),
        (sft, {"src": "Q", "tgt": 3}, "field 'tgt' is not a string or a list of strings"),
        (sft, {"src": "S", "tgt": "x", "is_system": 1}, "no turns"),
        (sft, {"src": "Q", "tgt": "A", "system": 5}, "field 'system' is not a string"),
        (dpo, {"src": "Q", "tgt": ["A"], **pair}, "src must hold one turn more than tgt"),
        (dpo, {"src": "Q", "tgt": [], "response": ["A"], "sort": [1, 0]},
         "field 'response' is not two answers"),
        (dpo, {"src": "Q", "tgt": [], "response": ["A", "B"], "sort": [1, 1]},
         "field 'sort' is not two different ranks"),
        (dpo, {"src": "Q", "tgt": [], "response": [["A", "Q2", "A2"], ["B"]], "sort": [1, 0]},
         "an answer is not one assistant turn"),
        (dpo, {"src": "Q", "tgt": [], "response": ["A", ""], "sort": [1, 0]}, "empty answer"),
        (dpo, {"src": "Q", "tgt": [], "response": [3, "B"], "sort": [1, 0]},
         "field 'response' is not two answers"),
    ]  # fmt: skip
    for build, row, reason in cases:
        with pytest.raises(BadRecordError) as info:
            build.tokenize(row) if build is dpo else build(row)
        assert info.value.reason == reason, (row, info.value)
    # is_system: 1 takes the system prompt from the first src (and drops the first tgt)
    row = {"src": ["Be brief.", "Q"], "tgt": ["-", "A"], "is_system": 1}
    assert _same_doc(sft(row), sft({"messages": [_msg("system", "Be brief."), _msg("user", "Q"),
                                                 _msg("assistant", "A")]}))  # fmt: skip
    dpo_system = {"src": ["Be brief.", "Q"], "tgt": ["-"], "is_system": 1, **pair}
    assert dpo.tokenize(dpo_system) == dpo.tokenize(_explicit(
        [_msg("system", "Be brief."), _msg("user", "Q")], "A", "B"))  # fmt: skip
    # a PaddleFormers DPO row under the sft recipe is in no sft format
    with pytest.raises(BadRecordError, match="missing field 'messages'.*PaddleFormers"):
        sft({"src": "Q", "tgt": [], **pair})


# -- data.format: detection, the pre-launch check, settings ----------------------------------


def test_each_file_is_detected_as_its_format(tmp_path: Path, tok_dir: Path) -> None:
    want = {
        "implicit_prompt": ("dpo", "implicit_prompt"),
        "ultrafeedback": ("dpo", "ultrafeedback"),
        "sharegpt": ("sft", "sharegpt"),
        "alpaca": ("sft", "alpaca"),
        "paddleformers_sft": ("sft", "paddleformers"),
        "paddleformers_dpo": ("dpo", "paddleformers"),
    }
    for name, (recipe, fmt) in want.items():
        sample = SampleSource(open_source(FILES[name]), 64)
        assert sample.records() == _rows(name), name
        assert detect(sample.records(), recipe=recipe).name == fmt, name
        found = check_data(_cfg(tmp_path, tok_dir, FILES[name], recipe), sample)
        assert found is not None and found.name == fmt
    assert check_data(_cfg(tmp_path, tok_dir, None, "sft"), sample) is None  # built-in data
    assert {f.name for f in formats_of("sft")} == {"messages", "sharegpt", "paddleformers",
                                                   "alpaca", "prompt_response"}  # fmt: skip
    assert len(FORMATS) == 10
    # one directory mixing formats: each row read in its own
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for name in ("sharegpt", "alpaca"):
        (mixed / FILES[name].name).write_bytes(FILES[name].read_bytes())
    data = TrainData(_cfg(tmp_path, tok_dir, mixed, "sft"))
    assert data.num_documents == 4 and data.bad_records.total == 0


def test_a_preflight_reads_each_sampled_row_once_and_checks_its_format(
    tmp_path: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flashcp.data.sources import iter_json_array

    reads: list[int] = []
    row = JsonlSource.row
    monkeypatch.setattr(JsonlSource, "row", lambda self, i: (reads.append(i), row(self, i))[1])
    lines = tmp_path / "d.jsonl"
    lines.write_text('{"text": "a"}\n\n{oops\n{"text": "b"}\n{"text": "c"}\n')
    sample = SampleSource(open_source(lines), 64)
    assert sample.records() == [{"text": "a"}, {"text": "b"}, {"text": "c"}]
    with pytest.raises(BadRecordError, match="not valid JSON: Expecting property name"):
        sample.row(1)
    assert reads == [0, 1, 2, 3]  # each row once, however often the sample is asked
    # the preflight's one call: the data class samples the rows and refuses them before indexing
    qa = tmp_path / "qa.jsonl"
    qa.write_text('{"question": "Q", "answer": "A"}\n' * 3)
    reads.clear()
    with pytest.raises(DataFormatError, match="data.prompt_field=question data.response_field"):
        TrainData(_cfg(tmp_path, tok_dir, qa, "sft"), sample=64)
    assert reads == [0, 1, 2]
    with pytest.raises(ValueError, match="starts a JSON array but is not valid JSON at line 1: "
                                         "expected '\\['"):  # fmt: skip
        list(iter_json_array(lines))


def _refusal(rows: list[Any], recipe: str, **data: Any) -> str:
    from flashcp.config.schema import DataConfig

    with pytest.raises(DataFormatError) as info:
        detect(rows, recipe=recipe, data=DataConfig(**data), source="data.path d.jsonl")
    message = str(info.value)
    assert "\n" not in message
    return message


def test_data_in_no_format_is_refused_naming_fields_formats_and_the_setting() -> None:
    qa = [{"question": "Q", "answer": "A", "id": 1}]
    msg = _refusal(qa, "sft")
    assert msg.startswith(
        "data.path d.jsonl: none of the 1 rows sampled is in a format "
        "run.recipe sft reads (`messages`: [{role, content}]; ShareGPT"
    )
    assert "the rows' fields are question (string), answer (string), id (int)" in msg
    assert "Alpaca `instruction`, `input`, `output`" in msg and "PaddleFormers `src`" in msg
    assert msg.endswith("to read them set data.prompt_field=question data.response_field=answer")
    pairs = _refusal([{"prompt": "Q", "chosen": "A", "rejected": "B"}], "sft")
    assert pairs.endswith("to read them set run.recipe=dpo")
    chat = _refusal([{"dialog": [{"role": "user", "content": "Q"}]}], "sft")
    assert "dialog (list of {content, role})" in chat
    assert chat.endswith("data.messages_field=dialog")
    dpo = _refusal([{"question": "Q", "good": "A", "bad": "B"}], "dpo")
    assert "TRL implicit prompt" in dpo and dpo.endswith(
        "data.prompt_field=question data.chosen_field=good data.rejected_field=bad"
    )
    # a suggestion is made only when it reads the rows: string answers with no prompt are not
    # TRL's implicit prompt (whole conversations), so no field names would help
    unreadable = _refusal([{"good": "A", "bad": "B"}], "dpo")
    assert unreadable.endswith("; convert them to one of these")
    lists = _refusal([{"q": ["x"]}], "dpo")
    assert "fields are q (list); convert them to one of these" in lists
    nowhere = _refusal([{"q": 1}], "sft", format="sharegpt")
    assert nowhere.endswith("fields are q (int); convert them to one of these")
    text = _refusal([{"content": "words"}], "pretrain")
    assert text.endswith("to read them set data.text_field=content")
    nothing = _refusal([None, 3], "sft")
    assert "fields are none (no JSON object); convert them to one of these" in nothing
    # a set format no row is in; auto would read them
    alpaca = [{"instruction": "Q", "input": "", "output": "A"}]
    pinned = _refusal(alpaca, "sft", format="sharegpt")
    assert "is in data.format sharegpt (ShareGPT `conversations`" in pinned
    assert pinned.endswith("to read them set data.format=auto (they are alpaca rows)")
    # some rows fit: not refused (the others are bad records); the most common format wins
    assert detect([*qa, *alpaca, *alpaca], recipe="sft").name == "alpaca"


def test_a_set_format_reads_every_row_in_it(glm: HFTokenizer) -> None:
    alpaca = {"instruction": "Q", "output": "A"}
    build = DocumentBuilder(glm, recipe="sft", format="sharegpt")
    with pytest.raises(
        BadRecordError,
        match="not a sharegpt row: data.format sharegpt reads "
        "ShareGPT .* the record's keys: instruction, output",
    ):
        build(alpaca)
    assert len(DocumentBuilder(glm, recipe="sft", format="alpaca")(alpaca)) > 0
    with pytest.raises(BadRecordError, match="not a preference row"):
        DPORecords(glm, budget=64, format="preference").tokenize({"chosen": [], "rejected": []})
    with pytest.raises(
        ValueError,
        match="data.format 'sharegpt' is not a format of run.recipe "
        "dpo: use auto or one of paddleformers, ultrafeedback",
    ):
        DPORecords(glm, budget=64, format="sharegpt")


def test_data_format_is_validated_against_the_recipe(tmp_path: Path) -> None:
    with pytest.raises(ProblemsError) as info:
        tiny_config(tmp_path, base=BASE, data={"format": "sharegpt"}, run={"recipe": "dpo"})
    assert "data.format: sharegpt is a format of run.recipe sft, not dpo: set data.format to " \
           "one of auto, paddleformers, ultrafeedback, preference, implicit_prompt" in str(
               info.value)  # fmt: skip
    with pytest.raises(ProblemsError, match="unknown format 'sharegtp'.*sharegpt"):
        tiny_config(tmp_path, base=BASE, data={"format": "sharegtp"}, run={"recipe": "sft"})
    ok = tiny_config(tmp_path, base=BASE, data={"format": "paddleformers"}, run={"recipe": "dpo"})
    assert ok.data.format == "paddleformers"


def test_existing_formats_read_as_before(glm: HFTokenizer) -> None:
    """The formats flashcp read before `data.format`: each row read by the same code whether
    the format is detected or set, and the reasons of rows in no format unchanged."""
    conv = [_msg("user", "Q"), _msg("assistant", "A")]
    for fmt, row in (("messages", {"messages": conv}),
                     ("prompt_response", {"prompt": "Q", "response": "A"})):  # fmt: skip
        assert _same_doc(DocumentBuilder(glm, recipe="sft")(row),
                         DocumentBuilder(glm, recipe="sft", format=fmt)(row))  # fmt: skip
    for row in (
        {"prompt": "Question?", "chosen": "A", "rejected": "B"},
        {"prompt": conv[:1], "chosen": conv[1:], "rejected": [_msg("assistant", "B")]},
    ):
        assert DPORecords(glm, budget=64).tokenize(row) == DPORecords(
            glm, budget=64, format="preference").tokenize(row)  # fmt: skip
    with pytest.raises(
        BadRecordError,
        match=r"^missing field 'messages': an sft record needs "
        r"one of: .* its keys: text$",
    ):
        DocumentBuilder(glm, recipe="sft")({"text": "x"})
