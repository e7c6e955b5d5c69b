"""GPT-2's tied embedding: the token embedding's gradient added into the output layer's, in place.

GPT-2 uses one (V, C) matrix twice: to look up each input token's row (the embedding) and to score
the final hidden states against every token (the output layer). Its gradient is the sum of two:

    dW = dW_head                     dense: every row, from the output layer (V, C)
       + sum over positions i        sparse: one row of d_x0 per input token, d_x0 (M, C) the
         of onehot(idx_i) d_x0_i     gradient of the embedded input, M = B * T positions

Autograd adds them as two dense matrices. Under torch.compile the embedding's part is a scatter into
a zero-filled fp32 (V, C) matrix, which is then added to the output layer's: for GPT-2 at 12 x 1024
tokens the zero fill and the addition move about 540 MB, for at most 12,288 of the 50,304 rows.

`embedding_grad_into_` adds the embedding's part into dW_head where it lies, touching only the rows
of tokens that occur:

    tokens, order = sort(idx)              each token's positions now form one run (stable: in order)
    first = searchsorted(tokens, tokens[::R])   where the run of each tile's first token begins
    kernel 1, per tile of R sorted positions and CHUNK columns: a segmented scan sums each run's rows
             of d_x0 inside the tile in fp32; the tile's last partial sum goes into a small table
    kernel 2, the same scan again; at each run's last position, the run's sum (plus the table's
             entries of the earlier tiles a long run began in) is added to its token's row of dW,
             read and rounded once

Every sum runs in a fixed order, so the gradient is the same from run to run (an atomic scatter is
not). A frequent token's run may span many tiles (in text the commonest tokens are a few per cent
of all: dozens of tiles of 32); only the tile where it ends adds the earlier tiles' entries, whose
indices `first` gives, so their loads do not wait on one another.

The autograd Function `tied_embedding` returns the embedded input (token and position embeddings
added, as the unfused model adds them) and the matrix itself, as a view, for the output layer to
use: the two gradients then meet in one backward call, which receives dW_head first-hand and adds
into it. Without Triton, on a CPU, the same sums run as torch ops.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mpgpt.fused_loss import first_derivative_only

from mpgpt.kernels import env
from mpgpt.kernels.env import tl, triton
from mpgpt.kernels.linear import _op

__all__ = ["embedding_grad_into_", "embedding_grad_reference", "tied_embedding"]


@triton.jit
def _segmented_add(a, tok_a, b, tok_b):
    # (sum, token) pairs of sorted positions: b's sum continues a's where they hold one token's run
    return tl.where(tok_a == tok_b, a + b, b), tok_b


@triton.jit
def _tile_runs(d_ptr, order_ptr, tok_ptr, M, C, pid_t, pid_c, R: tl.constexpr, CHUNK: tl.constexpr):
    """The tile's sorted positions, their tokens, its columns, and the scan: at each position the sum
    of its run's rows from the run's first position in this tile, fp32, (R, CHUNK)."""
    pos = pid_t * R + tl.arange(0, R)                                      # (R,) sorted positions
    ok = pos < M
    tok = tl.load(tok_ptr + pos, mask=ok, other=-1)                        # (R,) tokens, ascending
    src = tl.load(order_ptr + pos, mask=ok, other=0)                       # (R,) positions in d
    cols = pid_c * CHUNK + tl.arange(0, CHUNK)                             # (CHUNK,)
    col_ok = cols < C
    rows = tl.load(d_ptr + src.to(tl.int64)[:, None] * C + cols[None, :],
                   mask=ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)   # (R, CHUNK)
    run_sum, _ = tl.associative_scan((rows, tl.broadcast_to(tok[:, None], (R, CHUNK))), 0, _segmented_add)
    return pos, ok, tok, cols, col_ok, run_sum


@triton.jit
def _run_tails_kernel(
    d_ptr,                  # (M, C) row-major: d_x0, the gradient of the embedded input
    order_ptr,              # (M,) int64: the position in d of each sorted position
    tok_ptr,                # (M,) int32: the sorted tokens
    tail_ptr,               # (tiles, C) fp32 out: each tile's last partial run sum
    M, C,
    R: tl.constexpr,        # sorted positions per tile
    CHUNK: tl.constexpr,    # columns per program
):
    pid_t, pid_c = tl.program_id(0), tl.program_id(1)
    pos, ok, tok, cols, col_ok, run_sum = _tile_runs(d_ptr, order_ptr, tok_ptr, M, C, pid_t, pid_c, R, CHUNK)
    last = tl.minimum(M - pid_t * R, R) - 1                                # the tile's last valid row
    tail = tl.sum(tl.where((tl.arange(0, R) == last)[:, None], run_sum, 0.0), axis=0)   # (CHUNK,)
    tl.store(tail_ptr + pid_t * C + cols, tail, mask=col_ok)


@triton.jit
def _add_runs_kernel(
    d_ptr, order_ptr, tok_ptr, tail_ptr,   # as in _run_tails_kernel; tail_ptr now read
    first_ptr,              # (tiles,) int64: the sorted position where each tile's first run begins
    dw_ptr,                 # (V, C) rows `stride_dw` apart: dW_head, updated in place
    M, C, stride_dw,
    R: tl.constexpr, CHUNK: tl.constexpr,
):
    pid_t, pid_c = tl.program_id(0), tl.program_id(1)
    pos, ok, tok, cols, col_ok, run_sum = _tile_runs(d_ptr, order_ptr, tok_ptr, M, C, pid_t, pid_c, R, CHUNK)
    # The tile's first run may have begun in earlier tiles (tiles j0 .. pid_t - 1): where it also
    # ends in this tile, add those tiles' tails. Their indices are known, so the loads do not wait
    # on one another; a tile that a run only passes through writes nothing and adds nothing.
    start = pid_t * R
    first = tl.load(tok_ptr + start)
    after = tl.load(tok_ptr + tl.minimum(start + R, M - 1))   # the next tile's first token
    ends_here = (start + R >= M) | (after != first)             # sorted: the first run ends in this tile
    j0 = tl.load(first_ptr + pid_t) // R
    carry = tl.zeros((CHUNK,), dtype=tl.float32)
    for j in range(j0, tl.where(ends_here, pid_t, j0)):
        carry += tl.load(tail_ptr + j * C + cols, mask=col_ok, other=0.0)
    total = run_sum + tl.where((tok == first)[:, None], carry[None, :], 0.0)
    # A run's last position writes its token's row: each row of dW is written by one program only.
    tok_next = tl.load(tok_ptr + pos + 1, mask=pos + 1 < M, other=-1)
    mask = (ok & (tok != tok_next))[:, None] & col_ok[None, :]
    ptrs = dw_ptr + tok.to(tl.int64)[:, None] * stride_dw + cols[None, :]
    old = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (old + total).to(dw_ptr.dtype.element_ty), mask=mask)


# (R, CHUNK, num_warps): 32 sorted positions by 64 columns, 16 values a thread. Compiled ahead of time
# for sm_90 (Triton 3.6) with the specialisations a launch at GPT-2's sizes gets (aligned pointers,
# C divisible by 16), the addition kernel takes 56 registers a thread and the tails kernel 40, no
# spills, 16-byte loads of each row. Not yet timed on a GPU; the kernel benchmark's part "embedding"
# times it against Inductor's code and at other tiles. The interpreter runs one numpy op per tile:
# small tiles make runs span several of them there.
_CONFIG = (32, 64, 4)
_INTERPRET_CONFIG = (16, 32, 1)


def embedding_grad_reference(dw: Tensor, idx: Tensor, d: Tensor) -> Tensor:
    """dW_head plus the embedding's gradient with torch ops: the rows of ``d`` summed per token in
    fp32 (index_add_, in position order on a CPU), added to ``dw`` and rounded once into its dtype."""
    acc = torch.zeros(dw.shape, dtype=torch.float32, device=dw.device)
    acc.index_add_(0, idx.reshape(-1), d.reshape(-1, dw.shape[1]).float())
    return (dw.float() + acc).to(dw.dtype)


def embedding_grad_into_(dw: Tensor, idx: Tensor, d: Tensor, config=None) -> Tensor:
    """Add the token embedding's gradient into ``dw`` in place and return it, as the module docstring
    says: dw (V, C), the output layer's gradient of the tied matrix (fp32, bf16 or fp16, rows
    contiguous); idx (...) the token ids looked up, d (..., C) the gradient of what they looked up.
    Each touched row is read, added to in fp32 and rounded once. ``config`` (R, CHUNK, num_warps)
    overrides the tiles, for tests and benchmarks."""
    if dw.dim() != 2 or d.shape != (*idx.shape, dw.shape[1]):
        raise ValueError(f"expected dw (V, C), idx (...) and d (..., C) with the same C, got {tuple(dw.shape)}, "
                         f"{tuple(idx.shape)} and {tuple(d.shape)}")
    if dw.stride(1) != 1:
        raise ValueError("dw's rows must be contiguous (stride 1 along C); pass dw.contiguous()")
    if idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"idx must hold integer token ids (int32 or int64), got {idx.dtype}")
    env.check_device(dw)
    V, C = dw.shape
    M = idx.numel()
    if M == 0:
        return dw
    R, chunk, warps = env.tile_config(config, _INTERPRET_CONFIG if env.interpreting() else _CONFIG,
                                      ("R", "CHUNK", "num_warps"))
    if env.interpreting() and dw.dtype != torch.float32:
        # The interpreter keeps bf16 as raw 16-bit integers: add into an fp32 copy, then round once.
        wide = dw.float()
        embedding_grad_into_(wide, idx, d.float(), (R, chunk, warps))
        dw.copy_(wide)
        return dw
    tokens, order = torch.sort(idx.reshape(-1).to(torch.int32), stable=True)   # (M,) each
    first = torch.searchsorted(tokens, tokens[::R].contiguous())   # (tiles,): where each tile's first token's run begins
    d2 = d.reshape(M, C).contiguous()
    tiles = triton.cdiv(M, R)
    tails = torch.empty((tiles, C), dtype=torch.float32, device=dw.device)
    grid = (tiles, triton.cdiv(C, chunk))
    _run_tails_kernel[grid](d2, order, tokens, tails, M, C, R=R, CHUNK=chunk, num_warps=warps)
    _add_runs_kernel[grid](d2, order, tokens, tails, first, dw, M, C, dw.stride(0), R=R, CHUNK=chunk,
                           num_warps=warps)
    return dw


# ----------------------------------------------------------------------------------------------
# The sum as a custom operator, the autograd Function and the functional form
# ----------------------------------------------------------------------------------------------
def _triton_pass(t: Tensor) -> bool:
    """Whether the kernels run for ``t`` (a compiled kernel on a GPU; a module-level function, so
    tests can switch it)."""
    return env.runs_compiled(t)


def embedding_grad_impl(dw: Tensor, idx: Tensor, d: Tensor) -> None:
    """``dw`` += the embedding's gradient, in place: the kernels where they run, else torch's ops."""
    if _triton_pass(dw):
        embedding_grad_into_(dw, idx, d)
    else:
        dw.copy_(embedding_grad_reference(dw, idx, d))


embedding_grad_op = torch.library.custom_op("mpgpt::embedding_grad_into", mutates_args=("dw",))(embedding_grad_impl)


@embedding_grad_op.register_fake
def _(dw, idx, d):
    return None


class _TiedEmbeddingFunction(torch.autograd.Function):
    """(x0, w) = (wte[idx] + wpe[:T], wte as a view): the embedded input, and the tied matrix for the
    output layer. The backward pass gets both gradients of the matrix at once and adds the
    embedding's into the output layer's, in the tensor it receives: that assumes the view's only
    consumer is the output layer, whose backward returns a new tensor (F.linear, the fused and the
    chunked loss all do), so no other gradient shares it."""

    @staticmethod
    def forward(ctx, idx, wte, wpe):
        T = idx.shape[-1]
        x0 = F.embedding(idx, wte) + wpe[:T]                               # (B, T, C), as GPT.forward adds them
        ctx.save_for_backward(idx)
        ctx.meta = (wpe.shape[0], wpe.dtype)
        return x0, wte.view_as(wte)

    @staticmethod
    def backward(ctx, d_x0, d_w):
        first_derivative_only("the fused embedding", "mpgpt.fast.convert(model)")
        (idx,) = ctx.saved_tensors
        n_pos, wpe_dtype = ctx.meta
        # d_w comes from the output layer's backward alone (the view is used nowhere else), so it is
        # added into where it lies (autograd hands zeros where the output layer was not used).
        dw = d_w.contiguous()
        _op(embedding_grad_op, embedding_grad_impl)(dw, idx, d_x0)
        T = idx.shape[-1]
        d_pos = d_x0.reshape(-1, T, d_x0.shape[-1]).float().sum(0)             # (T, C): summed over the batch
        d_wpe = F.pad(d_pos, (0, 0, 0, n_pos - T)).to(wpe_dtype)            # (n_pos, C): zero past T
        return None, dw, d_wpe


def tied_embedding(idx: Tensor, wte: Tensor, wpe: Tensor) -> tuple[Tensor, Tensor]:
    """(wte[idx] + wpe[:T], wte): the embedded input (B, T, C) and the tied matrix for the output
    layer, whose gradients meet in one backward call (the module docstring). idx (B, T) token ids,
    wte (V, C), wpe (block_size, C)."""
    if idx.dim() != 2 or wte.dim() != 2 or wpe.dim() != 2 or wte.shape[1] != wpe.shape[1]:
        raise ValueError(f"expected idx (B, T), wte (V, C) and wpe (block_size, C), got {tuple(idx.shape)}, "
                         f"{tuple(wte.shape)} and {tuple(wpe.shape)}")
    if idx.shape[1] > wpe.shape[0]:
        raise ValueError(f"sequence length {idx.shape[1]} exceeds the {wpe.shape[0]} positions wpe holds; "
                         "crop the sequence to the model's block_size")
    return _TiedEmbeddingFunction.apply(idx, wte, wpe)
