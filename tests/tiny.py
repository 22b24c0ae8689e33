"""Tiny randomly initialised models, one per architecture family (no files, no network)."""

from __future__ import annotations

import torch

VOCAB = 64


def tiny_model(family: str, seed: int = 0):
    """A 2-layer model of `family` in eval mode, float32, eager-capable."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=128, **common)
        cls = tf.GPT2LMHeadModel
    elif family in ("llama", "mistral", "qwen2", "qwen3"):
        cfg_cls = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config,
                   "qwen3": tf.Qwen3Config}[family]
        cfg = cfg_cls(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      hidden_size=32, intermediate_size=64, max_position_embeddings=128, **common)
        cls = {"llama": tf.LlamaForCausalLM, "mistral": tf.MistralForCausalLM,
               "qwen2": tf.Qwen2ForCausalLM, "qwen3": tf.Qwen3ForCausalLM}[family]
    elif family == "gemma3_text":  # 4 query heads over 2 KV heads, a sliding-window layer then a global one
        cfg = tf.Gemma3TextConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  hidden_size=32, intermediate_size=64, max_position_embeddings=128,
                                  sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                  query_pre_attn_scalar=16, **common)
        cls = tf.Gemma3ForCausalLM
    elif family == "gpt_neox":
        cfg = tf.GPTNeoXConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=32,
                               intermediate_size=64, max_position_embeddings=128, **common)
        cls = tf.GPTNeoXForCausalLM
    elif family == "bert":
        cfg = tf.BertConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=32,
                            intermediate_size=64, max_position_embeddings=128, vocab_size=VOCAB, pad_token_id=0)
        cls = tf.BertModel
    elif family == "roberta":
        cfg = tf.RobertaConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=32,
                               intermediate_size=64, max_position_embeddings=130, vocab_size=VOCAB,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2)
        cls = tf.RobertaModel
    else:
        raise ValueError(family)
    model = cls(cfg).eval()
    # sharpen attention so sinks and content differ from uniform rows
    for name, p in model.named_parameters():
        if p.dim() == 2:
            p.data.mul_(3.0)
    return model


FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gpt_neox", "bert", "roberta")
CAUSAL = {"gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gpt_neox"}
GQA = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")  # 4 query heads over 2 KV heads
QK_NORM = {"qwen3", "gemma3_text"}  # q/k RMSNorms: GGUF's `llama`/`deci` cannot hold them


def ragged_batch(seed: int = 0, n: int = 6, max_len: int = 20, min_len: int = 5):
    """Token lists of different lengths, each starting with BOS=1 (ids 3..VOCAB-1 otherwise)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [[1] + torch.randint(3, VOCAB, (L - 1,), generator=g).tolist() for L in lengths]
