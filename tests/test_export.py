"""`pruner export` end to end on the shipped GPT-2, Llama (GQA) and BERT (causal MiniLM) checkpoints.

Every exported format is reloaded -- vanilla transformers for dense and vanilla compact
checkpoints, trust_remote_code=True and pruner's own loader for per-layer ones -- and
its logits and greedy generations compared with an independent in-memory pruned
model (base + scoped mask + folded bias, rounded to the storage dtype); the default
plan of every shipped recipe exports compact; the refusals write nothing; the push
runs against a recording fake client and an unreachable local endpoint (no network).
"""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path

import pytest
import torch
from tiny import tiny_model

from pruner.checkpoints import loading
from pruner.cli import main
from pruner.core import assets, runtime
from pruner.pruning import surgery
from pruner.pruning.compensation import compensate
from pruner.runs import export, folders

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--set", "calibration.num_samples=4", "--set", "calibration.length=64", "--set", "evaluation.num_samples=2",
         "--set", "evaluation.length=64", "--set", "evaluation.bootstrap=10", "--set", "evaluation.latency=false",
         "--set", "capture.metrics=[cosine]", "--set", "bench.enabled=false"]
TEXT = "Now is the winter of our discontent made glorious summer by this sun of York."


class FakeHub:
    """Records what `export.push` asks of the Hub client."""

    def __init__(self):
        self.calls = []

    def create_repo(self, repo_id, **kw):
        self.calls.append(("create_repo", repo_id, kw))

    def upload_folder(self, **kw):
        assert (Path(kw["folder_path"]) / "config.json").exists()  # uploaded after the export is complete
        self.calls.append(("upload_folder", kw))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One quick `pruner prune` per family, built on first use. GPT-2's recipe also exports and pushes."""
    base = tmp_path_factory.mktemp("runs")
    made = {}

    def get(name: str) -> Path:
        if name not in made:
            out = base / name
            refit, mean = ["--set", "surgery.compensation=refit"], ["--set", "surgery.compensation=mean"]
            extra = {"gpt2": ["--set", "export.format=dense", "--set", "export.push_to_hub=me/gpt2-pruned"],
                     "llama": ["--set", "selection.target=0.5"] + mean,  # 4 of 8 heads per layer: 256 / 4 divides
                     # 6 of 8 heads per layer (shape any): Llama's config refuses 256 / 6, Mistral's has no bias
                     "llama-default": ["--set", "selection.target=0.25", "--set", "selection.shape=any",
                                       "--set", "selection.budget=layer"] + mean,
                     "minilm": ["--set", "surgery.compensation=mean"],  # a bias export; too few tokens to refit
                     "llama-refit": ["--set", "selection.target=0.5", "--set", "export.format=compact"] + refit,
                     "minilm-refit": refit + ["--set", "calibration.num_samples=8"]}[name]  # >= 384 tokens
            recipe = {"gpt2": "gpt2-shakespeare", "llama": "llama-shakespeare", "llama-default": "llama-shakespeare",
                      "minilm": "quickstart", "llama-refit": "llama-shakespeare", "minilm-refit": "quickstart"}[name]
            hub = FakeHub()
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(export, "hub_client", lambda: hub)
                assert main(["prune", str(ROOT / "recipes" / f"{recipe}.yaml"), "--out", str(out)]
                            + QUICK + extra) == 0
            made[name] = out, hub
        return made[name][0]

    get.hub = lambda name: made[name][1]
    return get


def reference(run_dir: Path, generate: bool = False):
    """The pruned model in memory by another code path: base + permanent mask + compensation, every
    parameter rounded to the export's storage dtype as the checkpoint stores it (the shipped bases are
    float16 already, so only the compensated output projections change). Logits (1, T, vocab) [, greedy tokens]."""
    run = folders.load_run(run_dir)
    model = loading.load_base(run.recipe.model)
    ids = loading.load_tokenizer(run.recipe.model.path)(TEXT, return_tensors="pt").input_ids
    store = getattr(torch, export.storage_dtype(run))
    surgery.mask_heads(model, run.heads, run.compensation)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(store).float())
        logits = runtime.forward(model, ids, torch.ones_like(ids)).logits
        return (logits, greedy(model, ids)) if generate else logits


