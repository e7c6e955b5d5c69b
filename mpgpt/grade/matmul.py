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

import random

import torch

from mpgpt.kernels import env

from .core import Case, Check, Failed, expect, tensor_data, tensor_from

NAME = "ch6-matmul"
# The package's kernels: a file that imports these grades the package, not the learner's kernel
# (mpgpt.kernels itself is imported by the stub, for interpreting()).
OWN = ("mpgpt.kernels.grouped", "mpgpt.kernels.matmul", "mpgpt.kernels.launch", "mpgpt.kernels.linear",
       "mpgpt.kernels.streamk", "mpgpt.kernels.tma", "mpgpt.kernels.ws", "mpgpt.kernels.library",
       "mpgpt.kernels.ops", "mpgpt.kernels.partials", "mpgpt.kernels.epilogue")
OWN_NAMES = ("matmul", "plan", "grouped", "triton_linear", "TritonLinear", "launch", "streamk", "tma", "ws",
             "library", "ops", "partials", "epilogue")  # names of mpgpt.kernels that lead to those
LEGEND = ""

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
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _buffer_shape(rows: int, cols: int, *, flat: bool, transposed: bool = False) -> tuple[int, ...]:
    """The NaN-filled buffer a (rows, cols) operand lives in (see _view)."""
    if flat:
        return (rows * cols + PAD * max(cols, 1) + PAD,)
    shape = (cols, rows) if transposed else (rows, cols)
    return (shape[0] + PAD, shape[1] + PAD)


def _view(buf: torch.Tensor, rows: int, cols: int, *, flat: bool, transposed: bool = False) -> torch.Tensor:
    """flat: a contiguous (rows, cols) tensor at the start of the buffer. Otherwise a (rows, cols)
    view of a 2-d buffer, the transpose of a (cols, rows) view when transposed (strides swapped)."""
    if flat:
        return buf[: rows * cols].view(rows, cols)
    if transposed:
        return buf[:cols, :rows].t()
    return buf[:rows, :cols]


def _operands(inputs: dict, device: str = "cpu"):
    """(a, b, c) views and their buffers (abuf, bbuf, cbuf), from a case's inputs."""
    M, N, K, flat = inputs["M"], inputs["N"], inputs["K"], inputs["flat"]
    dtype = DTYPES[inputs["dtype"]]
    views, bufs = [], []
    for (rows, cols), t, key, dt in (((M, K), inputs["a_t"], "a", dtype), ((K, N), inputs["b_t"], "b", dtype),
                                     ((M, N), inputs["c_t"], "c", torch.float32)):
        buf = torch.full(_buffer_shape(rows, cols, flat=flat, transposed=t), float("nan"), dtype=dt, device=device)
        view = _view(buf, rows, cols, flat=flat, transposed=t)
        if key != "c":
            view.copy_(tensor_from(inputs[key], dtype, (rows, cols)))
        views.append(view)
        bufs.append(buf)
    return views, bufs


def _values(rows: int, cols: int, dtype, low: float, high: float, gen: torch.Generator) -> torch.Tensor:
    """Fresh random values, never zero (a zero would hide missing work)."""
    x = torch.empty((rows, cols), dtype=torch.float64).uniform_(low, high, generator=gen)
    x = torch.where(x.abs() < 1e-3, torch.full_like(x, 0.5), x)
    return x.to(dtype)


def _case(M, N, K, dtype="float16", *, flat=True, a_t=False, b_t=False, c_t=False, low=-1.0, high=1.0, what=""):
    """One product to run: its shapes, layout and the values of a and b (drawn in prepare())."""
    return dict(M=M, N=N, K=K, dtype=dtype, flat=flat, a_t=a_t, b_t=b_t, c_t=c_t, low=low, high=high, what=what)


def _prepare(*products: dict):
    def prepare(rng: random.Random) -> Case:
        gen = torch.Generator().manual_seed(rng.getrandbits(63))
        inputs = []
        for p in products:
            dtype = DTYPES[p["dtype"]]
            a = _values(p["M"], p["K"], dtype, p["low"], p["high"], gen)
            b = _values(p["K"], p["N"], dtype, p["low"], p["high"], gen)
            inputs.append({**p, "a": tensor_data(a), "b": tensor_data(b)})
        return Case(inputs)
    return prepare


def _observe(module, inputs) -> list[dict]:
    out = []
    for case in inputs:
        (a, b, c), (abuf, bbuf, cbuf) = _operands(case, _device())
        guard_a, guard_b = abuf.clone(), bbuf.clone()
        module.matmul(a, b, c)
        if _device() == "cuda":
            torch.cuda.synchronize()
        unchanged = (torch.equal(abuf.nan_to_num(7.0), guard_a.nan_to_num(7.0)) and
                     torch.equal(bbuf.nan_to_num(7.0), guard_b.nan_to_num(7.0)))
        out.append({"inputs_unchanged": unchanged, "c_buffer": tensor_data(cbuf)})
    return out


