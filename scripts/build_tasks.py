"""Build pruner's offline task suite from the Shakespeare plays, deterministically.

    python scripts/build_tasks.py                         # the shipped suite: evaluation plays -> pruner/assets/tasks
    python scripts/build_tasks.py --split calibration --out runs/tasks-dev   # the development copy (design choices)

Every task is a folder with `<task>.yaml` (lm-evaluation-harness task config) and
`<task>.jsonl` (its documents; 125 per play, in a seeded order, so any first N
documents mix the four plays). Design choices were made on the calibration split
with the shipped models; the shipped files are built from the evaluation plays,
which no shipped model was trained on. Frequency bands come from the training plays.

- `shakespeare_cloze` -- a lower-case content word removed from a line; choose it
  among four words of the same frequency band (floor(log2 count)). The context is
  the speech so far (up to 40 words); each choice is scored with the rest of its line.
- `shakespeare_recall` -- the next word, which the passage (40 words) already said
  before its last 8 words, among four same-band words; the three others do not occur
  in the passage. What a model takes from its context beyond local n-grams.
- `shakespeare_order` -- a line as written vs the same line with two adjacent words
  swapped, after the 30 words before it.
- `shakespeare_speech` (encoders: pooled embeddings, not the harness) -- the first two
  lines of a speech; which of two passages continues it: its next two lines, or two
  lines of a speech from another play.

Tried on the calibration split and dropped: "who speaks next" (the scene's last three
speeches with their headings, four speakers to choose from) was at chance for
minilm-causal (0.23) and gpt2-shakespeare (0.28; chance 0.25), though the speaker two
turns back was the answer in 78% of documents; a fully word-shuffled line was too easy
(0.98 for minilm-causal, unchanged when damaged); for the encoder, a line and another
line of its scene were near chance (0.53 against another scene of the play, 0.60
against another play).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from pruner.core import assets

ROOT = Path(__file__).resolve().parents[1]

SEED = 15
HEADING = re.compile(r"^[A-Z][A-Z' ,\-]*[A-Z]\.$")          # a speaker heading: "KING RICHARD."
SCENE = re.compile(r"^(SCENE|Scene)\b")
WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?")
STAGE = re.compile(r"\[[^\]]*\]?")                         # [Exit], [Aside], unclosed [Enter ... lines
PER_PLAY = 125  # documents per play and task: 500 per task


@dataclass
class Speech:
    speaker: str
    lines: list[str]


def parse(text: str) -> list[list[Speech]]:
    """Scenes of a play, each a list of speeches (speaker heading + its lines, stage directions removed)."""
    scenes: list[list[Speech]] = []
    speech: Speech | None = None
    in_stage = False
    for raw in text.splitlines():
        line = raw.strip()
        if SCENE.match(line):
            scenes.append([])
            speech = None
            continue
        if not scenes:
            continue
        if in_stage or line.startswith("["):
            in_stage = "]" not in line  # multi-line stage directions
            continue
        if not line:
            speech = None
            continue
        if HEADING.match(line):
            speech = Speech(line[:-1], [])
            scenes[-1].append(speech)
            continue
        line = " ".join(STAGE.sub("", line).split())
        if speech is not None and line:
            speech.lines.append(line)
    return [[s for s in scene if s.lines] for scene in scenes if scene]


def plays(split: str) -> dict[str, list[list[Speech]]]:
    return {p.stem: parse(p.read_text(encoding="utf-8")) for p in sorted(assets.shakespeare(split).glob("*.txt"))}


def word_counts() -> tuple[Counter, Counter]:
    """Word counts on the training plays, lower-cased, and of the words written in lower case (not names)."""
    every: Counter = Counter()
    lower: Counter = Counter()
    for p in sorted(assets.shakespeare("train").glob("*.txt")):
        words = WORD.findall(p.read_text(encoding="utf-8"))
        every.update(w.lower() for w in words)
        lower.update(w for w in words if w.islower())
    return every, lower


def _stream(scene: list[Speech]) -> list[tuple[str, bool]]:
    """The scene as (word, is_heading) pairs: "KING RICHARD." headings, then the speech's words."""
    out: list[tuple[str, bool]] = []
    for sp in scene:
        out.append((sp.speaker + ".", True))
        out += [(w, False) for line in sp.lines for w in line.split()]
    return out


