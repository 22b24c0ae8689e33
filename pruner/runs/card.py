"""The model card of an exported checkpoint: what was pruned and how, what it costs, how to load it."""

from __future__ import annotations

from pathlib import Path

from pruner.checkpoints import layout, modeling, saving
from pruner.core import arch, assets, runtime
from pruner.core.redact import redact
from pruner.runs import report
from pruner.runs.folders import Run

# shipped checkpoints derived from a Hub model; the from-scratch ones have no Hub base
HUB_BASE = {"minilm-causal": "sentence-transformers/all-MiniLM-L6-v2",
            "minilm": "sentence-transformers/all-MiniLM-L6-v2", "gemma-3-270m": "google/gemma-3-270m"}


def _hub_base(path: str) -> str | None:
    """The Hub id of the base model, or None for a from-scratch shipped checkpoint or a local folder."""
    if path in HUB_BASE:
        return HUB_BASE[path]
    if path in assets.CHECKPOINTS or Path(path).expanduser().exists():
        return None
    return path


def _pipeline_tag(config) -> str:
    if runtime.is_causal(config):
        return "text-generation"
    return "fill-mask" if runtime.is_masked_lm(config) else "feature-extraction"


def _gguf_text(model, saved: saving.Saved, gplan) -> str:
    counts = ", ".join(f"{a}/{b}" for a, b in zip(gplan.q_heads, gplan.kv_heads))
    how = ("every layer keeps the same heads" if gplan.arch == "llama" else
           "its layers keep different head counts, which llama.cpp's `deci` architecture reads per layer")
    proof = ("llama.cpp's greedy generation from a float32 GGUF of this model was checked against PyTorch's before "
             "this folder was written" if saved.generation else
             "llama.cpp's generation was not checked when this was written (llama-cpp-python was not installed); "
             "its structure (per-layer head counts, tensor shapes) was")
    return (f"**GGUF (llama.cpp)**: `model.gguf`, architecture `{gplan.arch}` ({how}; query/key-value heads per "
            f"layer: {counts}; head width {gplan.head_dim}), stored in {saved.dtype}, the tokenizer and its special "
            f"tokens inside; {proof}." + (f" {saved.note[0].upper()}{saved.note[1:]}." if saved.note else ""))


def _format_text(fmt: str, model, saved: saving.Saved, gplan=None) -> str:
    if fmt == "gguf":
        return _gguf_text(model, saved, gplan)
    if fmt == "onnx":
        return ("**ONNX (ONNX Runtime GenAI)**: the vanilla compact checkpoint (pruned heads physically removed; "
                f"{model.config.num_attention_heads} attention heads per layer) converted by ONNX Runtime GenAI's "
                f"model builder for the CPU in {saved.dtype}, KV cache included; its greedy generations were checked "
                "against PyTorch's before this folder was written.")
    if fmt == "dense":
        return ("**dense**: the pruned heads' output-projection columns are zero and every shape is the "
                "base model's, so it loads wherever the base loads (no memory or speed gain by itself).")
    q, kv = layout.head_counts(model)
    if saved.layout == "vanilla":
        return ("**compact**: the pruned heads are physically removed (q/k/v rows and output-projection "
                f"columns); the config says {q[0]} attention heads"
                + (f" over {kv[0]} key/value heads" if getattr(model.config, "num_key_value_heads", None) else "")
                + " per layer." + (f" It is {saved.note}." if saved.note else ""))
    counts = ", ".join(f"{a}" + (f"/{b}" if getattr(model.config, "num_key_value_heads", None) else "")
                       for a, b in zip(q, kv))
    return ("**compact, per-layer**: the pruned heads are physically removed (q/k/v rows and output-projection "
            f"columns), and no vanilla `{model.config.model_type}` config can describe the result: "
            f"{saved.why_per_layer}. `config.json` lists the heads kept in each layer "
            "(`num_attention_heads_per_layer`"
            + (", `num_key_value_heads_per_layer`" if getattr(model.config, "num_key_value_heads", None) else "")
            + f"; here {counts}) and `{modeling.file_name(model.config.model_type)}` builds each layer's "
            "attention with its own count (see How to load).")


