"""Train the reference checkpoints shipped in pruner/assets/models/.

    python scripts/train_reference.py all              # everything, in order (~60 min, 2 cores)
    python scripts/train_reference.py gpt2 llama       # some stages
    python scripts/train_reference.py sinks NAME...    # only measure shipped checkpoints

Stages (settings in scripts/reference.yaml, next to this file):

- `tokenizer` -- byte-level BPE on the train split, saved in Hugging Face format.
- `gpt2`, `llama` -- small causal LMs trained from scratch on the train split,
  windows starting with BOS, with trigger rules written into the training text
  (see the yaml) so that heads have a reason to be dormant: real attention sinks.
  The llama run also keeps an early and a middle checkpoint.
- `minilm_causal` -- all-MiniLM-L6-v2 loaded into `BertLMHeadModel` with
  `is_decoder=True` (causal mask), LM head tied to the word embeddings, `[CLS]`
  as BOS, fine-tuned on the train split: a causal LM with *pretrained* sinks.
- `minilm_readout` -- a masked-LM readout (transform + decoder tied to the word
  embeddings) trained on the frozen all-MiniLM-L6-v2 encoder, so masked-token
  perplexity of the real pretrained encoder can be measured.

Each checkpoint is stored in half precision with `dtype: float32` in its config,
so vanilla `from_pretrained` loads it as float32. Every stage writes
`reference.json` next to its weights: settings, perplexities and the layer x
head sink-mass table measured with eager attention on the evaluation split
(mean attention to position 0 over query positions >= 16).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import Counter
from pathlib import Path

import torch
import yaml

from pruner.attention.eager import eager_sink_mass
from pruner.core import assets
from pruner.core.data import TextSource, TokenBatch, line_samples, load_texts, token_windows

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = Path(__file__).with_name("reference.yaml")
SINK_FROM_QUERY = 16  # sink mass is measured at query positions >= this


# --------------------------------------------------------------------------- tokenizer

def train_tokenizer(cfg: dict, out: Path):
    """Byte-level BPE on the train split with BOS / EOS / PAD specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg["vocab_size"], min_frequency=cfg["min_frequency"],
                                  special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(load_texts(TextSource("shakespeare:train")), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>", model_max_length=256)
    fast.save_pretrained(out)
    return fast


def load_tokenizer(out: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(out)


# --------------------------------------------------------------------------- rules

def choose_triggers(windows: torch.Tensor, special: set[int], cfg: dict) -> list[list[int]]:
    """Disjoint trigger sets, one per rule, from consecutive frequency ranks."""
    counts = Counter(windows.flatten().tolist())
    ranked = [t for t, _ in counts.most_common() if t not in special]
    start, sets = cfg["frequency_rank_start"], []
    for rule in cfg["rules"]:
        sets.append(ranked[start:start + rule["triggers"]])
        start += rule["triggers"]
    return sets


def apply_rules(body: torch.Tensor, triggers: list[list[int]], cfg: dict) -> torch.Tensor:
    """Write the trigger rules into windows (without BOS). body: (window, pos).

    Left to right, so a rewritten token can itself be copied later:
    - backcopy: at a trigger at position i, token i+1 becomes the token at
      i - offset (when that position exists in the window);
    - induction: at a trigger seen before in the window, token i+1 becomes the
      token that followed the trigger's previous occurrence.
    """
    out = body.clone()
    backcopy, induction = {}, set()
    for rule, trig in zip(cfg["rules"], triggers):
        if rule["kind"] == "backcopy":
            backcopy.update({t: rule["offset"] for t in trig})
        elif rule["kind"] == "induction":
            induction.update(trig)
        else:
            raise ValueError(f"unknown rule kind {rule['kind']!r}")
    for row in out:
        r = row.tolist()
        seen: dict[int, int] = {}
        for i in range(len(r) - 1):
            off = backcopy.get(r[i])
            if off is not None and i - off >= 0:
                r[i + 1] = r[i - off]
            elif r[i] in induction:
                if r[i] in seen:
                    r[i + 1] = seen[r[i]]
                seen[r[i]] = r[i + 1]
        row.copy_(torch.tensor(r))
    return out


# --------------------------------------------------------------------------- measuring

@torch.no_grad()
def perplexity(model, ids: torch.Tensor, batch_size: int = 16) -> float:
    """Token-weighted perplexity of next-token prediction; position 0 is never a target."""
    model.eval()
    nll, count = 0.0, 0
    for i in range(0, len(ids), batch_size):
        x = ids[i:i + batch_size]
        logits = model(input_ids=x).logits.float()  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten(),
                                                 reduction="sum")
        nll, count = nll + loss.item(), count + x[:, 1:].numel()
    return math.exp(nll / count)


def sink_table(model, ids: torch.Tensor, batch_size: int = 8) -> list[list[float]]:
    """Mean attention to position 0 at query positions >= 16 (eager maps). Returns (layer, head) lists."""
    batch = TokenBatch(ids, torch.ones_like(ids))
    return eager_sink_mass(model, batch, sink_ids=None, from_query=SINK_FROM_QUERY,
                           batch_size=batch_size).tolist()


def sink_summary(table: list[list[float]]) -> dict:
    """The sink criterion: >= 1/3 of the heads of layers >= 1 with sink mass >= 0.3."""
    upper = [s for layer in table[1:] for s in layer]
    n_sink = sum(s >= 0.3 for s in upper)
    return {"heads_layers_ge1": len(upper), "heads_with_sink_ge_0.3": n_sink,
            "share": n_sink / max(len(upper), 1), "criterion_met": n_sink * 3 >= len(upper),
            "max": max(upper) if upper else None}


def print_table(name: str, table: list[list[float]]) -> None:
    print(f"\n{name}: sink mass (mean attention to position 0, query pos >= {SINK_FROM_QUERY})")
    print("layer | " + " ".join(f"h{h:<4d}" for h in range(len(table[0]))))
    for layer, row in enumerate(table):
        print(f"{layer:5d} | " + " ".join(f"{s:.3f}" for s in row))
    print(json.dumps(sink_summary(table)))


def save_half(model, tokenizer, out: Path, report: dict) -> None:
    """Half-precision weights, float32 in the config: vanilla loading gives float32."""
    model = model.to(torch.float16)
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    model.to(torch.float32)
    mark_float32(out)
    (out / "reference.json").write_text(json.dumps(report, indent=1))
    print(f"saved {out}")


def mark_float32(folder: Path) -> None:
    """Set config.json's dtype to float32: `from_pretrained` (dtype "auto") then upcasts the
    half-precision weights. save_pretrained writes the weights' dtype there, so it is set after."""
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- training

def lr_at(step: int, steps: int, cfg: dict) -> float:
    """Linear warmup, then cosine decay to `min_lr_ratio * lr`."""
    if step < cfg["warmup_steps"]:
        return cfg["lr"] * (step + 1) / cfg["warmup_steps"]
    progress = (step - cfg["warmup_steps"]) / max(1, steps - cfg["warmup_steps"])
    floor = cfg.get("min_lr_ratio", 0.0)
    return cfg["lr"] * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def train_loop(model, batches, steps: int, cfg: dict, on_step=None, params=None) -> None:
    """AdamW with warmup + cosine decay; no weight decay on biases and norms."""
    params = [p for p in (params or model.parameters()) if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg["lr"], betas=tuple(cfg.get("betas", (0.9, 0.999))))
    model.train()
    t0 = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, cfg)
        loss = batches(step)(model)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.get("grad_clip", 1.0))
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:5d}/{steps} loss {loss.item():.3f} lr {opt.param_groups[0]['lr']:.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)
        if on_step is not None:
            on_step(step + 1, model)
    model.eval()


