"""ch6-matmul: the tiled Triton matmul of chapter 6, graded in Triton's interpreter on a CPU
(compiled on a GPU).

The learner writes ``matmul(a, b, c)``: ``c = a @ b`` for fp16 or bf16 ``a`` (M, K) and ``b``
(K, N), any strides, into an fp32 ``c`` (M, N), with a Triton kernel that loops over K and
accumulates in fp32. The inputs and the output are views into larger buffers filled with NaN, so
a load or store past an edge reads or leaves a NaN where the checks see it (and never touches
memory outside the buffers). The expected result is float64 arithmetic on the same inputs; the
tolerance is the classic bound for a dot product of length K summed in fp32 (Higham 2002, ch. 3):
|error| <= gamma_K * sum_k |a_ik b_kj| with gamma_K ~ K u, u = 2**-24, doubled for the output
rounding and the tensor cores' summation order. A 16-bit accumulator misses it by a wide margin.
"""
from __future__ import annotations

import torch

from mpgpt.kernels import env

from .core import Check, Failed, expect

NAME = "ch6-matmul"

STUB = '''"""Chapter 6, graded: a tiled matmul in Triton that reads 16-bit inputs and accumulates in fp32.

Grade it with:  python -m mpgpt.grade ch6-matmul this_file.py
Without a GPU the grader runs your kernel in Triton's interpreter (import mpgpt before triton:
it sets TRITON_INTERPRET=1). Keep the blocks small there (32 x 32 x 32): each program runs in numpy.
"""
import mpgpt  # noqa: F401  (first: switches Triton to its interpreter when there is no GPU)
import torch
import triton
import triton.language as tl

# Write your kernel here, for example with this signature (one program per (BLOCK_M, BLOCK_N) tile of c):
#
# @triton.jit
# def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
#                   stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
#                   UPCAST: tl.constexpr,
#                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
#     ...


def matmul(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
    """Write a @ b into c with a Triton kernel.

    a: (M, K) and b: (K, N), both torch.float16 or both torch.bfloat16, on one device, with any
    strides (b may be a transposed view: read elements through a.stride() and b.stride()).
    c: (M, N) torch.float32, also with any strides; write every element of c and nothing else.

    What the grader checks, one behaviour at a time:
    - shapes that are multiples of the block, then M, N and K that are not (masks on the
      loads along K and on the store along M and N);
    - transposed and strided views of a, b and c (pointers from strides);
    - fp32 accumulation along a long K (a 16-bit accumulator is far less accurate);
    - bf16 inputs: in Triton's interpreter a bf16 tile holds raw 16-bit integers, so convert the
      tiles to fp32 before tl.dot there (tl.dot(a.to(tl.float32), b.to(tl.float32), acc));
    - a 1 x 1 x 1 product.
    """
    raise NotImplementedError
'''

PAD = 128  # NaN elements past every edge: more than any block reaches beyond the last tile


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _poisoned(rows: int, cols: int, dtype, *, transposed: bool = False, pad_cols: bool = True):
    """A (rows, cols) view into a NaN-filled buffer: (buffer, view). transposed: the view is the
    transpose of a (cols, rows) buffer view, so its strides are swapped."""
    shape = (cols, rows) if transposed else (rows, cols)
    buf = torch.full((shape[0] + PAD, shape[1] + (PAD if pad_cols else 0)), float("nan"), dtype=dtype,
                     device=_device())
    view = buf[: shape[0], : shape[1]]
    return buf, (view.t() if transposed else view)


def _flat(rows: int, cols: int, dtype):
    """A contiguous (rows, cols) tensor at the start of a NaN-filled buffer: (buffer, view)."""
    buf = torch.full((rows * cols + PAD * max(cols, 1) + PAD,), float("nan"), dtype=dtype, device=_device())
    return buf, buf[: rows * cols].view(rows, cols)


def _fill(view: torch.Tensor, low: float = -1.0, high: float = 1.0) -> None:
    """Fresh random values, never zero (a zero would hide missing work)."""
    x = torch.empty(view.shape, dtype=torch.float64).uniform_(low, high)
    x = torch.where(x.abs() < 1e-3, torch.full_like(x, 0.5), x)
    view.copy_(x.to(view.dtype))


