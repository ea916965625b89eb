"""What a data record must hold, checked field by field: `BadRecordError` names what is wrong.

A bad record is one row that cannot become training data: a missing field, a field of the
wrong type, an empty answer, a conversation the chat template cannot render, an example still
too long after the truncation policy. It is not a crash: `flashcp.data.index` counts bad records
by `reason` (short and row-independent, so rows group: "missing field 'messages'") and, by
`data.on_bad_record`, skips them with a report or stops naming the first one.
"""

from __future__ import annotations

from typing import Any

ROLE_ASSISTANT = "assistant"


class DataError(ValueError):
    """The data cannot be trained on: a bad record under `data.on_bad_record: error`, a row that
    fails to read, or no usable record. Every process raises it alike (`build_index`); a rank
    exits with `flashcp.launch.outcome.EXIT_DATA` and the job is not restarted."""


class BadRecordError(ValueError):
    """One record cannot be used. `reason` groups records in the report; `detail` says more
    about this one (its keys, the type found, the lengths)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def _keys(record: dict[str, Any]) -> str:
    return ", ".join(sorted(map(str, record))) or "none"


def _type(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def has_field(record: dict[str, Any], name: str) -> bool:
    """`record` holds `name` with a value (a null, as Parquet gives absent fields, is none)."""
    return record.get(name) is not None


def string_field(
    record: dict[str, Any], name: str, *, key: str = "", allow_empty: bool = True
) -> str:
    """The string `record[name]`; `BadRecordError` when it is missing, not a string, or (unless
    `allow_empty`) empty or only whitespace. `key`: the config key naming the field."""
    value = record.get(name)
    if value is None:
        hint = f"; set {key} to the field your data uses" if key else ""
        raise BadRecordError(f"missing field {name!r}", f"the record's keys: {_keys(record)}{hint}")
    if not isinstance(value, str):
        raise BadRecordError(f"field {name!r} is not a string", f"got {_type(value)}")
    if not allow_empty and not value.strip():
        raise BadRecordError("empty answer", f"field {name!r} is empty")
    return value


def message_list(value: Any, name: str) -> list[dict[str, Any]]:
    """`value` as a list of chat messages (`{"role": str, "content": str, ...}`), each a new
    dict without null-valued keys (Arrow/Parquet gives every row every struct field, absent
    ones as null; a template would print them as "None"). `BadRecordError` for anything else."""
    if not isinstance(value, list) or not value:
        what = "an empty list" if isinstance(value, list) else _type(value)
        raise BadRecordError(f"field {name!r} is not a list of messages", f"got {what}")
    out = []
    for k, message in enumerate(value):
        if not isinstance(message, dict):
            raise BadRecordError(
                f"field {name!r} is not a list of messages", f"message {k} is {_type(message)}"
            )
        message = {key: v for key, v in message.items() if v is not None}
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                got = "missing" if key not in message else _type(message[key])
                raise BadRecordError(
                    f"a message's {key!r} is not a string", f"{name}[{k}].{key} is {got}"
                )
        out.append(message)
    return out


def check_answers(messages: list[dict[str, Any]], name: str) -> None:
    """A conversation to train on: it ends with a non-empty assistant turn and no assistant
    turn is empty."""
    for k, message in enumerate(messages):
        if message["role"] == ROLE_ASSISTANT and not message["content"].strip():
            raise BadRecordError("empty answer", f"{name}[{k}] (assistant) is empty")
    last = messages[-1]["role"]
    if last != ROLE_ASSISTANT:
        raise BadRecordError(
            "conversation does not end with an assistant turn",
            f"its last message is {last!r}: there is no answer after it to train on",
        )
