"""Calibration mixtures, the held-back slice and the package-docs source (pruner.core.mixture,
pruner.core.package_docs_text)."""

from __future__ import annotations

import pytest
import torch

from pruner.core import data, mixture, package_docs_text
from pruner.core.data import DataError, TextSource, load_texts

KING, QUEEN = ["the king " * 200], ["the queen " * 200]


def _ids(tok, word: str) -> int:
    return tok.convert_tokens_to_ids(word)


@pytest.mark.unit
def test_shares_add_up_and_follow_the_weights():
    assert mixture.shares(64, [1, 1, 1]) == [22, 21, 21]  # ties to the earlier source
    assert mixture.shares(10, [3, 1]) == [8, 2] and sum(mixture.shares(7, [0.2, 0.5, 0.3])) == 7
    assert mixture.shares(5, [1, 0]) == [5, 0]
    with pytest.raises(ValueError, match="sum to a positive number"):
        mixture.shares(4, [0, 0])


@pytest.mark.unit
def test_one_source_without_holdout_is_exactly_data_samples(word_tokenizer):
    texts = ["the king was good and the queen was my lord " * 40]
    want = data.samples(word_tokenizer, texts, "windows", 8, num_samples=12, seed=3)
    got, held = mixture.mixed_samples(word_tokenizer, [texts], "windows", 8, draw=mixture.Draw(num_samples=12, seed=3))
    assert held is None and torch.equal(got.input_ids, want.input_ids)


@pytest.mark.unit
def test_each_window_comes_from_one_source_in_the_weighted_shares(word_tokenizer):
    """Two sources that share no word: every window is one source's, the counts follow the weights, both
    kinds appear early (interleaved), and the same call gives the same samples."""
    king, queen = _ids(word_tokenizer, "king"), _ids(word_tokenizer, "queen")
    batch, held = mixture.mixed_samples(word_tokenizer, [KING, QUEEN], "windows", 8, weights=[3, 1],
                                        draw=mixture.Draw(num_samples=16, seed=0))
    has_k, has_q = (batch.input_ids == king).any(1), (batch.input_ids == queen).any(1)
    assert held is None and not (has_k & has_q).any() and (has_k | has_q).all()
    assert int(has_k.sum()) == 12 and int(has_q.sum()) == 4
    assert has_q[:8].any() and has_k[:8].any()
    again, _ = mixture.mixed_samples(word_tokenizer, [KING, QUEEN], "windows", 8, weights=[3, 1],
                                     draw=mixture.Draw(num_samples=16, seed=0))
    assert torch.equal(again.input_ids, batch.input_ids)


@pytest.mark.unit
def test_the_held_back_slice_comes_from_every_source_and_never_from_the_sums(word_tokenizer):
    texts = [" ".join(["the king was good"] * 30 + ["and the queen was my lord"] * 30)]
    whole = data.samples(word_tokenizer, texts, "windows", 6, num_samples=20, seed=1)
    kept, held = mixture.mixed_samples(word_tokenizer, [texts], "windows", 6,
                                       draw=mixture.Draw(num_samples=20, seed=1, holdout=5))
    assert len(kept) == 15 and len(held) == 5

    def rows(b):
        return {tuple(r) for r in b.input_ids.tolist()}

    assert rows(kept) | rows(held) <= rows(whole) and len(rows(kept) | rows(held)) == len(rows(whole))
    king, queen = _ids(word_tokenizer, "king"), _ids(word_tokenizer, "queen")
    kept, held = mixture.mixed_samples(word_tokenizer, [KING, QUEEN], "windows", 8,
                                       draw=mixture.Draw(num_samples=16, holdout=4))
    assert len(kept) == 12 and int((held.input_ids == king).any(1).sum()) == 2
    assert int((held.input_ids == queen).any(1).sum()) == 2
    with pytest.raises(DataError, match="calibration.holdout: 3 held-back samples from b leave none of its 1 "):
        mixture.mixed_samples(word_tokenizer, [KING, ["the queen " * 5]], "windows", 8, names=["a", "b"],
                              draw=mixture.Draw(holdout=6))


@pytest.mark.unit
def test_lines_of_several_sources_are_padded_to_one_width(word_tokenizer):
    word_tokenizer.pad_token = "<pad>"
    short, long_ = ["the king was good\n" * 6], ["the queen was good and my lord was the king\n" * 6]
    b, _ = mixture.mixed_samples(word_tokenizer, [short, long_], "lines", 16, draw=mixture.Draw(num_samples=8))
    assert b.input_ids.shape[0] == 8 and int(b.attention_mask.sum(1).min()) < int(b.attention_mask.sum(1).max())
    assert (b.input_ids[b.attention_mask == 0] == word_tokenizer.pad_token_id).all()


@pytest.mark.unit
def test_package_docs_sections_split_by_heading_and_markup_dropped():
    md = ("# proj\n\n[![badge](x)](y)\n<p align=center>\n" + "intro words " * 20 + "\n\n## Install\n\n```\n# not a "
          "heading\npip install proj\n```\n" + "install words " * 20 + "\n")
    rst = "Title\n=====\n\n.. image:: x.png\n   :target: y\n\n" + "rst words " * 20 + "\n\nShort\n-----\n\ntoo few\n"
    got = package_docs_text.sections(md)
    assert [h for h, _ in got] == ["proj", "Install"] and "badge" not in got[0][1] and "<p" not in got[0][1]
    assert "# not a heading" in got[1][1]
    assert package_docs_text.sections(rst) == [("Title", ("rst words " * 20).strip())]


