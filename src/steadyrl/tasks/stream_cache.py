"""An on-disk cache of generated problem streams: one JSONL file per stream, line ``i`` holding entry ``i``.

Files are replaced atomically (written beside, then renamed), so concurrent processes that extend the same stream
each leave a complete, valid file. A file whose lines stop parsing is trusted up to the last good line.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

#: Environment variable naming steadyrl's cache root (tasks go in its ``tasks`` subdirectory).
CACHE_ENV = "STEADYRL_CACHE"
#: Cache root when the variable is unset.
DEFAULT_CACHE_ROOT = Path("~/.cache/steadyrl")
TASKS_SUBDIR = "tasks"
#: Bump when the cached line format changes, so old files are not read.
CACHE_FORMAT_VERSION = 1
#: Hex digits of the key hash in a cache file name.
KEY_HEX_CHARS = 16

Entry = dict[str, Any]


def task_cache_dir(override: Path | None = None) -> Path:
    """Where task caches live: ``override``, else ``$STEADYRL_CACHE/tasks``, else ``~/.cache/steadyrl/tasks``."""
    if override is not None:
        return override.expanduser()
    root = os.environ.get(CACHE_ENV)
    return (Path(root) if root else DEFAULT_CACHE_ROOT).expanduser() / TASKS_SUBDIR


def cache_key(key: Mapping[str, Any]) -> str:
    """A short stable hash of a JSON-serializable key (settings, seed, generator version)."""
    payload = json.dumps({"format": CACHE_FORMAT_VERSION, **key}, sort_keys=True, default=list)
    return hashlib.sha256(payload.encode()).hexdigest()[:KEY_HEX_CHARS]


def _read_lines(path: Path) -> list[Entry]:
    entries: list[Entry] = []
    if not path.exists():
        return entries
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                break  # a torn or foreign line: trust what came before it
            if not isinstance(entry, dict):
                break
            entries.append(entry)
    return entries


def _write_lines(path: Path, entries: list[Entry]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for entry in entries:
            f.write(json.dumps(entry) + "\n")
    os.replace(tmp, path)


class StreamCache:
    """Entries ``0..n-1`` of one generated stream, kept in memory and in ``path``; extended on demand.

    ``generate(start, stop)`` makes entries ``start..stop-1``; it is called only for indices not cached yet.
    """

    def __init__(self, *, path: Path, generate: Callable[[int, int], list[Entry]]) -> None:
        self.path = path
        self._generate = generate
        self._entries: list[Entry] | None = None

    def get(self, *, start: int, stop: int) -> list[Entry]:
        """Entries ``start..stop-1`` (generating and saving the missing tail first)."""
        if self._entries is None:
            self._entries = _read_lines(self.path)
        if stop > len(self._entries):
            # Another process may have extended the file meanwhile: reread before generating.
            on_disk = _read_lines(self.path)
            if len(on_disk) > len(self._entries):
                self._entries = on_disk
        if stop > len(self._entries):
            self._entries = self._entries + self._generate(len(self._entries), stop)
            _write_lines(self.path, self._entries)
        return self._entries[start:stop]