def _bare(token: str) -> str:
    return token.strip(".,;:!?-'\"()")


class Bands:
    """Frequency bands of the training plays' words: floor(log2(count)); function words (the top 100) and
    names (words mostly written capitalised) are left out."""

    def __init__(self, counts: tuple[Counter, Counter], min_count: int = 8, min_band: int = 20):
        self.counts, lower = counts
        ranked = [w for w, _ in self.counts.most_common()]
        self.common = set(ranked[:100])
        self.members: dict[int, list[str]] = {}
        for w in ranked:  # candidates are words mostly written in lower case: no names
            if (w not in self.common and self.counts[w] >= min_count and w.isalpha() and len(w) >= 3
                    and lower[w] >= 0.8 * self.counts[w]):
                self.members.setdefault(self.band(w), []).append(w)
        self.allowed = {w for ws in self.members.values() for w in ws}
        self.min_band = min_band

    def band(self, w: str) -> int:
        return int(math.log2(self.counts[w]))

    def target(self, token: str) -> bool:
        """A lower-case content word with enough same-band neighbours to draw distractors from."""
        w = _bare(token)
        return (w == token and w in self.allowed and len(self.members[self.band(w)]) >= self.min_band)

    def distractors(self, w: str, avoid: set[str], rng: random.Random, k: int = 3) -> list[str]:
        return rng.sample([x for x in self.members[self.band(w)] if x != w and x not in avoid], k)


def _choices(true: str, others: list[str], rng: random.Random) -> tuple[list[str], int]:
    choices = others + [true]
    rng.shuffle(choices)
    return choices, choices.index(true)


def cloze_items(scenes: list[list[Speech]], bands: Bands, rng: random.Random, n: int,
                context_words: int = 40) -> list[dict]:
    """A word removed from a line: the speech up to it, then each same-band candidate + the rest of the line."""
    candidates = [(sp, i, j) for scene in scenes for sp in scene for i, line in enumerate(sp.lines)
                  for j, tok in enumerate(line.split()) if 2 <= j < len(line.split()) - 1 and bands.target(tok)]
    items = []
    for sp, i, j in rng.sample(candidates, min(n, len(candidates))):
        words = sp.lines[i].split()
        w, after = words[j], " ".join(words[j + 1:])
        before = " ".join(sp.lines[:i]).split() + words[:j]
        others = bands.distractors(w, {_bare(x).lower() for x in words}, rng)
        choices, label = _choices(w, others, rng)
        items.append({"context": " ".join(before[-context_words:]), "choices": [f"{c} {after}" for c in choices],
                      "label": label, "answer": w})
    return items


def recall_items(scenes: list[list[Speech]], bands: Bands, rng: random.Random, n: int,
                 context_words: int = 40, gap: int = 8) -> list[dict]:
    """The next word, which was said earlier in the passage (not in its last `gap` words), among four
    same-band words the passage does not contain: what the model takes from context beyond n-grams."""
    candidates = []
    for scene in scenes:
        stream = _stream(scene)
        for k in range(context_words, len(stream)):
            tok, heading = stream[k]
            if heading or not bands.target(tok):
                continue
            context = [t for t, _ in stream[k - context_words:k]]
            if tok in {_bare(t).lower() for t in context[:-gap]}:
                candidates.append((context, tok))
    items = []
    for context, w in rng.sample(candidates, min(n, len(candidates))):
        choices, label = _choices(w, bands.distractors(w, {_bare(t).lower() for t in context}, rng), rng)
        items.append({"context": " ".join(context), "choices": choices, "label": label, "answer": w})
    return items


