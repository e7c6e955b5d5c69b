"""The last sum of a column sum made in two stages, rounded once into the gradient's dtype.

The one-pass backward kernels (LayerNorm's in `layernorm.py`, GELU's with the bias gradient in
`gelu.py`, the head merge in `heads.py`) each sum a gradient's columns while its tiles are still in
registers. Each program covers one group of rows, so what they leave is a table of partial sums:

    part[n, r] = sum of column n over row group r          (N, R) fp32, row-major
    out[n]     = sum over r of part[n, r]                  (N,), rounded once into `dtype`

Summed by `part.sum(1)`, the table gives an fp32 vector, and a model that keeps its parameters in
bf16 (the trainer's 16-bit AdamW) then casts it: each LayerNorm's weight and bias gradients took
three launches that way (the sum, and one cast each), GELU's and the head merge's bias gradients
two. In the fastest GPT-2 step those casts were dozens of tiny launches, each also leaving a gap
before the next kernel (measured: record train-profile-fastest-h200). `sum_partials` does the sum
and the rounding in one launch.

The sum runs over each row of the table in a fixed order, so the result does not change from run
to run.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import env
from .env import tl, triton


@triton.jit
def _sum_partials_kernel(
    part_ptr,               # (N, R) fp32, row-major: column n's partial sums side by side
    out_ptr,                # (N,) in the output dtype
    N, R,
    BLOCK_N: tl.constexpr,  # table rows per program
    BLOCK_R: tl.constexpr,  # partial sums per loop iteration
):
    rows = tl.program_id(axis=0) * BLOCK_N + tl.arange(0, BLOCK_N)          # (BLOCK_N,)
    row_ok = rows < N
    acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)                     # summed element-wise
    for r in range(0, R, BLOCK_R):
        cols = r + tl.arange(0, BLOCK_R)                                     # (BLOCK_R,)
        mask = row_ok[:, None] & (cols < R)[None, :]
        acc += tl.load(part_ptr + rows.to(tl.int64)[:, None] * R + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=row_ok)


_BLOCK_N, _BLOCK_R = 16, 128


def sum_partials(part: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """part (N, R) fp32 -> (N,) in ``dtype``: each row of the table summed in fp32, then rounded once.
    Runs where the kernels run (a GPU, or Triton's interpreter); the callers are Triton passes."""
    if part.dim() != 2 or part.dtype != torch.float32:
        raise ValueError(f"part must be an (N, R) fp32 table of partial sums, got {tuple(part.shape)} {part.dtype}")
    env.check_device(part)
    N, R = part.shape
    if N == 0 or R == 0:
        return part.sum(1).to(dtype)
    # The kernel rounds into fp32, fp16 or bf16 itself, except where bf16 cannot be stored that way:
    # the interpreter keeps bf16 as raw 16-bit integers, and Triton before 3.9 cannot compile bf16
    # below sm_80. There, and for any other dtype, torch rounds the fp32 sums.
    direct = dtype in (torch.float32, torch.float16) or (
        dtype == torch.bfloat16 and not env.interpreting() and env.capability(part.device) >= (8, 0))
    part = part.contiguous()
    out = torch.empty(N, dtype=dtype if direct else torch.float32, device=part.device)
    _sum_partials_kernel[(triton.cdiv(N, _BLOCK_N),)](part, out, N, R, BLOCK_N=_BLOCK_N, BLOCK_R=_BLOCK_R,
                                                       num_warps=4)
    return out if direct else out.to(dtype)
