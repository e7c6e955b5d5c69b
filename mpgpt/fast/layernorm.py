"""The residual add and the LayerNorm after it, with LayerNorm's backward in one Triton pass.

Each block of the GPT adds a branch (attention's or the MLP's output) into the residual stream and
normalises the sum for the next branch:

    x' = x + branch                                 the residual stream, (M, C)
    y  = (x' - mean) * rstd * w + b                 per row: mean, rstd = 1 / sqrt(var + eps)

The backward pass gets dy (from the next branch's matmul) and dx'_res (the stream's gradient from
later blocks) and needs, with xhat = (x' - mean) * rstd and g = dy * w,

    dx' = dx'_res + rstd * (g - mean(g) - xhat * mean(g * xhat))     per row (a row reduction)
    dw  = sum over rows of dy * xhat,   db = sum over rows of dy      per column (a column reduction)

and dx' is the gradient of both x and the branch. Inductor compiles the row part and the column
part as two kernels that each read dy and x' (or, with its "mix-order" reduction, as one kernel
whose many partial sums then take separate reductions).
`layer_norm_backward` does both in one pass, as `gelu.gelu_backward_bias` does for c_fc: each
program takes ROWS rows, BLOCK_M at a time, whole rows wide, writes dx' and keeps element-wise
fp32 sums of dy * xhat and dy; it sums them over its rows once, at the end, into a small table
that one last sum over contiguous memory finishes and rounds into the parameters' dtype
(`partials.py`; dw's and db's columns side by side: one launch for both). Bytes: read dy, x',
dx'_res, write dx', once each.

Where the branch's last matmul left its bias b out and the add puts it in, x' = x + (branch + b)
(`residual_layer_norm`'s branch_bias; mpgpt.fast.convert(model, fused_ln=True, bias_in_add=True) does this with
c_proj's biases), b's gradient is dx' summed over the rows. With SUM_DX the kernel keeps that sum
too, from dx' in fp32 before it is rounded, as a third table for the same last launch; the
reduction the matmul's bias would have needed over the same (M, C) gradient is gone.

At GPT-2's (12288, 768) on Hopper it runs faster than Inductor's two kernels (measured: record
kernels-layer-norm-one-sum-h200). The layout is what makes it pay: held as (BLOCK_M, 1024) tiles,
each row would be split across the warps, whose partial row sums then meet in shared memory twice
per iteration, which was slower than Inductor. Whole rows live in registers, so the kernel suits
GPT-2-sized rows (C in the hundreds or low thousands); much wider rows still compute correctly but
spill.

Whole rows also cost registers (about 170 a thread at C = 768 with the specialisations a launch at
GPT-2's shapes gets: 16-byte aligned pointers, sizes divisible by 16), so three 4-warp programs fit
on a multiprocessor. Loading each iteration's rows only when it starts leaves a warp waiting on
memory, then on dx'_res; with STAGES = 3 Triton's software pipeliner requests the rows of the next
iterations into shared memory while the current ones are computed. That takes about 210
registers (two programs per multiprocessor) and is the default, at (64, 4, 4): one wave of
programs at GPT-2's shape. (Making C a compile-time constant, or splitting the row into two
tiles, took more registers and did not pay.)

A second kernel (config method "two-pass") holds (BLOCK_M, 256) tiles only, 72 registers a
thread: it first walks each row for its two sums, then the columns chunk by chunk, reading dy and
x' a second time (from the L2 cache, if it still holds them). It is not the default: it is slower
at GPT-2's shape (measured: record kernels-grads-h200).

The forward pass stays torch ops (`residual_layer_norm`'s autograd Function): Inductor already fuses
the add, the statistics and the normalisation into one kernel. The Function keeps x', mean and
rstd for the backward pass, as torch's LayerNorm does. On a CPU, or without Triton, the backward
runs as the same formulas in torch ops.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from mpgpt.fused_loss import first_derivative_only

from mpgpt.kernels import env, library, partials
from mpgpt.kernels.env import tl, triton
from mpgpt.kernels.linear import _compute_dtype, _op


@triton.jit
def _layer_norm_backward_kernel(
    dy_ptr,                 # (M, C) row-major: the gradient of y
    x_ptr,                  # (M, C) row-major: x', LayerNorm's input
    mean_ptr, rstd_ptr,     # (M,) fp32 each
    w_ptr,                  # (C,) LayerNorm's weight
    res_ptr,                # (M, C) row-major: dx'_res, read only if HAS_RES
    dx_ptr,                 # (M, C) row-major: dx', written
    part_ptr,               # (2 or 3, C, R) fp32: [0] dw's, [1] db's and [2] (if SUM_DX) dx''s partial
                            # sum of column c over row group r
    M, C, R,                # rows, columns, row groups (cdiv(M, ROWS))
    HAS_RES: tl.constexpr,
    SUM_DX: tl.constexpr,   # also sum dx' over the rows: the gradient of a bias added into x'
    ROWS: tl.constexpr,     # rows per program, a multiple of BLOCK_M
    BLOCK_M: tl.constexpr,  # rows per loop iteration
    CHUNK: tl.constexpr,    # columns per chunk: 256 = one warp's 32 threads x 8 bf16 (16 bytes each)
    NCHUNK: tl.constexpr,   # a power of two >= C / CHUNK
    STAGES: tl.constexpr,   # 1: each iteration loads its rows when it starts; 2 or more: Triton's software
                            # pipeliner loads them that many iterations ahead (through shared memory)
):
    # A row is held as NCHUNK chunks of CHUNK columns: tiles are (NCHUNK, BLOCK_M, CHUNK), so that
    # one warp spans a chunk and the warps split the rows. A row's sums then stay inside one warp
    # (register shuffles); as a (BLOCK_M, C) tile the warps would split each row and exchange
    # partial sums through shared memory twice per iteration.
    pid = tl.program_id(axis=0)
    cols = tl.arange(0, NCHUNK)[:, None, None] * CHUNK + tl.arange(0, CHUNK)[None, None, :]  # (NCHUNK, 1, CHUNK)
    col_ok = cols < C
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    # Summed element by element across iterations and over the rows only once at the end (summing
    # over the rows each iteration was slower: it puts a reduction in every iteration).
    acc_w = tl.zeros((NCHUNK, BLOCK_M, CHUNK), dtype=tl.float32)          # sum of dy * xhat
    acc_b = tl.zeros((NCHUNK, BLOCK_M, CHUNK), dtype=tl.float32)          # sum of dy
    acc_x = tl.zeros((NCHUNK, BLOCK_M, CHUNK), dtype=tl.float32)          # sum of dx' (SUM_DX only)
    for r in tl.range(0, ROWS, BLOCK_M, num_stages=STAGES):
        rows = pid * ROWS + r + tl.arange(0, BLOCK_M)                       # (BLOCK_M,)
        row_ok = rows < M
        mask = row_ok[None, :, None] & col_ok                               # (NCHUNK, BLOCK_M, CHUNK)
        offs = rows.to(tl.int64)[None, :, None] * C + cols                  # 64-bit: M * C may pass 2^31
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)[None, :, None]
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)[None, :, None]
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        g = dy * w
        c1 = tl.sum(tl.sum(g * xhat, axis=2), axis=0) / C                   # (BLOCK_M,) mean(g * xhat)
        c2 = tl.sum(tl.sum(g, axis=2), axis=0) / C                          # (BLOCK_M,) mean(g)
        dx = (g - c2[None, :, None] - xhat * c1[None, :, None]) * rstd
        if HAS_RES:
            dx += tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        acc_w += dy * xhat                                                  # masked elements are 0
        acc_b += dy
        if SUM_DX:
            acc_x += dx  # 0 in rows past M (rstd and dx'_res load as 0); padding columns are never stored
    part_cols = tl.arange(0, NCHUNK)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]  # (NCHUNK, CHUNK)
    part_ok = part_cols < C
    tl.store(part_ptr + part_cols * R + pid, tl.sum(acc_w, axis=1), mask=part_ok)
    tl.store(part_ptr + (C + part_cols) * R + pid, tl.sum(acc_b, axis=1), mask=part_ok)
    if SUM_DX:
        tl.store(part_ptr + (2 * C + part_cols) * R + pid, tl.sum(acc_x, axis=1), mask=part_ok)


@triton.jit
def _layer_norm_backward_two_pass_kernel(
    dy_ptr, x_ptr, mean_ptr, rstd_ptr, w_ptr, res_ptr, dx_ptr, part_ptr,  # as in the kernel above
    stat_ptr,               # (2, M) fp32 scratch: [0] mean(g * xhat) and [1] mean(g) of each row
    M, C, R,
    HAS_RES: tl.constexpr,
    SUM_DX: tl.constexpr,
    ROWS: tl.constexpr,     # rows per program, a multiple of BLOCK_M
    BLOCK_M: tl.constexpr,  # rows per loop iteration
    CHUNK: tl.constexpr,    # columns per loop iteration
):
    # The same results as the kernel above, with tiles of (BLOCK_M, CHUNK) only: a few registers a
    # thread instead of whole rows, so more programs share a multiprocessor. The price is a second
    # read of dy and x' (from the L2 cache if it still holds them). Pass 1 walks each row's chunks for
    # its two sums and keeps them in `stat`; pass 2 walks the columns chunk by chunk and, for each,
    # the program's rows: dx' and the element-wise sums for dw and db.
    pid = tl.program_id(axis=0)
    r_idx = tl.arange(0, BLOCK_M)
    c_idx = tl.arange(0, CHUNK)
    for r in range(0, ROWS, BLOCK_M):                                         # pass 1: row sums
        rows = pid * ROWS + r + r_idx                                         # (BLOCK_M,)
        row_ok = rows < M
        mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)[:, None]
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)[:, None]
        s1 = tl.zeros((BLOCK_M, CHUNK), dtype=tl.float32)                     # sum of g * xhat, element-wise
        s2 = tl.zeros((BLOCK_M, CHUNK), dtype=tl.float32)                     # sum of g
        for c in range(0, C, CHUNK):
            cols = c + c_idx
            mask = row_ok[:, None] & (cols < C)[None, :]                      # (BLOCK_M, CHUNK)
            offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
            # w read by every row of the tile (from the L1 cache): a (BLOCK_M, CHUNK) load lands in the
            # tile's own layout, where a (CHUNK,) load would be redistributed through shared memory
            # each iteration
            w = tl.load(w_ptr + 0 * rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            g = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32) * w
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            s1 += g * tl.where(mask, (x - mean) * rstd, 0.0)
            s2 += g
        tl.store(stat_ptr + rows, tl.sum(s1, axis=1) / C, mask=row_ok)
        tl.store(stat_ptr + M + rows, tl.sum(s2, axis=1) / C, mask=row_ok)
    tl.debug_barrier()  # every thread's row sums written (and visible) before any thread reads them
    for c in range(0, C, CHUNK):                                              # pass 2: chunk by chunk
        cols = c + c_idx                                                      # (CHUNK,)
        col_ok = cols < C
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_w = tl.zeros((BLOCK_M, CHUNK), dtype=tl.float32)                  # sum of dy * xhat
        acc_b = tl.zeros((BLOCK_M, CHUNK), dtype=tl.float32)                  # sum of dy
        acc_x = tl.zeros((BLOCK_M, CHUNK), dtype=tl.float32)                  # sum of dx' (SUM_DX only)
        for r in range(0, ROWS, BLOCK_M):
            rows = pid * ROWS + r + r_idx
            row_ok = rows < M
            mask = row_ok[:, None] & col_ok[None, :]
            offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
            dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)[:, None]
            rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)[:, None]
            c1 = tl.load(stat_ptr + rows, mask=row_ok, other=0.0)[:, None]
            c2 = tl.load(stat_ptr + M + rows, mask=row_ok, other=0.0)[:, None]
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
            dx = (dy * w - c2 - xhat * c1) * rstd
            if HAS_RES:
                dx += tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            acc_w += dy * xhat
            acc_b += dy
            if SUM_DX:
                acc_x += dx                                                   # 0 in rows past M
        tl.store(part_ptr + cols * R + pid, tl.sum(acc_w, axis=0), mask=col_ok)
        tl.store(part_ptr + (C + cols) * R + pid, tl.sum(acc_b, axis=0), mask=col_ok)
        if SUM_DX:
            tl.store(part_ptr + (2 * C + cols) * R + pid, tl.sum(acc_x, axis=0), mask=col_ok)


# (ROWS, BLOCK_M, num_warps, method, stages) on a GPU: the fastest of a sweep at GPT-2's
# (12288, 768) on Hopper, with and without the dx' sums (`python -m mpgpt.bench kernels` sweeps
# LAYER_NORM_CONFIGS). With the third sum the kernel takes 255 registers, still two programs per
# multiprocessor. The interpreter runs one numpy op per tile, so there large tiles keep the tests fast.
_CONFIG = (64, 4, 4, "whole-rows", 3)  # with or without the third sum (SUM_DX): the fastest of both sweeps
_INTERPRET_CONFIG = (64, 32, 1)
_CHUNK = 256


def layer_norm_backward(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor,
                        dres: Optional[Tensor] = None, config=None, sum_dx: bool = False) -> tuple[Tensor, ...]:
    """(dx', dw, db) for y = LayerNorm(x') as the module docstring says, with dx'_res = ``dres``
    added to dx' (None: nothing added). With ``sum_dx``, (dx', dw, db, dbias): dbias is dx' summed
    over the rows in fp32, the gradient of a bias added into x' (see `residual_layer_norm`).

    dy, x, dres: (M, C) each; mean, rstd: (M,) fp32; weight: (C,). dx': a new contiguous (M, C)
    tensor in x's dtype; dw, db: (C,) fp32 (the two rows of one (2, C) tensor). `config`
    (ROWS, BLOCK_M, num_warps[, method[, stages]]) overrides the tile sizes, for benchmarks; method
    "whole-rows" (the default kernel) or "two-pass" (the second kernel: row sums first, then the
    columns chunk by chunk); stages (whole rows only): 1 loads each iteration's rows as it starts,
    2 or more has Triton's pipeliner load them that many iterations ahead."""
    dx, dwb = _layer_norm_backward_packed(dy, x, mean, rstd, weight, dres, config, sum_dx=sum_dx)
    return (dx, *dwb.unbind(0))


