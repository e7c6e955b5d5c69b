"""Triton kernels for chapter 6: a bf16 matmul with fp32 accumulation and a fused epilogue,
and TritonLinear, an nn.Linear replacement whose forward and backward GEMMs run through it.

    from mpgpt.kernels import matmul, plan, TritonLinear, kernels_available
    ok, why = kernels_available()
    print(plan(x, w.t()).reason)       # which kernel matmul(x, w.t()) runs here, and why

The package, one file per idea:

    env.py       where the kernels can run (interpreter, Triton missing, GPU generation)
    epilogue.py  jitted helpers the kernels share: tile order, bias + activation, stores
    grouped.py   the teaching kernel: grouped tile order, split-K, the interpreter path
    tma.py       Hopper's persistent TMA kernel
    ws.py        Hopper's warp-specialised Gluon kernel (128 x 192 tiles)
    launch.py    repeating a launch without Triton's Python launch path
    matmul.py    the public matmul, and plan(): which kernel runs, and why
    gelu.py      GELU's backward in one pass
    fp8_matmul.py  chapter 9's fp8 GEMM: scales in the epilogue, fp8 output with its amax
    fp8_ws.py    chapter 9's promoted fp8 GEMM for Hopper, warp-specialised (Gluon)
    fp8_cast.py  chapter 9's fp8 cast: amax, scale and saturating cast in two launches (Fp8Linear's casts)
    linear.py    TritonLinear; ops.py: its kernels as torch.compile-traceable custom operators
    library.py   how those operators are registered: the way that costs the host least per call
    mlp.py       the transformer's MLP with GELU fused into its first product (the ws kernel's epilogue)
    heads.py     the attention's dq, dk, dv merged into c_attn's gradient, its bias gradient in the same pass
    qkv.py       c_attn and the head split, with heads.py's pass in the backward
    layernorm.py the residual add with its LayerNorm, the backward (with the weight and bias gradients) in one pass
    partials.py  the last sum of those one-pass kernels' partial-sum tables, rounded into the parameters' dtype
    cross_entropy.py  chapter 7's fused output layer loss: loss and logit gradients in one pass
    embedding.py the tied embedding's gradient added into the output layer's, only the rows of tokens that occur
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
