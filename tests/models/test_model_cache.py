"""The model cache: root resolution, stable keys, atomic builds, reuse."""

from __future__ import annotations

from pathlib import Path

import pytest

from steadyrl.models.model_cache import CACHE_ENV, build_once, cache_key, models_dir

MARKER = "done.json"


def test_models_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert models_dir() == tmp_path / "models"
    assert models_dir(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv(CACHE_ENV)
    assert models_dir() == Path("~/.cache/steadyrl/models").expanduser()


def test_key_is_stable_and_order_free() -> None:
    assert cache_key({"a": 1, "b": [1, 2]}) == cache_key({"b": [1, 2], "a": 1})
    assert cache_key({"a": 1}) != cache_key({"a": 2})


def write(tmp: Path) -> None:
    (tmp / "weights.bin").write_bytes(b"w")
    (tmp / MARKER).write_text("{}")


def test_builds_once_then_reuses(tmp_path: Path) -> None:
    final = tmp_path / "m-abc"
    assert build_once(final, build=write, complete_marker=MARKER)
    assert (final / "weights.bin").read_bytes() == b"w"
    assert final.stat().st_mode & 0o777 == 0o755

    def fail(tmp: Path) -> None:
        raise AssertionError("must not rebuild")

    assert not build_once(final, build=fail, complete_marker=MARKER)


def test_interrupted_build_leaves_nothing(tmp_path: Path) -> None:
    final = tmp_path / "m-abc"

    def interrupted(tmp: Path) -> None:
        (tmp / "weights.bin").write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_once(final, build=interrupted, complete_marker=MARKER)
    assert not final.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["m-abc.lock"]


def test_stale_and_unmarked_directories_are_replaced(tmp_path: Path) -> None:
    final = tmp_path / "m-abc"
    final.mkdir()
    (final / "weights.bin").write_bytes(b"half")  # no marker: a crash left it
    stale = tmp_path / ".tmp-m-abc-123"
    stale.mkdir()
    assert build_once(final, build=write, complete_marker=MARKER)
    assert (final / "weights.bin").read_bytes() == b"w" and not stale.exists()


def test_build_must_write_the_marker(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=MARKER):
        build_once(tmp_path / "m", build=lambda tmp: None, complete_marker=MARKER)
    assert not (tmp_path / "m").exists()
