"""Where the embedded default model is cached, how a cache entry is named, and how it is written atomically.

Layout: ``<root>/models/<name>-<key>/`` holds a standard Hugging Face checkpoint (``config.json``,
``model.safetensors``, ``tokenizer.json`` …) plus a metadata file. ``<root>`` is ``$STEADYRL_CACHE`` when set, else
``~/.cache/steadyrl``. The key is a hash of everything that determines the weights, so a changed setting builds a new
entry and an unchanged one is reused.

Atomicity: an entry is built in a temporary sibling directory and moved into place with one ``os.replace``; an
interrupted build leaves at most a ``.tmp-*`` directory (removed on the next build of that key) and never a
half-written entry. Concurrent builders of one key (several processes of a run) serialize on a lock file, so the
model is trained once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

#: Environment variable that overrides the cache root.
CACHE_ENV = "STEADYRL_CACHE"
#: Cache root when the variable is unset.
DEFAULT_CACHE_ROOT = Path("~/.cache/steadyrl")
#: Subdirectory of the root that holds models.
MODELS_SUBDIR = "models"
#: Hex characters of the hash kept in an entry's name.
KEY_CHARS = 16
#: Prefix of in-progress build directories.
TMP_PREFIX = ".tmp-"
#: Permissions of a cache entry directory (rwxr-xr-x).
ENTRY_MODE = 0o755


def models_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The directory that holds cached models: ``cache_dir`` if given, else ``<root>/models``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    root = os.environ.get(CACHE_ENV)
    return (Path(root) if root else DEFAULT_CACHE_ROOT).expanduser() / MODELS_SUBDIR


def cache_key(payload: Mapping[str, Any]) -> str:
    """A short stable hash of a JSON-serializable ``payload`` (keys sorted, so dict order does not matter)."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:KEY_CHARS]


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_once(final: Path, *, build: Callable[[Path], None], complete_marker: str) -> bool:
    """Make sure ``final`` exists: if not, run ``build(tmp_dir)`` and move ``tmp_dir`` to ``final`` atomically.

    ``build`` must write ``complete_marker`` (a file name) last; a directory without it is not trusted. Returns True
    when this call built the entry, False when it was already there (possibly built meanwhile by another process).
    """
    if (final / complete_marker).is_file():
        return False
    with _locked(final.with_name(final.name + ".lock")):
        if (final / complete_marker).is_file():  # another process finished while we waited
            return False
        for stale in final.parent.glob(f"{TMP_PREFIX}{final.name}-*"):  # left by an interrupted build
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():  # no marker: not ours to trust
            shutil.rmtree(final)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{final.name}-", dir=final.parent))
        tmp.chmod(ENTRY_MODE)  # mkdtemp makes it private; a cache entry is readable by all, like the files in it
        try:
            build(tmp)
            if not (tmp / complete_marker).is_file():
                raise RuntimeError(f"the build of {final} did not write {complete_marker}")
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return True
