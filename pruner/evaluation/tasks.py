"""Downstream accuracy: EleutherAI's lm-evaluation-harness on the in-memory model.

The harness scores multiple-choice tasks by the log-likelihood of each answer
given its context. pruner runs it on the model object it already holds, so the
pruned model is the base model under the scoped mask of `surgery.masked` -- no
save and reload per plan -- and base and pruned are scored on the same
documents. The comparison is paired: per document, the pruned model's accuracy
minus the base model's, averaged, with a percentile bootstrap over documents.

Encoding is the part that must match how the model was trained. The harness's
default encodes every string with the tokenizer's own special tokens: BERT's
`[CLS] ... [SEP]` around the context, and again around context + continuation,
which scores continuations after a stray `[SEP]` (on a cloze task the causal
all-MiniLM-L6-v2 fell to chance that way). `PrunerLM` encodes text without
special tokens and starts each context with the token pruner's perplexity
windows start with (`data.bos_token_id`: BOS, else `[CLS]`) when the recipe's
`evaluation.bos` says the model was trained with one; nothing is appended.

lm-evaluation-harness is an optional extra (`pip install ".[tasks]"`).
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pruner.core import assets, data
from pruner.evaluation.accuracy import TaskScores

SUITE = assets.ASSETS / "tasks"  # the shipped offline task suite (scripts/build_tasks.py)
INSTALL = 'pip install ".[tasks]"'


class TaskError(ValueError):
    """A task request that cannot run; the message says what to do."""


def _require_harness():
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise TaskError(f"evaluation.tasks needs lm-evaluation-harness, which is not installed: {INSTALL}") from None


@dataclass(frozen=True)
class TaskSpec:
    """Which tasks to score and how (the recipe's evaluation.tasks / task_paths / task_limit / num_fewshot)."""

    names: tuple[str, ...]
    paths: tuple[str, ...] = ()
    limit: int | None = None          # first `limit` documents of each task
    num_fewshot: int | None = None    # None: the task's own default (0 if it has none)
    batch_size: int = 8
    bos: bool = True                  # start every context with BOS / [CLS], as the perplexity windows do
    seed: int = 0                     # few-shot sampling and the bootstrap


def spec_from_recipe(ev) -> TaskSpec:
    """The TaskSpec of a recipe's `evaluation` section."""
    return TaskSpec(tuple(ev.tasks), tuple(ev.task_paths), ev.task_limit, ev.num_fewshot, ev.batch_size,
                    ev.bos, ev.seed)


# ---------------------------------------------------------------- the model, as the harness sees it

def harness_lm(model, tokenizer, bos: bool = True, batch_size: int = 8, progress: bool = False):
    """An lm-eval `HFLM` over `model` as it is at call time (any scoped mask active), encoding as pruner does."""
    _require_harness()
    PrunerLM = _pruner_lm()
    bos_id = data.bos_token_id(tokenizer) if bos else None
    with _quiet():
        # a copy: the harness may set a pad token on the tokenizer it is given
        lm = PrunerLM(pretrained=model, tokenizer=copy.deepcopy(tokenizer), backend="causal",
                      batch_size=batch_size, prefix_token_id=bos_id)
    lm._pruner_bos, lm._pruner_progress = bos_id, progress
    return lm


def _pruner_lm() -> type:
    """The `HFLM` subclass `harness_lm` builds: made at call time, since lm-eval is an optional extra."""
    from lm_eval.models.huggingface import HFLM

    class PrunerLM(HFLM):
        """HFLM with pruner's encoding: no special tokens from the tokenizer, BOS first when trained with it."""

        def tok_encode(self, string, add_special_tokens=None, left_truncate_len=None, **kw):
            ids = self.tokenizer(string, add_special_tokens=False, verbose=False)["input_ids"]
            if left_truncate_len:
                ids = ids[-left_truncate_len:]
            return ids

        def _encode_pair(self, context, continuation):
            """(context ids, continuation ids): split where the context's own encoding ends; BOS first."""
            n_spaces = len(context) - len(context.rstrip())
            if n_spaces:  # as the harness does: trailing spaces belong to the continuation
                context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
            whole = self.tok_encode(context + continuation)
            ctx = self.tok_encode(context)
            cont = whole[len(ctx):]
            if self._pruner_bos is not None:  # the harness keeps max_length + 1 tokens: BOS + context tail + cont
                tail = self.max_length - len(cont)
                ctx = [self._pruner_bos] + (ctx[-tail:] if tail > 0 else [])
            return (ctx or [self.prefix_token_id]), cont

        def tok_batch_encode(self, strings, padding_side="left", left_truncate_len=None, truncation=False):
            """Generation contexts, encoded as `_encode_pair` encodes them, padded on `padding_side`."""
            rows = [([self._pruner_bos] if self._pruner_bos is not None else []) + self.tok_encode(s)
                    for s in strings]
            if left_truncate_len:
                rows = [r[-left_truncate_len:] for r in rows]
            batch = data.pad(rows, pad_id=self.tokenizer.pad_token_id or 0, side=padding_side)
            return batch.input_ids, batch.attention_mask

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self._pruner_progress)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm or not self._pruner_progress)

    return PrunerLM


@contextlib.contextmanager
def _quiet():
    """The harness logs every step at WARNING/INFO and draws a bar per task while it builds requests (with
    no switch for either); pruner prints its own progress and summary."""
    import lm_eval.api.task as task_module

    log, bar = logging.getLogger("lm_eval"), task_module.tqdm
    level = log.level
    log.setLevel(logging.ERROR)
    task_module.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        log.setLevel(level)
        task_module.tqdm = bar


# ---------------------------------------------------------------- loading tasks

_MANAGERS: dict[tuple, object] = {}


