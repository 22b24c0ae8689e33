"""The `recovery:` recipe section: one validated config for `pruner prune`, `pruner recover` and
`pruner.recover` (off by default: a recipe without it stays a prune)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pruner.core.mixture import check_shares, check_sources

METHODS = ("full", "blocks", "lora", "attention")
GENERATED = "generated"  # text sampled from the teacher itself


class RecoverySpec(BaseModel):
    """Distillation from the base model into the pruned one (see docs/recovery.md)."""

    model_config = ConfigDict(extra="forbid", strict=False, frozen=True)

    enabled: bool = Field(False, description="`pruner prune` recovers after the surgery (pruner recover always does)")
    method: str | None = Field(None, description="full: every kept weight; blocks: every weight of the transformer "
                                                 "blocks (embeddings, final norm and LM head stay the base's); "
                                                 "lora: PEFT LoRA on the attention and "
                                                 "MLP projections, merged at the end; attention: only the kept "
                                                 "heads' projections; unset: full where the student's training "
                                                 "state and the teacher fit the free memory, else lora")
    tokens: int = Field(65536, ge=1, description="training token budget (real, non-pad tokens)")
    data: str | list[str] = Field(GENERATED, description="generated (text the teacher samples, cached in the run "
                                                         "folder), any data source the recipes accept, or a list of "
                                                         "them, generated included (equal shares of the windows "
                                                         "unless `weights` says otherwise)")
    weights: list[float] | None = Field(None, description="a list's share of the windows per source (default: equal "
                                                          "shares)")
    split: str = "train"
    text_column: str = "text"
    name: str | None = None
    length: int = Field(128, ge=8, le=131072, description="tokens per training window")
    batch_size: int = Field(8, ge=1, description="windows per optimizer step (over all processes)")
    lr: float | None = Field(None, gt=0, description="peak learning rate (default: full and attention 1e-4, lora "
                                                     "1e-3)")
    restarts: int = Field(2, ge=0, description="times a run that drifted (a validation pass more than twice the "
                                               "pruned model's KL before any pass beat it) restarts from the pruned "
                                               "weights at the learning rate / sqrt(10), for the steps left")
    warmup: float = Field(0.05, ge=0, lt=1, description="fraction of the steps the learning rate warms up over")
    schedule: Literal["cosine", "linear", "constant_with_warmup"] = "cosine"
    weight_decay: float = Field(0.0, ge=0)
    temperature: float = Field(1.0, gt=0, description="softmax temperature of both distributions in the KL")
    ce_weight: float = Field(0.0, ge=0, description="weight of the next-token cross-entropy added to the KL")
    teacher: Literal["resident", "cached"] = Field(
        "resident", description="resident: the teacher runs beside the student; cached: it runs once over the "
                                "recovery tokens and its top-k log-probabilities are stored on disk")
    top_k: int = Field(64, ge=1, description="cached teacher: log-probabilities kept per token (the tail's mass too)")
    tail_samples: int = Field(32, ge=0, description="cached teacher: tokens sampled from the teacher's tail per "
                                                    "token (an unbiased full-vocabulary KL; 32 chosen on the "
                                                    "validation KL, docs/recovery.md); 0: the tail collapsed to one "
                                                    "bin (a lower bound)")
    lora_rank: int = Field(8, ge=1)
    lora_alpha: float = Field(16.0, gt=0)
    validation: float = Field(0.05, gt=0, lt=0.5, description="fraction of the recovery windows held back")
    eval_every: int | None = Field(None, ge=1, description="tokens between validation passes (default: 8 per run)")
    save_every: int | None = Field(None, ge=1, description="tokens between checkpoints for --resume (default: "
                                                           "the validation cadence)")
    fsdp: bool = Field(False, description="several processes shard the student's weights, gradients and AdamW state "
                                          "(torch FSDP) instead of each holding all of it")
    temperature_generate: float = Field(1.0, gt=0, description="generated data: sampling temperature")
    seed: int = 0

    @model_validator(mode="after")
    def _method(self):
        if self.method is not None and self.method not in METHODS:
            raise ValueError(f"unknown recovery method {self.method!r}; valid: {', '.join(METHODS)}")
        return self

    @field_validator("data")
    @classmethod
    def _data(cls, v: str | list[str]) -> str | list[str]:
        """One source or a list of them, `generated` (the teacher's own text) a source like any other; a list of
        one is that source."""
        if isinstance(v, str):
            if not v.strip():
                raise ValueError("must name a source (it is empty)")
            return v
        if len(set(v)) < len(v):
            raise ValueError(f"the list names a source twice ({v}): give it a larger weight instead")
        rest = [x for x in v if x != GENERATED]
        if rest or not v:
            check_sources(rest)  # an empty list: refused
        return v[0] if len(v) == 1 else v

    @model_validator(mode="after")
    def _weights(self):
        """One weight per source of a list (>= 0, a positive finite sum); none for a single source."""
        if self.weights is not None:
            if len(self.sources) == 1:
                raise ValueError("weights share a list of sources; recovery.data names one")
            check_shares(len(self.sources), self.weights, self.tokens, None)  # the calibration mixture's checks
        return self

    def shares(self) -> list[float]:
        """Each source's weight: `weights`, else equal shares."""
        return list(self.weights) if self.weights is not None else [1.0] * len(self.sources)

    @property
    def sources(self) -> list[str]:
        """The data sources, one or more (`[generated]` for the teacher's own text)."""
        return [self.data] if isinstance(self.data, str) else list(self.data)

    def peak_lr(self) -> float:
        """The learning rate: `lr`, else 1e-4 for every weight (`full`, `blocks`, `attention`) and 1e-3 for LoRA's adapters --
        chosen on the held-back validation slice of the shipped decoders (docs/recovery.md, `eval/studies/recovery/dev.py`:
        1e-4 the lowest validation KL of 1e-3 ... 3e-5 on the Llama and GPT-2 at 50%; 1e-3 overshoots on all three;
        Minitron uses 1e-4 at billions of parameters)."""
        if self.lr is not None:
            return self.lr
        return 1e-3 if self.method == "lora" else 1e-4

    @property
    def window_tokens(self) -> int:
        return self.batch_size * self.length
