"""The transformer's MLP with GELU fused into its first matmul's epilogue (chapter 7).

    out = gelu(x @ W_fc^T + b_fc) @ W_proj^T + b_proj      x: (..., C)   W_fc: (4C, C)   W_proj: (C, 4C)

Unfused, GELU's forward pass is a pass of its own over a (tokens, 4C) tensor: read Z, write
gelu(Z). llm.c moves it into cuBLASLt's GEMM epilogue; torch does not expose that epilogue with Z
kept for the backward pass, so here it goes into our warp-specialised Gluon kernel (ws.py), which
runs GPT-2's c_fc product close to cuBLAS (measured: record kernels-h200):

    forward    Z = x W_fc^T + b_fc, Y = gelu(Z)      one launch; the epilogue writes Z, then Y
               out = Y W_proj^T + b_proj             cuBLAS (torch)
    backward   dH = dOut W_proj                        cuBLAS
               dZ = dH * gelu'(Z), db_fc = sum_rows dZ  one Triton pass (gelu.py) on a GPU; or both
                                                        lines in one launch (gelu_backward="epilogue")
               the weight gradients and dx              cuBLAS (the weight gradients: or, with
                                                        weight_grad_kernel, a kernel of matmul.py)

Unfused, GELU's backward and c_fc's bias gradient are two passes (Inductor's pointwise kernel,
then a column reduction that reads dZ again). `gelu_backward_bias` sums the columns while each tile
of dZ is still in registers, so dZ is read once. On a CPU, or without Triton, the same two lines run
as torch ops.

GELU's backward can also go into the epilogue of dOut W_proj, as llm.c does (gelu_backward=
"epilogue": `product_gelu_backward`, EPILOGUE 2 of ws.py). Run by the MMA warps themselves, gelu'
(about fifteen fp32 operations per element) would keep the tensor cores waiting; the form here hands
each tile of dH to a partition of other warps, as the forward's GELU epilogue does, so that gelu' and
the column sums run beside the next tile's MMAs, and eight warps write dZ from registers. The recipe
token `gelu-epilogue` switches it on in the training step (`python -m mpgpt.recipe gelu-epilogue`
shows its measured effect); "pass" stays the default of this function. The memory kept for the
backward pass is what the unfused module keeps: x, Z and Y.

Where the Gluon kernel cannot run (no sm_90, no Gluon, odd alignment) the custom operator computes
the same thing with torch ops, so the module works everywhere and its autograd is tested on the
CPU; only the speed needs a Hopper GPU. Dtypes follow TritonLinear (linear.py): autocast's dtype
under autocast, a bf16/fp16 model's own dtype outside it, and plain fp32 (exactly the unfused
module) for an fp32 model outside autocast. Parameter gradients come back in the parameters' dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from mpgpt.fused_loss import first_derivative_only

from mpgpt.kernels import env, gelu, library, ops
from mpgpt.kernels.hopper import ws
from mpgpt.kernels.linear import _compute_dtype, _op
from mpgpt.kernels.matmul import KERNELS

# What may compute the MLP's weight gradients: cuBLAS (torch's matmul), or one of the package's
# matmul kernels, each of which can read a weight gradient's transposed A (ws through launch_split).
WEIGHT_GRAD_KERNELS = ("cublas",) + KERNELS


def check_weight_grad_kernel(kernel: str) -> str:
    """kernel, if it is one of WEIGHT_GRAD_KERNELS; otherwise a ValueError that lists them."""
    if kernel not in WEIGHT_GRAD_KERNELS:
        raise ValueError(f"weight_grad_kernel must be one of {WEIGHT_GRAD_KERNELS}, got {kernel!r}")
    return kernel


# ----------------------------------------------------------------------------------------------
# The fused product, as a custom operator (so torch.compile keeps it as a single node)
# ----------------------------------------------------------------------------------------------
def gelu_linear_impl(x2: Tensor, w: Tensor, bias: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(gelu(z), z) with z = x2 @ w.T + bias. x2: (M, K), w: (N, K) -> two (M, N) in x2's dtype."""
    if ws.gelu_eligible(x2, w, bias):
        return ws.gelu_forward(x2, w, bias)
    z = F.linear(x2, w, bias)
    return F.gelu(z, approximate="tanh"), z


def _gelu_linear_fake(x2, w, bias):
    y = x2.new_empty((x2.shape[0], w.shape[0]))
    return y, torch.empty_like(y)


gelu_linear = library.operator("gelu_linear", gelu_linear_impl, _gelu_linear_fake)


def _triton_backward(t: Tensor) -> bool:
    """Whether GELU's backward runs as the Triton pass here (a module-level function, so tests can switch it)."""
    return env.runs_compiled(t)