def reference_logits(run_dir: Path) -> torch.Tensor:
    return reference(run_dir)


def greedy(model, ids):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                              use_cache=True, pad_token_id=0)


def reloaded_logits(folder: Path, run_dir: Path, loader: str = "transformers"):
    """Logits of an export loaded as its model card says: plain transformers (trust_remote_code=True for a
    per-layer checkpoint), or `loader="pruner"`: pruner's own loader (no code from the folder)."""
    from transformers import AutoModelForCausalLM

    run = folders.load_run(run_dir)
    per_layer = "pruner_format" in json.loads((folder / "config.json").read_text())
    if loader == "pruner":
        model = loading.load(folder, dtype="float32")
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=per_layer).eval()
    ids = loading.load_tokenizer(run.recipe.model.path)(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        return model, runtime.forward(model, ids, torch.ones_like(ids)).logits


@pytest.mark.parametrize("name,fmt,layout", [
    ("gpt2", "dense", "dense"), ("gpt2", "compact", "per-layer"),               # GPT-2: head width = n_embd / n_head
    ("llama", "dense", "dense"), ("llama", "compact", "vanilla"),               # 4 of 8 heads in every layer
    ("llama-default", "compact", "per-layer"),                                  # 6 of 8: the config refuses 256 / 6
    ("minilm", "dense", "dense"), ("minilm", "compact", "per-layer")])          # the quickstart's global budget
def test_export_reloads_with_the_pruned_logits(runs, name, fmt, layout, capsys):
    run_dir = runs(name)
    out = run_dir / f"export-{fmt}"
    if not out.exists():  # GPT-2's came from its recipe's export section
        assert main(["export", str(run_dir), "--format", fmt]) == 0
        assert f"exported a {fmt} checkpoint" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", "plan.json"} <= {
        p.name for p in out.iterdir()}
    assert (out / "plan.json").read_text() == (run_dir / "plan.json").read_text()
    config = json.loads((out / "config.json").read_text())
    assert ("pruner_format" in config) == (layout == "per-layer") == any(out.glob("modeling_pruned_*.py"))
    assert config["dtype"] == "float16"  # the shipped checkpoints' own storage dtype (their config says float32)
    want, tokens = reference(run_dir, generate=True)
    for loader in ("transformers", "pruner") if layout == "per-layer" else ("transformers",):
        model, got = reloaded_logits(out, run_dir, loader)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        prompt = tokens[:, :-8]
        assert torch.equal(greedy(model, prompt), tokens), loader  # the KV cache path, token for token

    # mean compensation is in the checkpoint: o-proj bias = base bias + folded delta, stored in float16
    run = folders.load_run(run_dir)
    layer = next(iter(run.heads))
    base = loading.load_base(run.recipe.model)
    ad = surgery.arch.adapter_for(base)  # (a per-layer model has no single geometry: paths from the base's adapter)
    o_new, o_old = (surgery.arch.get(surgery.arch.get(m.base_model, ad.layers)[layer], ad.o_proj)
                    for m in (model, base))
    old_bias = o_old.bias if o_old.bias is not None else torch.zeros_like(o_new.bias)
    assert run.bias[layer].abs().max() > 0
    torch.testing.assert_close(o_new.bias, (old_bias + run.bias[layer]).half().float(), rtol=0, atol=0)

    n_params = sum(p.numel() for p in model.parameters())
    metrics = json.loads((run_dir / "metrics.json").read_text())
    if layout == "vanilla":
        assert model.config.num_attention_heads == 4 and model.config.num_key_value_heads == 2
    if fmt == "compact" and metrics["surgery"] == "remove":
        assert n_params == metrics["params_after"]
    if fmt == "compact":
        assert n_params < sum(p.numel() for p in base.parameters())
        base_bytes = (Path(assets.resolve(run.recipe.model.path)) / "model.safetensors").stat().st_size
        assert (out / "model.safetensors").stat().st_size < base_bytes  # smaller than the model it came from
    else:
        assert n_params >= sum(p.numel() for p in base.parameters())  # shapes kept (+ Llama's added biases)


