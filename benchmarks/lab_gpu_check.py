"""The NaN lab and the grader on a GPU: hidden syncs, the grader's compiled path, the scripts' times.

    python benchmarks/lab_gpu_check.py [--out-dir DIR] [--tag TAG]

Needs a CUDA GPU (on a CPU it says so and exits with status 2). Three parts, about a minute in all:

1. ``torch.cuda.set_sync_debug_mode("warn")`` around one fp16 training step of the course GPT: how
   many synchronizing operations PyTorch warns about in the scaler's ``step()`` and ``update()``
   with mpgpt's DynamicLossScaler and an ordinary AdamW, with a fused AdamW, and with
   torch.amp.GradScaler, and for one host-side ``isfinite`` check; with the first warning's text.
2. ``python -m mpgpt.grade``'s checks run on the package's own implementations, with the Triton
   kernel compiled (not interpreted): every behaviour must pass on the GPU too.
3. The wall time of each broken script of the lab, as written and with ``--fixed``, and its last line.

Writes ``lab-gpu_<machine>_<date>[_<tag>].json`` into ``--out-dir`` (default: the current folder)
through mpgpt.results.write_result (GPU, driver, torch and triton versions, date, command, commit).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import shlex
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

if importlib.util.find_spec("mpgpt") is None:  # not installed: run from a checkout as it is
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpgpt.grade import COMPONENTS, component  # noqa: E402
from mpgpt.grade.core import grade, load_module  # noqa: E402
from mpgpt.results import check_tag, write_result  # noqa: E402

# The package's own implementation behind each component's interface (mpgpt.grade.reference).
from mpgpt.grade.reference import REFERENCE as OWN  # noqa: E402
SCRIPTS = ("broken_clipping", "broken_resume", "broken_mask", "broken_adam_eps")


def sync_messages(caught) -> list[str]:
    """The first lines of the synchronisation warnings among caught warnings."""
    return [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()
            and "prototype" not in str(w.message).lower()]


def count_syncs(fn) -> tuple[int, list[str]]:
    """Run fn() with sync debug mode "warn"; (number of sync warnings, their first lines)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            torch.cuda.synchronize()  # not itself reported: it is an explicit wait
        finally:
            torch.cuda.set_sync_debug_mode("default")
    messages = sync_messages(caught)
    return len(messages), messages[:1]


def sync_part() -> dict:
    from mpgpt.data import TextDataset, default_corpus
    from mpgpt.model import GPT, GPTConfig
    from mpgpt.scaling import DynamicLossScaler

    data = TextDataset(default_corpus())
    x, y = data.get_batch("train", 8, 64, generator=torch.Generator().manual_seed(0), device="cuda")
    rows = {}
    setups = {
        "DynamicLossScaler, AdamW": (lambda: DynamicLossScaler(), {}),
        "DynamicLossScaler, AdamW(fused=True)": (lambda: DynamicLossScaler(), {"fused": True}),
        "torch.amp.GradScaler, AdamW": (lambda: torch.amp.GradScaler("cuda"), {}),
    }
    for name, (make_scaler, opt_kw) in setups.items():
        torch.manual_seed(0)
        model = GPT(GPTConfig.preset("tiny", vocab_size=data.tokenizer.vocab_size)).cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **opt_kw)
        scaler = make_scaler()
        for _ in range(2):  # the second step is measured: the first creates state and compiles nothing odd
            with torch.autocast("cuda", dtype=torch.float16):
                _, loss = model(x, y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            count, first = count_syncs(lambda: (scaler.step(optimizer), scaler.update()))
        rows[name] = {"syncs_in_step_and_update": count, "first_warning": first}
    w = torch.randn(1000, device="cuda")
    count, first = count_syncs(lambda: bool(torch.isfinite(w).all()))
    rows["bool(torch.isfinite(t).all())"] = {"syncs": count, "first_warning": first}
    return rows


def grade_part() -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in COMPONENTS:
            path = Path(tmp) / f"own_{name.replace('-', '_')}.py"
            path.write_text(OWN[name], encoding="utf-8")
            start = time.perf_counter()
            outcomes = grade(component(name).checks(), load_module(path))
            out[name] = {"seconds": round(time.perf_counter() - start, 2),
                         "failed": [o.line() for o in outcomes if not o.passed],
                         "behaviours": len(outcomes)}
    return out


def scripts_part() -> dict:
    out = {}
    for name in SCRIPTS:
        module = importlib.import_module(f"mpgpt.labs.{name}")
        for args in ([], ["--fixed"]):
            buffer = io.StringIO()
            start = time.perf_counter()
            with contextlib.redirect_stdout(buffer):
                try:
                    module.main(args)
                except SystemExit as stop:
                    print(stop.code)
            lines = buffer.getvalue().splitlines()
            out[" ".join([name, *args])] = {"seconds": round(time.perf_counter() - start, 2),
                                            "last_line": lines[-1] if lines else ""}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=None, help="folder for the JSON record (default: current folder)")
    parser.add_argument("--tag", type=check_tag, default=None, help="added to the file name")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("lab_gpu_check: needs a CUDA GPU (set_sync_debug_mode and the compiled kernel); run it on one",
              file=sys.stderr)
        return 2
    payload = {"syncs": sync_part(), "grade": grade_part(), "scripts": scripts_part()}
    for part, rows in payload.items():
        print(f"[{part}]")
        for key, value in rows.items():
            print(f"  {key}: {value}")
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    path = write_result("lab-gpu", payload, out_dir=args.out_dir, tag=args.tag, command=command)
    failed = [n for n, r in payload["grade"].items() if r["failed"]]
    print(f"wrote {path}" + (f"; grader FAILED on the package's own {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