def _run(module, M, N, K, dtype=torch.float16, *, flat=True, a_t=False, b_t=False, c_t=False,
         low=-1.0, high=1.0, what=""):
    if flat:
        (abuf, a), (bbuf, b), (cbuf, c) = _flat(M, K, dtype), _flat(K, N, dtype), _flat(M, N, torch.float32)
    else:
        (abuf, a), (bbuf, b) = _poisoned(M, K, dtype, transposed=a_t), _poisoned(K, N, dtype, transposed=b_t)
        cbuf, c = _poisoned(M, N, torch.float32, transposed=c_t)
    _fill(a, low, high)
    _fill(b, low, high)
    guard_a, guard_b = abuf.clone(), bbuf.clone()
    module.matmul(a, b, c)
    if _device() == "cuda":
        torch.cuda.synchronize()
    label = f"(M, N, K) = ({M}, {N}, {K}), {str(dtype).replace('torch.', '')}"
    if what:
        label = f"{what} {label}"
    expect(torch.equal(abuf.nan_to_num(7.0), guard_a.nan_to_num(7.0)) and
           torch.equal(bbuf.nan_to_num(7.0), guard_b.nan_to_num(7.0)), f"{label}: the inputs were modified")
    outside = cbuf.clone()
    outside_mask = torch.ones_like(cbuf, dtype=torch.bool)
    if flat:
        outside_mask[: M * N] = False
    elif c_t:
        outside_mask[:N, :M] = False
    else:
        outside_mask[:M, :N] = False
    written_outside = int((~outside[outside_mask].isnan()).sum())
    expect(written_outside == 0, f"{label}: {written_outside} elements written outside c (a store without its mask?)")
    missing = int(c.isnan().sum())
    if missing:
        raise Failed(f"{label}: {missing} of {M * N} elements of c are NaN: not written, or computed from "
                     "elements past an edge")
    ref = a.double().cpu() @ b.double().cpu()
    bound = a.double().abs().cpu() @ b.double().abs().cpu()
    err = (c.double().cpu() - ref).abs()
    tol = 2 * (K + 2) * 2.0**-24
    worst = (err / bound.clamp_min(1e-300)).max().item()
    expect(worst <= tol, f"{label}: error up to {worst:.2g} x sum|a||b|, allowed {tol:.2g} (fp32 accumulation)")


def _check_even(module) -> None:
    _run(module, 64, 64, 64)
    _run(module, 128, 64, 96)


def _check_mn_edges(module) -> None:
    for M, N in ((33, 17), (70, 100)):
        _run(module, M, N, 64)


def _check_k_edge(module) -> None:
    for K in (50, 100, 33):
        _run(module, 64, 64, K)


def _check_strides(module) -> None:
    _run(module, 40, 24, 56, flat=False, b_t=True, what="b transposed,")
    _run(module, 33, 50, 70, flat=False, a_t=True, what="a transposed,")
    _run(module, 20, 45, 30, flat=False, c_t=True, what="c transposed,")


def _check_accumulation(module) -> None:
    # positive entries: the partial sums grow to K/4, where a 16-bit accumulator's spacing is coarse
    _run(module, 64, 64, 1024, low=0.0, high=1.0)


def _check_bf16(module) -> None:
    _run(module, 33, 40, 70, dtype=torch.bfloat16)


def _check_one(module) -> None:
    _run(module, 1, 1, 1)


def _check_triton(module) -> None:
    expect(env.TRITON_IMPORT_ERROR is None, env.TRITON_IMPORT_ERROR or "")


def checks() -> list[Check]:
    return [
        Check("Triton is importable", "install Triton (Linux only; on macOS or Windows use Colab)", _check_triton),
        Check("shapes that are multiples of the block", "one program per (BLOCK_M, BLOCK_N) tile of c, a loop "
              "over K in steps of BLOCK_K, pointers from the strides of a, b and c", _check_even),
        Check("M and N not multiples of the block", "mask the store: rows < M and columns < N (loads past "
              "the edge may wrap with % M, % N or be masked)", _check_mn_edges),
        Check("K not a multiple of the block", "mask the loads along K (offs_k < K - k * BLOCK_K) with "
              "other=0, and loop over cdiv(K, BLOCK_K) tiles", _check_k_edge),
        Check("transposed views of a, b and c", "never assume a contiguous layout: element (i, j) of t is "
              "at t_ptr + i * t.stride(0) + j * t.stride(1)", _check_strides),
        Check("fp32 accumulation over a long K", "keep the accumulator in tl.float32 "
              "(tl.zeros(..., dtype=tl.float32)) and round only when storing", _check_accumulation),
        Check("bf16 inputs", "in the interpreter, convert bf16 tiles to tl.float32 before tl.dot "
              "(mpgpt.kernels.interpreting() tells you when)", _check_bf16),
        Check("a 1 x 1 x 1 product", "the masks must work when the matrix is smaller than one block",
              _check_one),
    ]
