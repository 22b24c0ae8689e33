"""`pruner recover RUN_DIR` on a shipped run: a run folder whose model/ reloads, and every refusal in one line
with no output folder (docs/recovery.md)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pruner.cli import main

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--tokens", "2048", "--set", "recovery.batch_size=4", "--set", "recovery.length=64"]


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "llama"
    quick = ["--set", "calibration.num_samples=8", "--set", "evaluation.num_samples=8", "--set",
             "evaluation.bootstrap=20", "--set", "bench.enabled=false", "--set", "evaluation.latency=false",
             "--set", "recovery.enabled=true", "--set", "recovery.tokens=1024", "--set", "recovery.batch_size=4",
             "--set", "recovery.length=64"]  # prune, then recover as one more stage
    assert main(["prune", str(ROOT / "recipes" / "llama-shakespeare.yaml"), "--out", str(out), *quick]) == 0
    return out


def test_prune_with_a_recovery_section_recovers_and_exports_the_recovered_weights(llama_run, tmp_path):
    import pruner
    from pruner.checkpoints import saving

    m = json.loads((llama_run / "metrics.json").read_text())
    assert m["recovery"]["tokens"] == 1024 and m["recovery"]["kept"] == "recovered"
    assert "## Recovery" in (llama_run / "report.md").read_text()
    assert main(["export", str(llama_run), "--out", str(tmp_path / "exp"), "--format", "compact"]) == 0
    assert "## Recovery" in (tmp_path / "exp" / "README.md").read_text()  # the model card: before and after
    ids = saving.check_ids(pruner.load(llama_run / "model"))
    a = saving.logits(pruner.load(llama_run / "model"), ids)
    b = saving.logits(pruner.load(tmp_path / "exp"), ids)
    assert (a - b).abs().max() < 1e-2  # the export is model/ (recovered), not base + plan rebuilt
    import dataclasses

    from pruner.runs import export, folders

    run = folders.load_run(llama_run)
    plain, _ = export.rebuild(dataclasses.replace(run, metrics={**run.metrics, "recovery": None}), "compact")
    assert (saving.logits(plain, ids) - a).abs().max() > 1e-2  # what the recovery changed


def test_recover_writes_a_run_folder_whose_model_reloads(llama_run, tmp_path, capsys):
    import pruner
    from pruner.checkpoints import loading

    out = tmp_path / "rec"
    assert main(["recover", str(llama_run), "--out", str(out), *SMALL]) == 0
    said = capsys.readouterr().out
    assert "damage recovered R" in said
    m = json.loads((out / "metrics.json").read_text())
    r = m["recovery"]
    from pruner.runs.report import verdict_line

    assert verdict_line(r["perplexity"]) in said and verdict_line(r["perplexity"]) in (out / "report.md").read_text()
    assert r["data"] == "generated" and r["tokens"] == 2048 and r["method"] == "full"
    assert list((llama_run / "recovery-cache").glob("generated-*.pt"))  # the teacher's text, kept in the run
    p = r["perplexity"]
    assert set(p) >= {"base", "pruned", "recovered", "damage_recovered", "kl_pruned", "kl_recovered"}
    assert p["kl_pruned"] > 0.01 and p["kl_recovered"] > 0  # the pruned model's divergence from its base, held out
    assert p["kl_recovered_share"] == pytest.approx(1 - p["kl_recovered"] / p["kl_pruned"])
    assert "KL(base ‖ model) per token on the same windows" in (out / "report.md").read_text()
    prov = json.loads((out / "provenance.json").read_text())["recovery"]
    assert prov["budget"] == 2048 and prov["seed"] == 0 and prov["teacher"]["files"]
    assert "## Recovery" in (out / "report.md").read_text()
    assert not (out / "state").exists() and not list(tmp_path.glob(".*partial"))
    rec, pruned = pruner.load(out / "model"), pruner.load(llama_run / "model")
    assert rec.config.num_attention_heads == pruned.config.num_attention_heads  # the pruned shape, vanilla
    assert loading.load_model(str(out / "model")).config.num_attention_heads == 4  # plain from_pretrained too


def test_recover_mixes_sources_given_twice_and_records_each(llama_run, tmp_path, capsys):
    out = tmp_path / "mix"
    assert main(["recover", str(llama_run), "--out", str(out), *SMALL, "--data", "shakespeare:train",
                 "--data", "python-docs:dev"]) == 0
    assert "data shakespeare:train, python-docs:dev" in capsys.readouterr().out
    r = json.loads((out / "metrics.json").read_text())["recovery"]
    assert r["data"] == "shakespeare:train, python-docs:dev" and r["spec"]["data"] == ["shakespeare:train",
                                                                                         "python-docs:dev"]
    src = json.loads((out / "provenance.json").read_text())["recovery"]["source"]
    assert src["kind"] == "mixture" and [x["kind"] for x in src["sources"]] == ["files", "python-docs"]
    assert main(["recover", str(llama_run), "--out", str(tmp_path / "gen"), *SMALL, "--data", "generated",
                 "--data", "python-docs:dev", "--set", "recovery.weights=[3, 1]"]) == 0  # the teacher's text
    # beside a kind of text of the user's, three windows of it to one
    r = json.loads((tmp_path / "gen" / "metrics.json").read_text())["recovery"]
    prov = json.loads((tmp_path / "gen" / "provenance.json").read_text())["recovery"]
    assert r["data"] == "generated ×3, python-docs:dev ×1" and r["kept"] in ("recovered", "pruned")
    assert prov["generated"]["by"] == "teacher" and prov["source"]["kind"] == "python-docs"
    assert prov["weights"] == {"generated": 3, "python-docs:dev": 1} and r["spec"]["weights"] == [3, 1]
    capsys.readouterr()  # the generation's progress
    assert main(["recover", str(llama_run), "--out", str(tmp_path / "bad"), *SMALL, "--data", "shakespeare:train",
                 "--data", "shakespeare:evaluation"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "shakespeare:evaluation overlaps the evaluation windows" in err[0]
    assert not (tmp_path / "bad").exists()


def _with_recipe(run: Path, folder: Path, **sections) -> Path:
    import yaml

    shutil.copytree(run, folder)
    recipe = yaml.safe_load((folder / "recipe.yaml").read_text())
    for section, values in sections.items():
        recipe[section].update(values)
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return folder


def test_a_cached_teacher_read_block_by_block_fills_the_cache_of_the_whole_one(llama_run, tmp_path, capsys,
                                                                            monkeypatch):
    from pruner.runs import recovery_stage

    cached = [*SMALL, "--data", "shakespeare:train", "--set", "recovery.teacher=cached"]
    records = {}
    for onload in ("all", "sequential"):
        run = _with_recipe(llama_run, tmp_path / onload, capture={"onload": onload})
        if onload == "sequential":  # the teacher is never loaded whole
            monkeypatch.setattr(recovery_stage.loading, "load_base",
                                lambda *a, **k: pytest.fail("teacher loaded whole"))
        assert main(["recover", str(run), "--out", str(tmp_path / f"rec-{onload}"), *cached]) == 0
        records[onload] = json.loads((tmp_path / f"rec-{onload}" / "metrics.json").read_text())["recovery"]
    a, b = records["all"], records["sequential"]
    assert b["validation_kl_pruned"] == pytest.approx(a["validation_kl_pruned"], rel=1e-5)
    assert b["perplexity"]["base"] == pytest.approx(a["perplexity"]["base"], rel=1e-5)  # the base, a block at a time
    assert b["validation_kl_best"] == pytest.approx(a["validation_kl_best"], rel=1e-3)
    capsys.readouterr()
    run = tmp_path / "sequential"
    assert main(["recover", str(run), "--out", str(tmp_path / "gen"), *SMALL, "--set", "recovery.teacher=cached"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "generated samples text from the whole teacher" in err[0]
    assert not (tmp_path / "gen").exists()


def test_recovery_scores_the_runs_downstream_tasks_before_and_after(llama_run, tmp_path):
    run = _with_recipe(llama_run, tmp_path / "run", evaluation={"tasks": ["shakespeare_cloze"], "task_limit": 16})
    assert main(["recover", str(run), "--out", str(tmp_path / "rec"), *SMALL]) == 0
    acc = json.loads((tmp_path / "rec" / "metrics.json").read_text())["recovery"]["tasks"]["shakespeare_cloze"]["acc"]
    assert acc["docs"] == 16 and all(0 <= acc[k] <= 1 for k in ("base", "pruned", "recovered"))
    assert acc["delta"] == pytest.approx(acc["recovered"] - acc["pruned"])
    assert acc["ci_low"] <= acc["delta"] <= acc["ci_high"]
    assert "| shakespeare_cloze | acc |" in (tmp_path / "rec" / "report.md").read_text()


def test_a_per_layer_run_recovers_into_a_per_layer_model(tmp_path):
    """GPT-2 has no vanilla pruned shape: model/ is the per-layer form, and so is the recovered model (the
    student loaded by pruner.load is saved as it is; was: refused at the very end, after the training)."""
    import pruner

    run, out = tmp_path / "gpt2", tmp_path / "rec"
    assert main(["prune", str(ROOT / "recipes" / "gpt2-shakespeare.yaml"), "--out", str(run), "--set",
                 "calibration.num_samples=8", "--set", "evaluation.num_samples=4", "--set", "bench.enabled=false",
                 "--set", "evaluation.latency=false", "--set", "surgery.mode=remove"]) == 0
    assert main(["recover", str(run), "--out", str(out), "--tokens", "1024", "--set", "recovery.batch_size=4",
                 "--set", "recovery.length=64"]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["model_layout"] == "per-layer" and (out / "model" / "modeling_pruned_gpt2.py").exists()
    rec, pruned = pruner.load(out / "model"), pruner.load(run / "model")
    assert rec.config.num_attention_heads_per_layer == pruned.config.num_attention_heads_per_layer
    # only the kept heads' projections trained (was: the per-layer student refused by the architecture adapter)
    assert main(["recover", str(run), "--out", str(tmp_path / "att"), "--tokens", "1024", "--set",
                 "recovery.batch_size=4", "--set", "recovery.length=64", "--set", "recovery.method=attention",
                 "--set", "recovery.lr=1e-5"]) == 0
    assert json.loads((tmp_path / "att" / "metrics.json").read_text())["recovery"]["kept"] == "recovered"
    att = pruner.load(tmp_path / "att" / "model").state_dict()
    changed = {k for k, v in pruned.state_dict().items() if not torch.equal(v, att[k])}
    assert changed and all(".attn." in k for k in changed), changed
    api = pruner.recover(pruner.load(run / "model"), "gpt2-shakespeare", data=["to be or not to be " * 400],
                         tokens=512, batch_size=4, length=32, progress=False)  # a per-layer student in memory
    assert api.record["steps"] == 4


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(run, dst)
    return dst


def no_model(run, tmp_path):
    dst = _copy(run, tmp_path)
    shutil.rmtree(dst / "model")
    (dst / "model").mkdir()
    (dst / "model" / "NOT_SAVED.txt").write_text("This pruned model was not saved: no layout holds it.\n")
    return dst, []


def changed_base(run, tmp_path):
    dst = _copy(run, tmp_path)
    prov = json.loads((dst / "provenance.json").read_text())
    prov["model"]["files"] = {k: "0" * 64 for k in prov["model"]["files"]}
    (dst / "provenance.json").write_text(json.dumps(prov))
    return dst, []


BAD = {
    "unknown method": (lambda run, tmp: (run, ["--set", "recovery.method=qlora"]), "unknown recovery method"),
    "budget below a batch": (lambda run, tmp: (run, ["--tokens", "10"]), "below one batch"),
    "evaluation overlap": (lambda run, tmp: (run, ["--data", "shakespeare:evaluation"]), "overlaps the evaluation"),
    "no pruned model": (no_model, "no pruned model to recover"),
    "teacher not the run's base": (changed_base, "the base is not the one"),
    "disk too small for the cache": (lambda run, tmp: (run, ["--set", "recovery.teacher=cached"]),
                                     "GiB is free"),
    "memory too small for the method": (lambda run, tmp: (run, ["--set", "recovery.method=full"]),
                                        "not enough memory for recovery (full)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_before_training_and_writes_nothing(llama_run, tmp_path, capsys, monkeypatch, case):
    make, message = BAD[case]
    run, extra = make(llama_run, tmp_path)
    if case == "disk too small for the cache":
        import collections

        import pruner.recovery.teacher as teacher

        usage = collections.namedtuple("usage", "total used free")
        monkeypatch.setattr(teacher.shutil, "disk_usage", lambda p: usage(1 << 30, 1 << 30, 1 << 20))
    if case == "memory too small for the method":
        from pruner.runs import recovery_memory

        monkeypatch.setattr(recovery_memory, "available_memory", lambda device: 1 << 20)
    out = tmp_path / "out"
    rc = main(["recover", str(run), "--out", str(out), *SMALL, *extra])
    err = capsys.readouterr().err.strip()
    if case == "memory too small for the method":  # checked on the loaded models: transformers' loading bars first
        err = "\n".join(line for line in err.splitlines() if not line.startswith("Loading weights")).strip()
    assert rc == 2 and len(err.splitlines()) == 1 and message in err, err
    assert "recovery:" not in capsys.readouterr().err  # no progress: refused before training
    assert not out.exists() and not (tmp_path / ".out.partial").exists()


@pytest.mark.parametrize("low, high, says", [(-0.5, -0.1, "lowered"), (0.1, 0.5, "raised"), (-0.1, 0.2, "within noise")])
def test_the_verdict_on_the_evaluation_perplexity_follows_the_interval(low, high, says):
    from pruner.runs.report import verdict_line

    line = verdict_line({"ci_low": low, "ci_high": high})
    assert says in line and "\n" not in line
    assert ("pruned model is better" in line) == (says == "raised")  # the one case that tells the user to keep it
