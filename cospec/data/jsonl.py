"""Prompt records from a JSONL file (``task.source=PATH.jsonl``), checked line by line.

One JSON object per line; blank lines are skipped. A record has

- exactly one of
  - ``"prompt"``: a non-blank string, the user's message (or the plain text after BOS), or
  - ``"messages"``: a chat, a non-empty list of ``{"role": str, "content": str}`` objects. Roles
    are "system", "user" and "assistant"; a "system" message may only come first, and the last
    message must be "user", since the policy writes the next assistant turn (a few-shot chat
    puts its examples as earlier user/assistant pairs). Other keys of a message are kept.
- ``"answer"``: a non-blank string or a finite number; a number is stored as ``str(n)``, so 12
  becomes "12" and 12.0 becomes "12.0" (the math verifier compares numerically; write a string
  when the exact text matters to an exact verifier);
- optionally ``"type"``: a non-blank string that metrics break down by (default "jsonl");
- any other fields, kept as they are for a plug-in verifier to read.

For example the line ``{"messages": [{"role": "user", "content": "2+3?"}], "answer": 5, "id": 7}``
becomes ``{"messages": [...], "answer": "5", "id": 7, "type": "jsonl"}``.

Every problem raises `PromptFileError` naming the file and, for a bad line, its 1-based number:
``data/q.jsonl:3: "answer" must be a non-blank string or a number, got list``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from cospec.config import ConfigError

DEFAULT_TYPE = "jsonl"
ROLES = ("system", "user", "assistant")


class PromptFileError(ConfigError):
    """A prompt file cannot be read or a line is not a valid record; ``path`` and ``line`` (1-based,
    None for the file as a whole) say where. A `ConfigError` (so a `ValueError`): the CLI reports it
    and exits 2, like any bad input the user gave."""

    def __init__(self, path: str | Path, line: int | None, problem: str):
        self.path, self.line = str(path), line
        super().__init__(f"{path}:{line}: {problem}" if line is not None else f"{path}: {problem}")


def load_prompt_records(path: str | Path) -> list[dict]:
    """Every record of the JSONL prompt file at ``path``, checked and normalised (see the module
    docstring). Raises PromptFileError for a missing or empty file or any bad line."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise PromptFileError(path, None, "no such prompt file (task.source)") from None
    except OSError as exc:
        raise PromptFileError(path, None, f"cannot read the prompt file: {exc.strerror}") from None
    records = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PromptFileError(path, number, f"not UTF-8 text ({exc.reason})") from None
        if number == 1:
            text = text.removeprefix("\ufeff")  # a byte-order mark some editors write
        if text.strip():
            records.append(_record(text, path, number))
    if not records:
        raise PromptFileError(path, None, "no records (the file is empty or has only blank lines)")
    return records


def _record(text: str, path: str | Path, number: int) -> dict:
    def fail(problem: str) -> PromptFileError:
        return PromptFileError(path, number, problem)

    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise fail(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise fail(f"expected a JSON object, got {_kind(record)}")
    if "prompt" in record and "messages" in record:
        raise fail('has both "prompt" and "messages"; give one')
    if "prompt" in record:
        if not _non_blank(record["prompt"]):
            raise fail(f'"prompt" must be a non-blank string, got {_shown(record["prompt"])}')
    elif "messages" in record:
        problem = _messages_problem(record["messages"])
        if problem:
            raise fail(problem)
    else:
        raise fail('missing "prompt" (or "messages")')
    if "answer" not in record:
        raise fail('missing "answer"')
    answer = record["answer"]
    if isinstance(answer, (int, float)) and not isinstance(answer, bool) and math.isfinite(answer):
        record["answer"] = str(answer)
    elif not _non_blank(answer):
        raise fail(f'"answer" must be a non-blank string or a number, got {_shown(answer)}')
    record.setdefault("type", DEFAULT_TYPE)
    if not _non_blank(record["type"]):
        raise fail(f'"type" must be a non-blank string, got {_shown(record["type"])}')
    return record


def _messages_problem(messages: object) -> str | None:
    """What is wrong with a "messages" value, or None."""
    if not isinstance(messages, list) or not messages:
        return f'"messages" must be a non-empty list, got {_shown(messages)}'
    for i, message in enumerate(messages):
        where = f'"messages"[{i}]'
        if not isinstance(message, dict):
            return f'{where} must be an object with "role" and "content", got {_kind(message)}'
        for key in ("role", "content"):
            if key not in message:
                return f'{where} is missing "{key}"'
            if not isinstance(message[key], str):
                return f'{where}["{key}"] must be a string, got {_kind(message[key])}'
        if message["role"] not in ROLES:
            return f'{where}["role"] must be one of {", ".join(ROLES)}, got {message["role"]!r}'
        if message["role"] == "system" and i > 0:
            return f'{where} is a "system" message; only the first message may be one'
    if messages[-1]["role"] != "user":
        return ('the last message must be "user" (the policy answers it), '
                f'got {messages[-1]["role"]!r}')
    if not messages[-1]["content"].strip():
        return "the last message's content is blank"
    return None


def _non_blank(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _kind(value: object) -> str:
    """A JSON value's kind, in JSON's words."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)


def _shown(value: object) -> str:
    """A bad value as the message shows it: short strings in full, other kinds by kind."""
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else f"a string of {len(value)} characters"
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return _kind(value)