def _manager(paths: tuple[str, ...], defaults: bool):
    """A TaskManager over the shipped suite, `paths`, and (with `defaults`) the harness's own tasks.

    Indexing the harness's ~15,000 task YAMLs takes seconds, so managers are kept per process and the
    defaults are indexed only when a requested name is not in the local folders.
    """
    from lm_eval.tasks import TaskManager

    key = (paths, defaults)
    if key not in _MANAGERS:
        with _quiet():
            _MANAGERS[key] = TaskManager(include_path=[str(SUITE), *paths], include_defaults=defaults)
    return _MANAGERS[key]


def _check_paths(paths: tuple[str, ...]) -> None:
    for p in paths:
        folder = Path(p).expanduser()
        if not folder.is_dir():
            raise TaskError(f"evaluation.task_paths: {p} is not a folder of task YAML files")
        if not any(folder.rglob("*.yaml")):
            raise TaskError(f"evaluation.task_paths: {p} holds no .yaml task files")


def load_tasks(spec: TaskSpec) -> dict:
    """The harness's task dict ({"tasks": {name: Task}, "groups": ...}) for `spec.names`, datasets loaded.

    Unknown names and tasks whose dataset cannot be fetched (the Hub, offline) fail with one line each.
    """
    _require_harness()
    if not spec.names:
        raise TaskError("no tasks given (evaluation.tasks is empty)")
    _check_paths(spec.paths)
    manager = _manager(spec.paths, defaults=False)
    if any(n not in manager.all_tasks and not n.endswith(".yaml") for n in spec.names):
        manager = _manager(spec.paths, defaults=True)
    for name in spec.names:
        if name not in manager.all_tasks and not (name.endswith(".yaml") and Path(name).is_file()):
            near = difflib.get_close_matches(name, manager.all_tasks, n=3)
            hint = f" (did you mean {', '.join(map(repr, near))}?)" if near else ""
            raise TaskError(f"unknown task {name!r}{hint}; the shipped offline suite: {', '.join(shipped())}; "
                            "add folders of your own task YAML with evaluation.task_paths")
    loaded: dict = {"tasks": {}, "groups": {}}
    for name in spec.names:
        try:
            with _quiet():
                one = manager.load([name])
        except (ConnectionError, OSError) as e:  # datasets' offline / unreachable Hub errors are OSErrors
            first = " ".join(str(e).split()) or type(e).__name__
            raise TaskError(f"task {name!r} needs its dataset from the network, which could not be reached "
                            f"({first}); run it where the Hugging Face Hub is reachable, or use the shipped "
                            f"offline suite ({', '.join(shipped())})") from None
        loaded["tasks"].update(one["tasks"])
        loaded["groups"].update(one["groups"])
    return loaded


def shipped() -> list[str]:
    """Names of the shipped offline tasks."""
    return sorted(p.stem for p in SUITE.glob("*/*.yaml"))


def jsonl_dataset(data_files: dict[str, str], config_source: str | None = None, **_):
    """`custom_dataset` for local task YAML: JSON-lines splits, paths relative to the YAML's folder.

    The harness's own `dataset_path: json` resolves relative `data_files` against the working
    directory; shipped tasks must load from anywhere.
    """
    import datasets

    base = Path(config_source).parent if config_source else Path.cwd()
    splits = {}
    for split, name in data_files.items():
        path = Path(name) if Path(name).is_absolute() else base / name
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        splits[split] = datasets.Dataset.from_list(rows)
    return datasets.DatasetDict(splits)


# ---------------------------------------------------------------- running

def run_tasks(lm, tasks: dict, spec: TaskSpec) -> dict[str, TaskScores]:
    """Score every task on the model as it is now; {task: TaskScores} with every mean-aggregated metric."""
    from lm_eval.api.metrics import mean
    from lm_eval.evaluator import evaluate

    for task in tasks["tasks"].values():
        if spec.num_fewshot is not None and task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=spec.num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=spec.seed)  # the same few-shot examples for base and pruned
    with _quiet(), torch.no_grad():
        res = evaluate(lm=lm, task_dict=tasks, limit=spec.limit, bootstrap_iters=0, log_samples=True)
    out = {}
    for name, task in tasks["tasks"].items():
        logged = sorted(res["samples"][name], key=lambda s: (s["filter"], s["doc_id"]))
        filters = list(dict.fromkeys(s["filter"] for s in logged))
        metrics = {}
        for f in filters:
            rows = [s for s in logged if s["filter"] == f]
            for m, agg in task.aggregation().items():
                if agg is mean and rows and m in rows[0]:
                    key = m if len(filters) == 1 else f"{m},{f}"
                    metrics[key] = torch.tensor([float(s[m]) for s in rows], dtype=torch.float64)
        first = [s for s in logged if s["filter"] == filters[0]] if filters else []
        if not metrics:
            raise TaskError(f"task {name!r} has no per-document mean metric (acc, acc_norm, exact_match ...) "
                            "to compare base and pruned on")
        out[name] = TaskScores(name, tuple(s["doc_id"] for s in first), tuple(s["prompt_hash"] for s in first),
                               metrics)
    return out


@dataclass
class Harness:
    """Tasks loaded once, scored on the model as it is at each call (base once, then each scoped mask)."""

    model: object
    tokenizer: object
    spec: TaskSpec
    progress: bool = False
    tasks: dict = field(init=False)
    lm: object = field(init=False)

    def __post_init__(self):
        self.tasks = load_tasks(self.spec)
        self.lm = harness_lm(self.model, self.tokenizer, bos=self.spec.bos, batch_size=self.spec.batch_size,
                             progress=self.progress)

    def scores(self) -> dict[str, TaskScores]:
        return run_tasks(self.lm, self.tasks, self.spec)
