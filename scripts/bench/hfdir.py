"""Test-sized Hugging Face tokenizer files, generated (never downloaded): reuse them anywhere a
test or a benchmark needs a real tokenizer directory (data, from_pretrained, export round trips;
the data benchmark `bench.data`, which is why this lives here: no script imports from tests/).

    from bench.hfdir import write_tokenizer_files
    tok_dir = write_tokenizer_files(tmp_path / "model")   # tokenizer.json + configs

The tokenizer is a byte-level BPE trained with the `tokenizers` library on flashcp's shipped
corpus and preference set (deterministic: same files every time), with GLM-4's special tokens
(`<|endoftext|>`, `[MASK]`, `[gMASK]`, `[sMASK]`, `<sop>`, `<eop>`, `<|system|>`, `<|user|>`,
`<|assistant|>`, `<|observation|>`, ids 0-9). `tokenizer_config.json` follows the layout of
GLM-4's own (Hugging Face `THUDM/GLM-4-9B-0414`, tokenizer_config.json): `eos_token` and
`pad_token` are `<|endoftext|>`, no `bos_token`, `PreTrainedTokenizerFast`, and a chat template
that renders the way GLM-4's does:

    [gMASK]<sop><|system|>\\n{system}<|user|>\\n{user}<|assistant|>\\n{answer}...

system messages first, every other turn as `<|role|>` + newline + content, and
`add_generation_prompt` appending `<|assistant|>` (the template here is a small rewrite with
the same output for system/user/assistant/observation turns; GLM-4's also renders tools and
`metadata`). It uses `{%- ... %}` whitespace control and `raise_exception`, so rendering it
needs HF's Jinja environment (trim_blocks, lstrip_blocks, its globals).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

GLM_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
)

GLM4_CHAT_TEMPLATE = """[gMASK]<sop>
{%- for message in messages if message.role == 'system' %}
<|system|>
{{ message.content }}
{%- endfor %}
{%- for message in messages if message.role != 'system' %}
{%- if message.role in ('user', 'assistant', 'observation') %}
<|{{ message.role }}|>
{{ message.content }}
{%- else %}
{{ raise_exception('unknown role ' ~ message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|assistant|>
{%- endif %}"""
"""A GLM-4-style chat template (see the module docstring)."""

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""A ChatML template (Qwen-style): each turn closed by `<|im_end|>`, the tokenizer's EOS."""

CHATML_SPECIAL_TOKENS = ("<|im_end|>", "<|im_start|>", "<|endoftext|>")

DEFAULT_VOCAB = 384
"""Target vocabulary of the trained BPE (the tiny test models' model.vocab_size)."""


def training_corpus() -> list[str]:
    """The texts the BPE is trained on: flashcp's shipped corpus and preference set."""
    from importlib import resources

    pkg = resources.files("flashcp.data")
    texts = []
    for name in ("default_corpus.jsonl", "dpo_default.jsonl"):
        for line in pkg.joinpath(name).read_text(encoding="utf-8").splitlines():
            if line.strip():
                texts += [v for v in json.loads(line).values() if isinstance(v, str)]
    return texts


def build_bpe(specials: tuple[str, ...], vocab_size: int = DEFAULT_VOCAB) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` trained on `training_corpus()` (trained once
    per process and arguments, then copied)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_trained_json(tuple(specials), int(vocab_size)))


@functools.lru_cache(maxsize=8)
def _trained_json(specials: tuple[str, ...], vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer)
    return str(tok.to_str())


def write_tokenizer_files(
    directory: str | Path,
    *,
    chat_template: str | None = GLM4_CHAT_TEMPLATE,
    specials: tuple[str, ...] = GLM_SPECIAL_TOKENS,
    eos_token: str = "<|endoftext|>",
    pad_token: str | None = "<|endoftext|>",
    bos_token: str | None = None,
    vocab_size: int = DEFAULT_VOCAB,
) -> Path:
    """Write `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json` into
    `directory` (created if needed; other files there are left alone); returns it."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_bpe(specials, vocab_size)
    tok.save(str(out / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 128000,
        "padding_side": "left",
        "eos_token": eos_token,
        "pad_token": pad_token,
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t in specials
        },
    }
    if bos_token is not None:
        config["bos_token"] = bos_token
    if chat_template is not None:
        config["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map: dict[str, Any] = {"eos_token": eos_token}
    if pad_token is not None:
        special_map["pad_token"] = pad_token
    if bos_token is not None:
        special_map["bos_token"] = bos_token
    named = set(special_map.values())
    special_map["additional_special_tokens"] = [t for t in specials if t not in named]
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return out


def write_chatml_tokenizer(directory: str | Path) -> Path:
    """A ChatML tokenizer directory (EOS `<|im_end|>`, the token that closes every turn)."""
    return write_tokenizer_files(
        directory,
        chat_template=CHATML_TEMPLATE,
        specials=CHATML_SPECIAL_TOKENS,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )


def write_jsonl(path: str | Path, records: list[Any]) -> Path:
    """`records` as JSON lines (a record may be any JSON value, to test bad rows)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return p


def write_parquet(path: str | Path, records: list[dict[str, Any]]) -> Path:
    """`records` as a Parquet file (columns from the records' keys, via pyarrow)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), str(p))
    return p


def chat_records(n: int, *, start: int = 0) -> list[dict[str, Any]]:
    """`n` deterministic SFT conversations (`messages`), alternately one and two turns, some
    with a system message; answers drawn from the shipped preference set (conversation i uses
    its pairs i and i + 7, modulo its 52: `start` past another set's last pair + 7 gives
    records sharing no pair with it, e.g. a held-out set)."""
    from importlib import resources

    text = resources.files("flashcp.data").joinpath("dpo_default.jsonl").read_text("utf-8")
    pairs = [json.loads(line) for line in text.splitlines() if line.strip()]
    out = []
    for i in range(start, start + n):
        a, b = pairs[i % len(pairs)], pairs[(i + 7) % len(pairs)]
        messages = [{"role": "system", "content": "Answer briefly."}] if i % 3 == 0 else []
        messages += [
            {"role": "user", "content": a["prompt"]},
            {"role": "assistant", "content": a["chosen"]},
        ]
        if i % 2:
            messages += [
                {"role": "user", "content": b["prompt"]},
                {"role": "assistant", "content": b["chosen"]},
            ]
        out.append({"messages": messages})
    return out


def preference_records(n: int, *, as_messages: bool, start: int = 0) -> list[dict[str, Any]]:
    """`n` deterministic DPO records from the shipped preference set (its pairs `start`,
    `start` + 1, ... modulo its 52): strings, or TRL's conversational form (prompt = messages,
    chosen/rejected = one assistant message each)."""
    from importlib import resources

    text = resources.files("flashcp.data").joinpath("dpo_default.jsonl").read_text("utf-8")
    pairs = [json.loads(line) for line in text.splitlines() if line.strip()]
    out: list[dict[str, Any]] = []
    for i in range(start, start + n):
        p = pairs[i % len(pairs)]
        if not as_messages:
            out.append(dict(p))
            continue
        out.append(
            {
                "prompt": [{"role": "user", "content": p["prompt"]}],
                "chosen": [{"role": "assistant", "content": p["chosen"]}],
                "rejected": [{"role": "assistant", "content": p["rejected"]}],
            }
        )
    return out
