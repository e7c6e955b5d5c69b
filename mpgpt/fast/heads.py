"""The attention's input gradients merged back into c_attn's layout, with c_attn's bias gradient
summed in the same pass (`merge_heads_bias`).

The attention layer splits c_attn's output into heads: qkv (B, T, 3C) -> q, k, v, each viewed
as (B, nh, T, hs). The attention kernel's backward returns dq, dk, dv in its own layout, and
autograd then needs two things from them before c_attn's two gradient GEMMs:

    d_qkv = [dq | dk | dv] as a (B*T, 3C) matrix     a copy that undoes the head split
    db    = d_qkv summed over its rows               c_attn's bias gradient, (3C,)

Under torch.compile these are two passes: a copy kernel, then a column reduction that reads
d_qkv again. This kernel does both in one pass, as `gelu.gelu_backward_bias` does
for c_fc: each program copies a (ROWS, hs) strip, one head of one source, BLOCK_M rows at a
time, and keeps an element-wise fp32 sum of what it copied:

    program (s*nh + h, i), for source s (q, k or v) and head h:
        columns h*hs ..+hs of s, lanes d
        rows i*ROWS ..+ROWS (token r = b*T + t), BLOCK_M at a time:
            tile = s[b, h, t, d]                           any strides
            d_qkv[r, s*C + h*hs + d] = tile                row-major (B*T, 3C)
            acc += tile                                    (BLOCK_M, hs) fp32
    part[s*C + h*hs + d, i] = acc summed over rows      once, after the loop
    db = sum of part's rows                             (3C, R) fp32 -> (3C,), in the bias's dtype (partials.py)

One launch covers all three sources, faster than Inductor's two kernels and than one launch per
source (measured: record kernels-fused-backward-h200). The copy is exact; db
sums the copied values in fp32 in a fixed order, the same on every run.

The head size and the number of heads are compile-time constants of the kernel (one compiled
kernel per model shape): the divisions by 3 * NH and the head's mask then fold away. Compiled
ahead of time for sm_90 (Triton 3.6) with the specialisations a launch at GPT-2's shapes gets
(16-byte aligned pointers, strides divisible by 16, the unit stride a constant), it takes 40
registers a thread where it took 48, with 16-byte loads either way: registers do not bound this
kernel, and the constants save a few integer operations per row. Not yet timed on a GPU.
"""
from __future__ import annotations

import torch

from mpgpt.kernels import env, partials
from mpgpt.kernels.env import tl, triton


@triton.jit
def _merge_heads_sum_kernel(
    q_ptr, k_ptr, v_ptr,    # dq, dk, dv: (B, nh, T, hs) each, with the same strides
    out_ptr,                # d_qkv, (B*T, 3C) row-major contiguous
    part_ptr,               # (3C, R) fp32: column n's sum over row group r at n * R + r
    M, T, R,                # rows B*T, sequence length, row groups
    s_b, s_h, s_t, s_d,     # the sources' strides, in elements
    HS: tl.constexpr,       # head size and heads: compile-time constants of the model, so the
    NH: tl.constexpr,       # divisions and masks below fold
    ROWS: tl.constexpr,     # rows per program, a multiple of BLOCK_M
    BLOCK_M: tl.constexpr,  # rows per loop iteration
    BLOCK_D: tl.constexpr,  # a power of two >= HS: one program covers one whole head
):
    # One grid axis, (source, head) fastest: CUDA caps the second grid axis at 65535 programs,
    # which row groups would pass beyond a few million tokens.
    pid = tl.program_id(axis=0) % (3 * NH)                                  # source * NH + head
    pid_r = tl.program_id(axis=0) // (3 * NH)
    s, h = pid // NH, pid % NH
    if s == 0:
        src_ptr = q_ptr
    elif s == 1:
        src_ptr = k_ptr
    else:
        src_ptr = v_ptr
    d = tl.arange(0, BLOCK_D)                                               # (BLOCK_D,) lanes of head h
    d_ok = d < HS
    # One head per program: the column offsets are a scalar plus d * s_d, and Triton compiles
    # s_d == 1 as a constant, so each row of a tile is one contiguous read and write (16-byte
    # accesses in the compiled code).
    src_col = h.to(tl.int64) * s_h + d.to(tl.int64) * s_d
    out_col = (s * NH + h) * HS + d                                         # (BLOCK_D,) in d_qkv
    out_n = 3 * NH * HS
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for r in range(0, ROWS, BLOCK_M):
        rows = pid_r * ROWS + r + tl.arange(0, BLOCK_M)                     # (BLOCK_M,) tokens b*T + t
        mask = (rows < M)[:, None] & d_ok[None, :]                          # (BLOCK_M, BLOCK_D)
        src_row = (rows // T).to(tl.int64) * s_b + (rows % T).to(tl.int64) * s_t
        x = tl.load(src_ptr + src_row[:, None] + src_col[None, :], mask=mask, other=0.0)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * out_n + out_col[None, :], x, mask=mask)  # 64-bit offsets
        acc += x.to(tl.float32)                                              # masked elements are 0
    tl.store(part_ptr + out_col * R + pid_r, tl.sum(acc, axis=0), mask=d_ok)


