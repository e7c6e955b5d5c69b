"""Execute the chapters as if on another GPU: a T4, an A100 or an L4, on the GPU this machine has.

The package asks every hardware question through `mpgpt.runtime` (capability, name, memory), so
this harness patches those three in each notebook kernel — and nothing that Triton's compiler
reads: patching torch.cuda.get_device_capability process-wide would make Triton build code for
the simulated GPU, which the real one cannot run. The kernel is also held to the simulated card's
memory with torch.cuda.set_per_process_memory_fraction, so a batch too large for a 15 GiB T4
fails here as it would there.

Each chapter runs top to bottom, copied into an empty folder. The harness records per chapter:
the wall time, the first error (if any), and every torch.autocast entered on CUDA with its dtype
(on a T4, bf16 would be emulated: the course must choose fp16 there).

Usage (on a GPU machine, from the repository root):
    python scripts/rehearse_runtime.py --profile t4 --out rehearsal-t4.json [notebooks/*.ipynb]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
PROFILES = {  # name, compute capability, memory in GiB (the usable memory of the common cards)
    "t4": ("Tesla T4", (7, 5), 15.0),
    "a100": ("NVIDIA A100-SXM4-40GB", (8, 0), 39.4),
    "l4": ("NVIDIA L4", (8, 9), 22.0),
    "h200": (None, None, None),  # the real device, unpatched: the baseline
}

# Runs first in the kernel (through a sitecustomize.py on its PYTHONPATH).
SITE = textwrap.dedent('''
    import json, os
    _profile = json.loads(os.environ["MPGPT_REHEARSE"])
    if _profile["capability"] is not None:
        import torch
        from mpgpt import runtime
        _real_cap, _real_name, _real_mem = runtime.capability, runtime.device_name, runtime.total_memory
        _fake_mem = int(_profile["memory_gib"] * 2**30)

        def capability(device=None):
            return None if _real_cap(device) is None else tuple(_profile["capability"])

        def device_name(device=None):
            return "CPU" if _real_cap(device) is None else _profile["name"]

        def total_memory(device=None):
            return None if _real_mem(device) is None else _fake_mem

        runtime.capability, runtime.device_name, runtime.total_memory = capability, device_name, total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, _fake_mem / _real_mem(0)), 0)

    import torch
    _log = os.environ["MPGPT_REHEARSE_LOG"]
    _init = torch.amp.autocast_mode.autocast.__init__

    def _logged_init(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        if enabled and device_type == "cuda":
            with open(_log, "a") as f:
                f.write(str(dtype or torch.get_autocast_dtype("cuda")) + "\\n")
        _init(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    torch.amp.autocast_mode.autocast.__init__ = _logged_init
''')


def run_chapter(path: Path, profile: str, work: Path) -> dict:
    name, cc, mem = PROFILES[profile]
    site = work / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITE)
    folder = work / path.stem
    folder.mkdir()
    copy = folder / path.name
    shutil.copy(path, copy)
    log = folder / "autocast.log"
    os.environ.update(MPGPT_REHEARSE=json.dumps({"name": name, "capability": cc, "memory_gib": mem}),
                      MPGPT_REHEARSE_LOG=str(log),
                      PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.read(copy, as_version=4)
    start = time.perf_counter()
    error = None
    try:
        NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(folder)}}).execute()
    except Exception as exc:  # the first failing cell: recorded, and the next chapter runs
        import traceback
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else ''}"
        error += " | " + " / ".join(traceback.format_exc().strip().splitlines()[-4:])[:600]
    wall = time.perf_counter() - start
    dtypes = log.read_text().split() if log.exists() else []
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    return {"chapter": path.name, "wall_s": round(wall, 1), "error": error,
            "cuda_autocast": {d: dtypes.count(d) for d in sorted(set(dtypes))},
            "says_fp16_instead": "no bf16 tensor cores" in text}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=PROFILES, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("notebooks", nargs="*", type=Path)
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb"))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    import torch
    record = {"profile": args.profile, "simulated": PROFILES[args.profile][0] or torch.cuda.get_device_name(0),
              "real_gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "chapters": []}
    with tempfile.TemporaryDirectory() as tmp:
        for path in paths:
            row = run_chapter(path.resolve(), args.profile, Path(tmp))
            record["chapters"].append(row)
            args.out.write_text(json.dumps(record, indent=1))  # after each chapter: a cut-off run keeps its rows
            print(f"[{args.profile}] {row['chapter']}: {row['wall_s']} s, "
                  f"{'ok' if row['error'] is None else row['error']}, cuda autocast {row['cuda_autocast']}", flush=True)
    return 0 if all(r["error"] is None for r in record["chapters"]) else 1


if __name__ == "__main__":
    sys.exit(main())
