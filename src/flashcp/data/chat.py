"""Conversations through the tokenizer's chat template, with the assistant's tokens located.

The template (the tokenizer's `chat_template`, rendered by transformers' `apply_chat_template`,
see `flashcp.data.tokenizer`) decides every character: prefixes such as GLM's `[gMASK]<sop>`,
role tokens, separators, end-of-turn tokens. To find which characters are the assistant's, each
assistant turn k is located by rendering prefixes of the conversation (as TRL and
LLaMA-Factory do):

    before_k  = render(messages[:k], add_generation_prompt=True)   # the prompt the model sees
    through_k = render(messages[:k + 1])                            # ... and its answer

The answer is `through_k[len(before_k):]`: exactly the text the model must generate after the
generation prompt (for GLM: "\\n" + content; for ChatML: content + "<|im_end|>\\n"). The prefixes
must nest — each `before_k` and `through_k` a prefix of the full rendering, and `before_k`
extending `through_{k-1}` — so the segments concatenate to the full rendering; a template
that rewrites earlier turns once later ones follow fails that check (a bad record: its answer
tokens cannot be located).

Each segment is tokenized on its own, as at inference (the prompt is tokenized, then the answer
generated token by token): the prompt segments are context, the answer segments targets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flashcp.data.records import ROLE_ASSISTANT, BadRecordError
from flashcp.data.tokenizer import Tokenizer


def render(
    tokenizer: Tokenizer, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool
) -> str:
    """`messages` through the chat template. A template that refuses the conversation (its
    `raise_exception`, an undefined value) is a `BadRecordError`; a template that is not valid Jinja
    is a `ValueError` (every record would fail)."""
    import jinja2

    try:
        return tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the tokenizer's chat_template is not valid Jinja: {exc}") from None
    except jinja2.TemplateError as exc:
        raise BadRecordError("the chat template refused the conversation", str(exc)) from None


def _nesting_error(k: int) -> BadRecordError:
    return BadRecordError(
        "chat template renders turns inconsistently",
        f"the rendering up to assistant message {k} is not a prefix of the whole conversation's"
        " (the template changes earlier text when later turns follow), so the answer's tokens "
        "cannot be located",
    )


def chat_segments(
    tokenizer: Tokenizer, messages: Sequence[dict[str, Any]]
) -> list[tuple[str, bool]]:
    """The rendered conversation as consecutive `(text, is_answer)` segments whose texts join
    to the full rendering; the answer segments are the assistant turns (module docstring)."""
    full = render(tokenizer, messages, add_generation_prompt=False)
    segments: list[tuple[str, bool]] = []
    pos = 0
    last = len(messages) - 1
    for k, message in enumerate(messages):
        if message["role"] != ROLE_ASSISTANT:
            continue
        before = render(tokenizer, messages[:k], add_generation_prompt=True)
        through = full
        if k != last:
            through = render(tokenizer, messages[: k + 1], add_generation_prompt=False)
        if len(before) < pos or not through.startswith(before) or not full.startswith(through):
            raise _nesting_error(k)
        if len(through) == len(before):
            raise BadRecordError(
                "empty answer", f"the chat template renders message {k} as nothing"
            )
        if len(before) > pos:
            segments.append((full[pos : len(before)], False))
        segments.append((full[len(before) : len(through)], True))
        pos = len(through)
    if pos < len(full):
        segments.append((full[pos:], False))
    return segments  # the nesting checks make them join to `full`


def answer_text(
    tokenizer: Tokenizer,
    prompt: Sequence[dict[str, Any]],
    prompt_text: str,
    answer: dict[str, Any],
) -> str:
    """The text an assistant `answer` adds after `prompt_text` (the prompt rendered with the
    generation prompt): what the model generates, for DPO's chosen and rejected turns."""
    through = render(tokenizer, [*prompt, answer], add_generation_prompt=False)
    if not through.startswith(prompt_text):
        raise _nesting_error(len(prompt))
    text = through[len(prompt_text) :]
    if not text:
        raise BadRecordError("empty answer", "the chat template renders the answer as nothing")
    return text


def tokenize_segments(
    tokenizer: Tokenizer, segments: Sequence[tuple[str, bool]]
) -> tuple[list[int], list[bool]]:
    """Token ids of the segments (each tokenized on its own) and a target flag per token."""
    ids: list[int] = []
    flags: list[bool] = []
    for text, is_answer in segments:
        part = tokenizer.encode(text)
        ids += part
        flags += [is_answer] * len(part)
    return ids, flags