def _judge(case: Case, observed) -> None:
    for inputs, seen in zip(case.inputs, observed, strict=True):
        M, N, K, flat, c_t = inputs["M"], inputs["N"], inputs["K"], inputs["flat"], inputs["c_t"]
        (a, b, _), _ = _operands(inputs)
        label = f"(M, N, K) = ({M}, {N}, {K}), {inputs['dtype']}"
        if inputs["what"]:
            label = f"{inputs['what']} {label}"
        expect(seen["inputs_unchanged"] is True, f"{label}: the inputs were modified",
               "only store into c: a and b are read-only")
        shape = _buffer_shape(M, N, flat=flat, transposed=c_t)
        cbuf = tensor_from(seen["c_buffer"], torch.float32, shape)
        c = _view(cbuf, M, N, flat=flat, transposed=c_t)
        outside = torch.ones_like(cbuf, dtype=torch.bool)
        _view(outside, M, N, flat=flat, transposed=c_t).fill_(False)
        written_outside = int((~cbuf[outside].isnan()).sum())
        expect(written_outside == 0, f"{label}: {written_outside} elements written outside c",
               "mask the store: rows < M and columns < N (and use c's strides)")
        missing = int(c.isnan().sum())
        if missing:
            k_edge = K % 32 != 0
            raise Failed(f"{label}: {missing} of {M * N} elements of c are NaN: not written, or computed from "
                         "elements past an edge",
                         "mask the loads along K (offs_k < K - k * BLOCK_K, other=0)" if k_edge else None)
        ref = a.double() @ b.double()
        bound = a.double().abs() @ b.double().abs()
        err = (c.double() - ref).abs()
        tol = 2 * (K + 2) * 2.0**-24
        worst = (err / bound.clamp_min(1e-300)).max().item()
        if not worst <= tol:
            hint = ("keep the accumulator in tl.float32 (tl.zeros(..., dtype=tl.float32)) and round only when storing"
                    if worst < 0.05 else None)  # a few 16-bit roundings, not missing work
            raise Failed(f"{label}: error up to {worst:.2g} x sum|a||b|, allowed {tol:.2g} (fp32 accumulation)", hint)


def _observe_triton(module, inputs) -> None:
    expect(env.TRITON_IMPORT_ERROR is None, env.TRITON_IMPORT_ERROR or "")


def checks() -> list[Check]:
    return [
        Check("Triton is importable", "install Triton (Linux only; on macOS or Windows use Colab)", _observe_triton),
        Check("shapes that are multiples of the block", "one program per (BLOCK_M, BLOCK_N) tile of c, a loop "
              "over K in steps of BLOCK_K, pointers from the strides of a, b and c", _observe, _judge,
              _prepare(_case(64, 64, 64), _case(128, 64, 96))),
        Check("M and N not multiples of the block", "mask the store: rows < M and columns < N (loads past "
              "the edge may wrap with % M, % N or be masked)", _observe, _judge,
              _prepare(_case(33, 17, 64), _case(70, 100, 64))),
        Check("K not a multiple of the block", "mask the loads along K (offs_k < K - k * BLOCK_K) with "
              "other=0, and loop over cdiv(K, BLOCK_K) tiles", _observe, _judge,
              _prepare(*(_case(64, 64, K) for K in (50, 100, 33)))),
        Check("transposed views of a, b and c", "never assume a contiguous layout: element (i, j) of t is "
              "at t_ptr + i * t.stride(0) + j * t.stride(1)", _observe, _judge,
              _prepare(_case(40, 24, 56, flat=False, b_t=True, what="b transposed,"),
                       _case(33, 50, 70, flat=False, a_t=True, what="a transposed,"),
                       _case(20, 45, 30, flat=False, c_t=True, what="c transposed,"))),
        Check("fp32 accumulation over a long K", "keep the accumulator in tl.float32 "
              "(tl.zeros(..., dtype=tl.float32)) and round only when storing", _observe, _judge,
              # positive entries: the partial sums grow to K/4, where a 16-bit accumulator's spacing is coarse
              _prepare(_case(64, 64, 1024, low=0.0, high=1.0))),
        Check("bf16 inputs", "in the interpreter, convert bf16 tiles to tl.float32 before tl.dot "
              "(mpgpt.kernels.interpreting() tells you when)", _observe, _judge,
              _prepare(_case(33, 40, 70, dtype="bfloat16"))),
        Check("a 1 x 1 x 1 product", "the masks must work when the matrix is smaller than one block",
              _observe, _judge, _prepare(_case(1, 1, 1))),
    ]
