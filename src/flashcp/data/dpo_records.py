"""DPO preference records -> token examples (`DPORecords`), and their truncation to a budget;
`flashcp.data.dpo_packing` packs the examples into share-question batches.

Records hold ``prompt``, ``chosen`` and ``rejected`` (field names: `data.prompt_field`,
`data.chosen_field`, `data.rejected_field`) in one of two forms (`DPORecords`):

* strings: ``prompt = [BOS] + encode(prompt)``, ``answer = encode(answer) + [EOS]``;
* conversations (TRL's conversational preference format): the prompt a list of messages, each
  answer the assistant turn (a one-message list, a message, or its content as a string). The
  prompt is the tokenizer's chat template rendering of the prompt messages with the generation
  prompt (for GLM ``[gMASK]<sop><|user|>\n...<|assistant|>``), each answer the text the
  template adds for the assistant turn after it (`flashcp.data.chat.answer_text`), tokenized
  on its own, + [EOS] unless the template's answer already holds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from flashcp.data import formats
from flashcp.data.chat import answer_text, render
from flashcp.data.records import (
    ROLE_ASSISTANT,
    BadRecordError,
    check_answers,
    has_field,
    message_list,
    string_field,
)
from flashcp.data.tokenizer import require_template

TRUNCATION_POLICIES = ("error", "truncate")


class DPOTokenizer(Protocol):
    """What DPO tokenization needs (the trainer's tokenizers qualify)."""

    bos_id: int | None
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def render_chat(
        self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = False
    ) -> str: ...


@dataclass(frozen=True)
class DPOExample:
    """One tokenized preference pair. The prompt is never empty; answers end with EOS."""

    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]

    @property
    def packed_len(self) -> int:
        """Tokens this example takes in a packed row (the prompt's last token per answer)."""
        return len(self.prompt) - 1 + len(self.chosen) + len(self.rejected)

    def unpacked_len(self, answer: int) -> int:
        """Tokens of the unpacked ``prompt + answer[:-1]`` (answer 0 chosen, 1 rejected)."""
        return len(self.prompt) + len(self.answers[answer]) - 1

    @property
    def answers(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.chosen, self.rejected)


class DPORecords:
    """A record → its `DPOExample`, fitted to `budget` tokens (packed layout), or
    `BadRecordError`: a missing or mistyped field, an empty answer, a prompt of fewer than 2
    tokens, strings mixed with messages, or an example too long even after `truncation`
    (the prompt leaving the answers no room). `truncation="error"` refuses any example longer
    than `budget` with a `ValueError` (it stops the run, naming the row).

    `format`: `data.format` (`auto`: each row in the first dpo format whose fields it has:
    PaddleFormers, UltraFeedback, prompt/chosen/rejected, TRL's implicit prompt;
    `flashcp.data.formats`). Every conversational format is tokenized like TRL's
    conversational rows (the module docstring)."""

    def __init__(
        self,
        tokenizer: DPOTokenizer,
        *,
        budget: int,
        truncation: str = "truncate",
        max_prompt_len: int | None = None,
        prompt_field: str = "prompt",
        chosen_field: str = "chosen",
        rejected_field: str = "rejected",
        format: str = "auto",
    ) -> None:
        if truncation not in TRUNCATION_POLICIES:
            raise ValueError(f"truncation must be one of {TRUNCATION_POLICIES}, got "
                             f"{truncation!r}")  # fmt: skip
        self.tokenizer = tokenizer
        self.budget = int(budget)
        self.truncation = truncation
        self.max_prompt_len = max_prompt_len
        self.fields = (prompt_field, chosen_field, rejected_field)
        self.names = formats.Fields(prompt=prompt_field, chosen=chosen_field,
                                    rejected=rejected_field)  # fmt: skip
        self.format = formats.get(format, "dpo")

    def __call__(self, record: dict[str, Any]) -> DPOExample:
        example = self.tokenize(record)
        need = example.packed_len
        if need > self.budget and self.truncation == "error":
            raise ValueError(
                f"the example needs {need} tokens packed (prompt {len(example.prompt)}, chosen "
                f"{len(example.chosen)}, rejected {len(example.rejected)}) but data.seq_len is "
                f"{self.budget}: raise data.seq_len or set dpo.truncation: truncate"
            )
        try:
            return fit_example(example, self.budget, max_prompt_len=self.max_prompt_len)
        except ValueError as exc:
            raise BadRecordError("too long", str(exc)) from None

    def tokenize(self, record: dict[str, Any]) -> DPOExample:
        """The example before truncation."""
        fmt = self.format or formats.row_format(record, "dpo", self.names)
        if fmt is None:
            raise formats.no_format(record, "dpo", self.names)
        fmt.check(record, self.names)
        if fmt.preference is not None:
            require_template(self.tokenizer, fmt.name, fmt.layout)
            messages, chosen, rejected = fmt.preference(record, self.names)
            return self._conversation(
                message_list(messages, self.fields[0]),
                ((chosen, self.fields[1]), (rejected, self.fields[2])),
            )
        tok = self.tokenizer
        prompt_field, chosen_field, rejected_field = self.fields
        for name in self.fields:
            if not has_field(record, name):
                keys = ", ".join(sorted(record)) or "none"
                raise BadRecordError(
                    f"missing field {name!r}",
                    f"the record's keys: {keys}; DPO records need {prompt_field!r}, "
                    f"{chosen_field!r} and {rejected_field!r} (data.prompt_field, "
                    "data.chosen_field, data.rejected_field name them)",
                )
        if not isinstance(record[prompt_field], str):
            messages = message_list(record[prompt_field], prompt_field)
            return self._conversation(
                messages, ((record[chosen_field], chosen_field),
                           (record[rejected_field], rejected_field))  # fmt: skip
            )
        eos = int(tok.eos_id)
        prompt_text = record[prompt_field]
        bos = getattr(tok, "bos_id", None)
        prompt = ([int(bos)] if bos is not None else []) + list(tok.encode(prompt_text))
        answers = []
        for name in (chosen_field, rejected_field):
            if isinstance(record[name], list | dict):
                raise BadRecordError(
                    "prompt is a string but an answer is a message",
                    f"{name!r} is a {type(record[name]).__name__}: give messages for the "
                    "prompt too, or strings for both answers",
                )
            text = string_field(record, name, allow_empty=False)
            answers.append([*tok.encode(text), eos])
        return self._example(prompt, answers)

    def _conversation(
        self, messages: list[dict[str, Any]], answers: Sequence[tuple[Any, str]]
    ) -> DPOExample:
        """A conversational example: the prompt `messages` rendered with the generation
        prompt, each answer (a value and its field name) the text its assistant turn adds."""
        tok = self.tokenizer
        eos = int(tok.eos_id)
        prompt_text = render(tok, messages, add_generation_prompt=True)
        prompt = list(tok.encode(prompt_text))
        ids_of = []
        for value, name in answers:
            turn = self._turn(value, name)
            ids = list(tok.encode(answer_text(tok, messages, prompt_text, turn)))
            ids_of.append(ids if eos in ids else [*ids, eos])
        return self._example(prompt, ids_of)

    @staticmethod
    def _example(prompt: list[int], answers: list[list[int]]) -> DPOExample:
        if len(prompt) < 2:
            raise BadRecordError(
                "prompt too short",
                f"{len(prompt)} token(s); the packed layout needs >= 2 (BOS and one text token)",
            )
        return DPOExample(tuple(prompt), tuple(answers[0]), tuple(answers[1]))

    @staticmethod
    def _turn(value: Any, name: str) -> dict[str, Any]:
        """The assistant message an answer field holds (a one-message list, a message dict, or
        the content string)."""
        if isinstance(value, str):
            value = [{"role": ROLE_ASSISTANT, "content": value}]
        elif isinstance(value, dict):
            value = [value]
        messages = message_list(value, name)
        if len(messages) != 1 or messages[0]["role"] != ROLE_ASSISTANT:
            roles = ", ".join(m["role"] for m in messages)
            raise BadRecordError(
                "an answer is not one assistant turn",
                f"{name!r} holds {len(messages)} message(s) ({roles})",
            )
        check_answers(messages, name)
        return messages[0]



