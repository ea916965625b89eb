"""The data formats flashcp reads: the layouts the field's tools write, detected row by row or
set by `data.format`, each turned into what flashcp trains on.

* pretrain — `text`: a `text` string;
* sft — `messages`: `[{role, content}]` (TRL's conversational language modeling, OpenAI chat);
  `sharegpt`: `conversations` of `{from, value}` turns, roles human / gpt / system (ShareGPT,
  LLaMA-Factory); `paddleformers`: `src`, `tgt` strings or multi-turn lists, `system`
  (PaddleFormers / ERNIEKit); `alpaca`: `instruction`, `input`, `output`, `system`,
  `history` (Stanford Alpaca, as LLaMA-Factory reads it); `prompt_response`: `prompt`,
  `response` strings, no chat template (flashcp);
* dpo — `paddleformers`: `src`, `tgt`, `response`, `sort`, `system`; `ultrafeedback`: a
  `prompt` string and `chosen` / `rejected` whole conversations (HuggingFaceH4's
  UltraFeedback); `preference`: `prompt`, `chosen`, `rejected` strings, or TRL's explicit
  conversational rows; `implicit_prompt`: `chosen` / `rejected` whole conversations sharing
  the prompt turns (TRL's implicit prompt).

Every chat format becomes a list of `{role, content}` messages (sft) or a prompt conversation
with a chosen and a rejected assistant turn (dpo); `flashcp.data.chat` renders them through
the tokenizer's chat template, once per conversation (as transformers' `apply_chat_template`
and the serving engines do), with the loss on the assistant turns. The field names of the
flashcp formats (`text`, `messages`, `prompt`, `response`, `chosen`, `rejected`) follow
`data.*_field`; the other formats' names are fixed by their tools.

`data.format: auto` (the default) reads each row in the first format of its recipe's list
(`RecipeSpec.formats`, `flashcp.config.recipe_spec`: a recipe names the formats it reads)
whose fields it has, so one file (or a directory) may mix formats; a set format reads every
row in it (a row without its fields is a bad record). `detect(rows, ...)`
is the pre-launch check of a sample (`check_data`: the rows a preflight's `SampleSource`
read): it refuses data in which no row fits, naming the fields found, the formats accepted and
the setting that would read it. docs/data.md has the details of each format and where
renderings differ from PaddleFormers'.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from flashcp.config.recipe_spec import RECIPES, Examples
from flashcp.config.schema import DataConfig
from flashcp.data.records import ROLE_ASSISTANT, BadRecordError, has_field, message_list
from flashcp.data.sources import SampleSource

Messages = list[dict[str, Any]]
Preference = tuple[Messages, Any, Any]
"""A preference row as flashcp reads it: the prompt messages and the chosen and rejected
answers (each an assistant message, a one-message list, or its content string)."""


@dataclass(frozen=True)
class Fields:
    """The field names of flashcp's own formats (`data.text_field`, ...)."""

    text: str = "text"
    prompt: str = "prompt"
    response: str = "response"
    messages: str = "messages"
    chosen: str = "chosen"
    rejected: str = "rejected"

    @classmethod
    def of(cls, data: DataConfig) -> Fields:
        return cls(
            text=data.text_field,
            prompt=data.prompt_field,
            response=data.response_field,
            messages=data.messages_field,
            chosen=data.chosen_field,
            rejected=data.rejected_field,
        )


@dataclass(frozen=True)
class Format:
    """One data format read as one kind of example (`examples`, the kind a recipe declares:
    `flashcp.config.recipe_spec.RecipeSpec`): how to tell a row is in it (`matches`) and, for
    chat formats, the conversation (`messages`, supervised) or preference (`preference`) it
    holds. `messages` / `preference` None: the recipe's builder reads the row itself
    (flashcp's plain-text formats)."""

    name: str
    examples: Examples
    layout: str
    """What a row holds, for messages (`conversations: [{from, value}]`)."""
    match: Callable[[dict[str, Any], Fields], bool]
    messages: Callable[[dict[str, Any], Fields], Messages] | None = None
    preference: Callable[[dict[str, Any], Fields], Preference] | None = None
    field: Callable[[Fields], str] = lambda f: ""
    """The field a conversation's messages come from, for bad-record details."""

    def matches(self, record: dict[str, Any], fields: Fields) -> bool:
        """`record` has this format's fields (of the right kinds)."""
        return bool(self.match(record, fields))

    def check(self, record: dict[str, Any], fields: Fields) -> None:
        """`BadRecordError` unless `record` is in this format (a row of a file whose
        `data.format` is set)."""
        if not self.matches(record, fields):
            keys = ", ".join(sorted(map(str, record))) or "none"
            raise BadRecordError(
                f"not a {self.name} row",
                f"data.format {self.name} reads {self.layout}; the record's keys: {keys}",
            )


