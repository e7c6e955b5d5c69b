"""GELU's backward in one pass: dZ = dY * gelu'(Z), computed in fp32, stored in dY's dtype.

TritonLinear's forward fuses GELU into the matmul's epilogue and keeps Z, the pre-activation.
Its backward then needs dZ = dY * gelu'(Z) before the two gradient GEMMs. Written with torch ops
(`gelu_tanh_grad` in linear.py) that is about a dozen elementwise kernels, each reading and
writing a full fp32 (tokens x 3072) tensor — far more memory traffic than the GEMMs around it
need. This kernel reads dY and Z once and writes dZ once: the memory floor of the operation.

    v = 2 sqrt(2/pi) (z + 0.044715 z^3),   s = sigmoid(v)
    gelu(z)  = z * s                                        (the tanh approximation)
    gelu'(z) = s + z * s (1 - s) * 2 sqrt(2/pi) (1 + 3 * 0.044715 z^2)
"""
from __future__ import annotations

import torch

from . import env
from .env import tl, triton
from .epilogue import sigmoid_f32  # shared with the matmul's GELU epilogue

_BLOCK = 1024  # elements per program (the interpreter uses the same: one program per 1024)


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
    v = 1.5957691216057308 * (z + 0.044715 * z * z * z)  # 2 sqrt(2/pi) (z + 0.044715 z^3)
    s = sigmoid_f32(v)
    d = s + z * s * (1.0 - s) * 1.5957691216057308 * (1.0 + 0.134145 * z * z)  # 3 * 0.044715
    tl.store(out_ptr + offs, (g * d).to(out_ptr.dtype.element_ty), mask=mask)


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