# ---------------------------------------------------------------------------- truncation

LAYOUTS = ("packed", "unpacked")


def example_need(example: DPOExample, layout: str) -> int:
    """Tokens `example` needs: one packed segment, or the longer of its unpacked sequences."""
    if layout == "packed":
        return example.packed_len
    if layout == "unpacked":
        return max(example.unpacked_len(0), example.unpacked_len(1))
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def fit_example(
    example: DPOExample,
    budget: int,
    *,
    layout: str = "packed",
    max_prompt_len: int | None = None,
) -> DPOExample:
    """`example` truncated so that `example_need(result, layout) <= budget`.

    The prompt first keeps its last `max_prompt_len` tokens (if given); then the answers are cut
    from the end to a common cap (the longer one shrinks first), each keeping >= 1 token. If the
    prompt leaves no room for that, `ValueError`. An example that fits is returned unchanged.
    """
    if example_need(example, layout) <= budget:
        return example
    prompt = example.prompt
    if max_prompt_len is not None and len(prompt) > max_prompt_len:
        if max_prompt_len < 2:
            raise ValueError(f"max_prompt_len must be >= 2, got {max_prompt_len}")
        prompt = prompt[-max_prompt_len:]
    room = budget - (len(prompt) - 1)  # what the answers may use
    need = 2 if layout == "packed" else 1
    if room < need:
        raise ValueError(
            f"a prompt of {len(prompt)} tokens leaves {max(room, 0)} of the {budget}-token "
            f"budget for the answers ({layout} layout needs >= {need}): set max_prompt_len or "
            "give a longer length"
        )
    c, r = len(example.chosen), len(example.rejected)
    cap = room
    if layout == "packed":
        cap = max(c, r)
        while min(c, cap) + min(r, cap) > room:
            cap -= 1
    return DPOExample(prompt, example.chosen[:cap], example.rejected[:cap])


def fit_examples(
    examples: Sequence[DPOExample],
    budget: int,
    *,
    layout: str = "packed",
    truncation: str = "error",
    max_prompt_len: int | None = None,
) -> list[DPOExample]:
    """Check (`truncation="error"`) or truncate (`"truncate"`) every example to `budget`.

    Errors name the example, its lengths and the budget. To compare layouts on the same tokens,
    truncate once (e.g. for the packed `seq_len`) and give the result to both.
    """
    if truncation not in TRUNCATION_POLICIES:
        raise ValueError(f"truncation must be one of {TRUNCATION_POLICIES}, got {truncation!r}")
    out = []
    for i, ex in enumerate(examples):
        need = example_need(ex, layout)
        if need > budget and truncation == "error":
            raise ValueError(
                f"DPO example {i} needs {need} tokens in the {layout} layout (prompt "
                f"{len(ex.prompt)}, chosen {len(ex.chosen)}, rejected {len(ex.rejected)}) but "
                f"only {budget} fit: use a longer length or truncation='truncate'"
            )
        out.append(fit_example(ex, budget, layout=layout, max_prompt_len=max_prompt_len))
    return out