# ----------------------------------------------------------------------------- row checks


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_turns(value: Any) -> bool:
    """A non-empty list whose first element is a dict (a list of messages or turns)."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict)


def _strings(record: dict[str, Any], name: str) -> list[str]:
    """`record[name]` as a list of strings (a string is a one-element list), PaddleFormers'
    reading of `src` / `tgt`."""
    value = record.get(name)
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        got = "missing" if value is None else type(value).__name__
        raise BadRecordError(
            f"field {name!r} is not a string or a list of strings", f"{name} is {got}"
        )
    return list(value)


def _system(record: dict[str, Any], name: str = "system") -> str | None:
    """An optional system prompt field: its string, None when absent or null."""
    value = record.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadRecordError(f"field {name!r} is not a string", f"got {type(value).__name__}")
    return value


# -------------------------------------------------------------------------------- sft


def _messages(record: dict[str, Any], f: Fields) -> Messages:
    return message_list(record[f.messages], f.messages)


SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
"""ShareGPT's `from` values → chat roles (LLaMA-Factory's defaults, plus the role names
themselves, which TRL's examples write)."""


def _sharegpt(record: dict[str, Any], f: Fields) -> Messages:
    """`conversations` → messages: `from` / `value` (or `role` / `content`) per turn, roles
    mapped by `SHAREGPT_ROLES`; a top-level `system` string (LLaMA-Factory's column) is the
    system message unless the first turn is one."""
    turns = record.get("conversations")
    if not _is_turns(turns):
        got = "an empty list" if turns == [] else type(turns).__name__
        raise BadRecordError("field 'conversations' is not a list of turns", f"got {got}")
    out: Messages = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadRecordError(
                "field 'conversations' is not a list of turns", f"turn {k} is a "
                f"{type(turn).__name__}"
            )  # fmt: skip
        who = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        if not isinstance(who, str) or not isinstance(text, str):
            raise BadRecordError(
                "a ShareGPT turn's 'from' or 'value' is not a string",
                f"conversations[{k}] has keys {', '.join(sorted(map(str, turn)))}",
            )
        if who not in SHAREGPT_ROLES:
            raise BadRecordError(
                "unknown ShareGPT role",
                f"conversations[{k}].from is {who!r}; flashcp reads "
                f"{', '.join(SHAREGPT_ROLES)}",
            )
        out.append({"role": SHAREGPT_ROLES[who], "content": text})
    system = _system(record)
    if system and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": system})
    return out


def _alpaca(record: dict[str, Any], f: Fields) -> Messages:
    """Alpaca → messages, as LLaMA-Factory reads it: the user turn is `instruction` and
    `input` joined by a newline (the empty ones left out), the answer `output`; optional
    `system` string and `history` of earlier [instruction, answer] pairs."""
    out: Messages = []
    system = _system(record)
    if system:
        out.append({"role": "system", "content": system})
    history = record.get("history")
    if history is not None:
        if not isinstance(history, list) or not all(
            isinstance(p, list | tuple) and len(p) == 2 and all(isinstance(s, str) for s in p)
            for p in history
        ):
            raise BadRecordError(
                "field 'history' is not a list of [instruction, answer] pairs",
                f"got {json.dumps(history)[:80]}",
            )
        for question, answer in history:
            out += [{"role": "user", "content": question},
                    {"role": ROLE_ASSISTANT, "content": answer}]  # fmt: skip
    parts = []
    for name in ("instruction", "input"):
        value = record.get(name)
        if value is not None and not isinstance(value, str):
            raise BadRecordError(f"field {name!r} is not a string", f"got {type(value).__name__}")
        if value:
            parts.append(value)
    output = record.get("output")
    if not isinstance(output, str):
        got = "missing" if output is None else type(output).__name__
        raise BadRecordError("field 'output' is not a string", f"output is {got}")
    out += [{"role": "user", "content": "\n".join(parts)},
            {"role": ROLE_ASSISTANT, "content": output}]  # fmt: skip
    return out


