"""Benchmark results: the one module that knows their schema and where they live.

A result is a JSON object ``{"environment": {...}, **payload}``. The environment says where and when
the numbers were made: GPU (or CPU), driver, CUDA, torch and triton versions, the date, the
command line and the code commit. Two kinds of results exist:

* **New runs** (``python -m mpgpt.bench ...``) go to ``--out-dir``, by default the current
  folder, as ``<kind>_<machine>_<date>[_<tag>].json``. Nothing is ever written into the package.
* **Curated records** ship inside the package (``mpgpt/records/*.json``, package data), so a chapter
  shows the same numbers from a repository checkout, an editable install or a wheel installed on
  Colab. They are loaded by name (``load_record("kernels-h200")``), never by searching a folder,
  so a stray file cannot change what the book says. ``RECORDS`` lists them with what each holds;
  ``benchmarks/README.md`` maps every number the book quotes to its record.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import re
import subprocess
from pathlib import Path

import torch

RECORDS_DIR = Path(__file__).resolve().parent / "records"

# name -> what the record holds (and the chapter that shows it)
RECORDS = {
    "kernels-h200": "Triton matmul kernels against cuBLAS, fused bias+GELU, TritonLinear (chapter 6)",
    "train-h200": "GPT-2 small training ladder in one run: 15 configurations, largest batch, a real run (chapters 3, 5, 7)",
    "scaler-overhead-cpu": "DynamicLossScaler against torch.amp.GradScaler, step time on 2 CPU cores (chapter 5)",
    "scaler-overhead-h200": "DynamicLossScaler against torch.amp.GradScaler, step time on an H200 (chapter 5)",
    "ddp-h200x2": "DDP and FSDP2 on 1 and 2 H200s: tokens/s and scaling efficiency (chapter 8)",
    "ddp-h200x2-variants": "DDP bucket sizes and compiled graphs on 2 H200s, one recording per run (chapter 8)",
    "train-peers-graph-h200": "the last rungs with the step recorded as a CUDA graph, beside llm.c and nanoGPT's bench.py, in one run, with a repeat run's times (chapter 7)",
    "train-peers-optim16-h200": "the step with the model held in bf16 and the package's fused 16-bit AdamW (llm.c's storage), with and without biases, against the step before it and the O2 recipe, beside llm.c and nanoGPT's bench.py in one run (chapter 7)",
    "kernels-graph-h200": "kernel='auto' and TritonLinear forward + backward against cuBLAS, timed by do_bench and as replayed CUDA graphs, two runs started separately (chapters 6, 7)",
    "train-ladder-h200": "chapter 7's compiled ladder in one run, rung by rung, and the rows read against their twins (chapter 7)",
    "fp8-h200": "fp8 GEMMs, Fp8Linear against bf16 nn.Linear per layer shape, long-K accumulation (chapter 9)",
    "fp8-training-h200": "GPT-2 small, 2000 steps: bf16 (two seeds) against fp8 in the output layer and in every linear layer (chapter 9)",
    "fp8-cast-h200": "the fused fp8 cast against the eager one, alone and inside one Fp8Linear step (chapter 9)",
    "optim16-h200": "one AdamW step at GPT-2 small's size: the fused 16-bit variants against torch's fused AdamW (chapter 10)",
    "optim16-training-h200": "GPT-2 small, 1000 steps with each optimizer-storage variant (chapter 10)",
    "optim16-long-h200": "GPT-2 small, 3000 steps with every optimizer-storage variant, three runs sharing the GPU (chapter 10)",
    "lab-gpu-h200": "the NaN lab on a GPU: hidden syncs, the grader's compiled checks, the scripts' times (the NaN lab)",
    "kernels-fused-backward-h200": "the head merge in one launch and the first one-pass LayerNorm backward against Inductor (chapter 7)",
    "kernels-grads-h200": "the gradient products on cuBLAS, the TMA, warp-specialised and stream-K kernels, TritonLinear with its gradients on each, GELU's and LayerNorm's backward sweeps, and kernel='auto' (chapters 6, 7)",
    "kernels-layer-norm-one-sum-h200": "the one-pass LayerNorm backward with one last sum for its weight and bias gradients, ten tile sizes (chapter 7)",
    "train-peers-final-h200": "the fastest steps with and without biases and bf16+compile, beside llm.c and nanoGPT's bench.py in one run (chapter 7)",
    "train-profile-h200": "a profile of the fastest compiled step with biases, and the same step with max-autotune (chapter 7)",
    "train-triton-gelu-h200": "the optim16 step with mlp.c_fc as a Triton matmul with GELU in its epilogue, between two runs of the step without it, with a profile (chapter 7)",
    "train-triton-gelu-ws-h100": "the same pair after TritonLinear's GELU forward moved to the warp-specialised kernel, two runs, on an H100 (chapter 7)",
    "train-triton-profile-h100": "the same pair profiled, each matrix product's device time by shape, and the host's time per step, one run, on an H100 (chapter 7)",
    "train-tuning-h200": "the fused classifier and the clip in the optimizer, one run; its coordinate-descent row reran the previous row's kernels (chapter 7)",
}


_NAME = r"[A-Za-z0-9][A-Za-z0-9.-]*"


def check_tag(tag: str) -> str:
    """A --tag value as it may appear in a file name; argparse's ``type=`` for the benchmarks, so a
    bad tag is refused before a long run rather than after it."""
    if not re.fullmatch(_NAME, tag):
        raise ValueError(f"tag {tag!r} may hold letters, digits, '.' and '-' only")
    return tag


def load_record(name: str) -> dict:
    """A curated record shipped with the package, by name (see RECORDS)."""
    if name not in RECORDS:
        raise KeyError(f"no curated record {name!r}; the records are: {', '.join(RECORDS)}")
    return json.loads((RECORDS_DIR / f"{name}.json").read_text(encoding="utf-8"))


def load_result(path) -> dict:
    """A result file written by a benchmark run (for example your own, from ``--out-dir``)."""
    path = Path(path)
    result = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(result, dict) or "environment" not in result:
        raise ValueError(f"{path} is not an mpgpt result (no 'environment'); pass a file a benchmark wrote")
    return result


def describe(result: dict, date: bool = True) -> str:
    """One line: where a result was measured (GPU or CPU and software versions) and, unless
    ``date=False``, when. The chapters pass ``date=False``: a learner needs the hardware and the
    versions; the date stays in the record."""
    env = result.get("environment", {})
    where = env.get("gpu") or env.get("device_name") or env.get("cpu") or "CPU"
    versions = ", ".join(f"{k} {env[k]}" for k in ("driver", "cuda", "torch", "triton") if env.get(k))
    cap = f" ({env['capability']})" if env.get("capability") else ""
    when = f", {str(env.get('date', '?'))[:10]}" if date else ""
    return f"{where}{cap}, {versions}{when}"


def code_commit() -> str | None:
    """The commit of the code that runs: MPGPT_COMMIT if set, else git's HEAD if the package sits in
    a checkout, else None (a wheel records its version instead)."""
    if os.environ.get("MPGPT_COMMIT"):
        return os.environ["MPGPT_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--", "mpgpt"],
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = head.stdout.strip()
    # Uncommitted changes to the package: the numbers came from code that no commit holds.
    return (commit + "-dirty" if status.stdout.strip() else commit) or None


def environment(command: str | None = None) -> dict:
    """Hardware and software versions for a result record."""
    from mpgpt import __version__

    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command if command is not None else "(called from Python, not a command line)",
        "commit": code_commit(),
        "mpgpt": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=torch.cuda.get_device_name(0), gpu_count=torch.cuda.device_count(),
                   capability=f"sm_{major}{minor}", multiprocessors=props.multi_processor_count,
                   driver=_driver_version())
    return env


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_slug(env: dict) -> str:
    """'nvidia-h200' or 'cpu': the machine part of a result's file name."""
    return re.sub(r"[^a-z0-9]+", "-", (env.get("gpu") or "cpu").lower()).strip("-")


