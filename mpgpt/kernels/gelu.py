"""GELU's backward in one pass: dZ = dY * gelu'(Z), computed in fp32, stored in dY's dtype.
With the layer's bias gradient summed beside it: db = sum over rows of dZ (`gelu_backward_bias`).

TritonLinear's forward fuses GELU into the matmul's epilogue and keeps Z, the pre-activation.
Its backward then needs dZ = dY * gelu'(Z) before the two gradient GEMMs. Written with torch ops
(`gelu_tanh_grad` in linear.py) that is about a dozen elementwise kernels, each reading and
writing a full fp32 (tokens x 3072) tensor — far more memory traffic than the GEMMs around it
need. This kernel reads dY and Z once and writes dZ once: the memory floor of the operation.

    v = 2 sqrt(2/pi) (z + 0.044715 z^3),   s = sigmoid(v)
    gelu(z)  = z * s                                        (the tanh approximation)
    gelu'(z) = s + z * s (1 - s) * 2 sqrt(2/pi) (1 + 3 * 0.044715 z^2)

A bias b before the GELU (GPT-2's c_fc) also needs db = dZ summed over the rows. Written as
`dz.sum(0)` that is a second pass, reading the whole dZ again. `gelu_backward_bias` sums each program's tile columns while the tile is still in registers, so
dZ is read by nobody but the two GEMMs after it:

    program (j, i): columns j*BLOCK_N ..+BLOCK_N, rows i*ROWS ..+ROWS, BLOCK_M rows at a time
        dZ tile = dY tile * gelu'(Z tile)                stored (rounded once)
        acc += dZ tile                                    (BLOCK_M, BLOCK_N) fp32, element-wise
    part[cols, i] = acc summed over its rows               once, after the loop
    db = sum of part's rows                               (N, M / ROWS) fp32 -> (N,): tiny, one launch
                                                          rounded into the bias's dtype (partials.py)

Summing over rows inside the loop instead was slower than the two passes it replaces: the warps
then exchange partial sums through shared memory every iteration. The column sums add the fp32 dZ, before its rounding to dY's dtype, so db is at
least as accurate as the unfused `dz.sum(0)` over the rounded dZ. Each program sums a fixed set
of rows in a fixed order: the result is the same on every run (no atomics).
"""
from __future__ import annotations

import torch

from . import env, partials
from .env import tl, triton
from .epilogue import sigmoid_f32  # shared with the matmul's GELU epilogue

_BLOCK = 1024  # elements per program (the interpreter uses the same: one program per 1024)


@triton.jit
def gelu_grad_f32(z):
    """gelu'(z) in fp32 (the module docstring's formula); both kernels below call it."""
    v = 1.5957691216057308 * (z + 0.044715 * z * z * z)  # 2 sqrt(2/pi) (z + 0.044715 z^3)
    s = sigmoid_f32(v)
    return s + z * s * (1.0 - s) * 1.5957691216057308 * (1.0 + 0.134145 * z * z)  # 3 * 0.044715


@triton.jit
def _gelu_backward_kernel(
    g_ptr,                  # dY, flat, n elements (bf16/fp16/fp32)
    z_ptr,                  # Z, the saved pre-activation, flat, n elements
    out_ptr,                # dZ, flat, n elements
    n,                      # number of elements
    BLOCK: tl.constexpr,    # elements per program
):
    offs = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (g * gelu_grad_f32(z)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_backward_bias_kernel(
    g_ptr,                  # dY, (M, N) row-major contiguous (bf16/fp16/fp32)
    z_ptr,                  # Z, the saved pre-activation, (M, N) row-major contiguous
    out_ptr,                # dZ, (M, N) row-major contiguous
    part_ptr,               # (N, R) fp32: column n's sum over row group r at n * R + r
    M, N, R,                # rows (tokens), columns (features), row groups (cdiv(M, ROWS))
    ROWS: tl.constexpr,     # rows per program, a multiple of BLOCK_M
    BLOCK_M: tl.constexpr,  # rows per loop iteration
    BLOCK_N: tl.constexpr,  # columns per program
):
    # One grid axis, column blocks fastest (so the programs running at once cover whole rows):
    # CUDA caps the second and third grid axes at 65535 programs, which row groups would pass
    # beyond a few million rows.
    pid = tl.program_id(axis=0)
    n_blocks = tl.cdiv(N, BLOCK_N)
    pid_n = pid % n_blocks
    pid_r = pid // n_blocks
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                        # (BLOCK_N,)
    col_ok = cols < N
    # Summed element by element across iterations and over the rows only once at the end: a sum
    # over rows inside the loop would make the warps exchange partial sums every iteration.
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(0, ROWS, BLOCK_M):
        rows = pid_r * ROWS + r + tl.arange(0, BLOCK_M)                   # (BLOCK_M,)
        mask = (rows < M)[:, None] & col_ok[None, :]                      # (BLOCK_M, BLOCK_N)
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]             # 64-bit: M * N may pass 2^31
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dz = g * gelu_grad_f32(z)
        tl.store(out_ptr + offs, dz.to(out_ptr.dtype.element_ty), mask=mask)
        acc += dz                                                           # masked elements are 0
    tl.store(part_ptr + cols * R + pid_r, tl.sum(acc, axis=0), mask=col_ok)


