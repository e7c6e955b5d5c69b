"""Jitted helpers that more than one kernel calls (chapter 6).

Whichever way a kernel gets its fp32 accumulator tile (the grouped kernel's pointer loads in
grouped.py, the persistent kernel's TMA loads in tma.py), what happens next is the same, so it is
written once here:

* `tile_coords`: which output tile a program computes, in *grouped* order;
* `bias_act`: the fused epilogue in fp32, z = acc + bias and y = act(z);
* `store_tile`: masked pointer stores of y (and z), rounded once to the output dtype;
* `sigmoid_f32`: the overflow-free sigmoid both GELU's forward (here) and its backward (gelu.py)
  are written with.

This module imports nothing from the kernel modules, so each of them can import it.
"""
from __future__ import annotations

from .env import tl, triton


@triton.jit
def sigmoid_f32(v):
    """sigmoid(v) in fp32 without overflow, with one approximate reciprocal.

    e = exp(-|v|) <= 1 never overflows (exp(-v) would, for v < -88). Then sigmoid(v) = r for
    v >= 0 and e * r for v < 0, with r = 1 / (1 + e). `tl.fdiv(..., ieee_rounding=False)` is
    the GPU's fast division (PTX div.full.f32: at most 2 ulp off, per the PTX ISA manual), a
    few instructions instead of the correctly rounded `/` (div.rn.f32) with its slow path, which
    two divisions per element made visible in the matmul's GELU epilogue."""
    e = tl.exp(-tl.abs(v))
    r = tl.fdiv(tl.full(v.shape, 1.0, tl.float32), 1.0 + e, ieee_rounding=False)
    return tl.where(v >= 0, r, e * r)


@triton.jit
def tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(row, column) of output tile `tile_id` in grouped order.

    Row-major order (tile 0, 1, 2, ... along a row of tiles) makes the programs running at the
    same time share one row of A but read every column of B. Grouped order walks GROUP_M rows of
    tiles column by column instead, so those programs reuse GROUP_M rows of A and a few columns
    of B from L2 (Triton tutorial 03). With num_pid_n = 3, GROUP_M = 2:

        tile_id:  0 2 4        (rows 0-1: the first group)
                  1 3 5
                  6 7 8        (row 2: a last group of one row)
    """
    num_pid_in_group = GROUP_M * num_pid_n          # tiles in one group of GROUP_M rows
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)  # the last group may be shorter
    pid_m = first_pid_m + ((tile_id % num_pid_in_group) % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def bias_act(acc, bias_ptr, offs_n, N,
             HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr):
    """fp32 epilogue on one tile: z = acc + bias; y = act(z). Returns (z, y).

    acc: (BLOCK_M, BLOCK_N) fp32; offs_n: (BLOCK_N,) the tile's column indices (bias[n] is
    added to column n; columns >= N read 0). ACTIVATION: "" (none), "gelu" (tanh approximation)
    or "relu"."""
    z = acc
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)  # (BLOCK_N,)
        z = z + bias.to(tl.float32)[None, :]                             # broadcast over rows
    if ACTIVATION == "gelu":
        # tanh-approximate GELU, written as z * sigmoid(2u) with u = sqrt(2/pi) (z + 0.044715 z^3)
        v = 1.5957691216057308 * (z + 0.044715 * z * z * z)  # 2 * sqrt(2/pi) = 1.5957...
        y = z * sigmoid_f32(v)
    elif ACTIVATION == "relu":
        y = tl.maximum(z, 0.0)
    else:
        y = z
    return z, y


@triton.jit
def store_tile(y, z, c_ptr, z_ptr, offs_cm, offs_cn, M, N, stride_cm, stride_cn, stride_zm, stride_zn,
               STORE_Z: tl.constexpr):
    """Masked pointer stores of one output tile y (and the pre-activation z), rounded once.

    y, z: (BLOCK_M, BLOCK_N) fp32; offs_cm (BLOCK_M,), offs_cn (BLOCK_N,): the tile's row and
    column indices; elements past M or N are not written."""
    mask = (offs_cm[:, None] < M) & (offs_cn[None, :] < N)                             # (BLOCK_M, BLOCK_N)
    c_ptrs = c_ptr + offs_cm[:, None] * stride_cm + offs_cn[None, :] * stride_cn
    tl.store(c_ptrs, y.to(c_ptr.dtype.element_ty), mask=mask)
    if STORE_Z:
        z_ptrs = z_ptr + offs_cm[:, None] * stride_zm + offs_cn[None, :] * stride_zn
        tl.store(z_ptrs, z.to(z_ptr.dtype.element_ty), mask=mask)