def _paddleformers_sft(record: dict[str, Any], f: Fields) -> Messages:
    """PaddleFormers' SFT row (`erniekit` type) → messages, as its reader
    (`paddleformers.datasets.reader.convertor.convert_txt_data`) builds them: `src` / `tgt`
    strings or equally long lists of turns, `is_system: 1` taking the system prompt from the
    first `src`, a non-empty `system` string as the system message. Its `label` is dropped
    there, so every answer is trained, here too."""
    src, tgt = _strings(record, "src"), _strings(record, "tgt")
    if not src or not tgt or any(not s.strip() for s in src + tgt):
        raise BadRecordError(
            "empty turn in a PaddleFormers row",
            f"src has {len(src)} and tgt {len(tgt)} turn(s); PaddleFormers skips rows with an "
            "empty src or tgt string",
        )
    label = record.get("label")
    if len(src) != len(tgt) or (isinstance(label, list) and len(label) != len(src)):
        extra = f", label {len(label)}" if isinstance(label, list) else ""
        raise BadRecordError(
            "src and tgt differ in length",
            f"src has {len(src)} turn(s), tgt {len(tgt)}{extra}: a PaddleFormers SFT row "
            "pairs each src with one tgt",
        )
    system = _system(record)
    if record.get("is_system") == 1:
        system, src, tgt = src[0], src[1:], tgt[1:]
        if not src:
            raise BadRecordError("no turns", "is_system: 1 and src holds only the system prompt")
    out: Messages = [{"role": "system", "content": system}] if system else []
    for question, answer in zip(src, tgt, strict=True):
        out += [{"role": "user", "content": question},
                {"role": ROLE_ASSISTANT, "content": answer}]  # fmt: skip
    return out


# -------------------------------------------------------------------------------- dpo


def _answer_lists(record: dict[str, Any], f: Fields) -> tuple[Messages, Messages]:
    chosen = message_list(record[f.chosen], f.chosen)
    rejected = message_list(record[f.rejected], f.rejected)
    return chosen, rejected


def _implicit(record: dict[str, Any], f: Fields) -> Preference:
    """TRL's implicit prompt (`trl.data_utils.extract_prompt`): `chosen` and `rejected` are
    whole conversations; the prompt is their longest common prefix of messages, each answer
    what follows it (one assistant turn)."""
    chosen, rejected = _answer_lists(record, f)
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if n == 0:
        raise BadRecordError(
            "chosen and rejected share no prompt",
            f"their first messages differ; an implicit-prompt row repeats the prompt turns at "
            f"the start of both {f.chosen!r} and {f.rejected!r}",
        )
    if n == len(chosen) == len(rejected):
        raise BadRecordError("chosen and rejected are the same conversation")
    return chosen[:n], chosen[n:], rejected[n:]


def _ultrafeedback(record: dict[str, Any], f: Fields) -> Preference:
    """UltraFeedback (binarized): `prompt` is a string and `chosen` / `rejected` whole
    conversations that begin with it. As TRL's `maybe_extract_prompt` does, the prompt is
    taken from the conversations (their common prefix), the string being its copy."""
    return _implicit(record, f)


