"""`pruner export RUN --format gguf` for Gemma 3 (llama.cpp's `gemma3`) and `--quantize`.

A tiny random Gemma 3 (a sliding-window layer, then a global one) with a tiny SentencePiece-style tokenizer
(BPE over `▁`-joined text, byte fallback: Gemma's kind): the file read back with the gguf reader (always
runs), the refusals (layers that keep different head counts, mean compensation's bias, unknown quantization
types, a missing quantizer), and in the llama_cpp tier llama.cpp's greedy tokens against PyTorch's, its
tokenization against transformers', and a quantized file scored beside the float one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pruner.checkpoints import gguf_file, llamacpp
from pruner.cli import main
from pruner.pruning import surgery

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
MERGES = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("i", "n"), ("▁", "b"), ("o", "r"), ("▁", "o")]


def gemma_style_tokenizer():
    """A SentencePiece-style BPE tokenizer as Gemma's tokenizer.json is built: specials, 16 byte tokens, `▁` and
    the letters, 8 merges; spaces become `▁`, unknown bytes fall back to <0xNN>."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = SPECIALS + [f"<0x{b:02X}>" for b in range(16)] + ["▁", *"abcdefghijklmnopqrstuvwxyz"]
    vocab = {t: i for i, t in enumerate(pieces + ["".join(m) for m in MERGES])}
    tok = Tokenizer(models.BPE(vocab, MERGES, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")


def tiny_gemma(vocab: int, seed: int = 0):
    """2 layers (sliding window 8, then global), 4 query heads over 2 KV heads of width 8, hidden 32, a query
    scale (query_pre_attn_scalar 16) that is not llama.cpp's 1/sqrt(head_dim); norms away from zero."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.Gemma3TextConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              hidden_size=32, intermediate_size=64, max_position_embeddings=128, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
                              vocab_size=vocab, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    model = tf.Gemma3ForCausalLM(cfg).eval()
    for name, p in model.named_parameters():
        if p.dim() == 2:
            p.data.mul_(3.0)  # sharper attention, logits further from ties
        elif name.endswith("norm.weight"):
            p.data.uniform_(-0.5, 0.5)  # Gemma stores norms as weight - 1: make the + 1 matter
    return model


@pytest.fixture
def tok():
    return gemma_style_tokenizer()


def pruned(tok, heads: dict[int, list[int]], compensation=None):
    model = tiny_gemma(len(tok))
    surgery.remove_heads(model, heads, compensation)
    return model


UNIFORM = {0: [1, 3], 1: [0, 2]}  # 2 of 4 query heads in each layer, one per KV group


def test_a_uniform_gemma_goes_in_as_llama_cpps_gemma3(tok, tmp_path):
    import gguf

    model = pruned(tok, UNIFORM)
    plan = gguf_file.plan(model, tok)
    gguf_file.write(model, tok, tmp_path / "m.gguf", "float16", plan)
    s = gguf_file.check_structure(tmp_path / "m.gguf", model, plan, "float16")
    assert (s["arch"], s["q_heads"], s["kv_heads"], s["key_length"], s["rope_dim"]) == ("gemma3", [2, 2], [2, 2], 8, 8)
    assert (s["sliding_window"], s["sliding"]) == (8, [True, False])
    assert (s["tokenizer"], s["tokens"], s["bos"], s["eos"]) == ("llama", len(tok), 2, 1)
    blk = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
           "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm"}
    want = {"token_embd.weight", "output_norm.weight"} | {f"blk.{i}.{b}.weight" for i in range(2) for b in blk}
    assert set(s["tensors"]) == want  # tied embeddings: no output.weight
    assert s["tensors"]["blk.0.attn_q.weight"] == ((16, 32), "F16") and s["tensors"]["blk.1.attn_q_norm.weight"] == \
        ((8,), "F32")

    r = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    got = {t.name: torch.from_numpy(t.data.copy()).float() for t in r.tensors}
    layer = model.model.layers[1]
    torch.testing.assert_close(got["blk.1.ffn_norm.weight"], layer.pre_feedforward_layernorm.weight + 1)
    torch.testing.assert_close(got["blk.1.attn_k_norm.weight"], layer.self_attn.k_norm.weight + 1)
    # transformers scales queries by 16 ** -0.5, llama.cpp by 8 ** -0.5: the ratio rides in the q norm
    torch.testing.assert_close(got["blk.1.attn_q_norm.weight"], (layer.self_attn.q_norm.weight + 1) * 0.5 ** 0.5)
    torch.testing.assert_close(got["blk.0.attn_q.weight"], model.model.layers[0].self_attn.q_proj.weight.half().float())
    fields = {k: r.fields[k].contents() for k in ("gemma3.rope.freq_base", "gemma3.rope.freq_base_swa",
                                                  "tokenizer.ggml.add_space_prefix")}
    assert fields == {"gemma3.rope.freq_base": 1_000_000.0, "gemma3.rope.freq_base_swa": 10_000.0,
                      "tokenizer.ggml.add_space_prefix": False}
    types = r.fields["tokenizer.ggml.token_type"].contents()
    scores = r.fields["tokenizer.ggml.scores"].contents()
    ids = tok.get_vocab()
    assert [types[ids[t]] for t in ("<bos>", "<0x0A>", "▁", "▁the")] == [
        gguf.TokenType.CONTROL, gguf.TokenType.BYTE, gguf.TokenType.NORMAL, gguf.TokenType.NORMAL]
    assert scores[ids["▁t"]] > scores[ids["he"]] > scores[ids["▁the"]]  # earlier merges score higher


def test_layers_that_keep_different_head_counts_are_refused_naming_what_works(tok):
    """llama.cpp's gemma3 sizes every layer from layer 0's head count: a global-budget plan does not fit it."""
    with pytest.raises(gguf_file.GgufError, match="sizes every layer from layer 0's head count") as e:
        gguf_file.plan(pruned(tok, {0: [1, 3]}), tok)
    assert "\n" not in str(e.value) and "selection.shape: servable" in str(e.value)
    assert "export --format compact" in str(e.value)
    assert gguf_file.family_refusal("gemma3_text", uniform=True) is None


def test_mean_compensations_bias_is_refused(tok):
    """llama.cpp's gemma3 has no output-projection bias to hold mean compensation's folded one."""
    mean = surgery.Compensation("mean", bias={i: torch.ones(32) for i in range(2)})
    with pytest.raises(gguf_file.GgufError, match="no attention biases.*surgery.compensation: refit or zero"):
        gguf_file.plan(pruned(tok, UNIFORM, mean), tok)


def test_a_byte_level_tokenizer_is_not_taken_for_gemmas(tok):
    from pruner.checkpoints import loading

    with pytest.raises(gguf_file.GgufError, match="SentencePiece-style BPE tokenizer"):
        gguf_file.plan(pruned(tok, UNIFORM), loading.load_tokenizer("llama-shakespeare"))


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """A quick llama-shakespeare run, for the export command's error paths."""
    out = tmp_path_factory.mktemp("q") / "run"
    assert main(["prune", str(ROOT / "recipes" / "llama-shakespeare.yaml"), "--out", str(out), "--set",
                 "calibration.num_samples=8", "--set", "evaluation.num_samples=4", "--set", "evaluation.bootstrap=10",
                 "--set", "evaluation.latency=false", "--set", "bench.enabled=false"]) == 0
    return out


@pytest.mark.parametrize("args,says", [
    (["--format", "gguf", "--quantize", "q9_9"], "unknown GGUF quantization 'q9_9'; known: q8_0, q6_k"),
    (["--format", "compact", "--quantize", "q8_0"], "--quantize applies only with --format gguf")])
def test_quantize_errors_are_one_line_and_write_nothing(llama_run, capsys, args, says):
    capsys.readouterr()
    assert main(["export", str(llama_run)] + args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]
    assert not any(p.name.startswith((("export-", ".export-"))) for p in llama_run.iterdir())


def test_quantize_without_llama_cpp_names_the_extra(llama_run, capsys, monkeypatch):
    monkeypatch.setattr(llamacpp, "available", lambda: False)
    capsys.readouterr()
    assert main(["export", str(llama_run), "--format", "gguf", "--quantize", "q4_k_m"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "llama-cpp-python, which is not installed" in err[0] and "pruner[llamacpp]" in err[0]
    assert not any(p.name.startswith(("export-", ".export-")) for p in llama_run.iterdir())


def test_the_help_lists_the_quantizers_types():
    from pruner.commands import export

    text = Path(export.__file__).read_text()
    assert ", ".join(llamacpp.QUANT_TYPES) in " ".join(text.replace('"\n', "").replace('"', "").split())


@pytest.mark.llama_cpp
def test_llama_cpp_generates_pytorchs_greedy_tokens_from_a_pruned_gemma(tok, tmp_path):
    """Float32 file, 8 prompt tokens + 16 generated ones: past the sliding window of 8, so the local layer's
    mask, both rope bases, the norms' + 1 and the folded query scale all show."""
    model = pruned(tok, UNIFORM)
    plan = gguf_file.plan(model, tok)
    gguf_file.write(model, tok, tmp_path / "m.gguf", "float32", plan)
    assert llamacpp.check(tmp_path / "m.gguf", model)
    ids = torch.randint(3, len(tok), (12,), generator=torch.Generator().manual_seed(7)).tolist()
    assert llamacpp.llamacpp_greedy(tmp_path / "m.gguf", ids, 20) == llamacpp.torch_greedy(model, ids, 20)


@pytest.mark.llama_cpp
def test_llama_cpp_tokenizes_text_as_transformers_does(tok, tmp_path):
    model = pruned(tok, UNIFORM)
    gguf_file.write(model, tok, tmp_path / "m.gguf", "float16", gguf_file.plan(model, tok))
    llm = llamacpp.open_model(tmp_path / "m.gguf", n_ctx=64)
    try:
        for text in ("the bother in a tub", "orbit\nthe boat"):
            assert llm.tokenize(text.encode(), add_bos=False, special=False) == tok(text)["input_ids"]
    finally:
        llm.close()


@pytest.mark.llama_cpp
def test_a_quantized_file_is_scored_beside_the_float_one(tok, tmp_path):
    model = pruned(tok, UNIFORM)
    gguf_file.write(model, tok, tmp_path / "m.gguf", "float16", gguf_file.plan(model, tok))
    llamacpp.quantize(tmp_path / "m.gguf", tmp_path / "q.gguf", "q8_0")
    assert gguf_file.structure(tmp_path / "q.gguf")["tensors"]["blk.0.ffn_up.weight"][1] == "Q8_0"
    ids = torch.randint(3, len(tok), (3, 20), generator=torch.Generator().manual_seed(1))  # (window, q_pos)
    labels = ids.clone()
    labels[:, 0] = -100
    labels[2, 15:] = -100  # a shorter last window (its padding)
    nll_f, count, top_f = llamacpp.window_scores(tmp_path / "m.gguf", ids, labels)
    nll_q, count_q, top_q = llamacpp.window_scores(tmp_path / "q.gguf", ids, labels)
    assert count == count_q == 19 + 19 + 14 and top_f.shape == top_q.shape == (count,)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()  # (window, q_pos, vocab)
    logp = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None])[..., 0]  # (window, q_pos - 1)
    torch.testing.assert_close(nll_f, -float(logp[labels[:, 1:] != -100].sum()), rtol=2e-3, atol=0)
    assert abs(nll_q - nll_f) / nll_f < 0.05 and float((top_f == top_q).float().mean()) > 0.8
