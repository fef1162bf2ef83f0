"""Loading dataset records: local JSONL / JSON / Parquet files, or Hugging Face datasets.

Everything is read and validated up front, when a run is set up: a missing file, a malformed
line or a record without a needed column is a `DataError` naming the path, line, record and
column, raised before any model is built.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from rl_algos.data.arithmetic import ArithmeticDatasetSpec, arithmetic_records
from rl_algos.data.errors import DataError
from rl_core.config import RLConfig

SUPPORTED_SUFFIXES: tuple[str, ...] = (".jsonl", ".json", ".parquet")


class DatasetSpec(RLConfig):
    """Where a dataset comes from and how its records are selected.

    Exactly one of `name` (a Hugging Face dataset id, or a builder such as `json` with
    `data_files`, loaded with `datasets.load_dataset`) and `path` (a local `.jsonl`, `.json` or
    `.parquet` file, or a directory of them) is given.

    For a directory, the files named after the split (`train.jsonl`,
    `train-00000-of-00002.parquet`, `validation_1.json`) are read; a directory without any
    split-named file (none named train/validation/valid/val/test/dev/eval) is read whole. Files
    are read in name order. For a single file `split` is not used.

    `column_mapping` maps the field a task expects to the column that holds it, e.g.
    `{"prompt": "question", "answer": "solution"}`; unmapped columns are kept as they are.
    """

    name: str | None = None
    path: str | None = None
    subset: str | None = Field(default=None, description="Hugging Face dataset configuration name")
    data_files: str | list[str] | None = Field(default=None, description="passed to datasets.load_dataset")
    split: str = "train"
    cache_dir: str | None = Field(default=None, description="datasets cache (default: HF_DATASETS_CACHE)")
    column_mapping: dict[str, str] = Field(default_factory=dict)
    max_samples: int | None = Field(default=None, ge=1)
    shuffle: bool = False
    seed: int = 0

    @model_validator(mode="after")
    def _one_source(self) -> DatasetSpec:
        if (self.name is None) == (self.path is None):
            raise ValueError("give exactly one of 'name' (a Hugging Face dataset) and 'path' (local files)")
        if self.data_files is not None and self.name is None:
            raise ValueError(
                "'data_files' goes with 'name' (datasets.load_dataset); for local files use 'path'"
            )
        return self

    def describe(self) -> str:
        if self.path is not None:
            return self.path
        subset = f", subset '{self.subset}'" if self.subset else ""
        return f"dataset '{self.name}' (split '{self.split}'{subset})"


@dataclass(frozen=True)
class _Located:
    """A record and where it came from, for error messages."""

    record: dict[str, Any]
    location: str  # "path:LINE" for JSONL, "path" otherwise
    index: int  # 0-based position in its file / dataset


AnyDatasetSpec = DatasetSpec | ArithmeticDatasetSpec


def load_records(spec: AnyDatasetSpec, required_columns: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Read, validate, rename, shuffle and cut the records `spec` describes (for the built-in
    arithmetic task: generate them).

    Every record must hold every source column of `spec.column_mapping` and, after renaming,
    every column in `required_columns` (the fields the task's processor reads); all records are
    checked, so a bad one late in a file still stops the run before training. Records are
    numbered from 0 within their file in error messages; JSONL errors also give the line.
    """
    if isinstance(spec, ArithmeticDatasetSpec):
        generated = arithmetic_records(spec)
        located = [_Located(dict(record), "arithmetic task", i) for i, record in enumerate(generated)]
        return [_apply_mapping(item, {}, required_columns) for item in located]
    located = list(
        _read_hf(spec) if spec.name is not None else _read_local(Path(spec.path or ""), spec.split)
    )
    records = [_apply_mapping(item, spec.column_mapping, required_columns) for item in located]
    if spec.shuffle:
        random.Random(spec.seed).shuffle(records)
    if spec.max_samples is not None:
        records = records[: spec.max_samples]
    return records


def _apply_mapping(
    item: _Located, column_mapping: Mapping[str, str], required_columns: Sequence[str]
) -> dict[str, Any]:
    record = item.record
    for target, source in column_mapping.items():
        if source not in record:
            raise DataError(
                f"{item.location}: record {item.index} has no column '{source}' (mapped to '{target}'; "
                f"columns: {', '.join(sorted(record))})"
            )
    renamed_sources = set(column_mapping.values()) - set(column_mapping)
    mapped = {key: value for key, value in record.items() if key not in renamed_sources}
    mapped.update({target: record[source] for target, source in column_mapping.items()})
    for column in required_columns:
        if column not in mapped:
            hint = "" if column_mapping else "; map a column to it with column_mapping"
            raise DataError(
                f"{item.location}: record {item.index} has no column '{column}' "
                f"(columns: {', '.join(sorted(record))}{hint})"
            )
    return mapped