@pytest.mark.parametrize("name,fmt", [("llama-refit", "compact"), ("llama-refit", "dense"), ("minilm-refit", "dense")])
def test_refit_export_reloads_with_vanilla_transformers_and_no_config_change(runs, name, fmt, capsys):
    """Refit compensation is plain weights: Llama exports without attention_bias (no o-proj bias at all),
    BERT keeps its own bias (+ the intercept); both reload with the pruned logits."""
    run_dir = runs(name)
    out = run_dir / f"export-{fmt}"
    if not out.exists():  # the Llama compact one came from its recipe's export section
        assert main(["export", str(run_dir), "--format", fmt]) == 0
    model, got = reloaded_logits(out, run_dir)
    torch.testing.assert_close(got, reference_logits(run_dir), rtol=0, atol=1e-5)
    run = folders.load_run(run_dir)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert run.compensation.kind == metrics["compensation"] == "refit" and set(run.compensation.weight) == \
        set(run.heads) == {int(k) for k in metrics["refit"]["layers"]}
    fit = metrics["refit"]["layers"][str(next(iter(run.heads)))]
    assert 0 <= fit["unexplained"] < fit["pruned"] and fit["relative"] == pytest.approx(fit["unexplained"] /
                                                                                           fit["residual"])
    assert "Refit compensation" in (run_dir / "report.md").read_text() and (run_dir / "refit.png").exists()
    assert "`refit`: the kept heads' output-projection columns" in (out / "README.md").read_text()
    if name.startswith("llama"):
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["attention_bias"] is False and not run.compensation.bias
        assert all(b.self_attn.o_proj.bias is None for b in model.model.layers)
    else:
        assert set(run.compensation.bias) == set(run.heads)


def test_recipe_export_section_pushes_through_the_client(runs):
    run_dir = runs("gpt2")
    (create, repo_id, kw), (upload, up) = runs.hub("gpt2").calls
    assert (create, repo_id, kw) == ("create_repo", "me/gpt2-pruned",
                                     {"private": False, "exist_ok": True, "repo_type": "model"})
    assert upload == "upload_folder" and up["repo_id"] == "me/gpt2-pruned"
    assert Path(up["folder_path"]) == run_dir / "export-dense"
    assert up["commit_message"].startswith("pruner: refit-energy pruned 8/32 heads (mean compensation, dense)")
    assert 'from_pretrained("me/gpt2-pruned")' in (run_dir / "export-dense" / "README.md").read_text()


def test_model_card_metadata_parses_with_huggingface_hub(runs):
    from huggingface_hub import ModelCard

    for name, base in (("minilm", "sentence-transformers/all-MiniLM-L6-v2"), ("llama", None)):
        folder = runs(name) / "export-dense"
        if not folder.exists():
            assert main(["export", str(runs(name)), "--format", "dense"]) == 0
        card = ModelCard.load(folder / "README.md")
        assert card.data.base_model == base  # from-scratch shipped checkpoints have no Hub base to name
        assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
        assert {"pruned", "attention-head-pruning"} <= set(card.data.tags)
        for text in ("`refit-energy`", "compensation: `mean`", "Convention sensitivity", "perplexity before",
                     "```yaml", "AutoModelForCausalLM.from_pretrained", "plan.json"):
            assert text in card.text, text


def test_per_layer_model_card_says_how_to_load_it_and_why(runs):
    from huggingface_hub import ModelCard

    folder = runs("minilm") / "export-compact"
    if not folder.exists():
        assert main(["export", str(runs("minilm")), "--format", "compact"]) == 0
    card = ModelCard.load(folder / "README.md")
    assert "custom_code" in card.data.tags and "(compact, per-layer)" in card.text
    for text in ('AutoModelForCausalLM.from_pretrained("path/to/this/folder", trust_remote_code=True)',
                 "Why `trust_remote_code=True`", "`modeling_pruned_bert.py`", "imports only transformers and torch",
                 'pruner.load("path/to/this/folder")', "the bert config derives the head width from hidden_size",
                 "`num_attention_heads_per_layer`", "stored in float16 (the base checkpoint's own dtype)",
                 "greedy generation with the KV cache gives the same tokens"):
        assert text in card.text, text


