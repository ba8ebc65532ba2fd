"""Specification of cospec.data.jsonl: a good prompt file loads into normalised records, and every
kind of bad data is a PromptFileError naming the file and the 1-based line."""

import json
import re

import pytest

from cospec.data.jsonl import PromptFileError, load_prompt_records

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "Answer: 4"},
        {"role": "user", "content": "And 3+3?"}]


def write(tmp_path, *lines, name="prompts.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines))
    return path


def test_a_good_file_loads_prompt_and_messages_records(tmp_path):
    path = write(tmp_path,
                 {"prompt": "What is 7 times 6?", "answer": "42"},
                 "",
                 {"messages": CHAT, "answer": 6, "type": "chat", "id": 17, "hint": ["add"]},
                 "   ",
                 {"prompt": "Half of 5?", "answer": 2.5},
                 "")
    assert load_prompt_records(path) == [
        {"prompt": "What is 7 times 6?", "answer": "42", "type": "jsonl"},
        {"messages": CHAT, "answer": "6", "type": "chat", "id": 17, "hint": ["add"]},
        {"prompt": "Half of 5?", "answer": "2.5", "type": "jsonl"},
    ]


def test_a_path_may_be_a_string_and_the_file_may_start_with_a_byte_order_mark(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "p", "answer": "a"}\r\n')
    assert load_prompt_records(str(path)) == [{"prompt": "p", "answer": "a", "type": "jsonl"}]


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(PromptFileError, match=r"nope\.jsonl: no such prompt file") as info:
        load_prompt_records(tmp_path / "nope.jsonl")
    assert info.value.line is None


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_a_file_without_records_is_an_error(tmp_path, text):
    path = tmp_path / "empty.jsonl"
    path.write_text(text)
    with pytest.raises(PromptFileError, match=r"empty\.jsonl: no records"):
        load_prompt_records(path)


GOOD = {"prompt": "What is 1+1?", "answer": "2"}
BAD_ANSWER = '"answer" must be a non-blank string or a number'

# (the bad third line, what the message says about it); lines 1-2 are a good record and a blank
BAD_LINES = [
    ('{"prompt": "x", "answer": ', "not valid JSON"),
    ("prompt: x", "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got a list"),
    ('"just text"', "expected a JSON object, got a string"),
    ({"answer": "2"}, 'missing "prompt" \\(or "messages"\\)'),
    ({"prompt": "x"}, 'missing "answer"'),
    ({"prompt": "x", "messages": CHAT, "answer": "2"}, 'has both "prompt" and "messages"'),
    ({"prompt": 5, "answer": "2"}, '"prompt" must be a non-blank string, got a number'),
    ({"prompt": "  ", "answer": "2"}, '"prompt" must be a non-blank string'),
    ({"prompt": "x", "answer": ["2"]}, f"{BAD_ANSWER}, got a list"),
    ({"prompt": "x", "answer": True}, f"{BAD_ANSWER}, got a boolean"),
    ({"prompt": "x", "answer": None}, f"{BAD_ANSWER}, got null"),
    ({"prompt": "x", "answer": ""}, f"{BAD_ANSWER}, got ''"),
    ('{"prompt": "x", "answer": NaN}', f"{BAD_ANSWER}, got nan"),
    ({"prompt": "x", "answer": "2", "type": 3}, '"type" must be a non-blank string, got a number'),
    ({"messages": [], "answer": "2"}, '"messages" must be a non-empty list'),
    ({"messages": "hi", "answer": "2"}, '"messages" must be a non-empty list'),
    ({"messages": ["hi"], "answer": "2"}, '"messages"\\[0\\] must be an object'),
    ({"messages": [{"role": "user"}], "answer": "2"}, '"messages"\\[0\\] is missing "content"'),
    ({"messages": [{"role": "user", "content": 2}], "answer": "2"},
     '"messages"\\[0\\]\\["content"\\] must be a string, got a number'),
    ({"messages": [{"role": "bot", "content": "x"}], "answer": "2"},
     '"messages"\\[0\\]\\["role"\\] must be one of system, user, assistant'),
    ({"messages": CHAT[1:] + CHAT[:1], "answer": "2"},
     '"messages"\\[3\\] is a "system" message; only the first'),
    ({"messages": CHAT[:3], "answer": "2"}, 'the last message must be "user"'),
    ({"messages": CHAT[:1], "answer": "2"}, 'the last message must be "user"'),
    ({"messages": [{"role": "user", "content": " "}], "answer": "2"},
     "the last message's content is blank"),
]


@pytest.mark.parametrize("line, problem", BAD_LINES)
def test_a_bad_line_is_an_error_naming_the_file_and_line(tmp_path, line, problem):
    path = write(tmp_path, GOOD, "", line, GOOD)
    with pytest.raises(PromptFileError, match=rf"^{re.escape(str(path))}:3: {problem}") as info:
        load_prompt_records(path)
    assert (info.value.path, info.value.line) == (str(path), 3)


def test_a_line_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(PromptFileError, match=r"latin1\.jsonl:2: not UTF-8 text"):
        load_prompt_records(path)


def test_a_prompt_file_error_is_a_value_error():
    assert issubclass(PromptFileError, ValueError)