def _paddleformers_dpo(record: dict[str, Any], f: Fields) -> Preference:
    """PaddleFormers' DPO row → a preference, as its reader
    (`paddleformers.datasets.reader.convertor.convert_dpo_txt_data`) builds it: the prompt is
    the `system` message (when the key is present), then `src` turns with the `tgt` answers
    between them (one fewer); `response` holds two answers and `sort` their ranks, the higher
    one chosen. Each answer must be one turn (PaddleFormers also takes odd-length lists that
    continue the conversation; flashcp trains one assistant turn per answer)."""
    src, tgt = _strings(record, "src"), _strings(record, "tgt")
    if len(src) != len(tgt) + 1:
        raise BadRecordError(
            "src must hold one turn more than tgt",
            f"src has {len(src)}, tgt {len(tgt)}: the last src is the question both "
            "responses answer",
        )
    response, sort = record.get("response"), record.get("sort")
    if not isinstance(response, list) or len(response) != 2:
        raise BadRecordError("field 'response' is not two answers", f"got {response!r:.80}")
    if (
        not isinstance(sort, list)
        or len(sort) != 2
        or not all(isinstance(s, int | float) and not isinstance(s, bool) for s in sort)
        or sort[0] == sort[1]
    ):
        raise BadRecordError("field 'sort' is not two different ranks", f"got {sort!r:.80}")
    answers = []
    for k, answer in enumerate(response):
        turns = [answer] if isinstance(answer, str) else answer
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            raise BadRecordError(
                "field 'response' is not two answers", f"response[{k}] is {answer!r:.60}"
            )
        if len(turns) != 1:
            raise BadRecordError(
                "an answer is not one assistant turn",
                f"response[{k}] holds {len(turns)} turns; flashcp trains one assistant turn "
                "per answer",
            )
        answers.append({"role": ROLE_ASSISTANT, "content": turns[0]})
    chosen, rejected = (answers[0], answers[1]) if sort[0] > sort[1] else (answers[1], answers[0])
    system = _system(record)
    if record.get("is_system") == 1:
        system, src, tgt = src[0], src[1:], tgt[1:]
    prompt: Messages = [] if system is None else [{"role": "system", "content": system}]
    for k, question in enumerate(src):
        prompt.append({"role": "user", "content": question})
        if k < len(tgt):
            prompt.append({"role": ROLE_ASSISTANT, "content": tgt[k]})
    return prompt, chosen, rejected


# ---------------------------------------------------------------------------- the table


def _has(*names: str) -> Callable[[dict[str, Any], Fields], bool]:
    return lambda r, f: all(has_field(r, n) for n in names)


def _ultrafeedback_match(r: dict[str, Any], f: Fields) -> bool:
    chosen = r.get(f.chosen)
    return (
        _is_str(r.get(f.prompt))
        and _is_turns(chosen)
        and _is_turns(r.get(f.rejected))
        and chosen[0].get("role") != ROLE_ASSISTANT
    )


FORMATS: tuple[Format, ...] = (
    Format("text", "text", "`text`: a string", lambda r, f: has_field(r, f.text),
           field=lambda f: f.text),
    Format("messages", "supervised", "`messages`: [{role, content}]",
           lambda r, f: has_field(r, f.messages), messages=_messages, field=lambda f: f.messages),
    Format("sharegpt", "supervised", "ShareGPT `conversations`: [{from, value}] (human/gpt/system)",
           _has("conversations"), messages=_sharegpt, field=lambda f: "conversations"),
    Format("paddleformers", "supervised", "PaddleFormers `src`, `tgt` (+ `system`)",
           lambda r, f: has_field(r, "src") and has_field(r, "tgt") and "response" not in r,
           messages=_paddleformers_sft, field=lambda f: "tgt"),
    Format("alpaca", "supervised", "Alpaca `instruction`, `input`, `output`",
           _has("instruction", "output"), messages=_alpaca, field=lambda f: "output"),
    Format("prompt_response", "supervised", "`prompt`, `response` strings (no chat template)",
           lambda r, f: has_field(r, f.prompt) and f.response in r, field=lambda f: f.prompt),
    Format("paddleformers", "preference", "PaddleFormers `src`, `tgt`, `response`, `sort`",
           _has("src", "tgt", "response", "sort"), preference=_paddleformers_dpo),
    Format("ultrafeedback", "preference",
           "UltraFeedback `prompt` string + `chosen` / `rejected` conversations",
           _ultrafeedback_match, preference=_ultrafeedback),
    Format("preference", "preference", "`prompt`, `chosen`, `rejected` (strings, or TRL messages)",
           lambda r, f: has_field(r, f.prompt), field=lambda f: f.prompt),
    Format("implicit_prompt", "preference",
           "TRL implicit prompt: `chosen` / `rejected` whole conversations",
           lambda r, f: f.prompt not in r and _is_turns(r.get(f.chosen))
           and _is_turns(r.get(f.rejected)), preference=_implicit),
)  # fmt: skip
"""Every format's reader, one per kind of example it serves. Which recipes read a format, and
in which order `auto` tries them, is each recipe's declaration (`RecipeSpec.formats`)."""


