"""Peak memory of a recovery's training step, estimated before the teacher samples a token.

A recovery that runs out of memory after the teacher has spent an hour writing its text loses
the run, and `full` training holds five times the student's float32 weights. What one process
holds at a training step's peak, in bytes:

- the student's weights in float32 (it trains in float32 whatever its checkpoint stores);
- for the weights it trains -- every one (`full`), the kept heads' projections (`attention`),
  LoRA's adapters (`lora`) -- their gradients, AdamW's two moments and the guard's copy of the
  best weights so far: 16 bytes a trained weight beside its own 4, and two copies of the largest
  trained tensor while AdamW steps it (with FSDP, 1/N of each);
- the teacher as loaded, when it is held (a `resident` one always; a `cached` one only where the
  caller keeps it: `pruner recover` and `pruner prune` free its weights while the student trains);
- one batch's activations kept for the backward pass, float32, at the teacher's width (the
  student's is at most that): per layer the residual stream, norms and q/k/v/o
  (`BACKWARD_PER_LAYER` x tokens x d_model), the MLP's four (tokens x d_ffn: a gated MLP's gate,
  up, activation and product) and, on a CPU, the attention weights SDPA materialises
  (batch x heads x T x T);
- the logits over the vocabulary in float32: the student's, their log-probabilities, the
  gradients of both, and with a resident teacher its logits, log-probabilities and
  probabilities (`LOGIT_COPIES`, `TEACHER_LOGIT_COPIES` tensors of tokens x V);
- `WORKING` bytes: the recovery text and its windows, the framework's own.

On a CPU the activations and logits count `CPU_SLACK` times: the heap serves the training step's
and the validation pass's buffers (of other sizes) from different places and keeps both, so a
run's resident memory climbs over its first validation passes to a plateau about half again
above its first step's (measured, `eval/bench/recovery_memory.py`). On a GPU the estimate is of
the memory allocated (`torch.cuda.max_memory_allocated`); the caching allocator reserves more.

A `cached` teacher first runs once over the recovery windows beside the loaded student: its
logits for a batch, and for the window being cached its log-probabilities, their top k, the
tail's probabilities and the samples drawn from them (`CACHE_COPIES` (T, V) float32 tensors). The
estimate is the larger of that pass and a training step. On a CPU the heap keeps that pass's
buffers (`pruner.core.host_memory.reuse_buffers` never trims it) and the training step's, of
other sizes, are not all served from them: there a cached teacher's training step counts the
cache pass's buffers too (measured: the Qwen2.5-0.5B shape's step peaked 2.5% above the estimate
without them).

A process trains `ceil(batch_size / processes)` windows of each batch. The constants are set
so that the estimate bounds the measured peaks (`eval/bench/recovery_memory.py`,
docs/recovery.md "Memory").
"""

from __future__ import annotations

import math

from pruner.core import arch
from pruner.core.runtime import model_bytes
from pruner.recovery import methods
from pruner.recovery.spec import RecoverySpec

BACKWARD_PER_LAYER = 10   # (tokens, d_model) float32 tensors a block keeps for the backward pass
MLP_PER_LAYER = 4         # (tokens, d_ffn) float32 tensors an MLP keeps: a gated one's gate, up, activation, product
LOGIT_COPIES = 4          # the student's (tokens, V) float32: logits, log-probabilities, and their gradients
TEACHER_LOGIT_COPIES = 3  # a resident teacher's (tokens, V) float32: logits, log-probabilities, probabilities
STATE_PER_TRAINED = 16    # bytes per trained weight beside its own: gradient, AdamW's two moments, the best copy
STEP_COPIES = 2           # float32 copies of the largest trained tensor while AdamW steps it
CACHE_COPIES = 8          # (T, V) float32 tensors of one window while the cache is written
WORKING = 128 << 20       # the recovery text, its windows and the framework's working memory
CPU_SLACK = 1.6           # a CPU run's plateau over its step's activations and logits (module docstring)


def shape(teacher) -> dict[str, int]:
    """The base model's width: layers L, heads H, d_model d, MLP width ffn, vocabulary V."""
    g, c = arch.geometry(teacher), teacher.config
    d = getattr(c, "hidden_size", None) or g.n_heads * g.head_dim
    ffn = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * d
    return {"L": g.n_layers, "H": g.n_heads, "d": d, "ffn": ffn, "V": c.vocab_size}


def trained_tensors(student, method: str, rank: int = 8) -> list[int]:
    """The sizes of the tensors `method` trains in `student` (LoRA: its adapters, rank x in and out x rank per
    projection)."""
    if method in ("full", "blocks", "attention"):
        own = methods.trained_prefixes(student, method)
        return [p.numel() for n, p in student.named_parameters() if own is None or n.startswith(own)]
    modules = dict(student.named_modules())
    sizes = []
    for name in methods._projections(student):
        w = modules[name].weight  # Linear: (out, in); Conv1D: (in, out)
        sizes += [rank * w.shape[0], rank * w.shape[1]]
    return sizes


def estimate(student, teacher, spec: RecoverySpec, method: str, *, teacher_held: bool, processes: int = 1,
             cpu: bool = True, teacher_bytes: int | None = None) -> dict[str, int]:
    """Peak bytes of one process's training step, by part (module docstring). `teacher_held`: whether the
    teacher's weights stay in this process's memory while the student trains; `teacher_bytes`: their size when
    `teacher` is a skeleton read a block at a time (default: the teacher's own bytes)."""
    s = shape(teacher)
    L, H, d, ffn, V = (s[k] for k in ("L", "H", "d", "ffn", "V"))
    rows = math.ceil(spec.batch_size / processes)
    tokens, T = rows * spec.length, spec.length
    shards = processes if spec.fsdp else 1
    weights = sum(p.numel() for p in student.parameters())
    sizes = trained_tensors(student, method, spec.lora_rank)
    trained = sum(sizes)
    if method == "lora":
        weights += trained  # the adapters beside the frozen weights
    per_layer = BACKWARD_PER_LAYER * tokens * d + MLP_PER_LAYER * tokens * ffn + (rows * H * T * T if cpu else 0)
    resident, slack = spec.teacher == "resident", CPU_SLACK if cpu else 1.0
    held = teacher_bytes if teacher_bytes is not None else model_bytes(teacher)
    step = {"student": 4 * weights // shards,
            "trained state": (STATE_PER_TRAINED * trained + STEP_COPIES * 4 * max(sizes, default=0)) // shards,
            "teacher": held if (teacher_held or resident) else 0,
            "activations": int(slack * 4 * L * per_layer),
            "logits": int(slack * 4 * tokens * V * (LOGIT_COPIES + (TEACHER_LOGIT_COPIES if resident else 0))),
            "working": WORKING}
    if resident:
        return step
    cache_pass = int(slack * 4 * (spec.batch_size + CACHE_COPIES) * T * V)
    if cpu:
        step["cache pass"] = cache_pass  # kept by the heap beside the step's own buffers (module docstring)
    student_now = sum(p.numel() * p.element_size() for p in student.parameters())
    cache = {"student": student_now, "teacher": held, "cache pass": cache_pass, "working": WORKING}
    return step if sum(step.values()) >= sum(cache.values()) else cache


def held_now(student, teacher, teacher_bytes: int | None = None) -> int:
    """What is loaded already when the estimate is checked: the float32 student and the teacher."""
    return model_bytes(student) + (teacher_bytes if teacher_bytes is not None else model_bytes(teacher))

