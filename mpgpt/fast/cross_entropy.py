"""The output layer's loss and its gradient in one pass over 16-bit logits (chapter 7's fused-ce rung).

GPT-2's output layer scores 12,288 positions (batch 12 x 1024) against 50,304 tokens: 618M logits,
1.24 GB in bf16. Written with torch ops (``F.cross_entropy(logits.float(), ...)``) and compiled, the
loss reduces them in the forward pass, keeps them for the backward pass, and reads them again there
to recompute the softmax. llm.c's fused
classifier instead computes the loss *and* the logits' gradient in the forward pass, over the 16-bit
logits, and overwrites the logits with that gradient. This module does the same:

    logits = x @ W^T                               (N, V) in the compute dtype, torch/cuBLAS
    kernel, one program per row, in place:
      pass 1   m, s = online max and sum of exp    fp32;  lse = m + log(s)
               loss_row = lse - logits[target]
      pass 2   logits <- softmax - onehot(target)  = exp(logit - lse) - [j == target], in [-1, 1]
    grad_x = g @ W,  grad_w = g^T @ x              (N, C), (V, C), fp32 out (grad_w bf16 below), torch/cuBLAS

so no fp32 logits exist, the logits are read twice and written once by the kernel, and nothing the
size of the logits outlives the forward pass. As in mpgpt.fused_loss (which this copies, chunk by
chunk there, whole here), ``g`` is the gradient of the *summed* loss: left unnormalised, its small
probabilities stay above fp16's smallest subnormal (2^-24); the 1/n of the mean and the upstream
gradient (a loss scale) are applied in fp32 in the backward pass, which only rescales.

A model held in bf16 (the trainer's 16-bit AdamW) takes W's gradient in bf16 in the end, and bf16
has fp32's exponent range, so g / n loses nothing to underflow there. Where W and the compute
dtype are bf16, the kernel therefore multiplies g by 1/n before rounding it (one rounding, as
before), and cuBLAS writes g^T @ x in bf16: for GPT-2 that gradient is 77 MB instead of 154 MB,
written once in the forward pass and read once in the backward pass, which then only multiplies
it by the upstream gradient. Two roundings can join the one at the end, as in every bf16 product of
the unfused model: cuBLAS may add split-K partial sums in bf16 (torch's default,
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction), and the upstream gradient
rounds again unless it is 1 or a power of two (a loss divided by 3 accumulation steps is not).
grad_x stays fp32 (the hidden states may be fp32 under autocast; it is a quarter of grad_w's fp32
size).

Rows whose target is -1 are ignored: no loss, a zero gradient row (-1 is the package's convention,
as in GPT.forward; torch's F.cross_entropy defaults to -100, which here counts as out of range). A
target outside [-1, V) gives a NaN loss, which stops a run loudly (checking it on the host would cost
a GPU sync every step).

The whole forward is one custom operator, ``mpgpt::linear_cross_entropy``, with a fake implementation,
so torch.compile records one opaque call (no graph break) and Inductor does not try to fuse into it.

In Triton's CPU interpreter the kernel loads convert to fp32 as usual, but the interpreter rounds
fp32 -> bf16 by truncation (see grouped.py), so there the kernel writes ``g`` into an fp32 buffer and
torch rounds it into the logits (round to nearest even, as a GPU store does).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from mpgpt.fused_loss import first_derivative_only, rescale_summed_grads, save_summed_grads

from mpgpt.kernels import env
from mpgpt.kernels.env import tl, triton

__all__ = ["cross_entropy_rows_", "linear_cross_entropy_op", "fused_linear_cross_entropy"]

# Logits per loop iteration. V = 50,304 is 12 blocks of 4096 and a masked 1152. The interpreter runs
# one numpy op per block, so small blocks keep masked tails (and the tests) cheap there.
_BLOCK_V = 4096
_INTERPRET_BLOCK_V = 128
_NUM_WARPS = 8


@triton.jit
def _cross_entropy_kernel(
    logits_ptr,             # (N, V) bf16/fp16/fp32, rows `stride_l` apart
    grad_ptr,               # (N, V) where g is written: logits_ptr itself on a GPU (in place)
    targets_ptr,            # (N,) int64, -1 = ignore
    loss_ptr,               # (N,) fp32 out: lse - logit[target], 0 for an ignored row
    V,                      # vocabulary size (any, not a multiple of BLOCK_V)
    stride_l,               # row stride of logits, in elements
    stride_g,               # row stride of grad, in elements
    scale_ptr,              # (1,) fp32: g is multiplied by it before its rounding (read only if SCALED)
    BLOCK_V: tl.constexpr,  # logits per iteration
    WRITE_GRAD: tl.constexpr,  # False: loss only (evaluation)
    SCALED: tl.constexpr,   # write g * scale (the mean's gradient) instead of g (the sum's)
):
    row = tl.program_id(axis=0).to(tl.int64)  # 64-bit: row * stride exceeds 2^31 for large N * V
    x_row = logits_ptr + row * stride_l
    t = tl.load(targets_ptr + row)
    valid = t != -1
    in_range = (t >= 0) & (t < V)
    t_safe = tl.where(in_range, t, 0)
    x_t = tl.load(x_row + t_safe).to(tl.float32)

    # Pass 1: the running maximum m and sum s of exp(x - m), rescaled whenever m grows.
    m = float("-inf")
    s = 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)  # (BLOCK_V,)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    loss = tl.where(in_range, lse - x_t, float("nan"))
    tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))

    # Pass 2: overwrite the row with softmax - onehot(target) (zeros for an ignored row).
    if WRITE_GRAD:
        g_row = grad_ptr + row * stride_g
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            mask = offs < V
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)  # (BLOCK_V,)
            g = tl.exp(x - lse) - tl.where(offs == t, 1.0, 0.0)
            g = tl.where(valid, g, 0.0)
            if SCALED:
                g = g * tl.load(scale_ptr)
            tl.store(g_row + offs, g.to(grad_ptr.dtype.element_ty), mask=mask)


def cross_entropy_rows_(logits: Tensor, targets: Tensor, write_grad: bool = True,
                        grad_scale: Tensor | None = None) -> Tensor:
    """Per-row cross-entropy of ``logits`` (N, V) against ``targets`` (N,), -1 = ignore -> (N,) fp32.

    With ``write_grad`` the logits are overwritten, in place, with the gradient of the summed loss,
    softmax(logits) - onehot(target), in their own dtype (zeros on ignored rows), multiplied by
    ``grad_scale`` (a one-element fp32 tensor on the logits' device) before it is rounded, if given.
    The trailing underscore says so, as in torch."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"expected logits (N, V) and targets (N,); got {tuple(logits.shape)} and "
                         f"{tuple(targets.shape)}")
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"logits must be bf16, fp16 or fp32, got {logits.dtype}")
    if targets.dtype != torch.int64:
        raise ValueError(f"targets must be int64 token ids, got {targets.dtype}; use targets.long()")
    if logits.stride(1) != 1:
        raise ValueError("logits rows must be contiguous (stride 1 along V); pass logits.contiguous()")
    env.check_device(logits)
    N, V = logits.shape
    loss = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N == 0:
        return loss
    interpreted = env.interpreting()
    # The interpreter truncates fp32 -> bf16 on store: let it write fp32, and let torch round.
    grad = logits
    if write_grad and interpreted and logits.dtype != torch.float32:
        grad = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    block = _INTERPRET_BLOCK_V if interpreted else _BLOCK_V
    extra = {} if interpreted else {"num_warps": _NUM_WARPS}
    if grad_scale is not None and (grad_scale.dtype != torch.float32 or grad_scale.numel() != 1
                                   or grad_scale.device != logits.device):
        raise ValueError(f"grad_scale must be a one-element fp32 tensor on {logits.device}, got {grad_scale.dtype} "
                         f"{tuple(grad_scale.shape)} on {grad_scale.device}")
    _cross_entropy_kernel[(N,)](logits, grad, targets.contiguous(), loss, V, logits.stride(0), grad.stride(0),
                                loss if grad_scale is None else grad_scale,
                                BLOCK_V=block, WRITE_GRAD=write_grad, SCALED=grad_scale is not None, **extra)
    if grad is not logits:
        logits.copy_(grad)
    return loss


