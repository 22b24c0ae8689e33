"""Run folders that can be trusted and no code the user did not ask for: provenance, plan checks,
remote code, safe YAML, tokens kept out of every message."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny import tiny_model

from pruner.checkpoints import loading
from pruner.core import assets
from pruner.core.redact import redact
from pruner.runs import export, provenance
from pruner.runs.recipe import RecipeError
from pruner.runs.recipe_io import load_recipe

pytestmark = pytest.mark.integration
FAKE_TOKEN = "hf_FakeTokenForPrunerTests0123456789"


def evil_folder(root: Path, marker: Path, tokenizer_code: bool = False) -> Path:
    """A tiny GPT-2 whose config maps to modeling code in the folder; importing that code writes `marker`."""
    import transformers as tf

    folder = root / "evil"
    torch.manual_seed(0)
    tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=4096, n_layer=2, n_head=4, n_embd=32, n_positions=64,
                                     bos_token_id=1, eos_token_id=2)).save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(assets.checkpoint("gpt2-shakespeare") / f, folder / f)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="evil-gpt2", auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                                                "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    (folder / "config.json").write_text(json.dumps(cfg))
    write = f"from pathlib import Path\nPath({str(marker)!r}).write_text('imported')\n"
    (folder / "configuration_evil.py").write_text(
        write + "from transformers import GPT2Config\n\nclass EvilConfig(GPT2Config):\n    model_type = 'evil-gpt2'\n")
    (folder / "modeling_evil.py").write_text(
        write + "from transformers import GPT2LMHeadModel\nfrom .configuration_evil import EvilConfig\n\n"
        "class EvilForCausalLM(GPT2LMHeadModel):\n    config_class = EvilConfig\n")
    if tokenizer_code:
        tc = json.loads((folder / "tokenizer_config.json").read_text())
        tc["auto_map"] = {"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]}
        (folder / "tokenizer_config.json").write_text(json.dumps(tc))
        (folder / "tokenization_evil.py").write_text(write)
    return folder


def test_remote_code_never_runs_unless_asked(tmp_path):
    marker = tmp_path / "marker"
    folder = evil_folder(tmp_path, marker, tokenizer_code=True)
    with pytest.raises(loading.RemoteCodeError, match=r"evil: its config.json asks to run code shipped with the "
                       r"checkpoint \(configuration_evil.EvilConfig, modeling_evil.EvilForCausalLM\); pruner never "
                       r"runs a model's own code unless asked: pass --trust-remote-code"):
        loading.load_model(str(folder))
    with pytest.raises(loading.RemoteCodeError, match=r"its tokenizer_config.json asks to run code shipped with the "
                                                     r"checkpoint \(tokenization_evil.EvilTokenizer\)"):
        loading.load_tokenizer(str(folder))
    assert not marker.exists()
    model = loading.load_model(str(folder), trust_remote_code=True)  # asked: the folder's code runs
    assert marker.exists() and type(model).__name__ == "EvilForCausalLM"


def test_pruner_format_goes_to_pruners_own_loader(tmp_path, monkeypatch):
    """A per-layer checkpoint (`pruner_format`) carries an auto_map too, but never needs remote code."""
    marker = tmp_path / "marker"
    folder = evil_folder(tmp_path, marker)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "pruner_format": "per-layer-heads/1"}))
    seen = {}
    monkeypatch.setattr(loading, "load_pruner_format", lambda path, **kw: seen.setdefault("path", path))
    assert loading.load_model(str(folder)) == str(folder)
    assert not marker.exists()


@pytest.mark.unit
def test_yaml_is_loaded_safely(tmp_path):
    marker = tmp_path / "pwned"
    recipe = tmp_path / "evil.yaml"
    recipe.write_text(f"model: {{path: gpt2-shakespeare}}\nseed: !!python/object/apply:os.system "
                      f"['touch {marker}']\n")
    with pytest.raises(RecipeError, match=r"evil.yaml \(line 2, column 7\): the tag !!python/object/apply:os.system "
                                          r"is not allowed; a recipe is plain YAML"):
        load_recipe(recipe)
    r = load_recipe({"model": {"path": "x"}}, [f"model.path=!!python/object/apply:os.system ['touch {marker}']"])
    assert r.model.path.startswith("!!python")  # --set: not YAML it will construct, so kept as text
    assert not marker.exists()


@pytest.mark.unit
def test_tokens_are_redacted(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "my-private-token-value")
    text = ("401 Unauthorized for url https://huggingface.co/api/repos/create; request headers "
            "{'Authorization': 'Bearer my-private-token-value'} also hf_abcdefghijklmnopqrstuvwx")
    out = redact(text)
    assert "my-private-token-value" not in out and "hf_abcdefghijklmnop" not in out
    assert out.startswith("401 Unauthorized for url https://huggingface.co/api/repos/create")
    assert redact("hf_hub_download and Authorization header docs") == "hf_hub_download and Authorization header docs"


def test_a_failed_push_never_shows_the_token(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)

    class Client:
        def create_repo(self, *a, **k):
            raise RuntimeError(f"403 Forbidden: headers={{'authorization': 'Bearer {FAKE_TOKEN}'}} "
                               f"token={FAKE_TOKEN}")
    with pytest.raises(export.PushError) as info:
        export.push(tmp_path, "you/model", False, "msg", client=Client())
    assert FAKE_TOKEN not in str(info.value) and "403 Forbidden" in str(info.value)


def test_a_hub_failure_never_shows_the_token(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)

    def load(path):
        raise OSError(f"401 Client Error for https://huggingface.co/{path} (Authorization: Bearer {FAKE_TOKEN})")
    with pytest.raises(OSError) as info:
        loading._from_hub(load, "someone/model", "model")
    assert FAKE_TOKEN not in str(info.value) and "401 Client Error" in str(info.value)


# --- provenance --------------------------------------------------------------------------------------


def copy_of(name: str, root: Path) -> Path:
    folder = root / name
    shutil.copytree(assets.checkpoint(name), folder)
    return folder


def test_provenance_names_what_changed(tmp_path):
    folder = copy_of("gpt2-shakespeare", tmp_path)
    spec = load_recipe({"model": {"path": str(folder)}}).model
    run = tmp_path / "run"
    run.mkdir()
    recipe = load_recipe({"model": {"path": str(folder)}})
    prov = provenance.record(recipe)
    provenance.write(run, prov)
    assert prov["model"]["kind"] == "local" and set(prov["model"]["files"]) == {"config.json", "model.safetensors"}
    assert set(prov["tokenizer"]["files"]) == {"tokenizer.json", "tokenizer_config.json"}
    assert prov["data"]["calibration"]["kind"] == "files" and len(prov["data"]["calibration"]["files"]) >= 1
    assert provenance.check_base(run, spec) is None
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "layer_norm_epsilon": 1e-3}))
    with pytest.raises(provenance.ProvenanceError, match=r"the base is not the one .*run was made from: base model "
                       r".*gpt2-shakespeare: config.json differs \(sha256 \w{12} now, \w{12} in the run\); pass "
                       r"--allow-changed-base to use it anyway"):
        provenance.check_base(run, spec)
    note = provenance.check_base(run, spec, allow_changed=True)
    assert note.startswith("Exported with --allow-changed-base: base model") and "config.json differs" in note
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(provenance.ProvenanceError, match=r"tokenizer .*: tokenizer_config.json is missing"):
        provenance.check_base(run, spec)


def test_hub_identity_is_the_cached_commit(tmp_path, monkeypatch):
    """A Hub id's identity is the commit its cached snapshot resolves to (no network)."""
    from huggingface_hub import constants

    def snapshot(commit: str) -> None:
        repo = tmp_path / "models--someone--tiny"
        (repo / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
        (repo / "snapshots" / commit / "config.json").write_text("{}")
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    snapshot("a" * 40)
    old = provenance.model_identity("someone/tiny")
    assert old == {"kind": "hub", "name": "someone/tiny", "repo_id": "someone/tiny", "commit": "a" * 40}
    snapshot("b" * 40)  # the Hub moved and a later download updated the cache
    assert provenance._what_changed("base model", old, provenance.model_identity("someone/tiny")) == \
        "base model someone/tiny resolves to Hub commit bbbbbbbbbbbb now, aaaaaaaaaaaa when the run was made"


@pytest.mark.parametrize("heads,bias,message", [
    ({"1": [0, 9]}, None, r"layer 1 head 9 is out of range"),
    ({"5": [0]}, None, r"layer 5 is out of range"),
    ({"0": [0, 1, 2, 3]}, None, r"it prunes all 4 heads of layer 0, emptying it"),
    ({"0": [1, 1]}, None, r"layer 0 lists a head twice \(\[1, 1\]\)"),
    ({"x": [1]}, None, r"layer 'x' is not a layer number"),
    ({"0": ["a"]}, None, r"layer 0's heads are not a list of head numbers"),
    ({"0": [1]}, {0: torch.zeros(16)}, r"compensation of .* layer 0's bias has shape \(16,\), the output projection "
                                        r"needs \(32,\)"),
    ({"0": [1]}, {1: torch.zeros(32)}, r"layer 1 has a bias but the plan prunes no head there"),
])
def test_a_plan_that_does_not_fit_is_refused(heads, bias, message):
    model = tiny_model("gpt2")  # 2 layers x 4 heads, d_model 32
    with pytest.raises(provenance.ProvenanceError, match=message):
        provenance.check_fits(Path("runs/x"), {"heads": heads}, bias, model)
    assert provenance.check_fits(Path("runs/x"), {"heads": {"0": [1], "1": [0, 3]}}, {0: torch.zeros(32)}, model) \
        == {0: [1], 1: [0, 3]}
