"""Repository-wide pytest setup, loaded for both tests/ and notebooks/ (nbval).

Under pytest-xdist each worker gets one CPU thread: two workers that each spin two OpenMP threads on
a 2-core machine slow small-tensor work down by more than 10x (measured: a tiny-GPT step took
0.96 s instead of 0.044 s). The environment variable also reaches the notebook kernels nbval starts.
"""
import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
