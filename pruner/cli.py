"""The `pruner` command line: the parser and the error policy. Each command lives in `pruner.commands`,
a thin shell over the Python API (`pruner.api`)."""

from __future__ import annotations

import argparse
import sys

from pruner.commands import analyze, bench, compare, evaluate, export, plan_memory, prune, recover, sinks
from pruner.core.redact import redact
from pruner.core.version import __version__

COMMANDS = (sinks, analyze, prune, recover, compare, evaluate, export, bench, plan_memory)  # the order `pruner --help` lists them in


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="pruner", description="Sink-aware attention-head pruning for Hugging Face checkpoints.")
    ap.add_argument("--version", action="version", version=f"pruner {__version__}")
    ap.add_argument("--debug", action="store_true", help="show full tracebacks instead of one-line errors")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)  # `--debug` also after the command name
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    for command in COMMANDS:
        command.add_parser(sub, common)
    return ap


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done, 2 bad input (one-line message), 1 unexpected failure, 130 interrupted.

    Tracebacks are for developers: `--debug` shows them, everyone else gets one line.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except KeyboardInterrupt as e:
        if args.debug:
            raise
        kept = getattr(e, "pruner_partial", None)
        print("pruner: interrupted; no output folder was written" + (
            f"; its progress is kept in {kept}: run the same command with --resume to continue" if kept else ""),
            file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:  # bad input: files, recipes, data, models, Hub (FileNotFoundError is an OSError)
        if args.debug:
            raise
        print(f"pruner: error: {redact(_one_line(e))}{_kept(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a bug or an environment problem: still one line without --debug
        if args.debug:
            raise
        print(f"pruner: error: unexpected {type(e).__name__}: {redact(_one_line(e))}{_kept(e)} (run with --debug for "
              "the traceback)", file=sys.stderr)
        return 1


def _kept(e: BaseException) -> str:
    """Where a failed run's checkpoints were kept (`report.atomic_dir`), if they were."""
    from pruner.core.resume import ResumeError

    kept = getattr(e, "pruner_partial", None)
    if kept is None or isinstance(e, ResumeError):
        return ""
    return f"; its progress is kept in {kept} (--resume continues it, --overwrite discards it)"


if __name__ == "__main__":
    sys.exit(main())
