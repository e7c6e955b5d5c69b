"""The NaN lab (after chapter 5): tools that find where an inf or a NaN starts, and broken
training scripts for learners to diagnose.

    nonfinite        first_nonfinite_module / first_nonfinite_grad: hooks that name the module
    broken_*.py      short training scripts that fail the way real runs do; each takes --fixed
                     for its repaired twin:  python -m mpgpt.labs.broken_clipping [--fixed]

The diagnoses are in the lab's solutions (notebooks/05b_debugging_nans.ipynb); the scripts
themselves say only what they do, as a colleague's script would.
"""
