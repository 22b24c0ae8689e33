"""Peak-memory probe run in a subprocess by tests/test_capture_memory.py.

    python tests/mem_probe.py {plain|capture|eager} T
    python tests/mem_probe.py moments N

Prints the peak resident memory (MiB) growth of one pass over a random model (`moments`: of one batch's output
moments of N rows, 16 heads x 128, joint, added to a layer's running sums):
VmHWM after resetting it (`/proc/self/clear_refs` = 5), minus VmRSS before. Not
`ru_maxrss`: it keeps the parent's peak across fork/exec, so a probe started from a
large pytest process would see no growth at all.
"""

from __future__ import annotations

import sys

import torch

from pruner.core.proc_status import PeakGrowth


def moments(N: int) -> None:
    from pruner.attention.moments import output_moments
    from pruner.core import host_memory

    host_memory.map_large_buffers()  # freed buffers leave the process: the peak is what is alive at once
    g = torch.Generator().manual_seed(0)
    o = [torch.randn(1, N, 16, 128, generator=g, dtype=torch.bfloat16) for _ in range(2)]
    u = [torch.randn(1, N, 16, 128, generator=g) for _ in range(2)]
    rows = torch.ones(1, N, dtype=torch.bool)
    running = output_moments(o[0], u[0], rows, True, channels=False, joint=True)
    with PeakGrowth() as peak:
        running.add_(output_moments(o[1], u[1], rows, True, channels=False, joint=True))
    print(peak.bytes / 2**20)


def main() -> None:
    mode, T = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    if mode == "moments":
        return moments(T)
    import transformers as tf
    from eager_reference import eager_stats

    from pruner.attention.capture import CaptureConfig, capture_stats
    from pruner.attention.sinks import SinkSpec
    from pruner.core.data import TokenBatch

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                         hidden_size=128, intermediate_size=256, max_position_embeddings=T, vocab_size=256)
    model = tf.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 256, (1, T))
    batch = TokenBatch(ids, torch.ones_like(ids))
    with torch.no_grad():
        model(input_ids=ids[:, :8])  # warm up allocator and lazy imports
    spec = SinkSpec("first")
    with PeakGrowth() as peak:
        if mode == "plain":
            with torch.no_grad():
                model(input_ids=ids)
        elif mode == "capture":
            capture_stats(model, batch, spec, config=CaptureConfig(chunk_size=64, metrics=("cosine",)))
        else:
            eager_stats(model, batch, spec, metrics=("cosine",))
    print(peak.bytes / 2**20)


if __name__ == "__main__":
    main()