def _read_local(path: Path, split: str) -> Iterator[_Located]:
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    files = _data_files_in(path, split) if path.is_dir() else [path]
    for file in files:
        yield from _read_file(file)


def _data_files_in(directory: Path, split: str) -> list[Path]:
    supported = sorted(p for p in directory.iterdir() if p.is_file() and p.suffix in SUPPORTED_SUFFIXES)
    if not supported:
        raise DataError(
            f"{directory}: no dataset files in this directory (looked for {', '.join(SUPPORTED_SUFFIXES)})"
        )
    of_split = [p for p in supported if _belongs_to_split(p, split)]
    if of_split:
        return of_split
    if any(_belongs_to_split(p, other) for p in supported for other in _COMMON_SPLITS):
        # Split-organised directory without this split: reading everything would mix splits.
        names = ", ".join(p.name for p in supported)
        raise DataError(f"{directory}: no files for split '{split}' in this directory (files: {names})")
    return supported


_COMMON_SPLITS = ("train", "validation", "valid", "val", "test", "dev", "eval")


def _belongs_to_split(file: Path, split: str) -> bool:
    return file.stem == split or file.name.startswith((f"{split}-", f"{split}_"))


def _read_file(path: Path) -> Iterator[_Located]:
    suffix = path.suffix
    if suffix == ".jsonl":
        yield from _read_jsonl(path)
    elif suffix == ".json":
        yield from _read_json(path)
    elif suffix == ".parquet":
        yield from _read_parquet(path)
    else:
        raise DataError(
            f"{path}: unknown dataset format '{suffix or path.name}' (supported: {', '.join(SUPPORTED_SUFFIXES)})"
        )


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc.strerror}") from None


def _decode(data: bytes, location: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{location}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None


def _read_jsonl(path: Path) -> Iterator[_Located]:
    index = 0
    # Lines are decoded one by one so that a bad byte is reported with its line number.
    for line_number, raw in enumerate(_read_bytes(path).splitlines(), start=1):
        location = f"{path}:{line_number}"
        line = _decode(raw, location)
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{location}: invalid JSON: {exc.msg} (column {exc.colno})") from None
        yield _Located(_as_record(value, location), location, index)
        index += 1


def _read_json(path: Path) -> Iterator[_Located]:
    text = _decode(_read_bytes(path), str(path))
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":
            # Several top-level values: JSON Lines under a .json name (as `datasets` accepts).
            yield from _read_jsonl(path)
            return
        raise DataError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(value, list):
        raise DataError(
            f"{path}: expected a JSON array of records (or one JSON object per line), got {type(value).__name__}"
        )
    for index, item in enumerate(value):
        yield _Located(_as_record(item, f"{path}: record {index}"), str(path), index)


def _read_parquet(path: Path) -> Iterator[_Located]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow (pip install 'rl-algos[datasets]')") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several unrelated types for a corrupt file
        raise DataError(f"{path}: cannot read Parquet: {exc}") from None
    for index, row in enumerate(rows):
        yield _Located(row, str(path), index)


def _as_record(value: Any, location: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DataError(f"{location}: expected a JSON object (a record), got {type(value).__name__}")
    return value


def _read_hf(spec: DatasetSpec) -> Iterator[_Located]:
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{spec.describe()}: loading a Hugging Face dataset needs `datasets` (pip install 'rl-algos[datasets]')"
        ) from None
    try:
        dataset = datasets.load_dataset(
            spec.name, spec.subset, split=spec.split, data_files=spec.data_files, cache_dir=spec.cache_dir
        )
    except (FileNotFoundError, ValueError, ConnectionError, datasets.exceptions.DatasetNotFoundError) as exc:
        raise DataError(f"{spec.describe()}: cannot load: {exc}") from None
    if not isinstance(dataset, datasets.Dataset):
        raise DataError(f"{spec.describe()}: expected a single split, got {type(dataset).__name__}")
    for index, row in enumerate(dataset.to_list()):
        yield _Located(row, spec.describe(), index)
