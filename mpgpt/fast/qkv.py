"""The attention layer's c_attn with its backward's head merge and bias gradient in one pass.

    q, k, v = heads(x @ W^T + b)     x: (B, T, C)   W: (3C, C)   q, k, v: (B, nh, T, hs) views

The forward pass is the unfused layer's: one matmul (cuBLAS), then views that split the output
into heads. The backward pass receives dq, dk, dv from the attention kernel and runs

    d_qkv, db = merge_heads_bias(dq, dk, dv)     one Triton pass on a GPU (heads.py)
    dW = d_qkv^T x,  dx = d_qkv W                cuBLAS

where autograd, compiled or not, would copy the three gradients into d_qkv and then read d_qkv
again for db (two passes where heads.py takes one). db is summed in fp32 from the same bf16 values, then rounded
once to the bias's dtype, where autocast's backward rounds it to bf16 first.

Dtypes follow the fused MLP (mlp.py): autocast's dtype under autocast, a bf16/fp16 model's own
dtype outside it, and exactly the unfused torch ops for an fp32 model outside autocast. Without
a bias, or on a CPU, the merge runs as torch ops: the fused pass only pays where it saves the
second read.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from mpgpt.fused_loss import first_derivative_only

from mpgpt.kernels import env, library
from mpgpt.kernels.linear import _compute_dtype, _op

from . import heads

def _triton_merge(t: Tensor) -> bool:
    """Whether the merge runs as the Triton pass here (a module-level function, so tests can switch it)."""
    return env.runs_compiled(t)


def merge_heads_impl(dq: Tensor, dk: Tensor, dv: Tensor, with_bias: bool,
                     db_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(d_qkv, db): (B*T, 3C) in dq's dtype, and (3C,) in ``db_dtype`` (the bias's dtype: summed in
    fp32, rounded once) or an empty tensor without ``with_bias``."""
    if with_bias and _triton_merge(dq):
        return heads.merge_heads_bias(dq, dk, dv, db_dtype=db_dtype)
    d_qkv, db = heads.merge_heads_reference(dq, dk, dv, with_bias)
    return d_qkv, db.to(db_dtype)


def _merge_heads_fake(dq, dk, dv, with_bias, db_dtype):
    B, nh, T, hs = dq.shape
    return dq.new_empty((B * T, 3 * nh * hs)), dq.new_empty((3 * nh * hs,) if with_bias else (0,), dtype=db_dtype)


merge_heads_op = library.operator("merge_heads_bias", merge_heads_impl, _merge_heads_fake)


def split_heads(qkv: Tensor, n_head: int) -> tuple[Tensor, Tensor, Tensor]:
    """(B, T, 3C) -> q, k, v: three (B, nh, T, hs) views, as the unfused attention layer makes them."""
    B, T, C3 = qkv.shape
    hs = C3 // (3 * n_head)
    return tuple(t.view(B, T, n_head, hs).transpose(1, 2) for t in qkv.split(C3 // 3, dim=2))


class _QKVFunction(torch.autograd.Function):
    """Forward and backward as in the module docstring; the backward names every dtype, so it
    does not depend on the autocast state it runs under."""

    @staticmethod
    def forward(ctx, x, w, b, n_head, dtype):
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)                      # (M, C)
        w_lp = w.to(dtype)                                              # (3C, C)
        qkv = F.linear(x2, w_lp, b.to(dtype) if b is not None else None)  # (M, 3C)
        ctx.save_for_backward(x2, w_lp)
        ctx.meta = (x.shape, x.dtype, w.dtype, None if b is None else b.dtype)
        return split_heads(qkv.view(*x.shape[:-1], w.shape[0]), n_head)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        first_derivative_only("the fused attention input (triton='mlp+qkv')", "mpgpt.fast.convert(model)")
        x2, w_lp = ctx.saved_tensors
        x_shape, x_dtype, w_dt, b_dt = ctx.meta
        dq, dk, dv = (g.to(w_lp.dtype) for g in (dq, dk, dv))
        db_dt = b_dt if b_dt is not None else torch.float32  # db comes in the bias's dtype: no cast follows
        d_qkv, db = _op(merge_heads_op, merge_heads_impl)(dq, dk, dv, b_dt is not None, db_dt)  # (M, 3C), (3C,)
        dw = (d_qkv.t() @ x2).to(w_dt)                                                   # (3C, C)
        dx = (d_qkv @ w_lp).to(x_dtype).view(x_shape)                                    # (M, C)
        return dx, dw, db.to(b_dt) if b_dt is not None else None, None, None


def qkv_heads(x: Tensor, w: Tensor, b: Optional[Tensor], n_head: int) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v, each (B, nh, T, hs), from x (B, T, C) through c_attn (w: (3C, C), b: (3C,) or None),
    with the backward pass of the module docstring; for an fp32 model outside autocast, exactly
    the unfused torch ops."""
    if x.dim() != 3 or w.shape[0] % (3 * n_head) or w.shape[1] != x.shape[-1]:
        raise ValueError(f"qkv_heads needs x (B, T, C) and w (3C, C) with 3C divisible by 3 * n_head={3 * n_head}, "
                         f"got x {tuple(x.shape)} and w {tuple(w.shape)}")
    dtype = _compute_dtype(x)
    if dtype is None:
        return split_heads(F.linear(x, w, b), n_head)
    return _QKVFunction.apply(x, w, b, n_head, dtype)
