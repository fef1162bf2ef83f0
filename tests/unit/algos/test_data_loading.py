"""Loading records from local files and Hugging Face datasets, and the errors that stop a run."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from rl_algos.data import ArithmeticDatasetSpec, DataError, DatasetSpec, load_records

ROWS = [{"question": f"What is {i} + {i}?", "solution": str(2 * i), "source": "synthetic"} for i in range(20)]
MAPPING = {"prompt": "question", "answer": "solution"}
MAPPED = [{"prompt": r["question"], "answer": r["solution"], "source": "synthetic"} for r in ROWS]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_jsonl_with_column_mapping(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "data.jsonl", ROWS)
    spec = DatasetSpec(path=str(path), column_mapping=MAPPING)
    assert load_records(spec, required_columns=("prompt", "answer")) == MAPPED


def test_jsonl_skips_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n   \n" + json.dumps(ROWS[1]) + "\n")
    assert load_records(DatasetSpec(path=str(path))) == ROWS[:2]


def test_parquet_with_column_mapping(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "data.parquet", ROWS)
    assert load_records(DatasetSpec(path=str(path), column_mapping=MAPPING)) == MAPPED


def test_json_array_and_json_lines_named_json(tmp_path: Path) -> None:
    array = tmp_path / "array.json"
    array.write_text(json.dumps(ROWS[:3]))
    lines = write_jsonl(tmp_path / "lines.json", ROWS[3:6])
    assert load_records(DatasetSpec(path=str(array))) == ROWS[:3]
    assert load_records(DatasetSpec(path=str(lines))) == ROWS[3:6]


def test_directory_reads_the_split_files(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "train-00000-of-00002.jsonl", ROWS[:5])
    write_parquet(tmp_path / "train-00001-of-00002.parquet", ROWS[5:12])
    write_jsonl(tmp_path / "validation.jsonl", ROWS[12:])
    assert load_records(DatasetSpec(path=str(tmp_path), split="train")) == ROWS[:12]
    assert load_records(DatasetSpec(path=str(tmp_path), split="validation")) == ROWS[12:]
    with pytest.raises(DataError) as info:
        load_records(DatasetSpec(path=str(tmp_path), split="test"))
    assert f"{tmp_path}: no files for split 'test'" in str(info.value)
    assert "validation.jsonl" in str(info.value)


def test_directory_without_split_names_is_read_whole_in_name_order(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "b.jsonl", ROWS[7:])
    write_parquet(tmp_path / "a.parquet", ROWS[:7])
    (tmp_path / "README.md").write_text("not data")
    assert load_records(DatasetSpec(path=str(tmp_path))) == ROWS


def test_shuffle_and_max_samples(tmp_path: Path) -> None:
    path = str(write_jsonl(tmp_path / "data.jsonl", ROWS))
    assert load_records(DatasetSpec(path=path, max_samples=4)) == ROWS[:4]
    shuffled = load_records(DatasetSpec(path=path, shuffle=True, seed=3))
    assert sorted(r["solution"] for r in shuffled) == sorted(r["solution"] for r in ROWS)
    assert shuffled != ROWS
    assert load_records(DatasetSpec(path=path, shuffle=True, seed=3)) == shuffled  # deterministic
    assert load_records(DatasetSpec(path=path, shuffle=True, seed=4)) != shuffled
    # max_samples takes a prefix of the shuffled order: a random subset, not the file's head
    assert load_records(DatasetSpec(path=path, shuffle=True, seed=3, max_samples=5)) == shuffled[:5]


def test_hugging_face_code_path_offline(tmp_path: Path) -> None:
    data = tmp_path / "hub_like"
    data.mkdir()
    write_jsonl(data / "train.jsonl", ROWS[:10])
    write_jsonl(data / "test.jsonl", ROWS[10:])
    cache = str(tmp_path / "cache")
    by_builder = DatasetSpec(
        name="json", data_files=str(data / "train.jsonl"), cache_dir=cache, column_mapping=MAPPING
    )
    assert load_records(by_builder) == MAPPED[:10]
    by_directory = DatasetSpec(name=str(data), split="test", cache_dir=cache)
    assert load_records(by_directory) == ROWS[10:]
    with pytest.raises(DataError) as info:
        load_records(DatasetSpec(name=str(data), split="validation", cache_dir=cache))
    assert f"dataset '{data}' (split 'validation'): cannot load" in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.jsonl"
    with pytest.raises(DataError) as info:
        load_records(DatasetSpec(path=str(path)))
    assert str(info.value) == f"{path}: no such file or directory"


def test_invalid_jsonl_line_names_path_and_line(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(
        json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[1]) + "\n" + '{"question": "x", "solution": \n'
    )
    with pytest.raises(DataError) as info:
        load_records(DatasetSpec(path=str(path)))
    assert str(info.value).startswith(f"{path}:3: invalid JSON: Expecting value")


def test_jsonl_line_that_is_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n[1, 2]\n")
    with pytest.raises(DataError) as info:
        load_records(DatasetSpec(path=str(path)))
    assert str(info.value) == f"{path}:2: expected a JSON object (a record), got list"


def test_missing_mapped_column_is_found_in_a_late_record(tmp_path: Path) -> None:
    rows = [dict(r) for r in ROWS]
    del rows[17]["question"]
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    # max_samples would never reach record 17: every record is still checked up front
    with pytest.raises(DataError) as info:
        load_records(DatasetSpec(path=str(path), column_mapping=MAPPING, max_samples=2))
    assert str(info.value) == (
        f"{path}:18: record 17 has no column 'question' (mapped to 'prompt'; columns: solution, source)"
    )


def test_missing_mapped_column_in_parquet(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "data.parquet", ROWS)
    with pytest.raises(DataError) as info:
        load_records(DatasetSpec(path=str(path), column_mapping={"prompt": "problem"}))
    assert str(info.value) == (
        f"{path}: record 0 has no column 'problem' (mapped to 'prompt'; columns: question, solution, source)"
    )


def test_missing_required_column_without_mapping(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "data.jsonl", ROWS)
    with pytest.raises(DataError) as info:
        load_records(DatasetSpec(path=str(path)), required_columns=("prompt",))
    assert str(info.value) == (
        f"{path}:1: record 0 has no column 'prompt' (columns: question, solution, source; "
        "map a column to it with column_mapping)"
    )


def test_unknown_format(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_text("question,solution\n")
    with pytest.raises(DataError) as info:
        load_records(DatasetSpec(path=str(path)))
    assert str(info.value) == f"{path}: unknown dataset format '.csv' (supported: .jsonl, .json, .parquet)"


def test_json_that_is_not_an_array(tmp_path: Path) -> None:
    path = tmp_path / "data.json"
    path.write_text('{"question": "x"}')
    with pytest.raises(DataError, match=r"data\.json: expected a JSON array of records"):
        load_records(DatasetSpec(path=str(path)))


def test_spec_needs_exactly_one_source() -> None:
    with pytest.raises(ValidationError, match="exactly one of 'name'"):
        DatasetSpec(name="gsm8k", path="data.jsonl")
    with pytest.raises(ValidationError, match="exactly one of 'name'"):
        DatasetSpec()
    with pytest.raises(ValidationError, match="shufle"):
        DatasetSpec.model_validate({"path": "x.jsonl", "shufle": True})


def test_arithmetic_spec_loads_generated_records() -> None:
    spec = ArithmeticDatasetSpec(num_samples=12, levels=[2], seed=5)
    records = load_records(spec, required_columns=("prompt", "answer"))
    assert len(records) == 12
    for record in records:
        expression = record["prompt"].removeprefix("What is ").removesuffix("?")
        assert str(eval(expression)) == record["answer"]


def test_undecodable_jsonl_line_names_path_and_line(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_bytes(json.dumps(ROWS[0]).encode() + b'\n{"question": "caf\xe9"}\n')
    with pytest.raises(DataError) as info:
        load_records(DatasetSpec(path=str(path)))
    assert str(info.value) == f"{path}:2: not UTF-8 text (byte 17: invalid continuation byte)"
