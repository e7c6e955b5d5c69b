"""The transformer's MLP with GELU fused into the matmuls on both sides of it (chapter 7).

    out = gelu(x @ W_fc^T + b_fc) @ W_proj^T + b_proj      x: (..., C)   W_fc: (4C, C)   W_proj: (C, 4C)

Unfused, GELU costs two passes over a (tokens, 4C) tensor in the forward direction (read Z, write
gelu(Z)) and three in the backward one (read dY and Z, write dZ), plus a fourth for b_fc's
gradient (sum dZ over the rows). On the H200 that was 1.6 ms of a 23.6 ms GPT-2 step
(benchmarks/NOTES-train.md). llm.c moves them into cuBLASLt's GEMM epilogues; torch does not
expose those, so here they go into our warp-specialised Gluon kernel (ws.py), which runs at
cuBLAS's speed on these shapes:

    forward    Z = x W_fc^T + b_fc                   one launch; Z stays in registers, the
               Y = gelu(Z), D = gelu'(Z)             epilogue writes Y and D (one tanh for both)
               out = Y W_proj^T + b_proj             cuBLAS (torch)
    backward   dW_proj = dOut^T Y,  db_proj = sum dOut     cuBLAS, torch
               dZ = (dOut W_proj) * D                one launch; the epilogue loads D, multiplies,
               db_fc = sum over rows of dZ           and writes per-tile column sums of dZ
               dW_fc = dZ^T x,  dx = dZ W_fc         cuBLAS

The derivative is evaluated in the forward pass, where the epilogue has Z in fp32 anyway, so the
backward epilogue is a single multiply: evaluated there, gelu' cost more than the bytes it saved,
because the epilogue runs while the tensor cores wait (benchmarks/NOTES-train.md). D takes Z's
place in memory: what is kept for the backward pass is as much as nn.Linear + nn.GELU +
nn.Linear keep (x, Z and Y), and D, rounded once from fp32, is as accurate as a gelu' evaluated
from a bf16 Z.

Where the Gluon kernel cannot run (no sm_90, no Gluon, fp32 outside autocast, odd alignment),
the two custom operators compute the same thing with torch ops, so the module works everywhere
and the autograd bookkeeping is tested on the CPU; only the speed needs a Hopper GPU.
Dtypes follow TritonLinear (linear.py): autocast's dtype under autocast, a bf16/fp16 model's
own dtype outside it, and plain fp32 (exactly the unfused module) for an fp32 model outside
autocast. Parameter gradients come back in the parameters' dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import ws
from .linear import _compute_dtype, _op, gelu_tanh_grad


# ----------------------------------------------------------------------------------------------
# The two fused products, as custom operators (so torch.compile keeps them as single nodes)
# ----------------------------------------------------------------------------------------------
def gelu_linear_impl(x2: Tensor, w: Tensor, bias: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(gelu(z), gelu'(z)) with z = x2 @ w.T + bias. x2: (M, K), w: (N, K) -> two (M, N) in x2's dtype."""
    if ws.gelu_eligible(x2, w) and (bias is None or bias.stride(0) == 1):
        return ws.gelu_forward(x2, w, bias)
    z = F.linear(x2, w, bias)
    return F.gelu(z, approximate="tanh"), gelu_tanh_grad(z).to(z.dtype)