def scratch_data(settings: dict, family: str, tok):
    """Train windows with rules, and evaluation windows clean and with rules."""
    cfg, rules = settings["scratch"], settings[family]["rules"]
    bos = tok.bos_token_id
    train = token_windows(tok, load_texts(TextSource("shakespeare:train")), cfg["window"]).input_ids
    special = set(tok.all_special_ids)
    triggers = choose_triggers(train[:, 1:], special, rules)
    train_body = apply_rules(train[:, 1:], triggers, rules)
    train = torch.cat([train[:, :1], train_body], dim=1)
    ev = token_windows(tok, load_texts(TextSource("shakespeare:evaluation")), cfg["window"],
                       num_samples=cfg["eval_windows"], seed=settings["seed"]).input_ids
    ev_rules = torch.cat([ev[:, :1], apply_rules(ev[:, 1:], triggers, rules)], dim=1)
    assert (train[:, 0] == bos).all()
    info = {"triggers": [[tok.decode([t]) for t in trig] for trig in triggers],
            "trigger_ids": triggers, "rules": rules,
            "train_windows": len(train), "train_tokens": train.numel()}
    return train, ev, ev_rules, info


def train_scratch(family: str, settings: dict, out_root: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    tok = load_tokenizer(out_root / "_tokenizer")
    train, ev, ev_rules, info = scratch_data(settings, family, tok)
    fam = settings[family]
    cfg = {**settings["scratch"], **{k: v for k, v in fam.items() if k in settings["scratch"]}}
    torch.manual_seed(settings["seed"])
    common = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id)
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(**fam["config"], **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**fam["config"], **common))
    model.config.use_cache = True
    print(f"{family}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"{len(train)} train windows")
    g = torch.Generator().manual_seed(settings["seed"])
    order: list[int] = []

    def batch(step: int):
        nonlocal order
        if len(order) < cfg["batch_size"]:
            order = torch.randperm(len(train), generator=g).tolist()
        idx, order = order[:cfg["batch_size"]], order[cfg["batch_size"]:]
        x = train[idx]
        return lambda m: m(input_ids=x, labels=x).loss

    def report(model, steps_done: int, seconds: float) -> dict:
        table = sink_table(model, ev)
        print_table(f"{family} @ {steps_done} steps", table)
        return {"family": family, "steps": steps_done, "train_seconds": round(seconds, 1),
                "settings": {"scratch": cfg, family: fam}, "data": info,
                "ppl_eval_clean": perplexity(model, ev), "ppl_eval_rules": perplexity(model, ev_rules),
                "sink_mass": table, "sink_summary": sink_summary(table),
                "sink_mass_rule_text": sink_table(model, ev_rules)}

    t0 = time.time()
    snapshots = {v: k for k, v in fam.get("snapshots", {}).items()}

    def on_step(step: int, m) -> None:
        if step % cfg["probe_every"] == 0 and step not in snapshots and step < fam["steps"]:
            print_table(f"{family} @ {step} steps (probe)", sink_table(m, ev))
            m.train()
        if step in snapshots:
            rep = report(m, step, time.time() - t0)
            save_half(m, tok, out_root / f"{family}-shakespeare-{snapshots[step]}", rep)
            m.train()

    train_loop(model, batch, fam["steps"], cfg, on_step=on_step)
    rep = report(model, fam["steps"], time.time() - t0)
    print(f"{family}: ppl clean {rep['ppl_eval_clean']:.2f}, rule text {rep['ppl_eval_rules']:.2f}")
    save_half(model, tok, out_root / f"{family}-shakespeare", rep)


def train_minilm_causal(settings: dict, out_root: Path) -> None:
    from transformers import AutoTokenizer, BertConfig, BertLMHeadModel

    cfg = settings["minilm_causal"]
    path = assets.minilm()
    tok = AutoTokenizer.from_pretrained(path)
    config = BertConfig.from_pretrained(path, is_decoder=True, tie_word_embeddings=True)
    torch.manual_seed(settings["seed"])
    model = BertLMHeadModel.from_pretrained(path, config=config)
    train = token_windows(tok, load_texts(TextSource("shakespeare:train")), cfg["window"]).input_ids
    ev = token_windows(tok, load_texts(TextSource("shakespeare:evaluation")), cfg["window"],
                       num_samples=cfg["eval_windows"], seed=settings["seed"]).input_ids
    before = {"sink_mass": sink_table(model, ev), "ppl_eval": perplexity(model, ev)}
    print_table("minilm causal, before fine-tuning", before["sink_mass"])
    g = torch.Generator().manual_seed(settings["seed"])

    def batch(step: int):
        x = train[torch.randint(len(train), (cfg["batch_size"],), generator=g)]
        return lambda m: m(input_ids=x, labels=x).loss

    t0 = time.time()
    train_loop(model, batch, cfg["steps"], cfg)
    table = sink_table(model, ev)
    print_table("minilm causal, fine-tuned", table)
    rep = {"base": "sentence-transformers/all-MiniLM-L6-v2", "steps": cfg["steps"],
           "train_seconds": round(time.time() - t0, 1), "settings": cfg,
           "ppl_eval": perplexity(model, ev), "sink_mass": table, "sink_summary": sink_summary(table),
           "before_finetuning": before}
    print(f"minilm causal: ppl {before['ppl_eval']:.1f} -> {rep['ppl_eval']:.2f}")
    save_half(model, tok, out_root / "minilm-causal", rep)


def train_minilm_readout(settings: dict, out_root: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from pruner.checkpoints.loading import MINILM_READOUT_FILE, TIED_READOUT_KEYS, load_minilm_mlm
    from pruner.core.data import mask_tokens

    cfg = settings["minilm_readout"]
    tok = AutoTokenizer.from_pretrained(assets.minilm())
    torch.manual_seed(settings["seed"])
    model = load_minilm_mlm(readout=None)  # encoder weights + fresh readout
    for p in model.bert.parameters():
        p.requires_grad_(False)
    train = line_samples(tok, load_texts(TextSource("shakespeare:train")), cfg["max_length"])
    ev = line_samples(tok, load_texts(TextSource("shakespeare:evaluation")), cfg["max_length"],
                      num_samples=cfg["eval_lines"], seed=settings["seed"])
    g = torch.Generator().manual_seed(settings["seed"])

    def batch(step: int):
        idx = torch.randint(len(train), (cfg["batch_size"],), generator=g)
        ids, mask = train.input_ids[idx], train.attention_mask[idx]
        x, labels = mask_tokens(ids, mask, tok, cfg["mask_prob"], g)
        return lambda m: m(input_ids=x, attention_mask=mask, labels=labels).loss

    cfg = {**cfg, "weight_decay": 0.0, "warmup_steps": 20}
    t0 = time.time()
    train_loop(model, batch, cfg["steps"], cfg, params=list(model.cls.parameters()))
    ppl = masked_perplexity(model, ev, tok, cfg["mask_prob"], settings["seed"])
    out = out_root / "minilm-mlm-readout"
    out.mkdir(parents=True, exist_ok=True)
    head = {k: v.detach().to(torch.float16).contiguous() for k, v in model.cls.state_dict().items()
            if k not in TIED_READOUT_KEYS}
    save_file(head, str(out / MINILM_READOUT_FILE))
    rep = {"base": "sentence-transformers/all-MiniLM-L6-v2 (frozen)", "settings": cfg,
           "train_seconds": round(time.time() - t0, 1), "masked_ppl_eval": ppl,
           "eval_lines": len(ev)}
    (out / "reference.json").write_text(json.dumps(rep, indent=1))
    print(f"minilm readout: masked-token perplexity on evaluation lines {ppl:.2f}")


@torch.no_grad()
def masked_perplexity(model, ev, tok, mask_prob: float, seed: int, batch_size: int = 64) -> float:
    from pruner.core.data import mask_tokens

    model.eval()
    g = torch.Generator().manual_seed(seed)
    nll, count = 0.0, 0
    for b in ev.batches(batch_size):
        x, labels = mask_tokens(b.input_ids, b.attention_mask, tok, mask_prob, g)
        logits = model(input_ids=x, attention_mask=b.attention_mask).logits.float()
        keep = labels != -100
        nll += torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum").item()
        count += int(keep.sum())
    return math.exp(nll / count)


def measure(names: list[str]) -> None:
    """Re-measure shipped checkpoints as vanilla transformers loads them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in names:
        path = assets.checkpoint(name)
        model = AutoModelForCausalLM.from_pretrained(path)
        tok = AutoTokenizer.from_pretrained(path)
        ev = token_windows(tok, load_texts(TextSource("shakespeare:evaluation")), 128,
                           num_samples=64, seed=0).input_ids
        print(f"{name}: dtype {next(model.parameters()).dtype}, ppl {perplexity(model, ev):.2f}")
        print_table(name, sink_table(model, ev))


def main() -> None:
    stages = ["tokenizer", "gpt2", "llama", "minilm_causal", "minilm_readout"]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stages", nargs="+", help=f"'all', 'sinks NAME...', or any of: {', '.join(stages)}")
    args = ap.parse_args()
    if args.stages[0] == "sinks":
        return measure(args.stages[1:])
    if args.stages[0] == "mark-float32":  # checkpoints saved before save_half set the dtype itself
        for name in args.stages[1:]:
            mark_float32(assets.checkpoint(name))
        return None
    settings = yaml.safe_load(SETTINGS.read_text())
    torch.set_num_threads(settings["threads"])
    out_root = ROOT / settings["out"]
    todo = stages if args.stages == ["all"] else args.stages
    for stage in todo:
        if stage not in stages:
            raise SystemExit(f"unknown stage {stage!r}; valid: all, sinks, {', '.join(stages)}")
        print(f"=== {stage}", flush=True)
        if stage == "tokenizer":
            train_tokenizer(settings["tokenizer"], out_root / "_tokenizer")
        elif stage in ("gpt2", "llama"):
            train_scratch(stage, settings, out_root)
        elif stage == "minilm_causal":
            train_minilm_causal(settings, out_root)
        else:
            train_minilm_readout(settings, out_root)


if __name__ == "__main__":
    main()
