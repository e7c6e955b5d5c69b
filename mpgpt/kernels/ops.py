"""TritonLinear's three kernels as PyTorch operators, so `torch.compile` can trace models
that use them (chapter 6, chapter 7's `bf16+compile+triton` row).

Left to itself, Dynamo (torch.compile's tracer) steps *into* a Python function it meets. Inside
`matmul` it finds Python it cannot put in a graph: `data_ptr()`, Triton's launcher, and on a CPU
the Triton interpreter, which it cannot trace at all. So the graph breaks at every layer, or
compiling fails outright.

An operator is a box with a declared signature (library.py registers it, and says why that
way). Dynamo records one call to it and does not look inside. Its "fake" implementation tells the
compiler the outputs' shapes and dtypes without running anything. At run time the box runs our
Python as usual, including the lean launch path.

The operators (namespace `mpgpt`):
    linear_forward(x2, w, bias, activation, keep_z) -> (y, z)   y = act(x2 @ w.T + bias), z its input
    matmul(a, b, out_dtype, choice) -> a @ b                     the two gradient GEMMs (choice: the kernel preferred)
    gelu_backward(grad, z, with_bias) -> (dz, db)                dz = grad * gelu'(z); with_bias: db = dz
                                                                 summed over rows, in the same pass

`linear.py` calls them only while torch.compile traces (`torch.compiler.is_compiling()`). In
eager mode it calls the same Python directly, because each trip through the dispatcher costs
host time.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import Tensor

from . import gelu, library
from .hopper import ws
from .matmul import KERNELS, _matmul_2d, _plan_2d


def linear_forward_impl(x2: Tensor, w: Tensor, bias: Optional[Tensor], activation: Optional[str],
                        keep_z: bool) -> tuple[Tensor, Tensor]:
    """y = act(x2 @ w.T + bias) in x2's dtype, x2: (M, in), w: (out, in) -> y: (M, out).
    With keep_z also z = x2 @ w.T + bias (GELU's backward needs it); otherwise z is empty.

    GELU with z kept runs on the warp-specialised kernel's GELU epilogue where it can (sm_90,
    ws.gelu_forward, the fused MLP's forward): `matmul` would take the TMA kernel for an epilogue
    that writes z, which is slower at c_fc's shape (measured: record train-triton-profile-h100).
    ws.gelu_forward computes GELU of z as stored (rounded to
    x2's dtype), as nn.Linear followed by nn.GELU does under autocast."""
    if activation == "gelu" and keep_z and ws.gelu_eligible(x2, w, bias):
        return ws.gelu_forward(x2, w, bias)
    y = torch.empty((x2.shape[0], w.shape[0]), dtype=x2.dtype, device=x2.device)
    z = torch.empty_like(y) if keep_z else y.new_empty(0)
    _matmul_2d(x2, w.t(), y, bias=bias, z=z if keep_z else None, activation=activation)
    return y, z


def matmul_impl(a: Tensor, b: Tensor, out_dtype: torch.dtype, choice: str = "auto") -> Tensor:
    """a @ b, a: (M, K), b: (K, N), any strides -> a new (M, N) tensor of out_dtype, on the
    matmul kernel `choice` names (matmul.KERNELS) where that kernel can run this product, on
    "auto"'s choice, with a warning that says why, where it cannot. (Decided here, on real
    tensors: while torch.compile traces the caller, the operands are fake and have no addresses
    to check.) The parameter is not called `kernel`: Inductor hands a custom operator's arguments
    to a function whose first parameter has that name, and lowering then fails ("got multiple
    values for argument 'kernel'")."""
    if choice not in KERNELS:
        raise ValueError(f"the gradient products' kernel must be one of {KERNELS}, got {choice!r}")
    out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    if choice != "auto":
        try:
            _plan_2d(a, b, out, None, None, None, choice, None)
        except ValueError as why:
            warnings.warn(f"kernel={choice!r} cannot run this {tuple(a.shape)} @ {tuple(b.shape)} product "
                          f"({why}); running kernel='auto' instead", stacklevel=2)
            choice = "auto"
    _matmul_2d(a, b, out, kernel=choice)
    return out


def gelu_backward_impl(grad: Tensor, z: Tensor, with_bias: bool) -> tuple[Tensor, Tensor]:
    """(dz, db): dz = grad * gelu'(z) in grad's dtype, grad and z (M, N). With with_bias, db is dz
    summed over the rows, (N,) fp32, made while each tile of dz is still in registers
    (`gelu.gelu_backward_bias`): a separate `dz.sum(0)` would read all of dz again. Without it, db
    is an empty fp32 tensor and dz comes from the one-dimensional kernel (`gelu.gelu_backward`)."""
    if with_bias:
        return gelu.gelu_backward_bias(grad, z)
    return gelu.gelu_backward(grad, z), grad.new_empty(0, dtype=torch.float32)


def _linear_forward_fake(x2, w, bias, activation, keep_z):
    y = x2.new_empty((x2.shape[0], w.shape[0]))
    return y, (torch.empty_like(y) if keep_z else y.new_empty(0))


def _matmul_fake(a, b, out_dtype, choice="auto"):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _gelu_backward_fake(grad, z, with_bias):
    return (torch.empty_like(grad, memory_format=torch.contiguous_format),
            grad.new_empty((grad.shape[1],) if with_bias else (0,), dtype=torch.float32))


linear_forward = library.operator("linear_forward", linear_forward_impl, _linear_forward_fake)
matmul = library.operator("matmul", matmul_impl, _matmul_fake)
gelu_backward = library.operator("gelu_backward", gelu_backward_impl, _gelu_backward_fake)
