"""The options of `pruner analyze` / `pruner sinks` / `pruner.analyze`: flags validated as a recipe is."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from pruner.runs.recipe import RecipeError, _Strict, error_message


class AnalyzeSpec(_Strict):
    """Options of `pruner analyze` / `pruner sinks` / `pruner.analyze` (they are flags, not a recipe)."""

    sinks: str | None = Field(None, description="first | bos | special | auto | ids:ID,... | positions:P,...")
    unit: Literal["windows", "lines"] | None = None
    max_length: int = Field(128, ge=4, le=131072)
    num_samples: int | None = Field(64, ge=1)
    metrics: list[str] = Field(["cosine", "js"], min_length=1)
    thresholds: dict[str, float] = {}
    clusters: int | None = Field(None, ge=2)
    seed: int = 0
    batch_size: int = Field(8, ge=1)
    chunk_size: int = Field(128, ge=1)
    bos: bool = True
    threads: int | None = Field(None, ge=1)
    trust_remote_code: bool = False
    memory_check: bool = True
    checkpoint_every_seconds: float | None = Field(600, ge=0)
    checkpoint_every_batches: int | None = Field(None, ge=1)

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, v: list[str]) -> list[str]:
        from pruner.attention.pairs import PAIR_METRICS

        bad = [m for m in v if m not in PAIR_METRICS]
        if bad:
            raise ValueError(f"unknown pair metrics {bad}; valid: {', '.join(PAIR_METRICS)}")
        return v

    @classmethod
    def validated(cls, values: dict[str, Any]) -> "AnalyzeSpec":
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            raise RecipeError(error_message(e).replace("invalid recipe", "invalid option", 1)) from None
