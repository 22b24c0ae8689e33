"""Everything `evaluation.tasks` asks for on one model: lm-evaluation-harness tasks for causal LMs and the
shipped embedding task for encoders, scored as the model is at each call (the base once, then each plan)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from pruner.core import data
from pruner.core.runtime import forward
from pruner.evaluation.accuracy import TaskScores, paired_accuracy
from pruner.evaluation.tasks import SUITE, Harness, TaskError, TaskSpec

EMBEDDING_TASKS = ("shakespeare_speech",)


@dataclass(frozen=True)
class EmbeddingTask:
    """Triplets over a list of lines: anchor, two choices, and which choice belongs with the anchor."""

    name: str
    lines: tuple[str, ...]
    anchor: torch.Tensor   # (doc,) index into lines
    choices: torch.Tensor  # (doc, 2)
    label: torch.Tensor    # (doc,) 0 or 1


def load_embedding_task(name: str, limit: int | None = None) -> EmbeddingTask:
    """A shipped embedding task (jsonl rows {"anchor", "choices": [a, b], "label"}), first `limit` documents."""
    if name not in EMBEDDING_TASKS:
        raise TaskError(f"unknown embedding task {name!r}; valid: {', '.join(EMBEDDING_TASKS)}")
    rows = [json.loads(x) for x in (SUITE / name / f"{name}.jsonl").read_text(encoding="utf-8").splitlines() if x]
    rows = rows[:limit]
    index: dict[str, int] = {}
    for r in rows:
        for line in (r["anchor"], *r["choices"]):
            index.setdefault(line, len(index))
    return EmbeddingTask(name, tuple(index), torch.tensor([index[r["anchor"]] for r in rows]),
                         torch.tensor([[index[c] for c in r["choices"]] for r in rows]),
                         torch.tensor([r["label"] for r in rows]))


@torch.no_grad()
def pooled_embeddings(model, tokenizer, lines: tuple[str, ...], max_length: int = 64,
                      batch_size: int = 32) -> torch.Tensor:
    """Mean of the last hidden states over each line's tokens (sentence-transformers' pooling). (line, d)"""

    model.eval()
    out = []
    for i in range(0, len(lines), batch_size):
        enc = [tokenizer(x, truncation=True, max_length=max_length)["input_ids"] for x in lines[i:i + batch_size]]
        batch = data.pad(enc, pad_id=tokenizer.pad_token_id or 0)
        h = forward(model, batch.input_ids, batch.attention_mask, output_hidden_states=True).hidden_states[-1].float()
        m = batch.attention_mask[..., None].to(h)
        out.append(((h * m).sum(1) / m.sum(1)).cpu())
    return torch.cat(out)


def embedding_scores(model, tokenizer, task: EmbeddingTask, batch_size: int = 32) -> TaskScores:
    """acc per document: the choice with the higher cosine to the anchor is the labelled one."""
    emb = torch.nn.functional.normalize(pooled_embeddings(model, tokenizer, task.lines, batch_size=batch_size), dim=-1)
    cos = (emb[task.anchor][:, None, :] * emb[task.choices]).sum(-1)  # (doc, 2)
    right = cos.gather(1, task.label[:, None])[:, 0] > cos.gather(1, 1 - task.label[:, None])[:, 0]
    n = len(task.label)
    return TaskScores(task.name, tuple(range(n)), ("",) * n, {"acc": right.double()})


class Downstream:
    """Everything `evaluation.tasks` asks for on one model: harness tasks (causal LMs) and embedding tasks.

    Built before any compute, so an unknown task, a missing extra or an unreachable dataset fails
    first. `scores()` scores the model as it is at that moment: the base once, then each plan under
    its scoped mask; `paired(base, pruned)` gives the accuracy changes on the same documents.
    """

    def __init__(self, model, tokenizer, spec: TaskSpec, causal: bool, n_boot: int = 1000, progress: bool = False):
        self.model, self.tokenizer, self.spec, self.n_boot = model, tokenizer, spec, n_boot
        harness = tuple(n for n in spec.names if n not in EMBEDDING_TASKS)
        if harness and not causal:
            raise TaskError(f"tasks {list(harness)} are scored by lm-evaluation-harness, which needs a causal LM; "
                            f"for an encoder use the embedding task {', '.join(EMBEDDING_TASKS)}")
        self.embedding = [load_embedding_task(n, spec.limit) for n in spec.names if n in EMBEDDING_TASKS]
        self.harness = Harness(model, tokenizer, TaskSpec(harness, spec.paths, spec.limit, spec.num_fewshot,
                                                          spec.batch_size, spec.bos, spec.seed), progress) \
            if harness else None

    def scores(self) -> dict[str, TaskScores]:
        out = self.harness.scores() if self.harness else {}
        for task in self.embedding:
            out[task.name] = embedding_scores(self.model, self.tokenizer, task, batch_size=self.spec.batch_size)
        return out

    def paired(self, base: dict[str, TaskScores], pruned: dict[str, TaskScores]) -> dict[str, dict[str, dict]]:
        """{task: {metric: {base, pruned, delta, ci_low, ci_high, docs}}}, as metrics.json and compare.json hold."""
        out: dict[str, dict[str, dict]] = {}
        for name, b in base.items():
            for d in paired_accuracy(b, pruned[name], n_boot=self.n_boot, seed=self.spec.seed):
                out.setdefault(name, {})[d.metric] = {"base": d.base, "pruned": d.pruned, "delta": d.delta,
                                                      "ci_low": d.ci_low, "ci_high": d.ci_high, "docs": d.docs}
        return out