# (ROWS, BLOCK_M, num_warps) on a GPU; the interpreter runs one numpy op per tile, so there large
# tiles keep the tests fast.
_CONFIG = (128, 32, 4)
_INTERPRET_CONFIG = (64, 64, 1)


def merge_heads_bias(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, config=None,
                     db_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_qkv, db) from the attention's input gradients, as the module docstring says.

    dq, dk, dv: (B, nh, T, hs) each, the same shape, dtype and device, any strides. d_qkv: a new
    contiguous (B*T, 3*nh*hs) tensor in their dtype, [dq | dk | dv] with heads side by side in each;
    db: (3*nh*hs,) in ``db_dtype``, d_qkv's column sums (fp32, rounded once). `config` (ROWS, BLOCK_M, num_warps) overrides the
    tile sizes, for benchmarks."""
    if dq.dim() != 4 or dk.shape != dq.shape or dv.shape != dq.shape:
        raise ValueError(f"dq, dk and dv must be (B, nh, T, hs) tensors of one shape, got {tuple(dq.shape)}, "
                         f"{tuple(dk.shape)} and {tuple(dv.shape)}")
    if dk.dtype != dq.dtype or dv.dtype != dq.dtype or dk.device != dq.device or dv.device != dq.device:
        raise ValueError(f"dq, dk and dv must share one dtype and device, got {dq.dtype}/{dq.device}, "
                         f"{dk.dtype}/{dk.device} and {dv.dtype}/{dv.device}")
    env.check_device(dq)
    B, nh, T, hs = dq.shape
    M, C = B * T, nh * hs
    rows, block_m, warps = env.tile_config(config, _INTERPRET_CONFIG if env.interpreting() else _CONFIG,
                                           ("ROWS", "BLOCK_M", "num_warps"))
    if block_m < 1 or block_m & (block_m - 1) or rows < 1 or rows % block_m:
        raise ValueError(f"config: BLOCK_M={block_m} must be a power of two and ROWS={rows} a multiple of it")
    out = torch.empty((M, 3 * C), dtype=dq.dtype, device=dq.device)
    if M == 0 or C == 0:
        return out, torch.zeros(3 * C, dtype=db_dtype, device=dq.device)
    if dq.dtype == torch.bfloat16 and env.interpreting():
        # The interpreter keeps bf16 as raw 16-bit integers: a copy survives that, a sum does not.
        d_qkv, db = merge_heads_bias(dq.float(), dk.float(), dv.float(), config, db_dtype)
        return d_qkv.to(dq.dtype), db
    if not dq.stride() == dk.stride() == dv.stride():  # one launch reads all three with one set of strides
        dq, dk, dv = dq.contiguous(), dk.contiguous(), dv.contiguous()
    R = triton.cdiv(M, rows)
    part = torch.empty((3 * C, R), dtype=torch.float32, device=dq.device)  # column-major partial sums
    _merge_heads_sum_kernel[(3 * nh * R,)](dq, dk, dv, out, part, M, T, R, *dq.stride(), HS=hs, NH=nh, ROWS=rows,
                                         BLOCK_M=block_m, BLOCK_D=triton.next_power_of_2(hs), num_warps=warps)
    return out, partials.sum_partials(part, db_dtype)


def merge_heads_reference(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                          with_bias: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The same two results with torch ops: what autograd computes for the unfused attention
    layer (the bias sum here in fp32, from the same rounded values). db is an empty tensor
    without ``with_bias``."""
    B, nh, T, hs = dq.shape
    d_qkv = torch.cat([t.transpose(1, 2).reshape(B * T, nh * hs) for t in (dq, dk, dv)], dim=1)  # (B*T, 3C)
    db = d_qkv.sum(0, dtype=torch.float32) if with_bias else d_qkv.new_empty(0, dtype=torch.float32)
    return d_qkv, db
