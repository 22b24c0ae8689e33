"""What the eval scripts share: where the repository and its results are, a script run in a fresh process (and a
command timed to its end with its own peak memory), and random-weight models of the public shapes (`pruner.core.shapes`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "eval" / "results"
GIB = 2**30
# glibc serves every allocation >= 128 KiB by mmap and unmaps it on free, so resident memory follows live
# tensors: no freed-but-kept heap inflates one case's peak (with the default dynamic threshold the same case
# varied by +-300 MiB)
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def gib(n: float) -> float:
    return n / GIB


def child_env(**extra: str) -> dict[str, str]:
    """This environment for a child process that imports `eval` and `pruner` from this checkout: the repository
    first on PYTHONPATH (what was there kept: a package carried beside it), tokenizers' threads off, then `extra`."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false", **extra}


def run_module(module: str, args: list[str], env: dict | None = None, stderr=subprocess.PIPE):
    """`python -m module args` in a fresh process -- its own allocator state and memory counters -- with its
    stdout captured (and its stderr, unless `stderr=None` lets it through); `env` defaults to `child_env()`.
    A script re-runs itself as `run_module(__spec__.name, ...)`: its dotted name, also when it is `__main__`."""
    return subprocess.run([sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=stderr, text=True,
                          env=child_env() if env is None else env)


@dataclass(frozen=True)
class Finished:
    """A child process run to its end."""

    seconds: float     # wall clock, start to exit
    peak_bytes: int    # its own peak resident set (its rusage; RUSAGE_CHILDREN's would be the largest child so far)
    returncode: int
    output: str        # its stderr, with its stdout before it when `stdout=True`


def run_timed(argv: list[str], env: dict | None = None, stdout: bool = False, cwd: Path | None = ROOT) -> Finished:
    """Run `argv` to its end in `cwd` (None: this process's), timed, with its own peak memory (`os.wait4`); its
    stdout is discarded unless `stdout`. `env` defaults to `child_env()`."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        child = subprocess.Popen(argv, cwd=cwd, env=child_env() if env is None else env,
                                 stdout=log if stdout else subprocess.DEVNULL, stderr=log, text=True)
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - t0
        log.seek(0)
        return Finished(seconds, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status), log.read())


def command_line() -> str:
    """The command this process runs, as a person would type it (`python -m eval.bench.calibrate --windows 4`)."""
    main = sys.modules["__main__"]
    name = main.__spec__.name if getattr(main, "__spec__", None) else sys.argv[0]
    return " ".join(["python -m", name, *sys.argv[1:]])


def last_json(stdout: str):
    """The JSON a child printed on its last line of output."""
    return json.loads(stdout.strip().splitlines()[-1])


def random_model(name: str, dtype):
    """A causal LM of the public shape `name` with seeded normal(0, 0.02) weights, norms 1, biases 0, in `dtype`,
    eval mode, SDPA attention (transformers' own init takes minutes at 1B; this one is seeded)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from pruner.core import shapes

    config = shapes.config(name)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    finally:
        torch.set_default_dtype(default)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02, generator=g)
            else:
                p.fill_(0.0 if pname.endswith("bias") else 1.0)
    model.tie_weights()
    return model.eval()


def shipped_plays(split: str) -> list[str]:
    """The shipped plays of a split, read directly (a GPU image may lack `datasets`; every device gets these)."""
    from pruner.core import assets

    return [f.read_text() for f in sorted(assets.shakespeare(split).glob("*.txt"))]


# --------------------------------------------------------------------------- estimate against measured

def estimate_cases(module: str, specs: list[str], env: dict) -> list[dict]:
    """The record of each case from `python -m module --case SPEC`, one fresh process per case, printing the
    estimate against the measured peak as it goes; exits with the child's error on the first case that fails."""
    rows = []
    for spec in specs:
        out = run_module(module, ["--case", spec], env)
        if out.returncode:
            sys.exit(f"case {spec} failed:\n{out.stderr[-2000:]}")
        rows.append(last_json(out.stdout))
        r = rows[-1]
        print(f"{spec}: estimate {r['estimate_bytes'] / 2**20:.0f} MiB, measured {r['measured_bytes'] / 2**20:.0f} MiB",
              file=sys.stderr, flush=True)
    return rows


def write_estimates(path: str | Path, rows: list[dict], method: str) -> None:
    """The cases and how they were measured as JSON at `path`, after printing the load average they ran under."""
    load = os.getloadavg()
    print(f"\nload average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"cases": rows, "loadavg": load, "method": method}, indent=1) + "\n")


# --------------------------------------------------------------------------- recovery students

def half_heads(model) -> dict[int, list[int]]:
    """Half of every KV group's query heads (every other head without GQA) in every layer."""
    from pruner.core import arch

    g = arch.geometry(model)
    size = g.n_heads // g.n_kv_heads
    gone = [h for h in range(g.n_heads) if (h % size < size // 2 if size > 1 else h % 2)]
    return {layer: gone for layer in range(g.n_layers)}


def student_of(teacher):
    """The teacher with `half_heads` removed, in float32 and eval mode: as `pruner recover` loads a run's model."""
    import copy

    from pruner.pruning import surgery

    student = copy.deepcopy(teacher)
    surgery.remove_heads(student, half_heads(teacher))
    return student.float().eval()


def meta_models(name: str):
    """Teacher (bfloat16) and student (float32) of the public shape `name` on the meta device: shapes, no weights."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from pruner.core import shapes
    from pruner.pruning import surgery

    with torch.device("meta"):
        teacher = AutoModelForCausalLM.from_config(shapes.config(name), dtype=torch.bfloat16)
    student = copy.deepcopy(teacher)
    surgery.remove_heads(student, half_heads(teacher))
    return teacher, student.float()
