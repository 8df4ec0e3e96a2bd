"""Prompt sources: load_problems (jsonl / parquet, error messages), FileSource splits, BuiltinTask."""

from __future__ import annotations

import json
import re

import pytest

from lightning_rlvr.data import BuiltinTask, FileSource, load_problems
from lightning_rlvr.tasks import ArithmeticTask, Problem


def _write_jsonl(path, rows) -> str:
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def _write_parquet(path, columns: dict) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return str(path)


def _rows(n: int) -> list[dict]:
    return [{"prompt": f"q{i}", "answer": f"a{i}"} for i in range(n)]


# ----------------------------------------------------------------------------- load_problems: jsonl
def test_jsonl_with_custom_field_names(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [
        {"question": "1+1=", "solution": 2, "extra": "ignored"},
        {"question": "what?", "solution": "x y"},
    ])
    assert load_problems(path, prompt_field="question", answer_field="solution") == [
        Problem("1+1=", "2"), Problem("what?", "x y"),
    ]


def test_jsonl_default_field_names_and_json_suffix(tmp_path):
    path = _write_jsonl(tmp_path / "d.json", _rows(3))
    assert load_problems(path) == [Problem(f"q{i}", f"a{i}") for i in range(3)]


def test_missing_field_names_file_line_and_field(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [
        {"question": "a", "solution": "1"},
        {"question": "b", "solution": "2"},
        {"question": "c"},
    ])
    with pytest.raises(ValueError) as info:
        load_problems(path, prompt_field="question", answer_field="solution")
    message = str(info.value)
    assert path in message and "line 3" in message and "'solution'" in message


def test_missing_field_line_number_counts_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n\n{"answer": "2"}\n', encoding="utf-8")
    with pytest.raises(ValueError) as info:
        load_problems(path)
    message = str(info.value)
    assert str(path) in message and "line 3" in message and "'prompt'" in message


def test_invalid_json_line_names_file_and_line(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, '{"prompt": "b", "answer":'])
    with pytest.raises(ValueError) as info:
        load_problems(path)
    message = str(info.value)
    assert path in message
    assert re.search(r"(:|line )2\b", message), message
    assert "JSON" in message


def test_non_object_row_names_the_line(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, "[1, 2]"])
    with pytest.raises(ValueError, match=r"line 2: expected an object, got list"):
        load_problems(path)


