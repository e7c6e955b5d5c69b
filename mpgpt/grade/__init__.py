"""The student edition's grader: ``python -m mpgpt.grade <component> <path/to/file.py>`` (chapters 1, 5, 6, lab).

A learner gets a stub for a component (``python -m mpgpt.grade --stub ch5-scaler -o my_scaler.py``),
fills it in, and grades it. The grader prints one line per behaviour, PASS or FAIL, with a hint
chosen by what went wrong, and exits non-zero if anything failed. It never shows reference code:
the checks compare behaviour with torch or with known answers, and they live inside the package, so
a wheel install grades as well as a checkout does. The learner's file runs in a child process with
limits; the expected results are computed, and the verdict decided, in the grader's own process.

    core        Check (prepare, observe, judge), Outcome, grade() in one process for trusted code
    sandbox     grade_file(): the child process, its limits, the verdict from the data it returns
    child       the child process: imports the learner's file and observes it
    guard       what the file may do in the child (an audit hook), and whether it uses the package
    rounding    ch1-rounding    fp32 -> fp16/bf16 round-to-nearest-even on bit patterns
    scaler      ch5-scaler      the dynamic loss scaler, against torch.amp.GradScaler
    matmul      ch6-matmul      the tiled Triton matmul (interpreter on a CPU)
    nonfinite   lab-nans-hooks  forward hooks that name the first module with an inf/NaN output

Component modules are imported when graded, so ``--list`` stays fast (Triton is imported only by
ch6-matmul).
"""
from __future__ import annotations

import importlib

# component name -> (module of this package that grades it, one line for --list)
COMPONENTS = {
    "ch1-rounding": ("rounding", "round an fp32 bit pattern to fp16/bf16, nearest-even, bit by bit (chapter 1)"),
    "ch5-scaler": ("scaler", "the dynamic loss scaler: skip, back off, grow, unscale once, resume (chapter 5)"),
    "ch6-matmul": ("matmul", "a tiled Triton matmul: masks, strides, fp32 accumulation (chapter 6)"),
    "lab-nans-hooks": ("nonfinite", "forward hooks that name the first module with an inf/NaN output (NaN lab)"),
}

__all__ = ["COMPONENTS", "component"]


def component(name: str):
    """The module that grades ``name`` (NAME, STUB, checks())."""
    if name not in COMPONENTS:
        raise ValueError(f"unknown component {name!r}; choose one of {', '.join(COMPONENTS)} "
                         "(python -m mpgpt.grade --list)")
    return importlib.import_module(f"mpgpt.grade.{COMPONENTS[name][0]}")
