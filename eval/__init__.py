"""The evidence: benchmarks, design studies and GPU checks that regenerate the docs' tables (`python -m eval --list`).

Every script is a module with a docstring giving its command and what it writes (`python -m eval.bench.capture
--help`); `python -m eval TABLE` runs the commands behind one table. Shared code lives in `eval.common`; shared
facts the package needs too (public model shapes, the /proc memory reader) live in `pruner.core`.
"""
