"""Specification of cospec.data.prompts: prompt sources behind one seam, rendered by the run's
tokenizer, scored by the configured verifier."""

import json
import random

import pytest

from cospec.config import TaskConfig
from cospec.data.prompts import RecordSource, TaskData, make_prompt_source
from cospec.data.tasks import TaskSuite
from cospec.data.tokenizer import BOS, EOS, CharTokenizer
from cospec.data.word_problems import PROBLEM_TYPES


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_synthetic_prompts_are_bos_then_the_prompt_characters():
    tok = CharTokenizer()
    data = TaskData.from_config(TaskConfig(), tok)
    assert isinstance(data.source, TaskSuite)
    ex = data.source.sample(random.Random(0))
    assert data.prompt_ids(ex) == [BOS] + tok.encode(ex.prompt)
    # the response is decoded up to EOS, then checked by the family's exact verifier
    assert data.reward(ex, tok.encode(ex.answer) + [EOS] + tok.encode("zz")) == 1.0


def test_jsonl_prompts_are_drawn_from_the_file_and_scored_by_the_math_verifier(tmp_path):
    records = [{"prompt": "two plus two", "answer": 4, "type": "add"},
               {"prompt": "three times three", "answer": "9", "type": "mul"}]
    path = write_jsonl(tmp_path / "p.jsonl", records)
    data = TaskData.from_config(TaskConfig(source=path, verifier="math"), CharTokenizer())
    assert data.source.family_names == ("add", "mul")
    rng = random.Random(0)
    drawn = {data.source.sample(rng).prompt for _ in range(50)}
    assert drawn == {"two plus two", "three times three"}
    ex = data.source.sample_family("mul", rng)
    tok = data.tokenizer
    assert data.reward(ex, tok.encode("so 3 3 9") + [EOS]) == 1.0
    assert data.reward(ex, tok.encode("answer: 8") + [EOS]) == 0.0
    with pytest.raises(ValueError, match="prompt type 'div'"):
        data.source.sample_family("div", rng)


def test_a_jsonl_answer_the_math_verifier_cannot_read_fails_when_the_file_is_loaded(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "answer": "1"},
                                              {"prompt": "capital?", "answer": "Paris"}])
    with pytest.raises(ValueError, match=r"p\.jsonl: record 2:.*Paris"):
        make_prompt_source(TaskConfig(source=path, verifier="math"))
    assert make_prompt_source(TaskConfig(source=path, verifier="exact")).family_names == ("jsonl",)


def test_the_math_source_is_seeded_and_grouped_by_problem_type():
    src = make_prompt_source(TaskConfig(source="math", math_levels=(1, 2)))
    assert src.family_names == PROBLEM_TYPES
    a = [src.sample(random.Random(3)) for _ in range(5)]
    b = [src.sample(random.Random(3)) for _ in range(5)]
    assert [e.prompt for e in a] == [e.prompt for e in b]
    ex = src.sample_family("mul", random.Random(1))
    assert ex.family == "mul" and ex.meta["record"]["level"] in (1, 2)
    assert src.reward(ex, f"... so the total is {ex.answer}.\nAnswer: {ex.answer}") == 1.0
    only = make_prompt_source(TaskConfig(source="math", math_types=("add", "sub")))
    assert only.family_names == ("add", "sub")
    assert {only.sample(random.Random(i)).family for i in range(40)} == {"add", "sub"}


def test_a_bad_verifier_or_problem_type_fails_before_any_prompt_is_drawn():
    with pytest.raises(ValueError, match="task.verifier"):
        make_prompt_source(TaskConfig(source="math", verifier="no_such_module_xyz:f"))
    with pytest.raises(ValueError, match="task.math_types"):
        make_prompt_source(TaskConfig(source="math", math_types=("calculus",)))


def test_record_source_passes_the_whole_record_to_a_plug_in_verifier():
    seen = []

    def verifier(record, response):
        seen.append((record["id"], response))
        return 0.5

    src = RecordSource.from_records([{"prompt": "p", "answer": "a", "id": 7}], verifier)
    ex = src.sample(random.Random(0))
    assert src.reward(ex, "resp") == 0.5 and seen == [(7, "resp")]


def test_without_a_chat_template_a_chat_record_is_fed_as_its_last_message():
    record = {"messages": [{"role": "system", "content": "be brief"},
                           {"role": "user", "content": "1+1="}], "answer": "2"}
    src = RecordSource.from_records([record], lambda r, s: 0.0)
    tok = CharTokenizer()
    data = TaskData(src, tok)
    assert not data.uses_chat_template
    assert data.prompt_ids(src.sample(random.Random(0))) == [BOS] + tok.encode("1+1=")