@pytest.mark.unit
def test_package_docs_is_a_third_domain_split_by_section():
    """The installed dependencies' READMEs: offline, from the fixed package list, dev and evaluation disjoint,
    deterministic, enough text for 64 windows of 128 tokens each."""
    dev, ev = load_texts(TextSource("package-docs:dev")), load_texts(TextSource("package-docs:evaluation"))
    assert len(dev) >= 20 and len(ev) >= 20 and not set(dev) & set(ev)
    assert sum(len(t.split()) for t in ev) > 5_000
    assert load_texts(TextSource("package-docs:evaluation")) == ev
    assert package_docs_text.versions()["torch"] == torch.__version__
    with pytest.raises(ValueError, match="unknown split 'train' of package-docs; valid: dev, evaluation"):
        load_texts(TextSource("package-docs:train"))


@pytest.mark.unit
@pytest.mark.parametrize("calibration, message", [
    ({"data": ["shakespeare:calibration", "pyton-docs:dev"]}, "unknown source 'pyton-docs:dev'"),
    ({"data": ["shakespeare:calibration", "package-docs:train"]}, "package-docs has the splits dev, evaluation"),
    ({"data": ["shakespeare:calibration", "python-docs:dev"], "weights": [0, 0]},
     "weights must be >= 0 and sum to a positive number"),
    ({"data": ["shakespeare:calibration", "python-docs:dev"], "weights": [1, -1]}, "weights must be >= 0"),
    ({"data": ["shakespeare:calibration", "python-docs:dev"], "weights": [1]}, "1 weights for 2 sources"),
    ({"data": ["shakespeare:calibration", "shakespeare:calibration"]}, "lists a source twice"),
    ({"data": [], "num_samples": 8}, "one or more non-empty sources"),
    ({"num_samples": 16, "holdout": 16}, "holdout: 16 held-back samples is not smaller than the calibration data"),
])
def test_bad_mixtures_are_one_line_recipe_errors(calibration, message):
    from pruner.runs.recipe_io import RecipeError, build_recipe

    with pytest.raises(RecipeError, match=message) as e:
        build_recipe({"model": {"path": "gpt2-shakespeare"}, "calibration": calibration})
    assert "\n" not in str(e.value) and str(e.value).startswith("invalid recipe: calibration")


@pytest.mark.unit
def test_a_mixture_recipe_names_its_sources_and_holds_back_for_auto():
    from pruner.runs.recipe_io import build_recipe

    r = build_recipe({"model": {"path": "gpt2-shakespeare"}, "scorer": {"name": "auto"},
                      "calibration": {"data": ["shakespeare:calibration", "package-docs:dev"], "weights": [2, 1]}})
    assert r.calibration.sources() == ["shakespeare:calibration", "package-docs:dev"]
    assert r.calibration.held_back(r.auto()) == 16 and build_recipe({"model": {"path": "x"}}).calibration.held_back(
        False) == 0
    assert build_recipe(r.model_dump(mode="json")) == r  # the saved recipe reloads


@pytest.mark.unit
@pytest.mark.parametrize("cli, message", [
    (["--set", "calibration.data=[shakespeare:calibration, pyton-docs:dev]"],
     "invalid recipe: calibration.data: unknown source 'pyton-docs:dev'"),
    (["--set", "calibration.data=[shakespeare:calibration, python-docs:dev]", "--set", "calibration.weights=[0, 0]"],
     "invalid recipe: calibration: weights must be >= 0 and sum to a positive number, got [0.0, 0.0]"),
    (["--set", "calibration.holdout=64"], "invalid recipe: calibration: holdout: 64 held-back samples is not smaller"),
    (["--set", "scorer.name=auto", "--set", "scorer.candidates=[cosine]"],
     "invalid recipe: (recipe): auto has a single candidate left (cosine + mean)"),
])
def test_bad_mixture_and_auto_flags_are_one_line_cli_errors(tmp_path, capsys, cli, message):
    from pathlib import Path

    from pruner.cli import main

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "gpt2-shakespeare.yaml"
    code = main(["prune", str(recipe), "--out", str(tmp_path / "r"), *cli])
    err = capsys.readouterr().err.strip()
    assert code != 0 and message in err and len(err.splitlines()) == 1, err


@pytest.mark.unit
def test_provenance_names_each_source_of_a_mixture_and_the_package_versions():
    from pruner.runs import provenance
    from pruner.runs.recipe_io import build_recipe

    r = build_recipe({"model": {"path": "gpt2-shakespeare"},
                      "calibration": {"data": ["shakespeare:calibration", "package-docs:dev"], "weights": [3, 1]}})
    cal = provenance.identity(r, evaluation=False)["data"]["calibration"]
    assert cal["kind"] == "mixture" and cal["weights"] == [3.0, 1.0]
    plays, docs = cal["sources"]
    assert plays["kind"] == "files" and docs["kind"] == "package-docs" and docs["source"] == "package-docs:dev"
    assert docs["packages"]["torch"] == torch.__version__ and len(docs["sha256"]) == 64
