"""Build pruner's offline task suite from the Shakespeare plays, deterministically.

    python eval/build_tasks.py                         # the shipped suite: evaluation plays -> pruner/assets/tasks
    python eval/build_tasks.py --split calibration --out runs/tasks-dev   # the development copy (design choices)

Every task is a folder with `<task>.yaml` (lm-evaluation-harness task config) and
`<task>.jsonl` (its documents). Design choices (context length, candidates,
frequency bands) were made on the calibration split; the shipped files are built
from the evaluation plays, which no shipped model was trained on.

- `shakespeare_cloze` -- a word removed from a line of verse; choose it among
  four words of the same frequency band (by counts on the training plays). The
  context is the speech so far; each choice is scored with the rest of its line.
- `shakespeare_speaker` -- who speaks next: the previous speeches of the scene
  with their speaker headings, then the next heading among four speakers.
- `shakespeare_scene` (encoders: pooled embeddings, not the harness) -- for a
  line, which of two other lines comes from the same scene.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pruner import assets  # noqa: E402

SEED = 15
HEADING = re.compile(r"^[A-Z][A-Z' ,\-]*[A-Z]\.$")          # a speaker heading: "KING RICHARD."
SCENE = re.compile(r"^(SCENE|Scene)\b")
WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?")
STAGE = re.compile(r"\[[^\]]*\]?")                         # [Exit], [Aside], unclosed [Enter ... lines
PER_PLAY = {"shakespeare_cloze": 150, "shakespeare_speaker": 150, "shakespeare_scene": 150}


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


def word_counts() -> Counter:
    """Lower-case word counts on the training plays: the frequency bands of the cloze distractors."""
    c: Counter = Counter()
    for p in sorted(assets.shakespeare("train").glob("*.txt")):
        c.update(w.lower() for w in WORD.findall(p.read_text(encoding="utf-8")))
    return c


def _tail(words: list[str], n: int) -> str:
    return " ".join(words[-n:])


def cloze_items(scenes: list[list[Speech]], counts: Counter, rng: random.Random, n: int,
                context_words: int = 40) -> list[dict]:
    """A lower-case word of a verse line and three same-band distractors; context = the speech up to it."""
    band = lambda w: int(math.log2(counts[w]))  # noqa: E731
    ranked = [w for w, _ in counts.most_common()]
    common = set(ranked[:100])  # function words: syntax alone picks them
    by_band: dict[int, list[str]] = {}
    for w in ranked:
        if w not in common and counts[w] >= 8 and w.isalpha() and len(w) >= 3:
            by_band.setdefault(band(w), []).append(w)
    candidates = []
    for scene in scenes:
        for sp in scene:
            for i, line in enumerate(sp.lines):
                words = line.split()
                for j, tok in enumerate(words):
                    w = tok.strip(".,;:!?-'\"()")
                    if (j >= 2 and j < len(words) - 1 and w == tok and w.islower() and w in counts
                            and w not in common and counts[w] >= 8 and len(by_band.get(band(w), [])) >= 20):
                        candidates.append((sp, i, j, w))
    items = []
    for sp, i, j, w in rng.sample(candidates, min(n, len(candidates))):
        words = sp.lines[i].split()
        before = " ".join(" ".join(sp.lines[:i]).split() + words[:j])
        after = " ".join(words[j + 1:])
        in_line = {x.strip(".,;:!?-'\"()").lower() for x in words}
        pool = [x for x in by_band[band(w)] if x != w and x not in in_line]
        choices = rng.sample(pool, 3) + [w]
        rng.shuffle(choices)
        items.append({"context": _tail(before.split(), context_words),
                      "choices": [f"{c} {after}" for c in choices], "label": choices.index(w), "answer": w})
    return items


def _speech_text(sp: Speech, max_lines: int = 3) -> str:
    return f"{sp.speaker}.\n" + "\n".join(sp.lines[-max_lines:])


def speaker_items(scenes: list[list[Speech]], rng: random.Random, n: int, previous: int = 3) -> list[dict]:
    """The next speaker heading after `previous` speeches of the scene, among four speakers of the play."""
    speakers = Counter(sp.speaker for scene in scenes for sp in scene)
    cast = [s for s, k in speakers.most_common() if k >= 3]
    candidates = [(scene, k) for scene in scenes for k in range(previous, len(scene))]
    items = []
    for scene, k in rng.sample(candidates, min(n, len(candidates))):
        true = scene[k].speaker
        in_scene = list(dict.fromkeys(sp.speaker for sp in scene if sp.speaker != true))
        pool = in_scene if len(in_scene) >= 3 else in_scene + [s for s in cast if s != true and s not in in_scene]
        choices = rng.sample(pool[:max(3, len(in_scene))], 3) + [true]
        rng.shuffle(choices)
        context = "\n\n".join(_speech_text(sp) for sp in scene[k - previous:k])
        items.append({"context": context, "choices": [f"{c}." for c in choices], "label": choices.index(true),
                      "answer": true})
    return items


def scene_items(scenes: list[list[Speech]], rng: random.Random, n: int, min_words: int = 6) -> list[dict]:
    """An anchor line, another line of its scene, and a line of another scene of the same play."""
    lines = [[ln for sp in scene for ln in sp.lines if len(ln.split()) >= min_words] for scene in scenes]
    usable = [i for i, ls in enumerate(lines) if len(ls) >= 10]
    items = []
    for _ in range(n):
        a, b = rng.sample(usable, 2)
        anchor, same = rng.sample(lines[a], 2)
        other = rng.choice(lines[b])
        first = rng.random() < 0.5
        items.append({"anchor": anchor, "choices": [same, other] if first else [other, same],
                      "label": 0 if first else 1})
    return items


YAML = {
    "shakespeare_cloze": """\
# Built by eval/build_tasks.py from the {split} plays; do not edit by hand.
# Which word was removed from this line? Four words of the same frequency band;
# each choice is scored together with the rest of its line. Chance: 0.25.
tag: shakespeare
task: shakespeare_cloze
custom_dataset: !function pruner.tasks.jsonl_dataset
dataset_kwargs:
  data_files: {{test: shakespeare_cloze.jsonl}}
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
""",
    "shakespeare_speaker": """\
# Built by eval/build_tasks.py from the {split} plays; do not edit by hand.
# Who speaks next? The previous speeches of the scene with their headings, then
# the next heading among four speakers of the play. Chance: 0.25.
tag: shakespeare
task: shakespeare_speaker
custom_dataset: !function pruner.tasks.jsonl_dataset
dataset_kwargs:
  data_files: {{test: shakespeare_speaker.jsonl}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: "\\n\\n"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""",
}


def build(split: str, out: Path) -> dict[str, int]:
    counts = word_counts()
    scenes_of = plays(split)
    made = {}
    for task, n in PER_PLAY.items():
        items = []
        for name, scenes in scenes_of.items():
            rng = random.Random(f"{SEED}:{task}:{name}")  # string seeds hash deterministically
            if task == "shakespeare_cloze":
                got = cloze_items(scenes, counts, rng, n)
            elif task == "shakespeare_speaker":
                got = speaker_items(scenes, rng, n)
            else:
                got = scene_items(scenes, rng, n)
            items += [{"play": name, **x} for x in got]
        folder = out / task
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{task}.jsonl").write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in items),
                                              encoding="utf-8")
        if task in YAML:
            (folder / f"{task}.yaml").write_text(YAML[task].format(split=split))
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
