"""Print the bad-input matrix of tests/test_reliability.py as the table of docs/troubleshooting.md.

    python tests/error_matrix.py > /tmp/matrix.md

Runs every case through the CLI (as the tests do) and prints `case | exit | message`.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path

from test_reliability import CASES, build_env, case_args, patched

from pruner.cli import main

ROOT = Path(__file__).resolve().parents[1]


def run() -> None:
    with tempfile.TemporaryDirectory() as d:
        env = build_env(Path(d))
        print("| bad input | exit | what pruner prints |\n|---|---|---|")
        for name, argv, _, _ in CASES:
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), patched(name, env):
                rc = main(case_args(argv, env, Path(d) / "out"))
            line = next(x for x in err.getvalue().splitlines() if x.startswith("pruner: "))
            print(f"| {name} | {rc} | `{line.replace(d, '<tmp>').replace('|', '/')}` |", flush=True)


if __name__ == "__main__":
    run()
