"""Bad inputs through the CLI: one clear line, a non-zero exit, nothing half-written.

Every case runs `pruner` in-process on small shipped or tiny models. A case passes
when the exit status and the message match, stderr is one line with no traceback,
and the output folder (and any temporary sibling) does not exist afterwards. A few
cases stand in for the machine (little memory, a full disk, a Hub error that echoes
a token) by patching one function while they run (`PATCHES`).
`tests/error_matrix.py` prints the same cases with their messages for docs/troubleshooting.md.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

from pruner.cli import main
from pruner.core import assets

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
TINY = ["--set", "calibration.num_samples=4", "--set", "calibration.length=32", "--set", "evaluation.num_samples=4",
        "--set", "evaluation.length=32", "--set", "evaluation.bootstrap=10", "--set", "capture.metrics=[cosine]",
        "--set", "evaluation.latency=false", "--set", "bench.enabled=false"]


def _tiny(folder: Path, cls_name: str, **config) -> Path:
    """A tiny random model of a transformers class with the shipped 4,096-token tokenizer."""
    import transformers as tf

    torch.manual_seed(0)
    cfg_cls, model_cls = {"gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel), "opt": (tf.OPTConfig, tf.OPTForCausalLM),
                          "llama": (tf.LlamaConfig, tf.LlamaForCausalLM)}[cls_name]
    model_cls(cfg_cls(vocab_size=4096, **config)).save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(assets.checkpoint("gpt2-shakespeare") / f, folder / f)
    return folder


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return build_env(tmp_path_factory.mktemp("bad"))


def build_env(d: Path) -> Path:
    """Files and tiny checkpoints the bad-input cases point at (built once, in folder `d`)."""
    import transformers as tf

    gpt2 = dict(n_layer=2, n_head=4, n_embd=32, n_positions=64, bos_token_id=1, eos_token_id=2)
    tiny = _tiny(d / "tiny-gpt2", "gpt2", **gpt2)
    nan = _tiny(d / "nan-gpt2", "gpt2", **gpt2)
    m = tf.AutoModelForCausalLM.from_pretrained(nan)
    with torch.no_grad():
        m.transformer.h[1].attn.c_attn.weight[0, 0] = float("nan")
    m.save_pretrained(nan)
    _tiny(d / "opt", "opt", hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
          max_position_embeddings=64, word_embed_proj_dim=32)
    twins = _tiny(d / "twin-heads", "gpt2", **gpt2)  # every head of every layer the same: singular moments
    m = tf.AutoModelForCausalLM.from_pretrained(twins)
    with torch.no_grad():
        for block in m.transformer.h:
            w, b = block.attn.c_attn.weight.view(32, 3, 4, 8), block.attn.c_attn.bias.view(3, 4, 8)
            w[:] = w[:, :, :1].clone()
            b[:] = b[:, :1].clone()
    m.save_pretrained(twins)
    nobos = _tiny(d / "nobos", "gpt2", **gpt2)
    tok = tf.AutoTokenizer.from_pretrained(nobos)
    tok.bos_token = None
    tok.save_pretrained(nobos)
    (d / "recipe.yaml").write_text(f"model: {{path: {tiny}}}\nsinks: {{mode: first}}\n")
    llama = _tiny(d / "tiny-llama", "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                  bos_token_id=1, eos_token_id=2)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        # one head per KV group in one layer: 2 and 4 query heads per layer, which no Llama config can say
        assert main(["prune", str(d / "recipe.yaml"), *TINY, "--set", f"model.path={llama}", "--set",
                     "selection.target=2", "--set", "selection.shape=any", "--out", str(d / "llama-run")]) == 0
        # ... so its compact export is per-layer; a copy with a hand-edited config no longer fits its weights
        assert main(["export", str(d / "llama-run"), "--format", "compact", "--out", str(d / "per-layer")]) == 0
    shutil.copytree(d / "per-layer", d / "edited-per-layer")
    config = json.loads((d / "edited-per-layer" / "config.json").read_text())
    config["num_attention_heads_per_layer"] = config["num_attention_heads_per_layer"][::-1]
    (d / "edited-per-layer" / "config.json").write_text(json.dumps(config))
    (d / "malformed.yaml").write_text("model:\n  path: [unclosed\n")
    (d / "unknown.yaml").write_text(f"model: {{path: {tiny}, colour: red}}\n")
    (d / "wrongtype.yaml").write_text(f"model: {{path: {tiny}}}\nselection: {{target: lots}}\n")
    (d / "tagged.yaml").write_text(f"model: {{path: {tiny}}}\nseed: !!python/object/apply:os.system "
                                   f"['touch {d / 'marker'}']\n")
    (d / "empty.txt").write_text("")
    (d / "short.txt").write_text("To be, or not to be.\n")
    (d / "latin1.txt").write_bytes("Caf\xe9 ol\xe9, se\xf1or.\n".encode("latin-1") * 50)
    ro = d / "readonly"
    ro.mkdir()
    ro.chmod(0o555)
    if os.access(ro, os.W_OK):  # root ignores permission bits: /sys refuses writes even to root
        ro = Path("/sys/pruner-readonly")
    d.joinpath("ro_path").write_text(str(ro))
    _remote_code_folder(d / "remote-code", d / "marker")
    for name, edit in (("changed-base-run", _changed_base), ("edited-plan-run", _emptied_layer)):
        shutil.copytree(d / "llama-run", d / name)
        edit(d / name)
    _interrupted(d)
    return d


def _remote_code_folder(folder: Path, marker: Path) -> None:
    """A tiny GPT-2 whose config maps to modeling code in its folder; importing that code writes `marker`."""
    _tiny(folder, "gpt2", n_layer=2, n_head=4, n_embd=32, n_positions=64, bos_token_id=1, eos_token_id=2)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "modeling_custom.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
                                               "from transformers import GPT2LMHeadModel as CustomForCausalLM\n")


def _changed_base(run: Path) -> None:
    """The run's record of its base weights no longer matches them (as if the base folder had changed)."""
    prov = json.loads((run / "provenance.json").read_text())
    prov["model"]["files"]["model.safetensors"] = "0" * 64
    (run / "provenance.json").write_text(json.dumps(prov))