def check_out_dir(out_dir=None) -> Path:
    """Make ``out_dir`` (default: the current folder) and prove a result file can be written there:
    the benchmarks call it before they measure anything, so a run never ends with nowhere to write."""
    out = Path(out_dir) if out_dir is not None else Path.cwd()
    if out.is_symlink() and not out.exists():
        raise ValueError(f"--out-dir {out} is a broken symbolic link; remove it or pass another folder")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out-dir {out} is a file, not a folder; pass a folder for the result")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".probe-{os.getpid()}.tmp"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--out-dir {out} cannot hold the result ({e.strerror or e}); pass a folder you can "
                         "write to") from None
    return out


def _json_safe(value):
    """``value`` with every float that JSON cannot hold (nan, inf) replaced by None (null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_result(kind: str, payload: dict, out_dir=None, tag: str | None = None, command: str | None = None,
                 environment_extra: dict | None = None) -> Path:
    """Write ``{environment, **payload}`` to ``<out_dir>/<kind>_<machine>_<date>[_<tag>].json``.

    ``out_dir`` defaults to the current folder; ``environment_extra`` adds facts about the machine
    (say the CPU model) to the environment. The file is written whole or not at all (a temporary
    file, then a rename), and an existing file of the same name is replaced. The environment is the
    result's provenance, so a payload may not hold a key of that name; a number JSON cannot hold
    (nan, inf: a failed measurement) is written as null, so the file stays standard JSON."""
    if not re.fullmatch(_NAME, kind) or (tag is not None and not re.fullmatch(_NAME, tag)):
        raise ValueError(f"kind and tag may hold letters, digits, '.' and '-' only; got {kind!r}, {tag!r}")
    if "environment" in payload:
        raise ValueError("the payload has a key 'environment', which would replace the result's provenance; "
                         "rename it (environment_extra adds facts to the environment)")
    env = {**environment(command), **(environment_extra or {})}
    out = check_out_dir(out_dir)
    name = f"{kind}_{machine_slug(env)}_{env['date'][:10]}" + (f"_{tag}" if tag else "") + ".json"
    path = out / name
    tmp = path.with_name(f".{name}.tmp")
    text = json.dumps(_json_safe({"environment": env, **payload}), indent=2, allow_nan=False) + "\n"
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


# The records no chapter loads stay in the repository, outside the wheel (benchmarks/README.md).
REPOSITORY_RECORDS_DIR = RECORDS_DIR.parents[1] / "benchmarks" / "records"


def find_record(name: str) -> dict | None:
    """A record by name: one shipped with the package, else one in a repository checkout's
    benchmarks/records; None where this copy of the package has neither (a wheel)."""
    if name in RECORDS:
        return load_record(name)
    path = REPOSITORY_RECORDS_DIR / f"{name}.json"
    return load_result(path) if re.fullmatch(_NAME, name) and path.is_file() else None
