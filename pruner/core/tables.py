"""Tables a person reads: markdown tables and the "+0.54 [+0.29, +0.80]" cell every report prints."""

from __future__ import annotations

from typing import Mapping


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A GitHub markdown table; floats print with two decimals, everything else as `str` gives it."""

    def fmt(v):
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def ci_cell(value: float, low: float, high: float, digits: int = 2, signed: bool = True) -> str:
    """`value [low, high]`: `+0.54 [+0.29, +0.80]` (a change, signed) or `0.512 [0.480, 0.540]` (a level)."""
    spec = f"{'+' if signed else ''}.{digits}f"
    return f"{value:{spec}} [{low:{spec}}, {high:{spec}}]"


def change_cell(d: Mapping | None, digits: int = 2) -> str:
    """The paired change of a record with `delta`, `ci_low`, `ci_high` as a `ci_cell`; `n/a` when absent."""
    return "n/a" if d is None else ci_cell(d["delta"], d["ci_low"], d["ci_high"], digits)