def _load_lines(cls: str, where: str, saved: saving.Saved, model) -> list[str]:
    if saved.layout == "gguf":
        return ["```bash", f"llama-cli -m {where}/model.gguf -p \"To be\"", "```", "", "```python",
                "from llama_cpp import Llama", "", f'llm = Llama("{where}/model.gguf")',
                'print(llm("To be", max_tokens=32)["choices"][0]["text"])', "```", "",
                "llama.cpp (or what is built on it: llama-cpp-python, Ollama, LM Studio) runs it; no pruner or "
                "transformers code is needed."]
    if saved.layout == "onnx":
        return ["```python", "import onnxruntime_genai as og", "",
                f'model = og.Model("{where}")', "tokenizer = og.Tokenizer(model)",
                "params = og.GeneratorParams(model)", "params.set_search_options(max_length=64)",
                "generator = og.Generator(model, params)", 'generator.append_tokens(tokenizer.encode("To be"))',
                "while not generator.is_done():", "    generator.generate_next_token()",
                "print(tokenizer.decode(generator.get_sequence(0)))", "```", "",
                "ONNX Runtime GenAI (`pip install onnxruntime-genai`): no pruner or transformers code is needed."]
    if saved.layout != "per-layer":
        return ["```python", f"from transformers import {cls}, AutoTokenizer", "",
                f'model = {cls}.from_pretrained("{where}")',
                f'tokenizer = AutoTokenizer.from_pretrained("{where}")', "```", "",
                "Plain transformers: no pruner code is needed to load or run it."]
    file = modeling.file_name(model.config.model_type)
    lines = len(modeling.source(model.config.model_type).read_text().splitlines())
    return ["```python", f"from transformers import {cls}, AutoTokenizer", "",
            f'model = {cls}.from_pretrained("{where}", trust_remote_code=True)',
            f'tokenizer = AutoTokenizer.from_pretrained("{where}", trust_remote_code=True)  # reads the config too',
            "```", "",
            "Why `trust_remote_code=True`: this model's layers keep different numbers of attention heads (or "
            "heads the vanilla config cannot describe), so transformers needs the model code in "
            f"`{file}` ({lines} lines, next to the weights; it imports only transformers and torch). It "
            f"subclasses transformers' own {model.config.model_type} classes and changes nothing but the size of "
            "each layer's attention projections. Read it before you trust it.", "",
            "Or, with pruner installed, without running any code from this folder (pruner uses its own copy "
            "of that file):", "",
            "```python", "import pruner", "", f'model = pruner.load("{where}")', "```"]


def _base_text(path: str, base: str | None) -> str:
    if base:
        return f"[`{base}`](https://huggingface.co/{base})"
    if path in assets.CHECKPOINTS:
        return f"`{path}` (pruner's shipped checkpoint, not on the Hub)"
    return f"`{path}`"


def _compensation_text(run: Run, model) -> str:
    return {
        "mean": "`mean`: each pruned head's mean output over the calibration tokens is folded into the "
                "output-projection bias (kept in this checkpoint"
                + (", through `attention_bias: true`, which adds zero q/k/v biases" if
                   getattr(model.config, "attention_bias", False) else "") + ")",
        "refit": "`refit`: the kept heads' output-projection columns were refitted by ridge least squares on the "
                 "calibration tokens to rebuild what the pruned heads wrote"
                 + (" (the constant into the existing bias)" if run.compensation.bias else
                    " (no bias: plain weights, the architecture unchanged)"),
    }.get(run.metrics["compensation"], "`zero`: pruned heads are simply removed")


def _storage_text(run: Run, saved: saving.Saved) -> str:
    return (f"- stored in {saved.dtype}" + (" (the base checkpoint's own dtype)"
                                            if run.recipe.export.dtype == "auto" else "")
            + (f"; rounding to {saved.dtype} moves the logits by at most {saved.storage_diff:.1e} from "
               "the model pruner evaluated" if saved.storage_diff > 0 else ""))