def order_items(scenes: list[list[Speech]], rng: random.Random, n: int, context_words: int = 30,
                min_words: int = 6) -> list[dict]:
    """A line as written vs the same line with two adjacent words swapped, after the passage before it."""
    candidates = []
    for scene in scenes:
        words: list[str] = []
        for sp in scene:
            words.append(sp.speaker + ".")
            for line in sp.lines:
                lw = line.split()
                if len(lw) >= min_words and len(words) >= context_words:
                    candidates.append((words[-context_words:], lw))
                words += lw
    items = []
    for context, lw in rng.sample(candidates, min(n, len(candidates))):
        swapped = lw
        while swapped == lw:  # a swap of two equal words changes nothing: draw again
            i = rng.randrange(len(lw) - 1)
            swapped = lw[:i] + [lw[i + 1], lw[i]] + lw[i + 2:]
        choices, label = _choices(" ".join(lw), [" ".join(swapped)], rng)
        items.append({"context": " ".join(context), "choices": choices, "label": label})
    return items


def speech_items(plays_scenes: dict[str, list[list[Speech]]], play: str, rng: random.Random, n: int,
                 half: int = 2) -> list[dict]:
    """The first `half` lines of a speech; which of two passages continues it: its next `half` lines, or
    `half` consecutive lines of a speech from another play."""
    def passages(name):
        return [sp.lines for scene in plays_scenes[name] for sp in scene if len(sp.lines) >= 2 * half]

    own = passages(play)
    others = [lines for name in plays_scenes if name != play for lines in passages(name)]
    items = []
    for lines in rng.sample(own, min(n, len(own))):
        other = rng.choice(others)
        k = rng.randrange(len(other) - half + 1)
        choices, label = _choices(" ".join(lines[half:2 * half]), [" ".join(other[k:k + half])], rng)
        items.append({"anchor": " ".join(lines[:half]), "choices": choices, "label": label})
    return items


# Harness tasks: name -> (what the YAML says about it, chance). All are multiple choice.
HARNESS = {
    "shakespeare_cloze": ("Which word was removed from this line? Four words of the same frequency band;\n"
                          "# each choice is scored together with the rest of its line.", "0.25"),
    "shakespeare_recall": ("Which word comes next? It was said earlier in the passage; the three others,\n"
                           "# of the same frequency band, were not.", "0.25"),
    "shakespeare_order": ("Which is the line as written: the line, or the line with two adjacent words\n"
                          "# swapped?", "0.5"),
}
TEMPLATE = """\
# Built by scripts/build_tasks.py from the {split} plays; do not edit by hand.
# {about} Chance: {chance}.
tag: shakespeare
task: {task}
custom_dataset: !function pruner.evaluation.tasks.jsonl_dataset
dataset_kwargs:
  data_files: {{test: {task}.jsonl}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def build(split: str, out: Path, per_play: int = PER_PLAY) -> dict[str, int]:
    """Every task's documents (`per_play` from each play, in a seeded order) and YAML, into `out/<task>/`."""
    bands = Bands(word_counts())
    scenes_of = plays(split)
    made = {}
    for task in (*HARNESS, "shakespeare_speech"):
        items = []
        for name, scenes in scenes_of.items():
            rng = random.Random(f"{SEED}:{task}:{name}")  # string seeds hash deterministically
            got = {"shakespeare_cloze": lambda: cloze_items(scenes, bands, rng, per_play),
                   "shakespeare_recall": lambda: recall_items(scenes, bands, rng, per_play),
                   "shakespeare_order": lambda: order_items(scenes, rng, per_play),
                   "shakespeare_speech": lambda: speech_items(scenes_of, name, rng, per_play)}[task]()
            items += [{"play": name, **x} for x in got]
        random.Random(f"{SEED}:{task}").shuffle(items)  # any first N documents mix the plays
        folder = out / task
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{task}.jsonl").write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in items),
                                              encoding="utf-8")
        if task in HARNESS:
            about, chance = HARNESS[task]
            (folder / f"{task}.yaml").write_text(TEMPLATE.format(split=split, about=about, chance=chance, task=task))
        made[task] = len(items)
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", default="evaluation", choices=("calibration", "evaluation"))
    ap.add_argument("--out", default=None, help="output folder (default: pruner/assets/tasks for the evaluation split)")
    args = ap.parse_args()
    if args.out is None and args.split != "evaluation":
        ap.error("only the evaluation split is shipped; give --out for a development copy")
    out = Path(args.out) if args.out else assets.ASSETS / "tasks"
    for task, n in build(args.split, out).items():
        print(f"{task}: {n} documents -> {out / task}")


if __name__ == "__main__":
    main()