def test_unequal_heads_per_layer_export_the_per_layer_form(runs, tmp_path, capsys):
    """A global budget can leave layers with different head counts: no vanilla Llama config says that."""
    run_dir = tmp_path / "uneven"
    shutil.copytree(runs("llama"), run_dir, ignore=shutil.ignore_patterns("model", "export-*"))
    plan = json.loads((run_dir / "plan.json").read_text())
    plan["heads"] = {"0": [0, 1, 4, 5]}  # layer 0 keeps 4 heads (2 per KV group), the others 8
    (run_dir / "plan.json").write_text(json.dumps(plan))
    comp = folders.load_run(run_dir).compensation  # the compensation of the layers still pruned (provenance checks)
    comp = surgery.Compensation(comp.kind, {k: v for k, v in comp.bias.items() if k == 0},
                                {k: v for k, v in comp.weight.items() if k == 0})
    folders.save_compensation(comp, run_dir / folders.COMPENSATION_FILE)
    assert main(["export", str(run_dir), "--format", "compact"]) == 0
    out = run_dir / "export-compact"
    config = json.loads((out / "config.json").read_text())
    assert config["num_attention_heads_per_layer"] == [4, 8, 8, 8][:config["num_hidden_layers"]]
    assert "head counts differ between layers (layer 0: 4/2 kv, layer 1: 8/2 kv" in (out / "README.md").read_text()
    for loader in ("transformers", "pruner"):
        _, got = reloaded_logits(out, run_dir, loader)
        torch.testing.assert_close(got, reference_logits(run_dir), rtol=0, atol=1e-5)


def test_a_bias_the_config_cannot_declare_exports_compact_only(runs, tmp_path, capsys):
    """Mistral's config has no attention_bias: a folded o-proj bias would be dropped by a vanilla reload, so
    dense is refused (pointing at compact) and the per-layer form declares the bias."""
    from transformers import AutoTokenizer

    base = tmp_path / "mistral"
    tiny_model("mistral").save_pretrained(base)
    AutoTokenizer.from_pretrained(assets.resolve("llama-shakespeare")).save_pretrained(base)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "recipe.yaml").write_text(f"model: {{path: {base}}}\n")
    (run_dir / "plan.json").write_text(json.dumps({"heads": {"0": [0, 1]}, "entries": []}))  # a whole KV group
    metrics = json.loads((runs("llama") / "metrics.json").read_text())  # any run's figures: the card needs some
    (run_dir / "metrics.json").write_text(json.dumps({**metrics, "compensation": "mean", "pruned_heads": 2}))
    folders.save_compensation({0: torch.randn(32)}, run_dir / folders.COMPENSATION_FILE)
    assert main(["export", str(run_dir), "--format", "dense"]) == 2
    err = capsys.readouterr().err
    assert "cannot write a dense checkpoint" in err and "mistral config cannot declare" in err
    assert "--format compact" in err and "surgery.compensation=refit" in err
    assert not (run_dir / "export-dense").exists()
    assert main(["export", str(run_dir), "--format", "compact"]) == 0
    config = json.loads((run_dir / "export-compact" / "config.json").read_text())
    assert config["o_proj_bias_per_layer"] == [True, False] and config["dtype"] == "float32"  # tiny: float32