def _emptied_layer(run: Path) -> None:
    plan = json.loads((run / "plan.json").read_text())
    plan["heads"]["0"] = [0, 1, 2, 3]
    (run / "plan.json").write_text(json.dumps(plan))


def _interrupted(d: Path) -> None:
    """A run interrupted (Ctrl-C) after its first checkpoint: its partial folder holds resumable state."""
    from pruner.core import resume

    def stop(label: str) -> None:
        if label == "capture:1":
            raise KeyboardInterrupt
    with mock.patch.object(resume, "kill_point", stop), contextlib.redirect_stderr(io.StringIO()), \
            contextlib.redirect_stdout(io.StringIO()):
        assert main(_recipe(d, "checkpoint.every_batches=1") + ["--out", str(d / "interrupted" / "run")]) == 130
    assert resume.has_state(d / "interrupted" / ".run.partial")


def _recipe(env, *sets):
    return ["prune", str(env / "recipe.yaml"), *TINY, *(x for s in sets for x in ("--set", s))]


# (id, argv from env, exit status, message regex). The output folder is always <tmp>/out.
CASES = [
    ("missing model path", lambda e: _recipe(e, "model.path=/nonexistent/model"), 2,
     r"model path '/nonexistent/model' does not exist"),
    ("Hub id, no network", lambda e: _recipe(e, "model.path=pruner-tests/no-such-model"), 2,
     r"cannot load the model 'pruner-tests/no-such-model': it is not a shipped checkpoint .* Hub did not provide"),
    ("unsupported architecture", lambda e: _recipe(e, f"model.path={e / 'opt'}"), 2,
     r"architecture 'opt' is not supported; supported: bert, gemma3_text, gpt2, gpt_neox, llama, mistral"),
    ("malformed YAML", lambda e: ["prune", str(e / "malformed.yaml")], 2, r"is not valid YAML \(line 3, column 1\)"),
    ("unknown recipe key", lambda e: ["prune", str(e / "unknown.yaml")], 2,
     r"invalid recipe: model.colour: unknown key"),
    ("wrong type", lambda e: ["prune", str(e / "wrongtype.yaml")], 2,
     r"invalid recipe: selection.target: Input should be a valid number"),
    ("missing recipe file", lambda e: ["prune", str(e / "nope.yaml")], 2, r"recipe file .*nope.yaml does not exist"),
    ("sparsity <= 0", lambda e: _recipe(e, "selection.target=0"), 2,
     r"selection.target: Input should be greater than 0"),
    ("sparsity >= 1 as a fraction", lambda e: _recipe(e, "selection.target=1.0"), 2,
     r"selection.target: .*fraction of heads must be in \(0, 1\); a head count is a whole number \(got 1.0\)"),
    ("selection would empty a layer", lambda e: _recipe(e, "selection.target=0.99"), 2,
     r"asks for 8 of 8 heads, but keeping min_heads_per_layer=1 in each of 2 layers leaves at most 6"),
    ("fewer heads than the per-layer minimum", lambda e: _recipe(e, "selection.min_heads_per_layer=3",
                                                                 "selection.target=0.5"), 2,
     r"asks for 4 of 8 heads, but keeping min_heads_per_layer=3 .* leaves at most 2 prunable"),
    ("per-layer minimum keeps every head", lambda e: _recipe(e, "selection.min_heads_per_layer=4"), 2,
     r"min_heads_per_layer=4 keeps all 4 heads of every layer: nothing can be pruned"),
    ("zero heads selected", lambda e: _recipe(e, "selection.target=0.01"), 2,
     r"selection.target 0.01 selects 0 of 8 heads; use at least 0.125"),
    ("empty calibration file", lambda e: _recipe(e, f"calibration.data={e / 'empty.txt'}"), 2,
     r"no text in '.*empty.txt'"),
    ("text shorter than one window", lambda e: _recipe(e, f"calibration.data={e / 'short.txt'}"), 2,
     r"text has \d+ tokens, shorter than one window of 31 tokens"),
    ("non-UTF-8 text", lambda e: _recipe(e, f"calibration.data={e / 'latin1.txt'}"), 2,
     r"latin1.txt is not UTF-8 text \(byte 3\): re-encode it as UTF-8"),
    ("every token a sink", lambda e: _recipe(e, "sinks.mode=positions",
                                             f"sinks.positions=[{','.join(map(str, range(32)))}]"), 2,
     r"sink spec 'positions' marks every token of every sample as a sink"),
    ("NaN in weights", lambda e: _recipe(e, f"model.path={e / 'nan-gpt2'}"), 2,
     r"weight transformer.h.1.attn.c_attn.weight contains NaN or inf"),
    ("invalid sink mode", lambda e: _recipe(e, "sinks.mode=wherever"), 2,
     r"sinks.mode: Input should be 'first', 'bos', 'special', 'ids', 'positions' or 'auto'"),
    ("invalid sink spec (sinks command)", lambda e: ["sinks", str(e / "tiny-gpt2"), "--sinks", "ids:x"], 2,
     r"invalid sink spec 'ids:x': values must be whole numbers"),
    ("BOS from a tokenizer without one", lambda e: _recipe(e, f"model.path={e / 'nobos'}"), 2,
     r"has neither a BOS nor a CLS token to start windows with; set bos: false"),
    ("perplexity of a model without an LM head", lambda e: _recipe(e, "model.path=minilm", "sinks.mode=special",
                                                                   "calibration.unit=lines"), 2,
     r"minilm: masked-token perplexity needs a masked-LM head \(set model.mlm_readout: shipped"),
    ("--set of a missing key", lambda e: _recipe(e, "selection.colour=3"), 2,
     r"--set selection.colour: no such key 'colour'; valid here: target, budget"),
    ("scorer name typo", lambda e: _recipe(e, "scorer.name=sink-awre"), 2,
     r"unknown scorer 'sink-awre' \(did you mean 'sink-aware'\?\)"),
    ("hidden states on disk with the whole model resident", lambda e: _recipe(e, "capture.onload=all",
                                                                              "capture.hidden=disk"), 2,
     r"capture.hidden: disk keeps a layer-by-layer pass's hidden states; with capture.onload: all there are none"),
    ("layer by layer with single-head ablations", lambda e: _recipe(e, "capture.onload=sequential",
                                                                    "scorer.name=ablation"), 2,
     r"single-head ablations need the whole model at once: capture.onload: all"),
    ("compare: bad sparsity list", lambda e: ["compare", str(e / "recipe.yaml"), "--sparsities", "0.1,1.5"], 2,
     r"--sparsities: '1.5' is neither a fraction in \(0, 1\) nor a whole head count"),
    ("compare: unknown compensation", lambda e: ["compare", str(e / "recipe.yaml"), "--compensation", "half"], 2,
     r"unknown compensation \['half'\]; valid: zero, mean, refit"),
    ("per-layer checkpoint with an edited config", lambda e: ["sinks", e / "edited-per-layer"], 2,
     r"edited-per-layer: config.json does not match the weights: model.layers.0.self_attn.o_proj.weight is "
     r"\[64, \d+\] in the checkpoint but \[64, \d+\] by the config's head counts \(was config.json edited"),
    ("refit: fewer calibration tokens than channels", lambda e: _recipe(e, "surgery.compensation=refit",
                                                                        "calibration.num_samples=1",
                                                                        "calibration.length=8"), 2,
     r"refit compensation of layer 0 fits 32 output-projection channels from only 8 calibration tokens; use at "
     r"least 32 tokens"),
    ("refit: negative ridge", lambda e: _recipe(e, "surgery.compensation=refit", "surgery.ridge=-1"), 2,
     r"surgery.ridge: a ridge is >= 0 \(relative to the mean diagonal\) or auto, got -1"),
    ("refit: singular system (twin heads, ridge 0)", lambda e: _recipe(e, f"model.path={e / 'twin-heads'}",
                                                                       "surgery.compensation=refit",
                                                                       "surgery.ridge=0", "scorer.name=sink-aware"), 2,
     r"refit compensation of layer \d: the (kept heads' second moment is singular|system is ill-conditioned).* "
     r"surgery.ridge"),
    ("refit-aware scorer: singular moment (twin heads, ridge 0)",
     lambda e: _recipe(e, f"model.path={e / 'twin-heads'}", "surgery.compensation=refit", "surgery.ridge=0"), 2,
     r"refit-aware scoring of layer \d: the heads' second moment is singular \(ridge 0\); set surgery.ridge > 0"),
    ("export of a folder that is not a run", lambda e: ["export", e / "tiny-llama", "--format", "dense"], 2,
     r"tiny-llama is not a pruner run folder \(no recipe.yaml, plan.json, metrics.json\)"),
    ("analyze: --compare-to with another tokenizer", lambda e: ["analyze", e / "tiny-gpt2", "--compare-to",
                                                               "minilm-causal", "--num-samples", "2"], 2,
     r"--compare-to needs the same tokenizer \(the same token rows\)"),
    ("analyze: unknown metric", lambda e: ["analyze", e / "tiny-gpt2", "--metrics", "cosine,kl"], 2,
     r"unknown pair metrics \['kl'\]; valid: cosine, js, hellinger, tv, aitchison"),
    ("analyze: bad threshold", lambda e: ["analyze", e / "tiny-gpt2", "--threshold", "cosine=high"], 2,
     r"--threshold takes METRIC=NUMBER, e.g. cosine=0.5; got 'cosine=high'"),
    ("read-only output folder", lambda e: _recipe(e) + ["--out", Path((e / "ro_path").read_text()) / "run"], 2,
     r"cannot write the output folder .*run: (Permission denied|permission denied|Operation not permitted)"),
    ("tasks without lm-evaluation-harness installed", lambda e: _recipe(e, "evaluation.tasks=[shakespeare_cloze]"),
     2, r'evaluation.tasks needs lm-evaluation-harness, which is not installed: pip install "\.\[tasks\]"'),
    ("unknown task name", lambda e: _recipe(e, "evaluation.tasks=[shakespeare_clozee]"), 2,
     r"unknown task 'shakespeare_clozee' \(did you mean 'shakespeare_cloze'.*\); the shipped offline suite"),
    ("task whose dataset needs the network", lambda e: _recipe(e, "evaluation.tasks=[piqa]"), 2,
     r"task 'piqa' needs its dataset from the network, which could not be reached"),
    ("evaluate: a harness task on an encoder", lambda e: ["evaluate", "minilm", "--tasks", "shakespeare_cloze"], 2,
     r"tasks \['shakespeare_cloze'\] are scored by lm-evaluation-harness, which needs a causal LM"),
    ("recipe with a Python tag", lambda e: ["prune", str(e / "tagged.yaml")], 2,
     r"tagged.yaml \(line 2, column 7\): the tag !!python/object/apply:os.system is not allowed; a recipe is plain "
     r"YAML"),
    ("model that ships its own code", lambda e: _recipe(e, f"model.path={e / 'remote-code'}"), 2,
     r"remote-code: its config.json asks to run code shipped with the checkpoint \(modeling_custom.CustomForCausalLM\); "
     r"pruner never runs a model's own code unless asked: pass --trust-remote-code"),
    ("export: the base model changed", lambda e: ["export", e / "changed-base-run", "--format", "dense"], 2,
     r"the base is not the one .*changed-base-run was made from: base model .*tiny-llama: model.safetensors differs "
     r"\(sha256 \w{12} now, 000000000000 in the run\); pass --allow-changed-base to use it anyway"),
    ("export: an edited plan that empties a layer", lambda e: ["export", e / "edited-plan-run", "--format", "dense"], 2,
     r"plan.json of .*edited-plan-run does not fit llama \(2 layers x 4 heads\): it prunes all 4 heads of layer 0, "
     r"emptying it"),
    ("interrupted run, no --resume", lambda e: _recipe(e) + ["--out", e / "interrupted" / "run"], 2,
     r"an interrupted run of .*interrupted/run is kept in .*interrupted/\.run\.partial: pass --resume to continue it, "
     r"or --overwrite to start over"),
    ("--resume with another recipe", lambda e: _recipe(e, "checkpoint.every_batches=1", "selection.target=0.5")
     + ["--out", e / "interrupted" / "run", "--resume"], 2,
     r"cannot resume from .*\.run\.partial: the interrupted run had a different setup \(recipe.selection.target: "
     r"0.25 -> 0.5\); rerun its own command with --resume, or start over with --overwrite"),
    ("tasks on a model larger than free memory (512 KiB)", lambda e: _recipe(e, "evaluation.tasks=[shakespeare_cloze]"),
     2, r"evaluation.tasks run the whole model \(620 KiB in float32\), and only 512 KiB is free on cpu: without "
     r"tasks, prune and compare run layer by layer \(perplexity, compensation and the written model/ one block at "
     r"a time\); or use a machine with more memory"),
    ("not enough memory (512 KiB free)", lambda e: _recipe(e, "calibration.batch_size=4", "capture.onload=all"), 2,
     r"not enough memory for calibration: its peak is about [\d.]+ \w+ \(model .*\), and only 512 KiB is free on cpu "
     r"beyond the loaded model; lower calibration.batch_size: \d+ \(about [\d.]+ \w+\) or model.dtype: bfloat16"),
    ("not enough disk (1 MiB free)", lambda e: _recipe(e), 2,
     r"not enough disk space in .*: the pruned checkpoint \(model/\) needs about [\d.]+ MiB, and 1 MiB "
     r"is free there; free some space or choose another --out"),
    ("disk full while saving", lambda e: _recipe(e), 2,
     r"no space left on device while writing .*out: nothing was written and the partial folder was removed; free "
     r"space on .* and run again"),
    ("Hub error that echoes the token", lambda e: _recipe(e, "model.path=someone/private-model"), 2,
     r"cannot load the model 'someone/private-model': .*\(401 Client Error: Unauthorized for url https://huggingface.co/"
     r"someone/private-model/resolve/main/config.json \(request headers: Authorization: Bearer \*\*\*\)\); check "
     r"the id, the network and HF_TOKEN"),
]
FAKE_TOKEN = "hf_FakeTokenForPrunerTests0123456789"


