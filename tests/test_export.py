"""`pruner export` end to end on the shipped GPT-2, Llama (GQA) and BERT (causal MiniLM) checkpoints.

Every exported format is reloaded with vanilla transformers and its logits compared
with an independent in-memory pruned model (base + scoped mask + folded bias); the
refusals write nothing; the push runs against a recording fake client and an
unreachable local endpoint (no network).
"""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path

import pytest
import torch

from pruner import export, models, surgery
from pruner.cli import main
from tiny import tiny_model

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
            extra = {"gpt2": ["--set", "export.format=dense", "--set", "export.push_to_hub=me/gpt2-pruned"],
                     "llama": ["--set", "selection.target=0.5"],  # 4 of 8 heads per layer: 256 / 4 divides
                     "minilm": []}[name]
            recipe = {"gpt2": "gpt2-shakespeare", "llama": "llama-shakespeare", "minilm": "quickstart"}[name]
            hub = FakeHub()
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(export, "hub_client", lambda: hub)
                assert main(["prune", str(ROOT / "recipes" / f"{recipe}.yaml"), "--out", str(out)]
                            + QUICK + extra) == 0
            made[name] = out, hub
        return made[name][0]

    get.hub = lambda name: made[name][1]
    return get


def reference_logits(run_dir: Path) -> torch.Tensor:
    """The pruned model in memory by another code path: base + scoped mask + folded bias. (1, T, vocab)"""
    run = export.load_run(run_dir)
    model = models.load_base(run.recipe.model)
    ids = models.load_tokenizer(run.recipe.model.path)(TEXT, return_tensors="pt").input_ids
    with surgery.masked(model, run.heads, run.bias), torch.no_grad():
        return models.forward(model, ids, torch.ones_like(ids)).logits


def reloaded_logits(folder: Path, run_dir: Path):
    from transformers import AutoModelForCausalLM

    run = export.load_run(run_dir)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = models.load_tokenizer(run.recipe.model.path)(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        return model, models.forward(model, ids, torch.ones_like(ids)).logits


@pytest.mark.parametrize("name,fmt", [("gpt2", "dense"), ("llama", "dense"), ("llama", "compact"),
                                      ("minilm", "dense")])
def test_export_reloads_with_the_pruned_logits(runs, name, fmt, capsys):
    run_dir = runs(name)
    out = run_dir / f"export-{fmt}"
    if not out.exists():  # GPT-2's came from its recipe's export section
        assert main(["export", str(run_dir), "--format", fmt]) == 0
        assert f"exported a {fmt} checkpoint" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", "plan.json"} <= {
        p.name for p in out.iterdir()}
    assert (out / "plan.json").read_text() == (run_dir / "plan.json").read_text()
    model, got = reloaded_logits(out, run_dir)
    torch.testing.assert_close(got, reference_logits(run_dir), rtol=0, atol=1e-5)

    # mean compensation is in the checkpoint: o-proj bias = base bias + folded delta
    run = export.load_run(run_dir)
    layer = next(iter(run.heads))
    base = models.load_base(run.recipe.model)
    o_new, o_old = (surgery.arch.get(surgery.arch.blocks(m)[layer], surgery.arch.adapter_for(m).o_proj)
                    for m in (model, base))
    old_bias = o_old.bias if o_old.bias is not None else torch.zeros_like(o_new.bias)
    assert run.bias[layer].abs().max() > 0
    torch.testing.assert_close(o_new.bias - old_bias, run.bias[layer], rtol=0, atol=1e-6)

    n_params = sum(p.numel() for p in model.parameters())
    if fmt == "compact":
        assert model.config.num_attention_heads == 4 and model.config.num_key_value_heads == 2
        assert n_params == json.loads((run_dir / "metrics.json").read_text())["params_after"]
        assert n_params < sum(p.numel() for p in base.parameters())
    else:
        assert n_params >= sum(p.numel() for p in base.parameters())  # shapes kept (+ Llama's added biases)