def dgelu_linear_impl(g: Tensor, w: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
    """(dz, db) with dz = (g @ w.T) * d in g's dtype (d = gelu'(z), from gelu_linear) and db = dz
    summed over rows in fp32 (before dz's rounding). g: (M, K), w: (N, K), d: (M, N) -> dz
    (M, N), db (N,)."""
    if ws.gelu_eligible(g, w) and d.dtype == g.dtype and d.is_contiguous():
        dz, colsum = ws.dgelu(g, w, d)
        return dz, colsum.sum(0)
    dz32 = (g @ w.t()).float() * d.float()
    return dz32.to(g.dtype), dz32.sum(0)


gelu_linear = torch.library.custom_op("mpgpt::gelu_linear", mutates_args=())(gelu_linear_impl)
dgelu_linear = torch.library.custom_op("mpgpt::dgelu_linear", mutates_args=())(dgelu_linear_impl)


@gelu_linear.register_fake
def _(x2, w, bias):
    y = x2.new_empty((x2.shape[0], w.shape[0]))
    return y, torch.empty_like(y)


@dgelu_linear.register_fake
def _(g, w, d):
    return g.new_empty((g.shape[0], w.shape[0])), g.new_empty((w.shape[0],), dtype=torch.float32)


# ----------------------------------------------------------------------------------------------
# The autograd Function and the functional form
# ----------------------------------------------------------------------------------------------
class _GeluMLPFunction(torch.autograd.Function):
    """Forward and backward as in the module docstring. Every op names its dtype, so the
    backward pass does not depend on the autocast state it runs under."""

    @staticmethod
    def forward(ctx, x, w_fc, b_fc, w_proj, b_proj, dtype):
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)  # (M, C)
        w_fc_lp, w_proj_lp = w_fc.to(dtype), w_proj.to(dtype)
        b_fc_lp = b_fc.to(dtype) if b_fc is not None else None
        b_proj_lp = b_proj.to(dtype) if b_proj is not None else None
        y, d = _op(gelu_linear, gelu_linear_impl)(x2, w_fc_lp, b_fc_lp)  # gelu(Z), gelu'(Z): (M, 4C) each
        out = F.linear(y, w_proj_lp, b_proj_lp)                            # (M, C)
        ctx.save_for_backward(x2, w_fc_lp, w_proj_lp, y, d)
        ctx.shapes = (x.shape, x.dtype)
        ctx.dtypes = (w_fc.dtype, None if b_fc is None else b_fc.dtype, w_proj.dtype,
                      None if b_proj is None else b_proj.dtype)
        return out.view(*x.shape[:-1], w_proj.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x2, w_fc_lp, w_proj_lp, y, d = ctx.saved_tensors
        (x_shape, x_dtype), (w_fc_dt, b_fc_dt, w_proj_dt, b_proj_dt) = ctx.shapes, ctx.dtypes
        g = grad_out.reshape(-1, grad_out.shape[-1]).to(w_proj_lp.dtype).contiguous()  # dOut: (M, C)
        d_w_proj = (g.t() @ y).to(w_proj_dt)                                          # (C, 4C)
        d_b_proj = g.sum(0, dtype=torch.float32).to(b_proj_dt) if b_proj_dt is not None else None
        # dZ = (dOut @ W_proj) * D: the kernel multiplies by w.T, so it gets W_proj^T as a
        # row-major (4C, C) weight (a 4C x C copy, small beside the (M, 4C) tensors; reading
        # W_proj as it is, (K, N) row-major, made the kernel slower on the H200).
        dz, d_b_fc = _op(dgelu_linear, dgelu_linear_impl)(g, w_proj_lp.t().contiguous(), d)  # (M, 4C), (4C,)
        d_w_fc = (dz.t() @ x2).to(w_fc_dt)                                                    # (4C, C)
        dx = (dz @ w_fc_lp).to(x_dtype).view(x_shape)                                         # (M, C)
        return dx, d_w_fc, d_b_fc.to(b_fc_dt) if b_fc_dt is not None else None, d_w_proj, d_b_proj, None


def gelu_mlp(x: Tensor, w_fc: Tensor, b_fc: Optional[Tensor], w_proj: Tensor, b_proj: Optional[Tensor]) -> Tensor:
    """gelu(x @ w_fc.T + b_fc) @ w_proj.T + b_proj (GELU's tanh approximation), fused as the module
    docstring says; for an fp32 model outside autocast, exactly the unfused torch ops."""
    dtype = _compute_dtype(x)
    if dtype is None:
        return F.linear(F.gelu(F.linear(x, w_fc, b_fc), approximate="tanh"), w_proj, b_proj)
    return _GeluMLPFunction.apply(x, w_fc, b_fc, w_proj, b_proj, dtype)