def test_refit_compensation_exports_where_mean_cannot(tmp_path, capsys):
    """Mistral: the refitted weights need no bias, so both formats export and reload with the pruned logits."""
    from tiny import ragged_batch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pruner.attention.capture import CaptureConfig, capture_stats
    from pruner.attention.sinks import SinkSpec
    from pruner.core.data import pad

    base = tmp_path / "mistral"
    model = tiny_model("mistral")
    model.save_pretrained(base)
    AutoTokenizer.from_pretrained(assets.resolve("llama-shakespeare")).save_pretrained(base)
    heads = {0: [0, 1], 1: [2, 3]}  # one whole KV group per layer: 2 query heads over 1 KV head everywhere
    batch = pad(ragged_batch(seed=3, n=10), 0)
    outputs = capture_stats(model, batch, SinkSpec("first"), config=CaptureConfig(metrics=(), outputs=True)).outputs
    comp = compensate(model, heads, outputs, "refit")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "recipe.yaml").write_text(f"model: {{path: {base}}}\n")
    (run_dir / "plan.json").write_text(json.dumps({"heads": {str(k): v for k, v in heads.items()}, "entries": []}))
    (run_dir / "metrics.json").write_text(json.dumps({"compensation": "refit"}))
    folders.save_compensation(comp, run_dir / folders.COMPENSATION_FILE)
    ids = batch.input_ids[:2]
    with surgery.masked(model, heads, comp), torch.no_grad():
        want = model(ids).logits
    for fmt in export.FORMATS:  # rebuilt from the run folder alone, saved, reload-checked
        rebuilt, tok = export.rebuild(folders.load_run(run_dir), fmt)
        assert folders.save_checkpoint(rebuilt, tok, tmp_path / fmt, removed=fmt == "compact").max_diff <= export.ATOL
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / fmt, dtype=torch.float32).eval()
        assert reloaded.config.model_type == "mistral" and reloaded.model.layers[0].self_attn.o_proj.bias is None
        with torch.no_grad():
            torch.testing.assert_close(reloaded(ids).logits, want, rtol=0, atol=1e-5)


def test_a_checkpoint_that_reloads_differently_is_refused(tmp_path, word_tokenizer):
    """The reload check is the last guard: here a bias the config cannot declare, with the flag that
    normally stops it cleared, is silently dropped by `from_pretrained`; the logits then differ."""
    model = tiny_model("mistral")
    surgery.mask_heads(model, {0: [0, 1]}, {0: torch.randn(32)})
    del model._pruner_bias_not_in_config
    with pytest.raises(export.ExportError, match=r"reloads \(transformers AutoModelForCausalLM\) with logits off by"):
        folders.save_checkpoint(model, word_tokenizer, tmp_path, removed=False)


def test_refuses_to_overwrite_without_overwrite(runs, capsys):
    run_dir = runs("llama")
    out = run_dir.parent / "llama-again"
    assert main(["export", str(run_dir), "--format", "dense", "--out", str(out)]) == 0
    (out / "README.md").write_text("mine")
    assert main(["export", str(run_dir), "--format", "dense", "--out", str(out)]) == 2
    assert "pass --overwrite" in capsys.readouterr().err and (out / "README.md").read_text() == "mine"
    assert main(["export", str(run_dir), "--format", "dense", "--out", str(out), "--overwrite"]) == 0
    assert (out / "README.md").read_text().startswith("---\n")


def test_push_arguments_reach_the_client(runs, tmp_path, monkeypatch, capsys):
    hub = FakeHub()
    monkeypatch.setattr(export, "hub_client", lambda: hub)
    out = tmp_path / "compact"
    assert main(["export", str(runs("llama")), "--format", "compact", "--out", str(out),
                 "--push-to-hub", "me/llama-compact", "--private"]) == 0
    assert hub.calls == [
        ("create_repo", "me/llama-compact", {"private": True, "exist_ok": True, "repo_type": "model"}),
        ("upload_folder", {"folder_path": str(out), "repo_id": "me/llama-compact", "repo_type": "model",
                           "commit_message": "pruner: refit-energy pruned 16/32 heads (mean compensation, compact)"})]
    assert "pushed to https://huggingface.co/me/llama-compact" in capsys.readouterr().out


@pytest.mark.parametrize("argv,match", [
    (["--private"], "--private applies only with --push-to-hub"),
    (["--push-to-hub", "not a repo"], "invalid Hub repo id 'not a repo'"),
])
def test_push_arguments_are_checked_before_any_work(tmp_path, argv, match, capsys):
    assert main(["export", str(tmp_path), "--format", "dense"] + argv) == 2
    assert match in capsys.readouterr().err and not (tmp_path / "export-dense").exists()