def gelu_backward_impl(h: Tensor, z: Tensor, with_bias: bool, db_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(dZ, db): dZ = h * gelu'(z) in h's dtype, h and z (M, N); db = dZ summed over rows in fp32 and
    rounded once into ``db_dtype`` (the bias's dtype, so no cast follows), (N,), or an empty tensor
    without ``with_bias``. The Triton passes are gelu.py's; without them, the same results as torch ops."""
    if _triton_backward(h) and with_bias:
        return gelu.gelu_backward_bias(h, z, db_dtype=db_dtype)
    if _triton_backward(h) and h.numel() < 2**31:  # gelu_backward's offsets are 32-bit
        return gelu.gelu_backward(h, z), h.new_empty(0, dtype=db_dtype)
    dz = torch.ops.aten.gelu_backward(h, z, approximate="tanh")  # what nn.GELU's backward does
    return dz, dz.sum(0, dtype=torch.float32).to(db_dtype) if with_bias else h.new_empty(0, dtype=db_dtype)


def _gelu_backward_fake(h, z, with_bias, db_dtype):
    return torch.empty_like(h, memory_format=torch.contiguous_format), h.new_empty(
        (h.shape[1],) if with_bias else (0,), dtype=db_dtype)


gelu_backward_op = library.operator("gelu_backward_bias", gelu_backward_impl, _gelu_backward_fake)


def product_gelu_backward_impl(g: Tensor, w: Tensor, z: Tensor, with_bias: bool,
                               db_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(dZ, db) as gelu_backward_impl(g @ w, z, ...) returns them, with GELU's backward in the
    product's epilogue where the warp-specialised kernel runs (ws.gelu_backward_eligible: sm_90):
    one launch instead of cuBLAS's product and the separate pass. g: (M, C) = dOut, w: (C, 4C) =
    W_proj, z: (M, 4C). Elsewhere the product, then gelu_backward_impl."""
    if ws.gelu_backward_eligible(g, w, z):
        return ws.gelu_backward_fused(g, w, z, with_bias, db_dtype)
    return gelu_backward_impl(g @ w, z, with_bias, db_dtype)


def _product_gelu_backward_fake(g, w, z, with_bias, db_dtype):
    return g.new_empty((g.shape[0], w.shape[1])), g.new_empty((w.shape[1],) if with_bias else (0,), dtype=db_dtype)


product_gelu_backward_op = library.operator("product_gelu_backward", product_gelu_backward_impl,
                                            _product_gelu_backward_fake)


# Where GELU's backward runs: "pass", after cuBLAS's dH = dOut W_proj, in gelu.py's one pass; or
# "epilogue", in that product's epilogue on the warp-specialised kernel (sm_90; elsewhere as "pass").
GELU_BACKWARDS = ("pass", "epilogue")


# "epilogue" is withdrawn: with other work on the GPU, ws.gelu_backward_fused gave different dZ and
# bias gradients from run to run (up to a few hundred elements at GPT-2's shape) and the fastest row
# trained on NaN, while the same row with "pass" trained. The race was not found in the kernel's
# synchronisation (barriers, proxy fences and single-thread arrives of the compiled code checked
# for Triton 3.6 and 3.9). The option bought 1.4-1.7 % of the step (records train-peers-dgelu-h100,
# train-peers-dgelu-2-h100); it comes back when tests/test_under_load.py passes with it.
WITHDRAWN = {"epilogue": "gelu_backward='epilogue' is withdrawn: GELU's backward in the epilogue of dOut W_proj "
                         "gave different gradients when other work shared the GPU; use gelu_backward='pass'"}


def check_gelu_backward(where: str) -> str:
    """where, if it is one of GELU_BACKWARDS and not withdrawn; otherwise a one-line ValueError."""
    if where not in GELU_BACKWARDS:
        raise ValueError(f"gelu_backward must be one of {GELU_BACKWARDS}, got {where!r}")
    if where in WITHDRAWN:
        raise ValueError(WITHDRAWN[where])
    return where


# ----------------------------------------------------------------------------------------------
# The autograd Function and the functional form
# ----------------------------------------------------------------------------------------------
def _weight_grad(a: Tensor, b: Tensor, out_dtype: torch.dtype, kernel: str) -> Tensor:
    """a @ b for a weight gradient, (out, tokens) @ (tokens, in). kernel "cublas": torch's matmul
    in a's dtype, then cast (what nn.Linear's backward does under autocast); otherwise that kernel
    of mpgpt.kernels.matmul (e.g. "tma", where it can run), which writes out_dtype straight
    from its fp32 sums."""
    if kernel == "cublas" or env.TRITON_IMPORT_ERROR is not None:
        return (a @ b).to(out_dtype)
    return _op(ops.matmul, ops.matmul_impl)(a, b, out_dtype, kernel)


class _GeluMLPFunction(torch.autograd.Function):
    """Forward and backward as in the module docstring. Every op in the backward pass works in the
    saved tensors' dtype, so it does not depend on the autocast state it runs under."""

    @staticmethod
    def forward(ctx, x, w_fc, b_fc, w_proj, b_proj, dtype, weight_grad_kernel, gelu_backward):
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)  # (M, C)
        w_fc_lp, w_proj_lp = w_fc.to(dtype), w_proj.to(dtype)
        b_fc_lp = b_fc.to(dtype) if b_fc is not None else None
        b_proj_lp = b_proj.to(dtype) if b_proj is not None else None
        y, z = _op(gelu_linear, gelu_linear_impl)(x2, w_fc_lp, b_fc_lp)  # gelu(Z), Z: (M, 4C) each
        out = F.linear(y, w_proj_lp, b_proj_lp)                            # (M, C)
        ctx.save_for_backward(x2, w_fc_lp, w_proj_lp, y, z)
        ctx.shapes = (x.shape, x.dtype)
        ctx.dtypes = (w_fc.dtype, None if b_fc is None else b_fc.dtype, w_proj.dtype,
                      None if b_proj is None else b_proj.dtype)
        ctx.weight_grad_kernel, ctx.gelu_backward = weight_grad_kernel, gelu_backward
        return out.view(*x.shape[:-1], w_proj.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        first_derivative_only("the fused MLP (triton='mlp')", "mpgpt.fast.convert(model)")
        x2, w_fc_lp, w_proj_lp, y, z = ctx.saved_tensors
        (x_shape, x_dtype), (w_fc_dt, b_fc_dt, w_proj_dt, b_proj_dt) = ctx.shapes, ctx.dtypes
        g = grad_out.reshape(-1, grad_out.shape[-1]).to(w_proj_lp.dtype).contiguous()  # dOut: (M, C)
        d_w_proj = _weight_grad(g.t(), y, w_proj_dt, ctx.weight_grad_kernel)          # (C, 4C)
        d_b_proj = g.sum(0, dtype=torch.float32).to(b_proj_dt) if b_proj_dt is not None else None
        db_dt = b_fc_dt if b_fc_dt is not None else torch.float32  # d_b_fc in the bias's dtype: no cast follows
        if ctx.gelu_backward == "epilogue":  # dH = dOut W_proj and GELU's backward in one launch
            dz, d_b_fc = _op(product_gelu_backward_op, product_gelu_backward_impl)(
                g, w_proj_lp, z, b_fc_dt is not None, db_dt)                                  # (M, 4C), (4C,)
        else:
            dz, d_b_fc = _op(gelu_backward_op, gelu_backward_impl)(g @ w_proj_lp, z, b_fc_dt is not None, db_dt)
        d_w_fc = _weight_grad(dz.t(), x2, w_fc_dt, ctx.weight_grad_kernel)                    # (4C, C)
        dx = (dz @ w_fc_lp).to(x_dtype).view(x_shape)                                         # (M, C)
        return dx, d_w_fc, d_b_fc.to(b_fc_dt) if b_fc_dt is not None else None, d_w_proj, d_b_proj, None, None, None


def gelu_mlp(x: Tensor, w_fc: Tensor, b_fc: Optional[Tensor], w_proj: Tensor, b_proj: Optional[Tensor],
             weight_grad_kernel: str = "cublas", gelu_backward: str = "pass") -> Tensor:
    """gelu(x @ w_fc.T + b_fc) @ w_proj.T + b_proj (GELU's tanh approximation), with GELU fused as
    the module docstring says; for an fp32 model outside autocast, exactly the unfused torch ops.
    weight_grad_kernel: "cublas", or a kernel of mpgpt.kernels.matmul for the two weight
    gradients (WEIGHT_GRAD_KERNELS; see _weight_grad). cuBLAS is the fastest of them at GPT-2's
    MLP, hence the default (measured: record kernels-grads-split-h100).
    gelu_backward: "pass" (cuBLAS's dOut W_proj, then gelu.py's pass) or "epilogue" (both in one
    launch of the warp-specialised kernel where it runs; GELU_BACKWARDS)."""
    check_weight_grad_kernel(weight_grad_kernel)
    check_gelu_backward(gelu_backward)
    dtype = _compute_dtype(x)
    if dtype is None:
        return F.linear(F.gelu(F.linear(x, w_fc, b_fc), approximate="tanh"), w_proj, b_proj)
    return _GeluMLPFunction.apply(x, w_fc, b_fc, w_proj, b_proj, dtype, weight_grad_kernel, gelu_backward)
