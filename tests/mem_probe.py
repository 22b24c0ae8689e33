"""Peak-memory probe run in a subprocess by tests/test_capture_memory.py.

    python tests/mem_probe.py {plain|capture|eager} T

Prints the peak resident memory (MiB) growth of one pass over a random model.
"""

from __future__ import annotations

import resource
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])


def main() -> None:
    mode, T = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    import transformers as tf

    from pruner.capture import CaptureConfig, capture_stats
    from pruner.data import TokenBatch
    from pruner.eager import eager_stats
    from pruner.sinks import SinkSpec

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                         hidden_size=128, intermediate_size=256, max_position_embeddings=T, vocab_size=256)
    model = tf.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 256, (1, T))
    batch = TokenBatch(ids, torch.ones_like(ids))
    with torch.no_grad():
        model(input_ids=ids[:, :8])  # warm up allocator and lazy imports
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    spec = SinkSpec("first")
    if mode == "plain":
        with torch.no_grad():
            model(input_ids=ids)
    elif mode == "capture":
        capture_stats(model, batch, spec, config=CaptureConfig(chunk_size=64, metrics=("cosine",)))
    else:
        eager_stats(model, batch, spec, metrics=("cosine",))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((peak - base) / 1024)


if __name__ == "__main__":
    main()