def test_failed_push_keeps_the_local_export_and_says_what_to_do(runs, tmp_path, monkeypatch, capsys):
    from huggingface_hub import HfApi

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(export, "hub_client", lambda: HfApi(endpoint=f"http://127.0.0.1:{port}", token="hf_fake"))
    out = tmp_path / "dense"
    t0 = time.time()
    assert main(["export", str(runs("minilm")), "--format", "dense", "--out", str(out),
                 "--push-to-hub", "me/minilm-pruned"]) == 2
    assert time.time() - t0 < 60
    err = capsys.readouterr().err.splitlines()[-1]  # after transformers' loading progress
    assert err.startswith("pruner: error: push to me/minilm-pruned failed")
    for text in (f"local export at {out} is intact", "hf auth login", "HF_TOKEN", "repo id",
                 f"hf upload me/minilm-pruned {out}"):
        assert text in err, text
    _, got = reloaded_logits(out, runs("minilm"))
    torch.testing.assert_close(got, reference_logits(runs("minilm")), rtol=0, atol=1e-5)


@pytest.mark.parametrize("family,sets,layout", [
    ("qwen2", ["selection.shape=any"], "per-layer"),              # a global budget: uneven layers
    ("qwen2", ["selection.target=0.5"], "vanilla"),               # the default shape: servable, uniform
    ("gpt_neox", [], "per-layer")])
def test_tiny_qwen2_and_gpt_neox_prune_and_export_compact(family, sets, layout, tmp_path, capsys):
    """Random Qwen2 (its config has no head_dim, as on the Hub) and GPT-NeoX with the shipped tokenizer, pruned
    with the default plan. (Equal counts without compensation make a vanilla Qwen2, with an explicit head_dim
    written: tests/test_compact.py.)"""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
    model = (tf.Qwen2ForCausalLM(tf.Qwen2Config(num_key_value_heads=2, **common)) if family == "qwen2" else
             tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**common)))
    base = tmp_path / family
    model.save_pretrained(base)
    assert "head_dim" not in json.loads((base / "config.json").read_text())
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(assets.resolve("gpt2-shakespeare")) / f, base / f)
    (tmp_path / "recipe.yaml").write_text(f"model: {{path: {base}}}\nsinks: {{mode: first}}\n")
    run_dir = tmp_path / "run"
    assert main(["prune", str(tmp_path / "recipe.yaml"), "--out", str(run_dir), *QUICK,
                 *(x for s in sets for x in ("--set", s))]) == 0
    assert main(["export", str(run_dir), "--format", "compact"]) == 0
    out = run_dir / "export-compact"
    config = json.loads((out / "config.json").read_text())
    assert ("pruner_format" in config) == (layout == "per-layer")
    assert config["model_type"] == (f"pruned_{family}" if layout == "per-layer" else family)
    want, tokens = reference(run_dir, generate=True)
    for loader in ("transformers", "pruner"):  # pruner.load reads vanilla checkpoints too
        reloaded, got = reloaded_logits(out, run_dir, loader)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        assert torch.equal(greedy(reloaded, tokens[:, :-8]), tokens), loader


def test_prune_saves_its_model_in_the_base_checkpoints_dtype(runs):
    """The quickstart's model/ used to be float32 (twice the shipped float16 original); now it is the base's
    own dtype and the compact form (remove mode): per-layer for its uneven global budget, as for
    llama-shakespeare's 6 of 8; dense in mask mode (gpt2-shakespeare's recipe)."""
    for name, layout in (("minilm", "per-layer"), ("llama-default", "per-layer"), ("gpt2", "dense")):
        metrics = json.loads((runs(name) / "metrics.json").read_text())
        assert (metrics["model_layout"], metrics["model_dtype"]) == (layout, "float16")
        assert json.loads((runs(name) / "model" / "config.json").read_text())["dtype"] == "float16"
        base = Path(assets.resolve(folders.load_run(runs(name)).recipe.model.path)) / "model.safetensors"
        assert metrics["model_bytes"] <= base.stat().st_size