def test_empty_lines_are_skipped(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('\n{"prompt": "a", "answer": "1"}\n\n   \n{"prompt": "b", "answer": "2"}\n\n', encoding="utf-8")
    assert load_problems(path) == [Problem("a", "1"), Problem("b", "2")]


def test_file_without_problems_raises(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n \n", encoding="utf-8")
    with pytest.raises(ValueError, match="no problems"):
        load_problems(path)


# ----------------------------------------------------------------------------- load_problems: parquet
def test_parquet_with_custom_field_names(tmp_path):
    path = _write_parquet(tmp_path / "d.parquet", {"q": ["1+1=", "2+2="], "a": [2, 4], "other": [0, 1]})
    assert load_problems(path, prompt_field="q", answer_field="a") == [Problem("1+1=", "2"), Problem("2+2=", "4")]


def test_parquet_missing_column_names_file_row_and_field(tmp_path):
    path = _write_parquet(tmp_path / "d.parquet", {"prompt": ["a", "b"], "solution": ["1", "2"]})
    with pytest.raises(ValueError) as info:
        load_problems(path)
    message = str(info.value)
    assert path in message and "row 1" in message and "'answer'" in message


def test_parquet_null_field_names_the_row(tmp_path):
    # Regression: a parquet row cannot lack a column, its missing value is a null, which load_problems once turned
    # into the reference answer "None" (str(None)) instead of reporting the row (same for a JSON null).
    path = _write_parquet(tmp_path / "d.parquet", {"prompt": ["a", "b", "c"], "answer": ["1", None, "3"]})
    with pytest.raises(ValueError) as info:
        load_problems(path)
    message = str(info.value)
    assert path in message and "row 2" in message and "'answer'" in message


# ----------------------------------------------------------------------------- load_problems: file errors
def test_unsupported_suffix_raises(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("prompt,answer\na,1\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"unsupported dataset format '\.csv'"):
        load_problems(path)


def test_missing_file_raises(tmp_path):
    path = tmp_path / "absent.jsonl"
    with pytest.raises(FileNotFoundError, match=re.escape(str(path))):
        load_problems(path)


# ----------------------------------------------------------------------------- FileSource
def test_file_source_with_held_out_file(tmp_path):
    train = _write_jsonl(tmp_path / "train.jsonl", [{"q": f"t{i}", "s": str(i)} for i in range(10)])
    held = _write_parquet(tmp_path / "held.parquet", {"q": ["h0", "h1"], "s": ["0", "1"]})
    source = FileSource(train, held_out_path=held, prompt_field="q", answer_field="s", warm_start_fraction=0.3)
    assert source.train_problems() == [Problem(f"t{i}", str(i)) for i in range(10)]
    assert source.held_out_problems() == [Problem("h0", "0"), Problem("h1", "1")]
    assert source.warm_start_problems() == source.train_problems()[:3]


def test_file_source_held_out_fraction_split(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", _rows(40))
    everything = set(load_problems(path))
    source = FileSource(path, held_out_fraction=0.25, seed=7)
    train, held = source.train_problems(), source.held_out_problems()
    assert len(held) == 10 and len(train) == 30
    assert not set(train) & set(held)
    assert set(train) | set(held) == everything
    assert source.warm_start_problems() == []


def test_file_source_split_is_deterministic_by_seed(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", _rows(40))
    a, b = FileSource(path, seed=7), FileSource(path, seed=7)
    assert a.train_problems() == b.train_problems() and a.held_out_problems() == b.held_out_problems()
    c = FileSource(path, seed=8)
    assert set(c.held_out_problems()) != set(a.held_out_problems())


def test_file_source_warm_start_is_a_prefix_of_train(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", _rows(40))
    source = FileSource(path, held_out_fraction=0.25, warm_start_fraction=0.2)
    assert len(source.warm_start_problems()) == 6
    assert source.warm_start_problems() == source.train_problems()[:6]


def test_file_source_holds_out_at_least_one(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", _rows(5))
    source = FileSource(path, held_out_fraction=0.01)
    assert len(source.held_out_problems()) == 1 and len(source.train_problems()) == 4


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.5])
def test_file_source_rejects_invalid_held_out_fraction(tmp_path, fraction):
    path = _write_jsonl(tmp_path / "d.jsonl", _rows(5))
    with pytest.raises(ValueError, match="held_out_fraction"):
        FileSource(path, held_out_fraction=fraction)


def test_file_source_too_few_problems_to_split(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", _rows(1))
    with pytest.raises(ValueError, match="too few problems"):
        FileSource(path, held_out_fraction=0.5)


# ----------------------------------------------------------------------------- BuiltinTask
def test_builtin_task_lists_are_the_arithmetic_task_splits():
    source = BuiltinTask("addition", max_operand=9, held_out_fraction=0.2, warm_start_fraction=0.1, seed=4)
    task = ArithmeticTask("addition", max_operand=9, held_out_fraction=0.2, warm_start_fraction=0.1, seed=4)
    assert source.train_problems() == task.train
    assert source.held_out_problems() == task.held_out
    assert source.warm_start_problems() == task.warm_start
    assert len(source.train_problems()) == 80 and len(source.held_out_problems()) == 20
    assert len(source.warm_start_problems()) == 10


@pytest.mark.parametrize("name,size", [("addition", 2500), ("addition3", 1000), ("reverse", 1000)])
def test_builtin_task_defaults(name, size):
    source = BuiltinTask(name)
    train, held = source.train_problems(), source.held_out_problems()
    assert len(train) + len(held) == size
    assert not set(train) & set(held)
    assert set(source.warm_start_problems()) <= set(train)


# ---------------------------------------------------------------- Hugging Face datasets directories
def test_a_datasets_directory_loads_with_field_mapping(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"question": f"{i}+1=", "solution": f"... #### {i + 1}", "id": i} for i in range(6)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    problems = load_problems(tmp_path / "ds", prompt_field="question", answer_field="solution")
    assert problems == [Problem(r["question"], r["solution"]) for r in rows]


def test_a_dataset_dict_directory_gives_its_train_and_held_out_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    splits = {"train": [{"prompt": f"{i}+2=", "answer": str(i + 2)} for i in range(5)],
              "test": [{"prompt": "9+9=", "answer": "18"}]}
    dataset_dict = datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()})
    dataset_dict.save_to_disk(str(tmp_path / "dd"))
    source = FileSource(str(tmp_path / "dd"), held_out_path=str(tmp_path / "dd"))
    assert source.train_problems() == [Problem(**row) for row in splits["train"]]
    assert source.held_out_problems() == [Problem("9+9=", "18")]
    with pytest.raises(ValueError, match=r"no split 'validation'; the dataset has \['test', 'train'\]"):
        load_problems(tmp_path / "dd", split="validation")


def test_a_datasets_directory_row_missing_a_field_is_named(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": None}]).save_to_disk(
        str(tmp_path / "ds"))
    with pytest.raises(ValueError, match=r"row 2: field 'answer' is null"):
        load_problems(tmp_path / "ds")


def test_a_directory_that_is_not_a_dataset_is_refused(tmp_path):
    pytest.importorskip("datasets")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a Hugging Face datasets directory"):
        load_problems(tmp_path / "empty")


def test_builtin_task_takes_exactly_the_arguments_of_the_task_it_wraps():
    """``BuiltinTask`` repeats ``ArithmeticTask``'s signature (jsonargparse reads a config's keys off it): the two
    must not drift apart."""
    import inspect

    def described(cls):
        return [(p.name, p.default, str(p.annotation)) for p in inspect.signature(cls).parameters.values()]

    assert described(BuiltinTask) == described(ArithmeticTask)