def _layer_norm_backward_packed(dy, x, mean, rstd, weight, dres=None, config=None,
                                dwb_dtype=torch.float32, sum_dx=False) -> tuple[Tensor, Tensor]:
    """(dx', dwb) with dwb = stack([dw, db]) (and dx''s column sums as a third row with ``sum_dx``),
    a (2, C) or (3, C) tensor in ``dwb_dtype`` (fp32 sums, rounded once): what the custom operator
    returns (its outputs may not be views of one tensor, and one launch of partials.sum_partials
    makes every row)."""
    if x.dim() != 2 or dy.shape != x.shape or (dres is not None and dres.shape != x.shape):
        raise ValueError(f"dy, x and dres must be (M, C) matrices of one shape, got {tuple(dy.shape)}, {tuple(x.shape)}"
                         f" and {None if dres is None else tuple(dres.shape)}; reshape to (tokens, features) first")
    M, C = x.shape
    if mean.shape != (M,) or rstd.shape != (M,) or weight.shape != (C,):
        raise ValueError(f"mean and rstd must be ({M},) and weight ({C},), got {tuple(mean.shape)}, "
                         f"{tuple(rstd.shape)} and {tuple(weight.shape)}")
    env.check_device(x)
    default = _INTERPRET_CONFIG if env.interpreting() else _CONFIG
    rows, block_m, warps, *rest = env.tile_config(config, default, ("ROWS", "BLOCK_M", "num_warps", "method", "stages"),
                                                  optional=2)
    method, stages = (list(rest) + ["whole-rows", 1][len(rest):])[:2]
    if method not in ("whole-rows", "two-pass"):
        raise ValueError(f"config: the method must be 'whole-rows' or 'two-pass', got {method!r}")
    if not isinstance(stages, int) or stages < 1 or (method == "two-pass" and stages != 1):
        raise ValueError(f"config: stages must be a positive integer (1 for 'two-pass'), got {stages!r}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"config: BLOCK_M={block_m} must be a power of two")
    if rows < 1 or rows % block_m:
        raise ValueError(f"config: ROWS={rows} must be a positive multiple of BLOCK_M={block_m}")
    if env.interpreting() and torch.bfloat16 in (dy.dtype, x.dtype, weight.dtype, getattr(dres, "dtype", None)):
        # The interpreter keeps bf16 as raw 16-bit integers and its arithmetic on them is wrong: widen first.
        dx, dwb = _layer_norm_backward_packed(dy.float(), x.float(), mean, rstd, weight.float(),
                                              None if dres is None else dres.float(),
                                              (rows, block_m, warps, method, stages), dwb_dtype, sum_dx)
        return dx.to(x.dtype), dwb
    dy, x = dy.contiguous(), x.contiguous()
    dres = dres.contiguous() if dres is not None else None
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    tables = 3 if sum_dx else 2
    if M == 0 or C == 0:
        return dx, torch.zeros((tables, C), dtype=dwb_dtype, device=x.device)
    R = triton.cdiv(M, rows)
    part = torch.empty((tables, C, R), dtype=torch.float32, device=x.device)  # each column's partial sums side by side
    chunk = min(_CHUNK, triton.next_power_of_2(C))
    args = (dy, x, mean.float().contiguous(), rstd.float().contiguous(), weight.contiguous(),
            dres if dres is not None else x, dx, part)
    if method == "two-pass":
        stat = torch.empty((2, M), dtype=torch.float32, device=x.device)
        _layer_norm_backward_two_pass_kernel[(R,)](*args, stat, M, C, R, HAS_RES=dres is not None, SUM_DX=sum_dx,
                                                   ROWS=rows, BLOCK_M=block_m, CHUNK=chunk, num_warps=warps)
    else:
        _layer_norm_backward_kernel[(R,)](*args, M, C, R, HAS_RES=dres is not None, SUM_DX=sum_dx, ROWS=rows,
                                          BLOCK_M=block_m, CHUNK=chunk,
                                          NCHUNK=triton.next_power_of_2(triton.cdiv(C, chunk)), STAGES=stages,
                                          num_warps=warps)
    return dx, partials.sum_partials(part.view(tables * C, R), dwb_dtype).view(tables, C)  # every row: one launch


def layer_norm_backward_reference(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor,
                                  dres: Optional[Tensor] = None, sum_dx: bool = False) -> tuple[Tensor, ...]:
    """The same results with torch ops, in fp32 (dx' returned in x's dtype; with ``sum_dx`` the
    fourth, dx' summed over the rows, from the fp32 dx' before rounding)."""
    xhat = (x.float() - mean[:, None]) * rstd[:, None]
    g = dy.float() * weight.float()
    dx = (g - g.mean(1, keepdim=True) - xhat * (g * xhat).mean(1, keepdim=True)) * rstd[:, None]
    if dres is not None:
        dx = dx + dres.float()
    sums = (dy.float() * xhat).sum(0), dy.float().sum(0)
    return (dx.to(x.dtype), *sums, dx.sum(0)) if sum_dx else (dx.to(x.dtype), *sums)


# ----------------------------------------------------------------------------------------------
# The backward pass as a custom operator, the autograd Function and the functional form
# ----------------------------------------------------------------------------------------------
def _triton_backward(*tensors: Tensor) -> bool:
    """Whether the backward runs as the Triton pass: it can for every operand's dtype here (a
    module-level function, so tests can switch it)."""
    return all(env.runs_compiled(t) for t in tensors)


def ln_backward_impl(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor,
                     dres: Optional[Tensor], sum_dx: bool, dwb_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(dx', stack([dw, db])) on the Triton pass where it runs, else torch's ops; dw and db summed
    in fp32 and rounded once into ``dwb_dtype`` (the parameters' dtype, so no cast follows). With
    ``sum_dx``, the stack has a third row: dx' summed over the rows."""
    if _triton_backward(dy, x, weight):
        return _layer_norm_backward_packed(dy, x, mean, rstd, weight, dres, dwb_dtype=dwb_dtype, sum_dx=sum_dx)
    dx, *sums = layer_norm_backward_reference(dy, x, mean, rstd, weight, dres, sum_dx)
    return dx, torch.stack(sums).to(dwb_dtype)


def _ln_backward_fake(dy, x, mean, rstd, weight, dres, sum_dx, dwb_dtype):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty((3 if sum_dx else 2, x.shape[1]), dtype=dwb_dtype))


ln_backward_op = library.operator("layer_norm_backward", ln_backward_impl, _ln_backward_fake)


class _ResidualLayerNormFunction(torch.autograd.Function):
    """x' = x + branch (+ branch_bias), or x' = x without a branch, then y = LayerNorm(x') in
    ``out_dtype``; returns (x', y) with a branch, y alone without. The backward pass names every
    dtype, so it does not depend on the autocast state it runs under."""

    @staticmethod
    def forward(ctx, x, branch, weight, bias, eps, out_dtype, branch_bias):
        ctx.set_materialize_grads(False)  # x' unused after the last block: no zero gradient to read
        if branch_bias is not None:
            branch = branch + branch_bias.to(branch.dtype)                # the bias the branch's matmul left out
        xs = x + branch if branch is not None else x                      # (..., C), x's dtype
        x2 = xs.reshape(-1, xs.shape[-1])                                  # (M, C)
        xf = x2.float()
        var, mean = torch.var_mean(xf, dim=1, correction=0)               # (M,) each
        rstd = torch.rsqrt(var + eps)
        y = (xf - mean[:, None]) * rstd[:, None] * weight.float()
        if bias is not None:
            y = y + bias.float()
        ctx.save_for_backward(x2, mean, rstd, weight)
        ctx.meta = (xs.shape, x.dtype, None if branch is None else branch.dtype, weight.dtype,
                    None if bias is None else bias.dtype, None if branch_bias is None else branch_bias.dtype)
        y = y.to(out_dtype).view(xs.shape)
        return (xs, y) if branch is not None else y

    @staticmethod
    def backward(ctx, *grads):
        first_derivative_only("the fused LayerNorm", "mpgpt.fast.convert(model)")
        x2, mean, rstd, weight = ctx.saved_tensors
        shape, x_dt, branch_dt, w_dt, b_dt, bb_dt = ctx.meta
        d_res, dy = grads if branch_dt is not None else (None, grads[0])
        dy = dy.reshape(x2.shape) if dy is not None else torch.zeros_like(x2)
        d_res = d_res.reshape(x2.shape).to(x2.dtype) if d_res is not None else None
        # The sums come in the parameters' dtype when they share one, so no cast kernels follow.
        dwb_dt = w_dt if b_dt in (None, w_dt) and bb_dt in (None, w_dt) else torch.float32
        dx, dwb = _op(ln_backward_op, ln_backward_impl)(dy, x2, mean, rstd, weight, d_res, bb_dt is not None,
                                                        dwb_dt)  # (M, C), (2 or 3, C)
        dx = dx.view(shape)  # the gradient of x' = x + branch (+ branch_bias), so of both
        return (dx.to(x_dt), dx.to(branch_dt) if branch_dt is not None else None, dwb[0].to(w_dt),
                dwb[1].to(b_dt) if b_dt is not None else None, None, None,
                dwb[2].to(bb_dt) if bb_dt is not None else None)  # the bias's gradient: dx' summed over rows


def residual_layer_norm(x: Tensor, branch: Optional[Tensor], ln: torch.nn.LayerNorm,
                        out_dtype: Optional[torch.dtype] = None, branch_bias: Optional[Tensor] = None):
    """(x + branch, ln(x + branch)) with the backward pass of the module docstring, or ln(x) alone
    when ``branch`` is None. Under autocast or with 16-bit x, y comes back in ``out_dtype``; None:
    autocast's dtype under autocast (what the next matmul multiplies, so the matmul's cast is
    already done), x's dtype outside it. For an fp32 model outside autocast, exactly the unfused
    torch ops, whose y is fp32 whatever ``out_dtype`` says.

    ``branch_bias`` (C,): a bias the branch's last matmul left out, added here instead, x' = x +
    (branch + branch_bias). Its gradient is dx' summed over the rows, which the backward kernel
    sums while dx' is in its registers, so the matmul's own bias gradient (a separate reduction over
    the same (M, C) gradient) is not needed."""
    if ln.normalized_shape != (x.shape[-1],) or not ln.elementwise_affine:
        raise ValueError(f"residual_layer_norm needs an affine LayerNorm over the last dimension ({x.shape[-1]}), "
                         f"got normalized_shape={ln.normalized_shape}, elementwise_affine={ln.elementwise_affine}")
    if branch_bias is not None and (branch is None or branch_bias.shape != (x.shape[-1],)):
        raise ValueError(f"branch_bias must be a ({x.shape[-1]},) vector added to a branch, got "
                         f"{None if branch_bias is None else tuple(branch_bias.shape)} with "
                         f"{'no branch' if branch is None else 'a branch'}; pass branch_bias=None")
    dtype = _compute_dtype(x)
    if dtype is None:
        if branch_bias is not None:
            branch = branch + branch_bias
        xs = x + branch if branch is not None else x
        y = ln(xs)
        return (xs, y) if branch is not None else y
    return _ResidualLayerNormFunction.apply(x, branch, ln.weight, ln.bias, ln.eps, out_dtype or dtype, branch_bias)
