"""The recipe's run sections: how calibration is captured, when the run checkpoints, what it benchmarks and
what it exports.

None of them changes which heads go or how they are compensated (`pruner.runs.recipe` holds those sections and
the `Recipe` that gathers every one); `_Strict`, the base every section shares, lives here, below both.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False, frozen=True)


class ExportSpec(_Strict):
    """`pruner prune` also exports (into RUN_DIR/export-FORMAT) and pushes, as `pruner export` would."""

    format: Literal["none", "dense", "compact", "onnx", "gguf"] = "none"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="storage dtype of saved checkpoints (model/ and exports); auto: the base checkpoint's own")
    push_to_hub: str | None = Field(None, description="Hub repo id NAMESPACE/NAME to upload the export to")
    private: bool = False

    @field_validator("push_to_hub")
    @classmethod
    def _repo_id(cls, v: str | None) -> str | None:
        if v is not None:
            from huggingface_hub.utils import HFValidationError, validate_repo_id

            try:
                validate_repo_id(v)
            except HFValidationError as e:
                raise ValueError(f"invalid Hub repo id {v!r}: {e}") from None
        return v

    @model_validator(mode="after")
    def _push_needs_export(self):
        if self.push_to_hub and self.format == "none":
            raise ValueError("push_to_hub needs an export: set export.format to dense, compact or onnx")
        if self.private and not self.push_to_hub:
            raise ValueError("private applies only with export.push_to_hub")
        return self


class CaptureSpec(_Strict):
    """Calibration capture. The scorers read the cosine matrices (always captured); each further
    pair metric costs a pass per pair of heads (O(heads^2 T^2) logarithms for JS), so none by default."""

    chunk_size: int = Field(128, ge=1)
    metrics: list[Literal["cosine", "js", "hellinger", "tv", "aitchison"]] = ["cosine"]
    memory_check: bool = Field(True, description="refuse, before calibration, a peak-memory estimate larger than "
                                                 "the free memory")
    moments: Literal["float64", "float32"] = Field(
        "float64", description="storage of each layer's finished joint second moment of the head outputs (most "
                               "of the calibration's host memory: L x (heads x d_head)^2): accumulated in float64 "
                               "either way; float32 halves it (plans and refits checked unchanged, docs/scaling.md)")
    onload: Literal["auto", "all", "sequential"] = Field(
        "auto", description="all: the whole model resident during calibration; sequential: one block at a time, "
                            "read from the checkpoint's safetensors (models larger than memory); auto: sequential "
                            "when the model does not fit the device's free memory")
    hidden: Literal["auto", "memory", "disk"] = Field(
        "auto", description="layer by layer: where every window's hidden states stay between blocks (the part of "
                            "its memory that grows with the calibration set); disk: memory-mapped files under "
                            "spill_dir, removed after each pass (the same numbers); auto: disk only where the memory "
                            "check finds that memory cannot hold them and files make it fit")
    read_ahead: bool = Field(True, description="layer by layer: read the next block from disk (or copy it to the GPU) "
                                               "on a background thread while one runs; one more block in memory")
    spill_dir: str | None = Field(None, description="the folder for capture.hidden's files (default: the system's "
                                                    "temporary folder)")

    @model_validator(mode="after")
    def _hidden_is_layer_by_layer(self):
        if self.hidden == "disk" and self.onload == "all":
            raise ValueError("capture.hidden: disk keeps a layer-by-layer pass's hidden states; with capture.onload: "
                             "all there are none between blocks (set onload: sequential or auto)")
        return self


class CheckpointSpec(_Strict):
    """How often a run saves its calibration sums and finished evaluations for `--resume`
    (into its partial folder; removed when the run completes). Either trigger saves."""

    every_seconds: float | None = Field(600, ge=0, description="seconds between saves; null: never by time")
    every_batches: int | None = Field(None, ge=1, description="batches (or examples) between saves")


class BenchSpec(_Strict):
    """What `prune` measures of the pruned compact model against the base (parameters, checkpoint bytes,
    KV cache, peak memory, prefill latency, decode throughput; see pruner.evaluation.bench). Small by default so a
    run stays quick; `pruner bench RUN_DIR` measures at full length."""

    enabled: bool = True
    lengths: list[int] = Field([128, 512], description="prefill latency at batch 1, tokens (capped at the "
                                                        "position table)")
    decode: list[tuple[int, int]] = Field([(1, 16), (8, 256)], description="greedy decode cases "
                                                                          "[batch, prompt tokens]")
    new_tokens: int = Field(32, ge=2, description="tokens each decode case generates")
    repeats: int = Field(3, ge=1, description="interleaved rounds (figures are medians)")

    @model_validator(mode="after")
    def _positive(self):
        if any(t < 1 for t in self.lengths) or any(b < 1 or p < 1 for b, p in self.decode):
            raise ValueError("lengths, batch sizes and prompt lengths must be >= 1")
        if self.enabled and not self.lengths and not self.decode:
            raise ValueError("nothing to measure: give lengths or decode cases (or enabled: false)")
        return self
