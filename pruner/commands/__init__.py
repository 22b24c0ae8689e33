"""The command line: one module per `pruner` command, a thin shell over the Python API.

`add_parser(sub, common)` declares a command's flags, `run(args)` parses them, calls the
Python API (`pruner.api`), writes files and prints. Heavy imports happen inside `run`, so
`pruner --help` stays instant."""

from __future__ import annotations

import argparse


def recipe_args(p: argparse.ArgumentParser, default_out: str) -> None:
    """The arguments every recipe-driven command takes."""
    p.add_argument("recipe", help="YAML recipe (see recipes/)")
    p.add_argument("--out", help=f"output folder (default: {default_out})")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a recipe key, e.g. --set selection.target=0.4 (repeatable)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    resume_args(p)
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run Python code shipped with the model checkpoint (its config's auto_map); "
                        "same as --set model.trust_remote_code=true")


def resume_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted run of the same command from the checkpoints in its partial "
                        "folder (.OUT.partial); starts afresh when there are none")


def recipe_overrides(args: argparse.Namespace) -> list[str]:
    """`--set` values, plus what flags of recipe-driven commands set."""
    return (args.set or []) + (["model.trust_remote_code=true"] if args.trust_remote_code else [])


def sample_args(p: argparse.ArgumentParser, num_samples: int) -> None:
    """Which token rows `sinks` and `analyze` measure."""
    p.add_argument("--data", default="shakespeare:evaluation",
                   help="shakespeare:<split>, python-docs:<dev|evaluation>, a local .txt file/folder, or a Hub dataset id")
    p.add_argument("--sinks", default=None,
                   help="first | bos | special | auto | ids:ID,... | positions:P,... (default by model)")
    p.add_argument("--unit", choices=("windows", "lines"), default=None,
                   help="fixed-length windows (decoder default) or one sample per non-empty line (encoder "
                        "default)")
    p.add_argument("--max-length", "--length", dest="max_length", type=int, default=128,
                   help="window length / max line length in tokens")
    p.add_argument("--num-samples", type=int, default=num_samples)
    p.add_argument("--no-bos", action="store_true", help="do not start decoder windows with BOS")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run Python code shipped with the model checkpoint (its config's auto_map)")


def sample_options(args: argparse.Namespace) -> dict:
    """The flags of `sample_args` as `pruner.api` options."""
    return {"sinks": args.sinks, "unit": args.unit, "max_length": args.max_length, "num_samples": args.num_samples,
            "bos": not args.no_bos, "batch_size": args.batch_size, "seed": args.seed, "threads": args.threads,
            "trust_remote_code": args.trust_remote_code}