def _hub_401(*args, **kwargs):
    raise OSError(f"401 Client Error: Unauthorized for url https://huggingface.co/someone/private-model/resolve/main/"
                  f"config.json (request headers: Authorization: Bearer {FAKE_TOKEN})\nmore")


def _no_room(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


# cases that stand in for the machine: what is patched while they run
@contextlib.contextmanager
def _without_harness():
    """As if the tasks extra were not installed: `import lm_eval` fails."""
    saved = sys.modules.get("lm_eval")
    sys.modules["lm_eval"] = None
    try:
        yield
    finally:
        if saved is None:
            del sys.modules["lm_eval"]
        else:
            sys.modules["lm_eval"] = saved


PATCHES = {  # case name -> what it runs under
    "tasks without lm-evaluation-harness installed": lambda e: _without_harness(),
    "not enough memory (512 KiB free)": lambda e: mock.patch("pruner.runs.resources.available_memory",
                                                              lambda device: 512 << 10),
    "tasks on a model larger than free memory (512 KiB)": lambda e: mock.patch(
        "pruner.runs.resources.available_memory", lambda device: 512 << 10),
    "not enough disk (1 MiB free)": lambda e: mock.patch("pruner.runs.resources.free_disk", lambda folder: 1 << 20),
    "disk full while saving": lambda e: mock.patch("pruner.runs.folders.save_checkpoint", _no_room),
    "Hub error that echoes the token": lambda e: _patches(
        mock.patch.dict(os.environ, {"HF_TOKEN": FAKE_TOKEN}),
        mock.patch("transformers.PretrainedConfig.get_config_dict", _hub_401)),
}


@contextlib.contextmanager
def _patches(*patches):
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


def patched(name: str, env: Path):
    """The patches of case `name` (nothing for most cases)."""
    return PATCHES[name](env) if name in PATCHES else contextlib.nullcontext()




def case_args(argv, env: Path, out: Path) -> list[str]:
    args = [str(a) for a in argv(env)]
    return args + ["--out", str(out)] if "--out" not in args and args[0] != "sinks" else args


@pytest.mark.parametrize("name,argv,status,message", CASES, ids=[c[0] for c in CASES])
def test_bad_input(env, tmp_path, capsys, name, argv, status, message):
    out = tmp_path / "out"
    with patched(name, env):
        rc = main(case_args(argv, env, out))
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("pruner: ")]
    assert rc == status, err
    assert len(lines) == 1 and lines[0].startswith("pruner: error: "), err
    assert re.search(message, lines[0]), lines[0]
    assert "Traceback" not in err and FAKE_TOKEN not in err
    assert not out.exists() and not list(tmp_path.glob(".out.*")), "half-written output left behind"
    assert not (env / "marker").exists(), "a model's own code ran without --trust-remote-code"


