"""Downstream tasks through lm-evaluation-harness: pruner's encoding, its NLL, the scoped mask, paired CIs."""

from __future__ import annotations

import json

import lm_eval  # noqa: F401 - the tasks extra is part of the test extra: its absence fails, never skips
import pytest
import torch
from tiny import tiny_model

from pruner.checkpoints import loading
from pruner.core import arch
from pruner.evaluation import accuracy, downstream, perplexity, tasks
from pruner.pruning import surgery

TASK_YAML = """\
task: {name}
custom_dataset: !function {function}
dataset_kwargs:
  data_files: {{test: {name}.jsonl}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
  - metric: acc_norm
"""
DOCS = [
    {"context": "the king is", "choices": ["good", "my lord", "a queen of the"], "label": 0},
    {"context": "my lord the queen", "choices": ["was good", "is"], "label": 1},
    {"context": "and", "choices": ["the king was my lord", "a good queen"], "label": 1},
]


def write_task(folder, name="tiny_task", docs=DOCS, function="pruner.evaluation.tasks.jsonl_dataset"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.yaml").write_text(TASK_YAML.format(name=name, function=function))
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    return folder


@pytest.mark.integration
@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("bos", [True, False])
def test_harness_loglikelihoods_equal_pruner_nll(tmp_path, word_tokenizer, family, bos):
    """Every (context, choice) the harness scores: its log-likelihood = -pruner's NLL of the same tokens."""
    from lm_eval.evaluator import evaluate as lm_evaluate

    model = tiny_model(family)
    spec = tasks.TaskSpec(("tiny_task",), (str(write_task(tmp_path / "t")),), bos=bos, batch_size=2)
    loaded = tasks.load_tasks(spec)
    lm = tasks.harness_lm(model, word_tokenizer, bos=bos, batch_size=2)
    res = lm_evaluate(lm=lm, task_dict=loaded, bootstrap_iters=0, log_samples=True)
    samples = sorted(res["samples"]["tiny_task"], key=lambda s: s["doc_id"])
    assert len(samples) == len(DOCS)

    def enc(s):
        return word_tokenizer(s, add_special_tokens=False)["input_ids"]

    rows, labels, harness_ll = [], [], []
    for doc, s in zip(DOCS, samples):
        assert [a[1] for a in s["arguments"]] == [" " + c for c in doc["choices"]]
        for (context, continuation), resp in zip(s["arguments"], s["resps"]):
            ctx, cont = enc(context), enc(continuation)
            first = [word_tokenizer.bos_token_id] if bos else []
            rows.append(first + ctx + cont)
            labels.append([-100] * len(first + ctx) + cont)
            harness_ll.append(resp[0][0])
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    lab = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
    nll, count = perplexity.window_nll(model, perplexity.EvalWindows(ids, mask, lab), batch_size=3)
    assert count.tolist() == [len(enc(c)) for s in samples for _, c in s["arguments"]]
    assert torch.allclose(-nll, torch.tensor(harness_ll, dtype=torch.float64), atol=1e-4)


@pytest.mark.unit
@pytest.mark.parametrize("name,first", [("minilm-causal", 101), ("gpt2-shakespeare", 0), ("llama-shakespeare", 0)])
def test_encoding_starts_with_the_training_bos_and_appends_nothing(name, first):
    """[CLS] / BOS first, as pruner's perplexity windows; no [SEP] / EOS; the continuation split where it belongs."""
    tok = loading.load_tokenizer(name)
    lm = tasks.harness_lm(tiny_model("gpt2"), tok, bos=True)
    ctx, cont = lm._encode_pair("To be, or not to be: that is", " the question")
    plain = tok("To be, or not to be: that is the question", add_special_tokens=False)["input_ids"]
    assert ctx[0] == first and ctx[1:] + cont == plain
    assert tok.decode(cont).strip().lower() == "the question"
    assert not set(ctx[1:] + cont) & set(tok.all_special_ids)
    assert lm.prefix_token_id == first  # empty contexts are scored after the same token
    off = tasks.harness_lm(tiny_model("gpt2"), tok, bos=False)
    ctx2, cont2 = off._encode_pair("To be, or not to be: that is", " the question")
    assert ctx2 + cont2 == plain


@pytest.mark.integration
def test_scoped_mask_is_active_during_the_harness_run():
    """minilm-causal on the shipped cloze: masking every head but one changes accuracy; leaving the scope restores it."""
    model, tok = loading.load_model("minilm-causal"), loading.load_tokenizer("minilm-causal")
    h = tasks.Harness(model, tok, tasks.TaskSpec(("shakespeare_cloze",), limit=24, batch_size=8))
    base = h.scores()["shakespeare_cloze"]
    g = arch.geometry(model)
    all_but_one = {layer: list(range(g.n_heads)) for layer in range(g.n_layers)}
    all_but_one[0] = all_but_one[0][1:]
    with surgery.masked(model, all_but_one):
        masked = h.scores()["shakespeare_cloze"]
    again = h.scores()["shakespeare_cloze"]
    assert base.metrics["acc"].mean() > 0.5  # well above chance (0.25) even on 24 documents
    assert not torch.equal(base.metrics["acc"], masked.metrics["acc"])
    assert masked.metrics["acc"].mean() < base.metrics["acc"].mean()
    assert torch.equal(base.metrics["acc"], again.metrics["acc"])
    (d_acc, d_norm) = accuracy.paired_accuracy(base, masked, n_boot=200)
    assert d_acc.metric == "acc" and d_norm.metric == "acc_norm" and d_acc.docs == 24
    assert d_acc.delta == pytest.approx(masked.metrics["acc"].mean().item() - base.metrics["acc"].mean().item())


@pytest.mark.unit
def test_paired_accuracy_bootstrap():
    ids = tuple(range(40))
    base = accuracy.TaskScores("t", ids, ("p",) * 40, {"acc": torch.ones(40, dtype=torch.float64)})
    same = accuracy.paired_accuracy(base, base, n_boot=100)[0]
    assert (same.delta, same.ci_low, same.ci_high) == (0.0, 0.0, 0.0)
    half = torch.tensor([1.0, 0.0] * 20, dtype=torch.float64)
    d = accuracy.paired_accuracy(base, accuracy.TaskScores("t", ids, ("p",) * 40, {"acc": half}), n_boot=500)[0]
    assert d.base == 1.0 and d.pruned == 0.5 and d.delta == -0.5
    assert d.ci_low < -0.5 < d.ci_high < 0
    with pytest.raises(ValueError, match="same documents"):
        accuracy.paired_accuracy(base, accuracy.TaskScores("t", ids[::-1], ("p",) * 40, {"acc": half}))


@pytest.mark.unit
def test_missing_extra_unknown_task_and_encoder_refusal_are_one_clear_error(monkeypatch, word_tokenizer):
    with pytest.raises(tasks.TaskError, match=r"encoder: use the embedding task shakespeare_speech|needs a causal LM"):
        downstream.Downstream(tiny_model("bert"), word_tokenizer, tasks.TaskSpec(("shakespeare_cloze",)), causal=False)
    with pytest.raises(tasks.TaskError, match=r"unknown embedding task 'speech'"):
        downstream.load_embedding_task("speech")
    with pytest.raises(tasks.TaskError, match=r"no .yaml task files"):
        tasks.load_tasks(tasks.TaskSpec(("x",), (str(tasks.SUITE.parent / "models"),)))
    monkeypatch.setitem(__import__("sys").modules, "lm_eval", None)  # as if the extra were not installed
    with pytest.raises(tasks.TaskError, match=r'not installed: pip install "\.\[tasks\]"'):
        tasks.load_tasks(tasks.TaskSpec(("shakespeare_cloze",)))


@pytest.mark.unit
def test_recipe_task_keys():
    from pruner.runs.recipe import RecipeError
    from pruner.runs.recipe_io import load_recipe

    r = load_recipe("recipes/quickstart.yaml", ["evaluation.tasks=[shakespeare]", "evaluation.task_limit=50",
                                                "evaluation.num_fewshot=0", "evaluation.task_paths=[a, b]"])
    spec = tasks.spec_from_recipe(r.evaluation)
    assert spec == tasks.TaskSpec(("shakespeare",), ("a", "b"), 50, 0, 8, True, 0)
    with pytest.raises(RecipeError, match=r"evaluation: task_limit applies only with evaluation.tasks"):
        load_recipe("recipes/quickstart.yaml", ["evaluation.task_limit=50"])
    with pytest.raises(RecipeError, match=r"evaluation.task_limit: Input should be greater than or equal to 1"):
        load_recipe("recipes/quickstart.yaml", ["evaluation.tasks=[x]", "evaluation.task_limit=0"])


@pytest.mark.integration
def test_embedding_task_is_the_cosine_of_pooled_embeddings():
    """all-MiniLM-L6-v2 (encoder): each document's verdict is cos(anchor, labelled) > cos(anchor, other)."""
    model, tok = loading.load_model("minilm"), loading.load_tokenizer("minilm")
    ds = downstream.Downstream(model, tok, tasks.TaskSpec(("shakespeare_speech",), limit=16, batch_size=8), causal=False,
                          n_boot=100)
    task, base = ds.embedding[0], ds.scores()
    s = base["shakespeare_speech"]
    assert len(s.doc_ids) == 16 and set(s.metrics["acc"].tolist()) <= {0.0, 1.0}
    with torch.no_grad():
        def embed(text):
            return model(**tok(text, return_tensors="pt")).last_hidden_state[0].mean(0)

        for i in range(3):
            a, c = embed(task.lines[task.anchor[i]]), [embed(task.lines[j]) for j in task.choices[i]]
            cos = [torch.cosine_similarity(a, x, dim=0).item() for x in c]
            assert s.metrics["acc"][i].item() == float(cos[task.label[i]] > cos[1 - task.label[i]])
    g = arch.geometry(model)
    with surgery.masked(model, {layer: list(range(1, g.n_heads)) for layer in range(g.n_layers)}):
        masked = ds.scores()
    d = ds.paired(base, masked)["shakespeare_speech"]["acc"]
    assert d["docs"] == 16 and d["delta"] == pytest.approx(d["pruned"] - d["base"])
    assert not torch.equal(s.metrics["acc"], masked["shakespeare_speech"].metrics["acc"])


GPT2_QUICK = ["--set", "calibration.num_samples=4", "--set", "evaluation.num_samples=4", "--set",
              "evaluation.bootstrap=50", "--set", "evaluation.latency=false", "--set", "selection.target=0.5",
              "--set", "surgery.compensation=zero", "--set", "evaluation.tasks=[shakespeare_order]",
              "--set", "evaluation.task_limit=12"]


@pytest.mark.integration
def test_prune_compare_and_evaluate_report_the_same_task_accuracy(tmp_path, capsys):
    """prune (scoped mask) and evaluate (the run rebuilt from its folder) agree document for document;
    compare writes the accuracy tables beside the perplexity table; evaluate MODEL gives the base."""
    from pruner.cli import main

    recipe = str(tasks.SUITE.parents[2] / "recipes" / "gpt2-shakespeare.yaml")
    run = tmp_path / "run"
    assert main(["prune", recipe, "--out", str(run), *GPT2_QUICK]) == 0
    pruned = json.loads((run / "metrics.json").read_text())["evaluation"]["tasks"]["shakespeare_order"]
    assert set(pruned) == {"acc", "acc_norm"} and pruned["acc"]["docs"] == 12
    assert "shakespeare_order acc " in capsys.readouterr().out
    assert "## Downstream tasks" in (run / "report.md").read_text()

    assert main(["evaluate", str(run), "--out", str(tmp_path / "ev")]) == 0
    again = json.loads((tmp_path / "ev" / "evaluation.json").read_text())["tasks"]["shakespeare_order"]
    for metric in ("acc", "acc_norm"):
        assert again[metric]["base"] == pruned[metric]["base"] and again[metric]["pruned"] == pruned[metric]["pruned"]

    assert main(["evaluate", "gpt2-shakespeare", "--tasks", "shakespeare_order", "--task-limit", "12",
                 "--set", "evaluation.num_samples=4", "--out", str(tmp_path / "base")]) == 0
    alone = json.loads((tmp_path / "base" / "evaluation.json").read_text())["tasks"]["shakespeare_order"]["acc"]
    assert alone["value"] == pruned["acc"]["base"] and alone["ci_low"] <= alone["value"] <= alone["ci_high"]

    out = tmp_path / "cmp"
    assert main(["compare", recipe, "--out", str(out), "--scorers", "sink-aware,random", "--sparsities", "0.5",
                 "--compensation", "zero", *GPT2_QUICK]) == 0
    records = json.loads((out / "compare.json").read_text())
    assert [r["tasks"]["shakespeare_order"]["acc"]["base"] for r in records] == [pruned["acc"]["base"]] * 2
    assert records[0]["tasks"]["shakespeare_order"]["acc"]["pruned"] == pruned["acc"]["pruned"]  # same plan as prune
    md = (out / "compare.md").read_text()
    assert "shakespeare_order acc: base" in md and "shakespeare_order acc_norm: base" in md
    assert "shakespeare_order/acc/delta" in (out / "compare.csv").read_text().splitlines()[0]
