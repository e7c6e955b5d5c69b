"""Triton kernels for chapter 6: a bf16 matmul with fp32 accumulation and a fused epilogue,
and TritonLinear, an nn.Linear replacement whose forward and backward GEMMs run through it.

    from mpgpt.kernels import matmul, TritonLinear, kernels_available
    ok, why = kernels_available()

Importing this package never fails: without a CUDA GPU it switches Triton to its CPU
interpreter (TRITON_INTERPRET=1, set before any kernel is decorated), and without Triton
(macOS, Windows) the entry points raise a RuntimeError that says why.
"""
from ._env import interpreting, kernels_available  # first: sets TRITON_INTERPRET if needed
from .gelu import gelu_backward
from .linear import TritonLinear, gelu_tanh_grad, triton_linear
from .matmul import ACTIVATIONS, matmul

__all__ = ["matmul", "TritonLinear", "triton_linear", "kernels_available", "interpreting",
           "gelu_tanh_grad", "gelu_backward", "ACTIVATIONS"]