def test_recipe_export_section_pushes_through_the_client(runs):
    run_dir = runs("gpt2")
    (create, repo_id, kw), (upload, up) = runs.hub("gpt2").calls
    assert (create, repo_id, kw) == ("create_repo", "me/gpt2-pruned",
                                     {"private": False, "exist_ok": True, "repo_type": "model"})
    assert upload == "upload_folder" and up["repo_id"] == "me/gpt2-pruned"
    assert Path(up["folder_path"]) == run_dir / "export-dense"
    assert up["commit_message"].startswith("pruner: sink-aware pruned 8/32 heads (mean compensation, dense)")
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
        for text in ("`sink-aware`", "compensation: `mean`", "Convention sensitivity", "perplexity before",
                     "```yaml", "AutoModelForCausalLM.from_pretrained", "plan.json"):
            assert text in card.text, text


@pytest.mark.parametrize("name", ["gpt2", "minilm"])
def test_compact_is_refused_without_explicit_head_dim(runs, name, capsys):
    out = runs(name).parent / f"{name}-compact"
    assert main(["export", str(runs(name)), "--format", "compact", "--out", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()[-1]  # after transformers' loading progress
    assert err.startswith("pruner: error: cannot write a compact checkpoint") and "no explicit head_dim" in err
    assert "--format dense" in err and "Traceback" not in err
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.*"))


def test_compact_is_refused_for_unequal_heads_per_layer(runs, tmp_path, capsys):
    """A global budget can leave layers with different head counts: no vanilla Llama config says that."""
    run_dir = tmp_path / "uneven"
    shutil.copytree(runs("llama"), run_dir, ignore=shutil.ignore_patterns("model", "export-*"))
    plan = json.loads((run_dir / "plan.json").read_text())
    plan["heads"] = {"0": [0, 1, 4, 5]}  # layer 0 keeps 4 heads (2 per KV group), the others 8
    (run_dir / "plan.json").write_text(json.dumps(plan))
    assert main(["export", str(run_dir), "--format", "compact"]) == 2
    err = capsys.readouterr().err
    assert "head counts differ between layers (layer 0: 4, layer 1: 8" in err and "--format dense" in err
    assert not (run_dir / "export-compact").exists()


def test_mean_compensation_is_refused_where_the_config_cannot_hold_the_bias(tmp_path, capsys):
    """Mistral's config has no attention_bias: a folded o-proj bias would be dropped on reload."""
    from transformers import AutoTokenizer

    base = tmp_path / "mistral"
    tiny_model("mistral").save_pretrained(base)
    AutoTokenizer.from_pretrained(models.resolve("llama-shakespeare")).save_pretrained(base)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "recipe.yaml").write_text(f"model: {{path: {base}}}\n")
    (run_dir / "plan.json").write_text(json.dumps({"heads": {"0": [0, 1]}, "entries": []}))  # a whole KV group
    (run_dir / "metrics.json").write_text(json.dumps({"compensation": "mean"}))
    export.save_compensation({0: torch.randn(32)}, run_dir / export.COMPENSATION_FILE)
    for fmt in export.FORMATS:
        assert main(["export", str(run_dir), "--format", fmt]) == 2
        err = capsys.readouterr().err
        assert "mistral config cannot declare" in err and "surgery.compensation=zero" in err
        assert not (run_dir / f"export-{fmt}").exists()


def test_a_checkpoint_that_reloads_differently_is_refused(tmp_path, word_tokenizer):
    """The reload check is the last guard: here a bias the config cannot declare, with the flag that
    normally stops it cleared, is silently dropped by `from_pretrained`; the logits then differ."""
    model = tiny_model("mistral")
    surgery.mask_heads(model, {0: [0, 1]}, {0: torch.randn(32)})
    del model._pruner_bias_not_in_config
    with pytest.raises(export.ExportError, match="reloads with logits off by"):
        export.save_checkpoint(model, word_tokenizer, tmp_path, removed=False)


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
                           "commit_message": "pruner: sink-aware pruned 16/32 heads (mean compensation, compact)"})]
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
