"""Matrix products at the model's own precision, exactly where that loses nothing (bfloat16 on the CPU, TF32 on CUDA)."""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def matmul_precision(half: bool):
    """Inside, float32 matrix products may round their inputs to the model's precision (`half`):
    bfloat16 with float32 accumulation on the CPU (oneDNN: AMX / avx512_bf16), TF32 on CUDA.

    Exact for products of bfloat16 values (q k^T of a bfloat16 model: every product of
    two 8-bit mantissas fits float32, and bfloat16 fits TF32's 10 bits), and several
    times faster than IEEE float32. Only products of the model's own values, or of
    values whose rounding matters no more than the model's (see `output_moments`),
    run here. (The CUDA setting is untested here: no GPU was available.)
    """
    if not half:
        yield
        return
    cpu, cuda = torch.backends.mkldnn.matmul, torch.backends.cuda.matmul
    prev = cpu.fp32_precision, cuda.fp32_precision
    cpu.fp32_precision, cuda.fp32_precision = "bf16", "tf32"
    try:
        yield
    finally:
        cpu.fp32_precision, cuda.fp32_precision = prev