def formats_of(recipe: str) -> tuple[Format, ...]:
    """The formats `recipe` reads (its `RecipeSpec.formats`), in detection order, each as
    its kind of example (`RecipeSpec.examples`); () for a recipe that reads none."""
    spec = RECIPES.get(recipe)
    if spec is None or not spec.formats:
        return ()
    readers = {f.name: f for f in FORMATS if f.examples == spec.examples}
    missing = [name for name in spec.formats if name not in readers]
    if missing:
        raise ValueError(f"run.recipe {recipe} lists data format(s) {', '.join(missing)}, which "
                         f"have no reader of {spec.examples} examples in flashcp.data.formats")
    return tuple(readers[name] for name in spec.formats)


def examples_of(recipe: str) -> Examples | None:
    """The kind of example `recipe` reads (None: an unknown recipe, or one without formats)."""
    spec = RECIPES.get(recipe)
    return None if spec is None else spec.examples


def get(name: str, recipe: str) -> Format | None:
    """`data.format` `name` for `recipe` (None: `auto`); `ValueError` for a format `recipe`
    does not read."""
    if name == "auto":
        return None
    for fmt in formats_of(recipe):
        if fmt.name == name:
            return fmt
    names = ", ".join(f.name for f in formats_of(recipe))
    raise ValueError(f"data.format {name!r} is not a format of run.recipe {recipe}: use auto or "
                     f"one of {names}")  # fmt: skip


def row_format(record: dict[str, Any], recipe: str, fields: Fields) -> Format | None:
    """The format `auto` reads `record` in: the first of `recipe`'s formats it matches."""
    for fmt in formats_of(recipe):
        if fmt.matches(record, fields):
            return fmt
    return None


def no_format(record: dict[str, Any], recipe: str, fields: Fields) -> BadRecordError:
    """The bad record of a row in none of `recipe`'s formats: "missing field" of the recipe's
    first flashcp field (as before formats were detected), the formats and the row's keys."""
    first = {"text": fields.text, "supervised": fields.messages,
             "preference": fields.prompt}[examples_of(recipe) or "text"]  # fmt: skip
    keys = ", ".join(sorted(map(str, record))) or "none"
    accepted = "; ".join(f.layout for f in formats_of(recipe))
    return BadRecordError(
        f"missing field {first!r}",
        f"an {recipe} record needs one of: {accepted} (data.format; data.*_field name "
        f"flashcp's own fields); its keys: {keys}",
    )


# ------------------------------------------------------------------------ the data check


class DataFormatError(ValueError):
    """Data in which no row of the sample is in a format the run reads (one line: the fields
    found, the formats accepted, the setting that would read it)."""


def _kind(value: Any) -> str:
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        if value and isinstance(value[0], dict):
            return "list of {" + ", ".join(sorted(map(str, value[0]))) + "}"
        return "list"
    return "null" if value is None else type(value).__name__


PROMPT_NAMES = ("prompt", "question", "query", "instruction", "input", "src", "user", "context")
RESPONSE_NAMES = ("response", "answer", "output", "completion", "tgt", "target", "reply")
CHOSEN_NAMES = ("chosen", "preferred", "accepted", "positive", "pos", "good", "win")
REJECTED_NAMES = ("rejected", "dispreferred", "negative", "neg", "bad", "lose", "loss")


def _pick(kinds: dict[str, str], names: Sequence[str], want: str) -> str | None:
    for name in names:
        for key, kind in kinds.items():
            if key.lower() == name and kind.startswith(want):
                return key
    return None


