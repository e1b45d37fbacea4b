"""Reading a user's data file into rows, each tagged with where it came from (for :class:`DatasetError` messages).

JSONL: one JSON object a line; blank lines are skipped but counted, so ``line N`` is the 1-based line in an editor.
Parquet: read with pyarrow when it is installed (it is not in the pinned environment); rows are 1-based.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from steadyrl.tasks.config import PARQUET_SUFFIXES
from steadyrl.tasks.types import DatasetError

PYARROW_HINT = "pip install pyarrow"


class Row(NamedTuple):
    """One record of a data file: its fields and where it is (``"line 3"`` / ``"row 3"``)."""

    fields: dict[str, Any]
    where: str


def _read_jsonl(path: Path) -> list[Row]:
    rows: list[Row] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"line {lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(path=path, where=where, reason=f"bad JSON: {err.msg} (column {err.colno})") from err
            if not isinstance(record, dict):
                got = type(record).__name__
                raise DatasetError(path=path, where=where, reason=f"expected a JSON object, got {got}")
            rows.append(Row(fields=record, where=where))
    return rows


def _read_parquet(path: Path) -> list[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError(
            f"reading {path} needs pyarrow, which is not installed: `{PYARROW_HINT}`, or convert the file to JSONL"
        ) from err
    records = pq.read_table(path).to_pylist()
    return [Row(fields=record, where=f"row {i}") for i, record in enumerate(records, start=1)]


def read_rows(path: Path) -> list[Row]:
    """All rows of a ``.jsonl`` or ``.parquet`` file. Raises DatasetError (file and line) on a row that is not an
    object, ImportError when Parquet is asked for without pyarrow, FileNotFoundError when the file is missing."""
    path = path.expanduser()
    if path.suffix.lower() in PARQUET_SUFFIXES:
        return _read_parquet(path)
    return _read_jsonl(path)
