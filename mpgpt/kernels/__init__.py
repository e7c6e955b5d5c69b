"""The teaching kernels (chapters 6, 9, 10): a bf16 matmul with fp32 accumulation and a fused
epilogue, TritonLinear (an nn.Linear replacement whose forward and backward GEMMs run through it),
the fp8 GEMM and cast, and the 16-bit AdamW. The Hopper matrix kernels that `plan` may choose are in
`hopper/`; the GPT-2 fast path's fused kernels are in `mpgpt.fast`.

    from mpgpt.kernels import matmul, plan, TritonLinear, kernels_available
    ok, why = kernels_available()
    print(plan(x, w.t()).reason)       # which kernel matmul(x, w.t()) runs here, and why

The package, one file per idea:

    env.py       where the kernels can run (interpreter, Triton missing, GPU generation)
    epilogue.py  jitted helpers the kernels share: tile order, bias + activation, stores
    grouped.py   the teaching kernel: grouped tile order, split-K, the interpreter path
    hopper/      Hopper's persistent TMA kernel (tma.py), its warp-specialised Gluon kernels (ws.py,
                 fp8_ws.py: chapter 9's promoted fp8 GEMM)
    launch.py    repeating a launch without Triton's Python launch path
    matmul.py    the public matmul, and plan(): which kernel runs, and why
    gelu.py      GELU's backward in one pass
    fp8_matmul.py  chapter 9's fp8 GEMM: scales in the epilogue, fp8 output with its amax
    fp8_cast.py  chapter 9's fp8 cast: amax, scale and saturating cast in two launches (Fp8Linear's casts)
    linear.py    TritonLinear; ops.py: its kernels as torch.compile-traceable custom operators
    library.py   how those operators are registered: the way that costs the host least per call
    partials.py  the last sum of the one-pass kernels' partial-sum tables, rounded into the parameters' dtype
    adamw16.py   chapter 10's AdamW with 16-bit weights and state, one fused pass
    (the benchmark against cuBLAS is mpgpt/bench/kernels.py: python -m mpgpt.bench kernels)

Importing this package never fails: without a CUDA GPU it switches Triton to its CPU
interpreter (TRITON_INTERPRET=1, set by env.py before any kernel is decorated), and without
Triton (macOS, Windows) the entry points raise a RuntimeError that says why.
"""
from . import env  # first: sets TRITON_INTERPRET if needed, before any kernel is decorated
from .env import capability, check_device, interpreting, kernels_available
from .gelu import gelu_backward, gelu_backward_bias
from .linear import TritonLinear, gelu_tanh_grad, triton_linear
from .matmul import ACTIVATIONS, KERNELS, Plan, matmul, plan

__all__ = ["matmul", "plan", "Plan", "TritonLinear", "triton_linear", "kernels_available", "interpreting",
           "check_device", "capability", "gelu_tanh_grad", "gelu_backward",
           "gelu_backward_bias", "ACTIVATIONS", "KERNELS"]
