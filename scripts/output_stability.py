"""Which checked notebook outputs depend on the CPU? Execute the chapters under several CPU settings
and compare every checked cell (tagged `nbval-check-output`) with the committed output.

    python scripts/output_stability.py                       # all chapters, the default variants
    python scripts/output_stability.py notebooks/04_*.ipynb --variant ATEN_CPU_CAPABILITY=default
    python scripts/output_stability.py --perturb 1 --perturb 2   # seeded ulp-sized perturbations

A checked cell must print the same text on every CPU, BLAS build and thread count that a learner
or a CI machine might have. PyTorch picks its vectorised CPU kernels at run time (AVX-512, AVX2 or
plain C++); each sums in a different order, so the last bits of a reduction differ between
machines. `ATEN_CPU_CAPABILITY=default` forces the plain kernels here, which reorders the sums the
way another CPU would; a thread count of 1 or 2 splits the work differently again. A cell whose
text changes under any variant prints something the CPU decides, not the code.

The settings available on one machine cover only its own CPU's alternatives: an AMD CPU cannot
run an AVX-512 FP16 or AMX kernel. `--perturb SEED` covers the rest: it executes the chapters with
every matrix product and reduction moved by a few ulps (scripts/perturb.py), seeded, which is what a
different summation order does on any CPU. A checked cell that moves under it holds by luck.

Each variant runs in its own kernel environment (the variables are set before torch starts). The
report lists, per variant, the checked cells whose text differs from the committed output; the
exit status is 1 if any does.
"""
from __future__ import annotations

import argparse
import difflib
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
MARKER = "NBVAL_CHECK_OUTPUT"  # the old comment form; the tag is what the chapters use
DEFAULT_VARIANTS = [
    "ATEN_CPU_CAPABILITY=default,OMP_NUM_THREADS=1",
    "OMP_NUM_THREADS=2",
]


def is_checked(cell) -> bool:
    return cell.cell_type == "code" and (MARKER in cell.source or "nbval-check-output" in cell.metadata.get("tags", []))


def text_of(cell) -> str:
    """The cell's outputs as nbval compares them: streams joined, plain-text results, errors."""
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            parts.append(out.get("data", {}).get("text/plain", ""))
        elif out.output_type == "error":
            parts.append(f"{out.ename}: {out.evalue}")
    return "".join(parts)


def parse_variant(spec: str) -> dict:
    env = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        env[key.strip()] = value.strip()
    return env


PERTURB = "MPGPT_PERTURB_SEED"  # set by --perturb: the kernel installs scripts/perturb.py first
PERTURB_WIDE = "MPGPT_PERTURB_WIDE"  # set by --perturb-wide: 16-bit results moved by their own ulps


def execute(path: Path, env: dict) -> nbformat.NotebookNode:
    """Run the notebook in a child process whose environment has `env` added (the kernel inherits it)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / path.name
        subprocess.run([sys.executable, __file__, "--execute-one", str(path), str(out)],
                       env={**os.environ, **env}, check=True)
        return nbformat.read(out, as_version=4)


def execute_one(path: Path, out: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    seed = os.environ.get(PERTURB)
    if seed is not None:  # a first cell, removed again below, installs the perturbation in the kernel
        nb.cells.insert(0, nbformat.v4.new_code_cell(
            f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import perturb; "
            f"perturb.enable(seed={int(seed)}, wide={os.environ.get(PERTURB_WIDE) == '1'})"))
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    if seed is not None:
        nb.cells.pop(0)
    nbformat.write(nb, out)


def compare(path: Path, spec: str) -> list[str]:
    committed = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    try:
        ran = execute(path, parse_variant(spec))
    except subprocess.CalledProcessError:
        line = f"{path.name} failed to execute under {spec} (its traceback is above)"
        print(line, flush=True)
        return [line]
    lines = []
    for index, (old, new) in enumerate(zip(committed.cells, ran.cells)):
        if not is_checked(old):
            continue
        a, b = text_of(old), text_of(new)
        if a != b:
            diff = difflib.unified_diff(a.splitlines(), b.splitlines(), "committed", spec, lineterm="", n=0)
            lines.append(f"{path.name} cell {index} differs under {spec}:\n  " + "\n  ".join(diff))
    print(f"{path.name} [{spec}]: {time.perf_counter() - start:.0f} s, {len(lines)} checked cell(s) differ",
          flush=True)
    for line in lines:
        print(line, flush=True)
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="notebooks to execute (default: every chapter in notebooks/)")
    parser.add_argument("--variant", action="append",
                        help="comma-separated VAR=VALUE settings for one run (repeatable); "
                             f"default: {' and '.join(DEFAULT_VARIANTS)}")
    parser.add_argument("--perturb", action="append", type=int, metavar="SEED",
                        help="a variant with every product and reduction moved by up to 2 ulps, seeded "
                             "(repeatable; scripts/perturb.py)")
    parser.add_argument("--perturb-wide", action="append", type=int, metavar="SEED",
                        help="the same with bf16/fp16 results moved by their own ulps, as a CPU with native "
                             "fp16 arithmetic might (harsher; for claims about training runs)")
    parser.add_argument("--jobs", type=int, default=2, help="notebooks executed at once (default 2)")
    parser.add_argument("--execute-one", nargs=2, type=Path, metavar=("NOTEBOOK", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.execute_one:
        execute_one(*args.execute_one)
        return 0
    notebooks = args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb"))
    variants = list(args.variant or [])
    variants += [f"{PERTURB}={seed}" for seed in args.perturb or []]
    variants += [f"{PERTURB}={seed},{PERTURB_WIDE}=1" for seed in args.perturb_wide or []]
    variants = variants or DEFAULT_VARIANTS
    jobs = [(nb, v) for v in variants for nb in notebooks]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        found = [line for lines in pool.map(lambda job: compare(*job), jobs) for line in lines]
    print(f"{len(found)} difference(s)" if found else "every checked cell printed its committed output under every variant")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
