"""Public checkpoints' configs as data: the real shapes the benchmarks and tests build random-weight models of.

Each entry holds the fields of the checkpoint's `config.json` on the Hugging Face Hub that fix the architecture,
copied as published (nothing is downloaded): `config_kwargs(name)` is what `AutoConfig.for_model` takes, with
overrides (a benchmark cuts `num_hidden_layers` to a few blocks). `rope_scaling` and `rope_theta` are the
published spellings; transformers 5 reads them into `rope_parameters`. Random weights have no trained sinks,
but nothing measured at these shapes (time, memory, bytes saved, servable head counts) depends on the weights.
"""

from __future__ import annotations

import copy

_LLAMA3 = dict(model_type="llama", vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5, attention_bias=False,
               mlp_bias=False, hidden_act="silu", bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16")

SHAPES: dict[str, dict] = {
    # meta-llama/Meta-Llama-3-8B
    "llama-3-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                       tie_word_embeddings=False),
    # meta-llama/Meta-Llama-3-70B: the 70B width (benchmarks cut it to a few blocks)
    "llama-3-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192,
                        tie_word_embeddings=False),
    # meta-llama/Llama-3.3-70B-Instruct: Llama-3-70B's shape with Llama 3.1's long context
    "llama-3.3-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                          max_position_embeddings=131072, tie_word_embeddings=False,
                          eos_token_id=[128001, 128008, 128009],
                          rope_scaling={"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                        "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
    # meta-llama/Llama-3.2-1B
    "llama-3.2-1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                         tie_word_embeddings=True,
                         rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                       "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
    # Qwen/Qwen2.5-0.5B
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, use_sliding_window=False, sliding_window=32768,
                         max_window_layers=24, hidden_act="silu", bos_token_id=151643, eos_token_id=151643,
                         torch_dtype="bfloat16"),
    # mistralai/Mistral-7B-v0.3
    "mistral-7b-v0.3": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, vocab_size=32768,
                            max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5,
                            sliding_window=None, tie_word_embeddings=False, hidden_act="silu", bos_token_id=1,
                            eos_token_id=2, torch_dtype="bfloat16"),
    # openai-community/gpt2 (GPT-2 small; its config names no dtype: the weights are float32)
    "gpt2-small": dict(model_type="gpt2", n_embd=768, n_head=12, n_layer=12, n_positions=1024, n_ctx=1024,
                       vocab_size=50257, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                       bos_token_id=50256, eos_token_id=50256),
}


def config_kwargs(name: str, **overrides) -> dict:
    """A fresh copy of the public config `name` (`model_type` included: a config.json's fields), with `overrides`
    on top; an unknown name is an error listing the known ones."""
    if name not in SHAPES:
        raise KeyError(f"unknown public shape {name!r}; known: {', '.join(SHAPES)}")
    return copy.deepcopy({**SHAPES[name], **overrides})


def config(name: str, **overrides):
    """The transformers config of the public shape `name`, with `overrides` (e.g. `num_hidden_layers=2`)."""
    from transformers import AutoConfig

    fields = config_kwargs(name, **overrides)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def dtype_name(name: str) -> str:
    """The dtype the public checkpoint is stored in (float32 where its config names none)."""
    return SHAPES[name].get("torch_dtype", "float32")