def _what_was_pruned(run: Run, fmt: str, model, params: int, saved: saving.Saved, gplan=None) -> list[str]:
    """The card's "What was pruned and how" list, then the notes on sensitivity, base check and refit."""
    m, r = run.metrics, run.recipe
    g = arch.geometry(model)
    conv = f", {report.convention_phrase(m)}" if m["convention"] else ""
    per_layer = ", ".join(f"{k}: {v}" for k, v in run.plan["heads"].items())
    cal = r.calibration
    lines = [
        "## What was pruned and how", "",
        f"- scorer: `{m['scorer']}`{conv}; target `{r.selection.target:g}` "
        f"({r.selection.budget or 'default'} budget, GQA `{r.selection.gqa}`, shape `{r.selection.shape}`, >= {r.selection.min_heads_per_layer} head per layer)",
        f"- pruned: {m['pruned_heads']} of {m['total_heads']} heads ({g.n_layers} layers x {g.n_heads} heads); "
        f"per layer: {per_layer} (full list in `plan.json`)",
        f"- compensation: {_compensation_text(run, model)}",
        f"- format: {_format_text(fmt, model, saved, gplan)}",
        _storage_text(run, saved),
        f"- parameters: {m['params_before']:,} (base) -> {params:,} (this checkpoint)",
        f"- calibration: {cal.num_samples} {cal.unit} of {cal.length} tokens from `{', '.join(cal.sources())}`; "
        f"sinks `{m['sinks']['mode']}`", "",
    ]
    notes = [report.sensitivity_text(m), run.base_note and f"**Base model check.** {run.base_note}",
             report.refit_text(m)]
    return lines + [x for note in notes if note for x in (note, "")]


def _results(run: Run, params: int, saved: saving.Saved) -> list[str]:
    e = run.recipe.evaluation
    return [
        "## Results", "",
        f"Perplexity on {e.num_samples} {e.unit} of `{e.data}` ({e.length} tokens), paired with the unpruned "
        "model on the same windows; 95% bootstrap CI over windows. Measured with the pruned heads masked in "
        + ("memory; this ONNX model's greedy generations (ONNX Runtime GenAI, KV cache) equal PyTorch's on the same "
           "compact checkpoint." if saved.layout == "onnx" else
           "memory; this GGUF holds the compact model's tensors (read back with the gguf reader)"
           + ("; llama.cpp's greedy generations from it (float32) equal PyTorch's." if saved.generation else ".")
           if saved.layout == "gguf" else
           "memory; this checkpoint reproduces those logits: reloaded and compared with that model (rounded to the "
           "storage dtype) to 1e-5" + (", and greedy generation with the KV cache gives the same tokens"
                                       if saved.generation else "") + "."), "",
        report.result_table(run.metrics, params), "",
    ]


def model_card(run: Run, fmt: str, model, params: int, repo_id: str | None = None,
               saved: saving.Saved | None = None, gplan=None):
    """A huggingface_hub ModelCard: YAML metadata, what was pruned and how, results, recipe, loading. `gplan`:
    a GGUF export's `gguf_file.Plan`."""
    from huggingface_hub import ModelCard, ModelCardData

    m, r = run.metrics, run.recipe
    base = _hub_base(r.model.path)
    saved = saved or saving.Saved("dense" if fmt == "dense" else "vanilla", None, "float32", 0.0, 0.0, None, ())
    tags = ["pruned", "attention-head-pruning", "pruner", model.config.model_type]
    data = ModelCardData(base_model=base, library_name="gguf" if fmt == "gguf" else "transformers",
                         pipeline_tag=_pipeline_tag(model.config),
                         tags=tags + (["custom_code"] if saved.layout == "per-layer" else []))
    cls = runtime.auto_class(model.config).__name__
    title_fmt = "compact, per-layer" if saved.layout == "per-layer" else fmt
    lines = [
        f"# {r.model.path}, {m['pruned_heads']} of {m['total_heads']} attention heads pruned ({title_fmt})", "",
        f"Attention heads of {_base_text(r.model.path, base)} pruned with pruner (sink-aware attention-head "
        "pruning: heads are scored with the attention sink and the content channel separated).", "",
        *_what_was_pruned(run, fmt, model, params, saved, gplan),
        *_results(run, params, saved),
        *([report.recovery_text(m), ""] if m.get("recovery") else []),  # distilled after pruning: before/after
        "## How to load", "",
        *_load_lines(cls, repo_id or "path/to/this/folder", saved, model), "",
        "## Recipe", "",
        "The resolved pruner recipe of the run:", "",
        "```yaml", r.to_yaml().rstrip(), "```", "",
        "## Pruned heads", "", report.plan_table(run.plan), "",
    ]
    return ModelCard(redact(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)))
