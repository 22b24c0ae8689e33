"""Data module: local text, windows with/without BOS, line samples, determinism, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pruner.core import assets
from pruner.core.data import DataError, TextSource, bos_token_id, line_samples, load_texts, pad, token_windows

pytestmark = pytest.mark.unit


def test_shipped_splits_are_disjoint_whole_plays():
    names = {s: {p.name for p in assets.shakespeare(s).glob("*.txt")} for s in assets.SPLITS}
    assert all(len(v) >= 4 for v in names.values())
    assert not names["train"] & names["calibration"]
    assert not names["train"] & names["evaluation"]
    assert not names["calibration"] & names["evaluation"]
    assert len(load_texts(TextSource("shakespeare:evaluation"))) == len(names["evaluation"])


def test_local_file_and_folder(tmp_path):
    (tmp_path / "a.txt").write_text("the king\nthe queen\n")
    (tmp_path / "b.txt").write_text("my lord\n")
    assert load_texts(TextSource(str(tmp_path / "a.txt"))) == ["the king\nthe queen\n"]
    assert load_texts(TextSource(str(tmp_path))) == ["the king\nthe queen\n", "my lord\n"]


def test_windows_with_and_without_bos(word_tokenizer):
    text = " ".join(["the king is good"] * 10)  # 40 tokens + EOS = 41
    with_bos = token_windows(word_tokenizer, [text], length=8, bos=True)
    without = token_windows(word_tokenizer, [text], length=8, bos=False)
    assert with_bos.input_ids.shape == (41 // 7, 8)
    assert without.input_ids.shape == (41 // 8, 8)
    assert (with_bos.input_ids[:, 0] == word_tokenizer.bos_token_id).all()
    assert (without.input_ids[:, 0] != word_tokenizer.bos_token_id).all()
    stream = word_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert with_bos.input_ids[:, 1:].flatten().tolist() == stream[: 5 * 7]
    assert without.input_ids.flatten().tolist() == stream[:40]
    assert with_bos.attention_mask.all()


def test_documents_are_separated_by_eos(word_tokenizer):
    w = token_windows(word_tokenizer, ["the king", "the queen"], length=6, bos=False)
    assert w.input_ids[0].tolist() == word_tokenizer("the king <eos> the queen <eos>",
                                                     add_special_tokens=False)["input_ids"]


def test_window_sampling_is_seeded(word_tokenizer):
    text = " ".join(["the king is good and the queen was my lord"] * 30)
    a = token_windows(word_tokenizer, [text], 8, num_samples=10, seed=1)
    b = token_windows(word_tokenizer, [text], 8, num_samples=10, seed=1)
    c = token_windows(word_tokenizer, [text], 8, num_samples=10, seed=2)
    full = token_windows(word_tokenizer, [text], 8)
    assert torch.equal(a.input_ids, b.input_ids)
    assert not torch.equal(a.input_ids, c.input_ids)
    assert len(a) == 10 and len(full) > 10
    rows = {tuple(r) for r in full.input_ids.tolist()}
    assert all(tuple(r) in rows for r in a.input_ids.tolist())


def test_line_samples_truncate_and_keep_special_tokens(minilm_tokenizer):
    texts = ["the king is dead\n\n" + "long " * 100 + "\nah\n"]
    s = line_samples(minilm_tokenizer, texts, max_length=16, min_tokens=4)
    assert len(s) == 2  # "ah" is 3 tokens with [CLS]/[SEP]: dropped
    assert s.input_ids.shape[1] == 16
    cls, sep = minilm_tokenizer.cls_token_id, minilm_tokenizer.sep_token_id
    assert (s.input_ids[:, 0] == cls).all()
    lengths = s.attention_mask.sum(1).tolist()
    assert lengths == [6, 16]
    assert s.input_ids[0, 5] == sep and s.input_ids[1, 15] == sep


def test_padding_sides():
    right = pad([[5, 6, 7], [8]], pad_id=0, side="right")
    left = pad([[5, 6, 7], [8]], pad_id=0, side="left")
    assert right.input_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert left.input_ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert left.attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_line_sampling_is_seeded(minilm_tokenizer):
    texts = ["\n".join(f"line number {i} of the play" for i in range(50))]
    a = line_samples(minilm_tokenizer, texts, 16, num_samples=5, seed=3)
    b = line_samples(minilm_tokenizer, texts, 16, num_samples=5, seed=3)
    assert torch.equal(a.input_ids, b.input_ids) and len(a) == 5


@pytest.mark.parametrize("content", ["", "   \n\n"])
def test_empty_input_is_a_clear_error(tmp_path, content):
    f = tmp_path / "empty.txt"
    f.write_text(content)
    with pytest.raises(DataError, match="no text"):
        load_texts(TextSource(str(f)))


def test_too_short_text_is_a_clear_error(word_tokenizer):
    with pytest.raises(DataError, match="shorter than one window"):
        token_windows(word_tokenizer, ["the king"], length=64)


def test_non_utf8_is_a_clear_error(tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes("café royal".encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8"):
        load_texts(TextSource(str(f)))


def test_empty_folder_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="no .txt files"):
        load_texts(TextSource(str(tmp_path)))


def test_bos_falls_back_to_cls_and_errors_without_either(minilm_tokenizer, word_tokenizer):
    assert bos_token_id(minilm_tokenizer) == minilm_tokenizer.cls_token_id
    assert bos_token_id(word_tokenizer) == word_tokenizer.bos_token_id
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    bare = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0}, unk_token="a")))
    with pytest.raises(DataError, match="neither a BOS nor a CLS"):
        bos_token_id(bare)


@pytest.mark.unit
def test_what_the_wheel_leaves_out_is_named_when_missing(tmp_path, monkeypatch):
    """The wheel leaves out the checkpoints and text only eval/ and the tests read (pyproject's
    exclude-package-data): asking for them without a clone says so in one line, and the two lists agree."""
    import tomllib

    from pruner.core import assets

    excluded = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    patterns = excluded["tool"]["setuptools"]["exclude-package-data"]["pruner"]
    named = {p.removeprefix("assets/models/").removesuffix("/*") for p in patterns if p.startswith("assets/models/")}
    named |= {"shakespeare:" + p.removeprefix("assets/shakespeare/").removesuffix("/*")
              for p in patterns if p.startswith("assets/shakespeare/")}
    assert named == set(assets.REPOSITORY_ONLY)
    monkeypatch.setattr(assets, "MODELS", tmp_path / "models")
    monkeypatch.setattr(assets, "SHAKESPEARE", tmp_path / "shakespeare")
    with pytest.raises(FileNotFoundError, match="not in the wheel .* install pruner from a clone"):
        assets.checkpoint("llama-shakespeare-early")
    with pytest.raises(FileNotFoundError, match="not in the wheel"):
        assets.shakespeare("train")
    with pytest.raises(FileNotFoundError, match="'gpt2-shakespeare' is missing at"):
        assets.checkpoint("gpt2-shakespeare")


@pytest.mark.unit
def test_python_docs_is_a_second_domain_split_by_module():
    """The standard library's docstrings: offline wherever Python runs, dev and evaluation by whole module,
    prose only (no doctest lines), deterministic."""
    from pruner.core import python_docs_text

    dev, ev = load_texts(TextSource("python-docs:dev")), load_texts(TextSource("python-docs:evaluation"))
    assert len(dev) >= 50 and len(ev) >= 50 and not set(dev) & set(ev)
    assert sum(len(t.split()) for t in ev) > 40_000  # 256 windows of 128 tokens and more
    assert not any(line.lstrip().startswith(">>>") for t in ev for line in t.splitlines())
    assert load_texts(TextSource("python-docs:evaluation")) == ev
    kept = python_docs_text.modules()
    assert "json" in kept and not any(".test." in f".{name}." for name in kept)
    assert {python_docs_text.split_of(n) for n in kept} == {"dev", "evaluation"}
    with pytest.raises(ValueError, match="unknown split 'train' of python-docs; valid: dev, evaluation"):
        load_texts(TextSource("python-docs:train"))
