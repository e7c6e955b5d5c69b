"""Output layer and cross-entropy in chunks, never materialising the full logits (chapter 7).

For GPT-2 small at batch 12 x 1024 the logits are 12,288 x 50,304 values: 1.2 GB in bf16 and
2.5 GB again when upcast to fp32 for the loss, read and written several times between the forward
and the backward pass. This module computes, for a slice of rows at a time,

    logits = x_c @ W^T                 (rows x V, in the autocast dtype, fp32 accumulation)
    loss  += logsumexp(logits) - logits[target]            (fp32)
    g      = softmax(logits) - onehot(target)              (fp32, the gradient of the summed loss)
    dx_c   = g @ W,   dW += g^T @ x_c                      (matmuls in the autocast dtype)

so only one chunk of logits exists at a time, and the backward pass only rescales the stored
gradients by ``grad_output / n``. ``g`` is kept *unnormalised* (entries in [-1, 1]) and the 1/n of
the mean is applied in fp32 at the end: divided by n = 12,288 first, the small probabilities in
``g`` would fall below fp16's smallest subnormal (2^-24) and vanish before the loss scale could
lift them.

Numerically it is the same computation as ``F.cross_entropy(x @ W^T, targets)``, in a different
summation order; ``tests/test_fused_loss.py`` checks it against that reference.
``mpgpt.fast.cross_entropy`` does the same in one Triton kernel over the 16-bit logits.
"""
from __future__ import annotations

import torch

__all__ = ["chunked_linear_cross_entropy", "save_summed_grads", "rescale_summed_grads", "first_derivative_only"]


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, chunk_rows: int, compute_dtype):
        # x (N, C), weight (V, C), targets (N,) with -1 for "ignore"
        N, C = x.shape
        acc = torch.promote_types(compute_dtype, torch.float32)  # fp32, or fp64 for a float64 reference
        xc, wc = x.to(compute_dtype), weight.to(compute_dtype)
        grad_x = torch.empty(N, C, dtype=acc, device=x.device)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=x.device)
        loss_sum = torch.zeros((), dtype=acc, device=x.device)
        for start in range(0, N, chunk_rows):
            rows = slice(start, min(start + chunk_rows, N))
            t = targets[rows]
            valid = (t != -1).unsqueeze(1)                        # (n, 1)
            t = t.clamp_min(0)
            logits = (xc[rows] @ wc.t()).to(acc)                   # (n, V): the only logits alive
            lse = torch.logsumexp(logits, dim=1, keepdim=True)    # (n, 1)
            loss_sum += ((lse - logits.gather(1, t.unsqueeze(1))) * valid).sum()
            g = logits.sub_(lse).exp_()                           # softmax, in place: (n, V)
            g.scatter_add_(1, t.unsqueeze(1), torch.full_like(lse, -1.0))  # minus the one-hot
            g.mul_(valid)
            g = g.to(compute_dtype)
            grad_x[rows] = g @ wc                                  # (n, C)
            grad_w += g.t() @ xc[rows]                             # (V, C)
        return save_summed_grads(ctx, loss_sum, grad_x, grad_w, targets, x.dtype, weight.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        first_derivative_only("the chunked loss", "mpgpt.fast.convert(model)")
        return (*rescale_summed_grads(ctx, grad_out), None, None, None)


def first_derivative_only(layer: str, off: str) -> None:
    """Called first in the backward pass of the package's autograd Functions whose saved tensors
    carry no graph (gradients computed in the forward pass, as here, or Triton kernels): raise a
    one-line RuntimeError when that backward runs with create_graph=True (the only time grad mode
    is on inside it), since a second derivative through it would come out silently wrong."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{layer} computes first derivatives only, and this backward pass was asked for a "
                           f"graph (create_graph=True) to differentiate twice; call {off} for higher-order gradients")


def save_summed_grads(ctx, loss_sum, grad_x, grad_w, targets, x_dtype, w_dtype, n_valid=None):
    """For a loss whose forward pass already computed the gradients of the *summed* loss: keep them
    and return the mean over the targets that are not -1 (shared with mpgpt.fast.cross_entropy).
    ``n_valid``: that count as a tensor, where the caller has it already."""
    if n_valid is None:
        n_valid = (targets != -1).sum().clamp_min(1)
    n_valid = n_valid.to(loss_sum.dtype)
    ctx.save_for_backward(grad_x, grad_w, n_valid)
    ctx.dtypes = (x_dtype, w_dtype)
    return loss_sum / n_valid


def rescale_summed_grads(ctx, grad_out):
    """The backward pass of such a loss: the stored gradients times grad_out / n, in fp32 (or the
    stored dtype), then cast to the inputs' dtypes. Returns (grad_x, grad_w)."""
    grad_x, grad_w, n_valid = ctx.saved_tensors
    scale = grad_out.to(n_valid.dtype) / n_valid
    return (grad_x * scale).to(ctx.dtypes[0]), (grad_w * scale).to(ctx.dtypes[1])


def chunked_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                 chunk_rows: int = 2048) -> torch.Tensor:
    """Mean cross-entropy of ``x @ weight.T`` against ``targets`` (-1 = ignore), ``chunk_rows`` rows at a time.

    x: (N, C) hidden states, weight: (V, C) output matrix, targets: (N,) int64. Under autocast the
    matmuls run in the autocast dtype (as ``nn.Linear`` would); the softmax and the loss in fp32.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or targets.shape != x.shape[:1]:
        raise ValueError(f"expected x (N, C), weight (V, C), targets (N,); got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(targets.shape)}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(x.dtype, weight.dtype)
    with torch.autocast(device_type, enabled=False):  # dtypes are chosen above, explicitly
        return _ChunkedLinearCrossEntropy.apply(x, weight, targets, chunk_rows, compute_dtype)
