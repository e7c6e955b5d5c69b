"""A learner's solution to ch6-matmul, as chapter 6 builds it (version 2: a loop over K).

The grading tests plant bugs into this file by replacing marked lines (# PLANT: name)."""
import mpgpt  # noqa: F401  (first: switches Triton to its interpreter when there is no GPU)
import torch
import triton
import triton.language as tl

from mpgpt.kernels import interpreting


@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                  stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  UPCAST: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (rm[:, None] % M) * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rk[:, None] * stride_bk + (rn[None, :] % N) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # PLANT: accumulator
    for k in range(0, tl.cdiv(K, BLOCK_K)):  # PLANT: loop
        a = tl.load(a_ptrs, mask=rk[None, :] < K - k * BLOCK_K, other=0.0)  # PLANT: mask_a
        b = tl.load(b_ptrs, mask=rk[:, None] < K - k * BLOCK_K, other=0.0)  # PLANT: mask_b
        if UPCAST:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")  # PLANT: upcast
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptrs, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))  # PLANT: store


def matmul(a, b, c):
    M, K = a.shape
    N = b.shape[1]
    grid = (triton.cdiv(M, 32), triton.cdiv(N, 32))
    matmul_kernel[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),  # PLANT: strides
                        c.stride(0), c.stride(1), UPCAST=interpreting(), BLOCK_M=32, BLOCK_N=32, BLOCK_K=32)