# (ROWS, BLOCK_M, BLOCK_N, num_warps) on a GPU; the interpreter runs one numpy op per tile, so there
# large tiles keep the tests fast. The GPU default is the fastest of ten tile sizes at GPT-2's
# (12288, 3072), one loop iteration per program, and faster than Inductor's two kernels (measured:
# record kernels-gelu-backward-h200).
_BIAS_CONFIG = (64, 64, 64, 4)
_INTERPRET_BIAS_CONFIG = (64, 64, 64, 1)


def gelu_backward_bias(grad: torch.Tensor, z: torch.Tensor, config=None,
                       db_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(dZ, db): dZ = grad * gelu'(z) as in `gelu_backward`, and db = dZ summed over the rows.

    grad and z: the same (M, N) shape, on the same device. dZ: a new contiguous (M, N) tensor in
    grad's dtype; db: (N,) in ``db_dtype``, the fp32 sum of the unrounded fp32 dZ rounded once
    (partials.sum_partials). `config` (ROWS, BLOCK_M, BLOCK_N, num_warps) overrides the tile
    sizes, for benchmarks."""
    if grad.dim() != 2 or grad.shape != z.shape:
        raise ValueError(f"grad and z must be (M, N) matrices of the same shape, got {tuple(grad.shape)} and "
                         f"{tuple(z.shape)}; reshape to (tokens, features) first")
    if grad.device != z.device:
        raise ValueError(f"grad is on {grad.device} but z is on {z.device}")
    env.check_device(grad)
    g, zc = grad.contiguous(), z.contiguous()
    M, N = g.shape
    interpreted = env.interpreting()
    rows, block_m, block_n, warps = env.tile_config(config, _INTERPRET_BIAS_CONFIG if interpreted else _BIAS_CONFIG,
                                                    ("ROWS", "BLOCK_M", "BLOCK_N", "num_warps"))
    if any(b < 1 or b & (b - 1) for b in (block_m, block_n)) or rows < 1 or rows % block_m:
        raise ValueError(f"config: BLOCK_M={block_m} and BLOCK_N={block_n} must be powers of two and ROWS={rows} "
                         "a multiple of BLOCK_M")
    out = torch.empty(g.shape, dtype=torch.float32 if interpreted else g.dtype, device=g.device)
    R = triton.cdiv(M, rows)
    # (N, R): each column's partial sums side by side, so the last sum runs along contiguous memory
    part = torch.empty((N, R), dtype=torch.float32, device=g.device)
    if M == 0 or N == 0:
        return out.to(g.dtype), torch.zeros(N, dtype=db_dtype, device=g.device)
    grid = (triton.cdiv(N, block_n) * R,)  # program j + i * (column blocks): see the kernel
    _gelu_backward_bias_kernel[grid](g, zc, out, part, M, N, R, ROWS=rows, BLOCK_M=block_m, BLOCK_N=block_n,
                                     num_warps=warps)
    return out.to(g.dtype), partials.sum_partials(part, db_dtype)


def gelu_backward(grad: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """dZ = grad * gelu'(z) (tanh approximation), evaluated in fp32 and returned in grad's dtype.

    grad and z: the same shape, on the same device; any float dtypes. A new contiguous tensor."""
    if grad.shape != z.shape:
        raise ValueError(f"grad and z must have the same shape, got {tuple(grad.shape)} and {tuple(z.shape)}")
    if grad.device != z.device:
        raise ValueError(f"grad is on {grad.device} but z is on {z.device}")
    env.check_device(grad)
    g, zc = grad.contiguous(), z.contiguous()
    n = g.numel()
    if n >= 2**31:
        raise ValueError(f"{n} elements: offsets are 32-bit inside the kernel; split the tensor")
    # The interpreter rounds fp32 -> bf16 by truncation (see grouped.py): write fp32, let torch round.
    out_dtype = torch.float32 if env.interpreting() else g.dtype
    out = torch.empty(g.shape, dtype=out_dtype, device=g.device)
    if n:
        _gelu_backward_kernel[(triton.cdiv(n, _BLOCK),)](g, zc, out, n, BLOCK=_BLOCK)
    return out.to(g.dtype)