def _settings(rows: Sequence[dict[str, Any]], recipe: str, fields: Fields) -> list[str]:
    """Settings that would read `rows`, each checked to: another recipe whose formats fit
    them, or field names of flashcp's formats mapped onto theirs."""
    out = []
    for other in RECIPES:
        if other != recipe and any(row_format(r, other, fields) for r in rows):
            out.append(f"run.recipe={other}")
    kinds: dict[str, str] = {}
    for r in rows:
        for key, value in r.items():
            kinds.setdefault(str(key), _kind(value))
    maps: list[dict[str, str]] = []
    kind = examples_of(recipe)
    if kind == "supervised":
        chat = [k for k, v in kinds.items() if v.startswith("list of {") and "role" in v]
        maps += [{"messages": k} for k in chat[:1]]
        p, a = _pick(kinds, PROMPT_NAMES, "string"), _pick(kinds, RESPONSE_NAMES, "string")
        if p and a and p != a:
            maps.append({"prompt": p, "response": a})
    elif kind == "preference":
        c, r = _pick(kinds, CHOSEN_NAMES, ""), _pick(kinds, REJECTED_NAMES, "")
        p = _pick(kinds, PROMPT_NAMES, "")
        if c and r:
            maps.append({"prompt": p, "chosen": c, "rejected": r} if p else
                        {"chosen": c, "rejected": r})  # fmt: skip
    else:
        maps += [{"text": k} for k, v in kinds.items() if v == "string"][:1]
    for names in maps:
        mapped = replace(fields, **names)
        if any(row_format(r, recipe, mapped) for r in rows):
            out.append(" ".join(f"data.{k}_field={v}" for k, v in names.items()))
    return out


def detect(
    rows: Iterable[Any],
    *,
    recipe: str,
    data: DataConfig | None = None,
    source: str = "data.path",
) -> Format:
    """The format of a sample of rows (the one most rows are in; with `data.format` set,
    that one), or `DataFormatError` when no row is in a format `recipe` reads (`data.format`
    set: in that format). Rows that are not JSON objects are skipped (bad records)."""
    data = data or DataConfig()
    fields = Fields.of(data)
    sample = [r for r in rows if isinstance(r, dict)]
    setting = get(data.format, recipe)
    found: Counter[str] = Counter()
    by_name: dict[str, Format] = {}
    for r in sample:
        if setting is not None:
            fmt = setting if setting.matches(r, fields) else None
        else:
            fmt = row_format(r, recipe, fields)
        if fmt is not None:
            found[fmt.name] += 1
            by_name[fmt.name] = fmt
    if found:
        return by_name[found.most_common(1)[0][0]]
    kinds: dict[str, str] = {}
    for r in sample:
        for key, value in r.items():
            kinds.setdefault(str(key), _kind(value))
    seen = ", ".join(f"{k} ({v})" for k, v in kinds.items()) or "none (no JSON object)"
    fixes = _settings(sample, recipe, fields)
    if setting is not None:
        auto = [f for f in (row_format(r, recipe, fields) for r in sample) if f is not None]
        if auto:
            fixes = [f"data.format=auto (they are {auto[0].name} rows)"]
        wanted = f"data.format {setting.name} ({setting.layout})"
    else:
        accepted = "; ".join(f.layout for f in formats_of(recipe))
        wanted = f"a format run.recipe {recipe} reads ({accepted})"
    fix = ("to read them set " + " or ".join(fixes)) if fixes else "convert them to one of these"
    raise DataFormatError(
        f"{source}: none of the {len(sample)} rows sampled is in {wanted}: the rows' fields "
        f"are {seen}; {fix}"
    )


def check_data(cfg: Any, sample: SampleSource) -> Format | None:
    """The pre-launch data check of a run (`cfg`: a `flashcp.config.Config`): `detect` on the
    rows of `sample` (the data class's `SampleSource` of `data.path`, read once) for
    `run.recipe`. None when data.path is null (flashcp's built-in sets) or for a recipe
    registered elsewhere, whose data flashcp does not read."""
    if cfg.data.path is None or not formats_of(cfg.run.recipe):
        return None
    return detect(sample.records(), recipe=cfg.run.recipe, data=cfg.data,
                  source=str(cfg.data.path))  # fmt: skip