# torch.mm(a, b, out_dtype=torch.float32) on 16-bit CUDA inputs: the aten::mm.dtype overload (torch >= 2.8).
_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()


def _mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b with fp32 output. On CUDA cuBLAS writes fp32 straight from its fp32 accumulator
    (torch.mm's out_dtype; an older torch rounds the product to 16 bits first, as nn.Linear's
    backward does). Elsewhere the 16-bit inputs are upcast: their products are exact in fp32."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        if _MM_OUT_DTYPE:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.mm(a, b).float()
    return torch.mm(a.float(), b.float())


@torch.library.custom_op("mpgpt::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(x: Tensor, w: Tensor, targets: Tensor, compute_grad: bool,
                            grad_scale: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Summed cross-entropy of ``x @ w.T`` and, with ``compute_grad``, its gradients.

    x (N, C) and w (V, C) in the compute dtype, targets (N,) int64 with -1 = ignore. Returns
    (loss_sum: fp32 scalar, grad_x: (N, C) fp32, grad_w: (V, C) fp32), the gradients of the *sum*;
    without ``compute_grad`` the two gradients are empty and their GEMMs are skipped. With
    ``grad_scale`` (1/n as a one-element fp32 device tensor, n the targets that are not -1; bf16
    inputs only) the gradients are those of the *mean*, and grad_w comes in bf16: the kernel scales
    g by it before rounding it, and cuBLAS writes that product in bf16 (the module docstring says
    when and why)."""
    mean_grads = grad_scale is not None
    if mean_grads and (x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16):
        raise ValueError(f"the mean's gradients (grad_scale) need bf16 x and w (fp16's range loses g / n), got "
                         f"{x.dtype} and {w.dtype}")
    logits = torch.mm(x, w.t())                                          # (N, V), compute dtype
    loss_sum = cross_entropy_rows_(logits, targets, write_grad=compute_grad,
                                   grad_scale=grad_scale if compute_grad else None).sum()
    w_grad_dtype = torch.bfloat16 if mean_grads else torch.float32
    if not compute_grad:
        return loss_sum, x.new_empty(0, dtype=torch.float32), w.new_empty(0, dtype=w_grad_dtype)
    grad_w = torch.mm(logits.t(), x) if mean_grads else _mm_fp32(logits.t(), x)       # g^T @ x (V, C)
    return loss_sum, _mm_fp32(logits, w), grad_w                                      # g @ W (N, C) fp32


@linear_cross_entropy_op.register_fake
def _(x, w, targets, compute_grad, grad_scale=None):
    loss_sum = x.new_empty((), dtype=torch.float32)
    w_grad_dtype = torch.bfloat16 if grad_scale is not None else torch.float32
    if not compute_grad:
        return loss_sum, x.new_empty(0, dtype=torch.float32), w.new_empty(0, dtype=w_grad_dtype)
    return loss_sum, x.new_empty(x.shape, dtype=torch.float32), w.new_empty(w.shape, dtype=w_grad_dtype)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, compute_dtype):
        # x (N, C), weight (V, C), targets (N,) with -1 for "ignore"
        ctx.mean_grads = weight.dtype == compute_dtype == torch.bfloat16  # a model held in bf16
        n_valid = (targets != -1).sum().clamp_min(1).to(torch.float32)    # on the device: no sync
        scale = (1.0 / n_valid).reshape(1) if ctx.mean_grads else None
        loss_sum, grad_x, grad_w = linear_cross_entropy_op(x.to(compute_dtype), weight.to(compute_dtype), targets, True,
                                                           scale)
        return save_summed_grads(ctx, loss_sum, grad_x, grad_w, targets, x.dtype, weight.dtype, n_valid)

    @staticmethod
    def backward(ctx, grad_out):
        first_derivative_only("the fused loss", "mpgpt.fast.convert(model)")
        if ctx.mean_grads:  # the 1/n is in already: only the upstream gradient (exact for a power of two)
            grad_x, grad_w, _ = ctx.saved_tensors
            return (grad_x * grad_out).to(ctx.dtypes[0]), grad_w * grad_out, None, None
        return (*rescale_summed_grads(ctx, grad_out), None, None)


def fused_linear_cross_entropy(x: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of ``x @ weight.T`` against ``targets`` (-1 = ignore), fused in one Triton pass.

    The same interface as mpgpt.fused_loss.chunked_linear_cross_entropy (without chunk_rows):
    x (N, C) hidden states, weight (V, C) output matrix, targets (N,) int64. Under autocast the
    matmuls and the logits are in the autocast dtype; the softmax and the loss in fp32. Without
    grad (evaluation, torch.no_grad) only the loss is computed: no gradient GEMMs, no pass 2.
    Needs Triton: a GPU of compute capability >= 7.0 (fp16 only below 8.0), or the CPU interpreter.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or targets.shape != x.shape[:1]:
        raise ValueError(f"expected x (N, C), weight (V, C), targets (N,); got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(targets.shape)}")
    if env.TRITON_IMPORT_ERROR is not None:
        raise RuntimeError(f"the fused cross-entropy needs Triton: {env.TRITON_IMPORT_ERROR}")
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(x.dtype, weight.dtype)
    with torch.autocast(device_type, enabled=False):  # dtypes are chosen above, explicitly
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return _FusedLinearCrossEntropy.apply(x, weight, targets, compute_dtype)
        loss_sum, _, _ = linear_cross_entropy_op(x.to(compute_dtype), weight.to(compute_dtype), targets, False)
        return loss_sum / (targets != -1).sum().clamp_min(1).to(torch.float32)
