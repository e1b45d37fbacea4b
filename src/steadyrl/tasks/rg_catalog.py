"""reasoning-gym's dataset registry, read for ``task=reasoning_gym``: the dataset names, the options each takes, and
their validation with errors that name the config key.

reasoning-gym (Stojanovski et al. 2025, arXiv:2505.24760) registers every dataset as a ``(dataset class, config
dataclass)`` pair in ``reasoning_gym.factory.DATASETS``; ``create_dataset(name, seed=..., size=..., **options)``
builds ``config_cls(seed=..., size=..., **options)``, calls its ``validate()`` (assertions) and then the dataset. The
checks here do the first two steps only, so validating a config generates nothing.

List every dataset and its options: ``python -m steadyrl.tasks.rg_catalog`` (``--json`` for programs).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import sys
from collections.abc import Mapping
from typing import Any

#: The command that lists every dataset (quoted in error messages).
LIST_COMMAND = "python -m steadyrl.tasks.rg_catalog"
#: Close matches an unknown dataset name's error suggests.
MAX_SUGGESTIONS = 5
#: difflib similarity a suggestion needs (its default 0.6 misses e.g. ``arithmetic`` → ``basic_arithmetic``).
SUGGESTION_CUTOFF = 0.5
#: Keys of a reasoning-gym config that the task sets itself (``task.size``, and seeds derived from the run's seed).
RESERVED_OPTIONS: tuple[str, ...] = ("seed", "size")


def _registry() -> Mapping[str, tuple[type, type]]:
    """``reasoning_gym.factory.DATASETS`` (imported on first use: importing reasoning-gym takes about a second)."""
    from reasoning_gym.factory import DATASETS

    return DATASETS


def dataset_names() -> list[str]:
    """Every registered reasoning-gym dataset name, sorted."""
    return sorted(_registry())


def check_dataset_name(name: str) -> str:
    """``name`` if reasoning-gym registers it; else a ValueError with the closest names and how to list all."""
    names = dataset_names()
    if name in names:
        return name
    close = difflib.get_close_matches(name, names, n=MAX_SUGGESTIONS, cutoff=SUGGESTION_CUTOFF)
    close += [n for n in names if name and name in n and n not in close][: MAX_SUGGESTIONS - len(close)]
    hint = f"did you mean {', '.join(repr(n) for n in close)}? " if close else ""
    raise ValueError(
        f"unknown reasoning-gym dataset {name!r}: {hint}{len(names)} datasets are registered; list them with "
        f"`{LIST_COMMAND}`"
    )


def dataset_options(name: str) -> dict[str, Any]:
    """The options of dataset ``name`` with their defaults (the config dataclass's fields, minus seed and size)."""
    config_cls = _registry()[name][1]
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config_cls):
        if f.name in RESERVED_OPTIONS:
            continue
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        else:
            out[f.name] = None  # required (only composite's ``datasets``)
    return out


def check_dataset_options(name: str, options: Mapping[str, Any], *, size: int) -> None:
    """Raise a ValueError when reasoning-gym's config of ``name`` refuses ``options`` (the value of ``task.config``).

    Unknown keys list the valid ones; a value reasoning-gym's ``validate()`` rejects gives its own message.
    ``name`` must be registered (:func:`check_dataset_name`).
    """
    reserved = sorted(set(options) & set(RESERVED_OPTIONS))
    if reserved:
        raise ValueError(
            f"{', '.join(reserved)} cannot be set in task.config (task.size sets the dataset size, and the run's "
            "seed derives the seeds of the train and eval streams)"
        )
    valid = dataset_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"reasoning-gym's {name} has no option {', '.join(repr(k) for k in unknown)}; its options "
            f"are {', '.join(valid) or 'none'}"
        )
    config_cls = _registry()[name][1]
    try:
        config = config_cls(seed=0, size=size, **options)
        if callable(getattr(config, "validate", None)):
            config.validate()
    except (AssertionError, ValueError, TypeError, KeyError) as err:
        raise ValueError(f"reasoning-gym's {name} rejects {dict(options)}: {err or type(err).__name__}") \
            from err


def _describe(name: str) -> str:
    doc = (_registry()[name][0].__doc__ or "").strip().splitlines()
    return doc[0] if doc else ""


def main(argv: list[str] | None = None) -> int:
    """Print every reasoning-gym dataset with its first docstring line and its options (defaults)."""
    parser = argparse.ArgumentParser(prog=LIST_COMMAND, description="List reasoning-gym's datasets for "
                                     "task=reasoning_gym task.dataset=<name> (options go in task.config.<key>).")
    parser.add_argument("--json", action="store_true", help="one JSON object: name -> {summary, options}")
    args = parser.parse_args(argv)
    rows = {name: {"summary": _describe(name), "options": dataset_options(name)} for name in dataset_names()}
    if args.json:
        json.dump(rows, sys.stdout, indent=1, default=repr)
        print()
        return 0
    for name, row in rows.items():
        print(f"{name}: {row['summary']}")
        options = ", ".join(f"{k}={v!r}" for k, v in row["options"].items())
        print(f"    {options or '(no options)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
