"""pruner's version: one literal, read by the package, the run records and the build (pyproject)."""

__version__ = "0.1.0"