def test_a_model_larger_than_free_memory_is_pruned_layer_by_layer(env, tmp_path, capsys):
    """What used to be refused (the whole model cannot fit) now runs: `capture.onload: auto` reads the blocks one
    at a time, and model/ is written a block at a time and reload-checked the same way."""
    with mock.patch("pruner.runs.resources.available_memory", lambda device: 512 << 10):
        rc = main(_recipe(env) + ["--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0, out
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert "never whole in memory" in metrics["layer_by_layer"] and metrics["model_saved"]
    assert "layer by layer: the model was never whole in memory" in out
    assert (tmp_path / "out" / "model" / "model.safetensors.index.json").exists()


def test_existing_output_folder_is_kept_without_overwrite(env, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(_recipe(env) + ["--out", str(out)]) == 2
    assert re.search(r"output folder .*out exists and is not empty; pass --overwrite", capsys.readouterr().err)
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and not list(tmp_path.glob(".out.*"))
    assert main(_recipe(env) + ["--out", str(out), "--overwrite"]) == 0
    assert (out / "plan.json").exists() and not (out / "keep.txt").exists()


def test_debug_shows_the_traceback(env, capsys):
    with pytest.raises(ValueError, match="selects 0 of 8 heads"):
        main(_recipe(env, "selection.target=0.01") + ["--debug", "--out", str(env / "never")])
    assert not (env / "never").exists()


def test_unexpected_errors_are_one_line_with_a_hint(env, tmp_path, capsys, monkeypatch):
    from pruner.runs import pipeline

    def boom(*a, **k):
        raise RuntimeError("something broke\ninside")
    monkeypatch.setattr(pipeline, "scoring_inputs", boom)
    assert main(_recipe(env) + ["--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "pruner: error: unexpected RuntimeError: something broke inside (run with --debug for the traceback)"
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_interrupted_export_leaves_nothing(env, tmp_path, capsys, monkeypatch):
    from pruner.runs import export

    def interrupt(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(export.saving, "verify", interrupt)  # Ctrl-C while the written checkpoint is checked
    out = tmp_path / "export"
    assert main(["export", str(env / "llama-run"), "--format", "dense", "--out", str(out)]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "pruner: interrupted; no output folder was written"
    assert not out.exists() and not list(tmp_path.glob(".export.*"))


def test_half_precision_underflow_is_handled(env, tmp_path, capsys):
    """fp16 attention rows with exact zeros (eager softmax underflows): statistics come from float32 logits."""
    import transformers as tf

    folder = _tiny(tmp_path / "fp16", "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                   bos_token_id=1, eos_token_id=2)
    m = tf.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():  # sharp attention: logit gaps far beyond fp16's exp range
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(40)
            layer.self_attn.k_proj.weight.mul_(40)
    m.save_pretrained(folder)
    half = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float16, attn_implementation="eager")
    ids = torch.randint(3, 4096, (1, 32), generator=torch.Generator().manual_seed(0))
    att = half(ids, output_attentions=True).attentions[1]  # (1, H, T, T) fp16
    causal = torch.ones(32, 32, dtype=torch.bool).tril()
    assert (att[0][:, causal] == 0).any(), "premise: fp16 attention rows contain exact zeros"
    out = tmp_path / "run"
    rc = main(["prune", str(env / "recipe.yaml"), *TINY, "--set", f"model.path={folder}", "--set",
               "model.dtype=float16", "--set", "capture.metrics=[cosine,js,aitchison]", "--set", "selection.shape=any",
               "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    import json

    plan = json.loads((out / "plan.json").read_text())
    metrics = json.loads((out / "metrics.json").read_text())
    assert plan["entries"] and all(torch.isfinite(torch.tensor(e["score"])) for e in plan["entries"])
    assert torch.isfinite(torch.tensor([metrics["evaluation"]["base"], metrics["evaluation"]["pruned"]])).all()


def terminal_sigint() -> None:
    """`preexec_fn` of a child that Ctrl-C must reach: SIGINT as a terminal leaves it (default), whatever
    this test process inherited (a suite launched in the background inherits SIGINT *ignored*, and a
    Python child then never sees the signal)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_interrupt_leaves_no_partial_output(env, tmp_path):
    """Ctrl-C (SIGINT) mid-calibration: exit 130, one line, no output folder, no temporary sibling."""
    out = tmp_path / "run"
    log = tmp_path / "stderr.txt"
    cmd = [sys.executable, "-m", "pruner.cli", "prune", str(ROOT / "recipes" / "gpt2-shakespeare.yaml"),
           "--set", "calibration.num_samples=256", "--set", "calibration.batch_size=1", "--out", str(out)]
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stderr=f, stdout=subprocess.DEVNULL, preexec_fn=terminal_sigint)
        deadline = time.time() + 120
        while "capture:" not in log.read_text() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert list(tmp_path.glob(".run.*")), "premise: the run is in progress with its temporary folder"
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
    assert rc == 130
    assert log.read_text().strip().splitlines()[-1] == "pruner: interrupted; no output folder was written"
    assert "Traceback" not in log.read_text()
    assert not out.exists() and not list(tmp_path.glob(".run.*"))


def test_a_token_never_reaches_the_output_or_the_run_folder(env, tmp_path, capsys, monkeypatch):
    """HF_TOKEN set; prune, export and a push that fails with an error echoing the token and its header."""
    from pruner.runs import export

    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)

    class Client:
        def create_repo(self, *a, **k):
            raise RuntimeError(f"401 Client Error: Unauthorized (request headers: {{'authorization': 'Bearer "
                               f"{FAKE_TOKEN}'}}, body: token {FAKE_TOKEN} is invalid)")
    monkeypatch.setattr(export, "hub_client", lambda: Client())
    out = tmp_path / "run"
    assert main(_recipe(env) + ["--out", str(out)]) == 0
    assert main(["export", str(out), "--format", "dense", "--push-to-hub", "someone/model"]) == 2
    printed = capsys.readouterr()
    assert "push to someone/model failed (RuntimeError: 401 Client Error: Unauthorized" in printed.err
    assert FAKE_TOKEN not in printed.out + printed.err
    files = [f for f in tmp_path.rglob("*") if f.is_file()]
    assert any(f.name == "README.md" for f in files) and any(f.name == "provenance.json" for f in files)
    assert not [f for f in files if FAKE_TOKEN.encode() in f.read_bytes()]
