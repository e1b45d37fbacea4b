"""The ``steadyrl`` command: a thin dispatcher to each subcommand's ``main``."""

from __future__ import annotations

import argparse
import sys


def _methods(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="steadyrl methods", description="List every method steadyrl implements.")
    parser.add_argument("--json", action="store_true", help="print a JSON list (name, summary, paper, confidence...)")
    parser.add_argument(
        "--frameworks", action="store_true",
        help="list the framework-qualified names (verl:vanilla, trl:dapo, ...): options and parity tests",
    )  # fmt: skip
    args = parser.parse_args(argv)
    from steadyrl.methods.catalog import format_catalog, format_frameworks

    print(format_frameworks(as_json=args.json) if args.frameworks else format_catalog(as_json=args.json))
    return 0


def _train(argv: list[str]) -> int:
    from steadyrl.train.entry import main as train_main

    return train_main(argv)


def _demo(argv: list[str]) -> int:
    from steadyrl.demo import main as demo_main

    return demo_main(argv)


def _sweep(argv: list[str]) -> int:
    from steadyrl.sweep.entry import sweep_main

    return sweep_main(argv)


def _report(argv: list[str]) -> int:
    from steadyrl.sweep.entry import report_main

    return report_main(argv)


def _check(argv: list[str]) -> int:
    from steadyrl.check.entry import main as check_main

    return check_main(argv)


#: Commands that need an extra beyond the core (``methods`` and ``demo`` run on the core alone).
NEEDS_EXTRA = {"train": "train", "sweep": "train", "report": "train", "check": "train"}

COMMANDS = {
    "methods": (_methods, "list the methods (objectives, corrections, baselines, controllers) and their papers"),
    "demo": (_demo, "every method's loss on synthetic stale rollouts at several lags (seconds, no model)"),
    "train": (_train, "RL-train a causal LM on a verifiable task at a chosen policy lag"),
    "sweep": (_sweep, "run a grid of train runs (methods x lags x seeds) in parallel; results.csv, summary"),
    "report": (_report, "one self-contained HTML report (embedded plots) of a sweep or run directory"),
    "check": (_check, "setup checks of a run, a sweep or a framework's losses (idle clip, batch reuse, fair arms)"),
}


def _one_line_notices() -> None:
    """A renamed config key prints one line (``steadyrl: config key 'lag' is renamed to ...``), not a warning's
    file and source line."""
    import warnings

    from steadyrl.config.renamed import RenamedKeyWarning

    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
        if issubclass(category, RenamedKeyWarning):
            print(f"steadyrl: {message}", file=sys.stderr if file is None else file)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``steadyrl`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: steadyrl <command> [args]\n\ncommands:")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:<10} {help_text}")
        print("\nRun `steadyrl <command> --help` for the options of a command.")
        return 0
    if argv[0] in ("-V", "--version"):
        from steadyrl import __version__

        print(f"steadyrl {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    _one_line_notices()
    if name not in COMMANDS:
        print(f"steadyrl: unknown command {name!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    if name in NEEDS_EXTRA:  # one line saying what to install, before any import can fail
        from steadyrl.base.extras import MissingExtraError, require_extra

        try:
            require_extra(NEEDS_EXTRA[name], f"steadyrl {name}")
        except MissingExtraError as err:
            print(err, file=sys.stderr)
            return 1
    try:
        return COMMANDS[name][0](rest)
    except BrokenPipeError:  # output piped into `head` or similar: not an error
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
