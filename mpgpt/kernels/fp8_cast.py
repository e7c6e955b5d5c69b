"""The fp8 cast in two Triton kernels: amax, then scale + saturate + cast (chapter 9).

mpgpt.fp8.quantize spells the cast out in about a dozen eager torch operations per tensor (abs,
an fp32 copy, amax, log2 / floor / exp2 / where for the scale, multiply, clamp, cast), and the
backward pass of Fp8Linear adds a ``.contiguous()`` copy for each transposed operand. Each of
those operations is one kernel launch and one trip over memory; at GPT-2 width the launches cost
more host time than the three fp8 GEMMs take on the GPU. Here the same cast is two launches:

    kernel 1  _amax_kernel   each (BLOCK_R, BLOCK_C) tile takes its largest |x| and folds it into
                             the amax with an atomic max: one fp32 (tensorwise) or one per row
                             of the view (rowwise)
    kernel 2  _cast_kernel   every program turns the amax into the multiplier s itself (a few
                             integer operations), scales, clamps to +-fmax (saturation) and
                             casts its tile; one program per tile row writes the dequantisation
                             scale 1/s

With a given amax (the delayed recipe's history) the scale is known before the pass, so kernel 2
alone does everything and records the current amax with an atomic max while it casts.

The result is bit for bit what mpgpt.fp8.quantize returns, data, scale and amax:

* the multiplier follows scale_from_amax(power_of_two=True): the largest power of two s with
  amax * s <= fmax (1 for an amax of 0). The kernel takes floor(log2(fmax / amax)) from the
  exponent bits of the fp32 quotient (a bitcast, exact, where a log2 approximation could land on
  the wrong side of a power of two), then checks both neighbours with products amax * s, which
  are exact in fp32 for a power of two s, so a quotient one rounding off changes nothing;
* multiplying by a power of two is exact, so only the final cast rounds, to nearest even as in
  torch. The kernel does that rounding itself, in fp32 (_round_to_grid), and leaves the
  conversion instruction nothing to round: Triton's fp32 -> fp8 conversion differs between
  releases (3.9 emits one cvt.rn from fp32; 3.6 on Hopper was seen to go through fp16 first, with
  a round-toward-zero step, and rounding twice can land on the other neighbour).

The input is read through its strides, so ``transpose=True`` casts x.T (the backward pass's
operands g.T, x.T, w.T) straight from x, and the output is written row-major in the transposed
shape: torch._scaled_mm gets its layout without a copy. Tiles are 2-D so that a transposed read
still loads whole runs of contiguous memory (Triton transposes the tile through shared memory).

Triton's interpreter (CPU) converts fp32 to fp8 wrongly when rounding carries into the next
power of two (seen with Triton 3.9: 31.9 became 16), so there kernel 2 stores the scaled,
clamped fp32 values and the host casts them with torch, as fp8_matmul.py does.

Host time is what the fusion saves, so on a GPU the second call with the same signature (device,
dtypes, shape, strides, alignments, recipe) skips Triton's Python launch path and hands the new
tensors straight to the compiled kernels (launch.py explains how; MPGPT_LEAN_LAUNCH=0 turns it off).
"""
from __future__ import annotations

import torch

from mpgpt.formats import get_format
from mpgpt.fp8 import E4M3, ScaledFp8, check_recipe

from . import env
from .env import tl, triton
from .launch import compiled_launch, lean_launch_enabled

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
TILE = dict(BLOCK_R=64, BLOCK_C=64)   # 16 KB of fp32 per tile; a 64-wide run of either dimension is read whole
NUM_WARPS = 4


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, R, C, stride_r, stride_c,
                 ROWWISE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """amax (fp32, zeroed) <- max |x| over the (R, C) view: one value, or one per row (ROWWISE)."""
    rr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rr[:, None] < R) & (rc[None, :] < C)
    x = tl.load(x_ptr + rr[:, None] * stride_r + rc[None, :] * stride_c, mask=mask, other=0.0)
    a = tl.abs(x.to(tl.float32))                                             # (BLOCK_R, BLOCK_C)
    if ROWWISE:
        tl.atomic_max(amax_ptr + rr, tl.max(a, axis=1), mask=rr < R)          # (BLOCK_R,)
    else:
        tl.atomic_max(amax_ptr, tl.max(tl.max(a, axis=1), axis=0))


@triton.jit
def _multiplier(amax, FMAX: tl.constexpr):
    """s = the largest power of two with amax * s <= FMAX; 1 where amax is 0 (scale_from_amax's rule)."""
    q = FMAX / tl.where(amax > 0, amax, 1.0)          # within an ulp or two of fmax / amax
    bits = q.to(tl.int32, bitcast=True)
    s = (bits & 0x7F800000).to(tl.float32, bitcast=True)   # 2^floor(log2 q): q with its mantissa cleared
    s = tl.where(amax * (s * 2.0) <= FMAX, s * 2.0, s)     # the quotient rounded down below a power of two
    s = tl.where(amax * s > FMAX, s * 0.5, s)              # ... or up onto one
    return tl.where(amax > 0, s, 1.0)


@triton.jit
def _round_to_grid(y, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """y (fp32, |y| <= the format's largest value) rounded to nearest even onto the fp8 format's
    values: MBITS stored mantissa bits, EMIN the smallest normal exponent. In the binade
    [2^e, 2^(e+1)) the values are 2^(e - MBITS) apart, and subnormals keep the spacing of the
    smallest binade; y / spacing is exact (a power of two), and adding then subtracting 1.5 * 2^23
    rounds it to an integer, to nearest even, as every fp32 addition rounds."""
    a = tl.abs(y)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127                # floor(log2 a) for normal a
    e = tl.maximum(e, EMIN)                                                 # subnormals: the smallest spacing
    spacing = ((e - MBITS + 127) << 23).to(tl.float32, bitcast=True)        # 2^(e - MBITS)
    inverse = ((MBITS - e + 127) << 23).to(tl.float32, bitcast=True)        # 2^(MBITS - e), exact
    r = ((a * inverse + 12582912.0) - 12582912.0) * spacing                 # 12582912 = 1.5 * 2^23
    y_bits = y.to(tl.int32, bitcast=True)
    sign = (y_bits >> 31) << 31                                             # y's sign bit (so -0 stays -0)
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _cast_kernel(x_ptr, out_ptr, amax_ptr, current_ptr, scale_ptr, R, C, stride_r, stride_c, stride_out,
                 FMAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, ROWWISE: tl.constexpr,
                 GIVEN: tl.constexpr, UPCAST: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """out (R, C) row-major <- clamp(x * s, +-FMAX) in fp8 (fp32 when UPCAST), s from amax_ptr;
    scale_ptr <- 1/s. GIVEN: amax_ptr is a given (delayed) amax, so also fold this tensor's own
    amax into current_ptr (fp32, zeroed)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rr = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rc = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rr[:, None] < R) & (rc[None, :] < C)
    x = tl.load(x_ptr + rr[:, None] * stride_r + rc[None, :] * stride_c, mask=mask, other=0.0).to(tl.float32)
    if ROWWISE:
        s = _multiplier(tl.load(amax_ptr + rr, mask=rr < R, other=1.0), FMAX)       # (BLOCK_R,)
        y = tl.clamp(x * s[:, None], -FMAX, FMAX)
        if pid_c == 0:
            tl.store(scale_ptr + rr, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s), mask=rr < R)
    else:
        s = _multiplier(tl.load(amax_ptr), FMAX)
        y = tl.clamp(x * s, -FMAX, FMAX)
        if (pid_r == 0) & (pid_c == 0):
            tl.store(scale_ptr, tl.math.div_rn(1.0, s))
    if GIVEN:
        a = tl.abs(x)
        if ROWWISE:
            tl.atomic_max(current_ptr + rr, tl.max(a, axis=1), mask=rr < R)
        else:
            tl.atomic_max(current_ptr, tl.max(tl.max(a, axis=1), axis=0))
    y = _round_to_grid(y, MBITS, EMIN)          # fp8 values now: the conversion below is exact
    out_ptrs = out_ptr + rr[:, None] * stride_out + rc[None, :]
    if UPCAST:
        tl.store(out_ptrs, y, mask=mask)
    else:
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)


def check_cast_device(t: torch.Tensor) -> None:
    """Raise a one-line error unless the cast kernels can run where ``t`` lives (sm_89+ or the interpreter)."""
    ok, why = env.kernels_available()
    if not ok:
        raise RuntimeError(why)
    if env.interpreting():
        return
    if t.device.type != "cuda":
        raise RuntimeError("CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before importing mpgpt, "
                           "or use mpgpt.fp8.quantize")
    cc = env.capability(t.device)
    if cc < (8, 9):
        raise RuntimeError(f"{env.device_name(t.device)} (sm_{cc[0]}{cc[1]}) has no fp8 conversion instructions "
                           "(sm_89+ needed); use mpgpt.fp8.quantize, which runs everywhere")


def fused_quantize(x: torch.Tensor, fmt=E4M3, recipe: str = "tensorwise", amax: torch.Tensor | None = None,
                   transpose: bool = False) -> ScaledFp8:
    """``mpgpt.fp8.quantize(x.t() if transpose else x, fmt, recipe, amax=amax)``, bit for bit, in two
    launches (one with a given ``amax``), the data written row-major in the (transposed) shape.

    x: (R, K) bf16, fp16 or fp32, any strides (read in place, never copied). Recipes tensorwise,
    delayed and rowwise; ``amax``: the amax to scale by (the delayed recipe's history), () or (R, 1)
    like the recipe's own; the returned ScaledFp8's amax is always the tensor's current one."""
    check_recipe(recipe)
    if recipe == "block":
        raise ValueError("fused_quantize casts with one scale per tensor or per row; use mpgpt.fp8.quantize "
                         "for the block recipe")
    if x.dim() != 2:
        raise ValueError(f"fused_quantize takes a 2-D tensor (rows, K), got shape {tuple(x.shape)}; reshape it first")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"fused_quantize reads bf16, fp16 or fp32, got {x.dtype}; convert with x.float() first")
    fmt = get_format(fmt)
    if fmt.dtype not in FP8_DTYPES:
        raise ValueError(f"fused_quantize casts to e4m3fn or e5m2, not {fmt.name}")
    R, C = (x.shape[1], x.shape[0]) if transpose else x.shape
    stride_r, stride_c = (x.stride(1), x.stride(0)) if transpose else (x.stride(0), x.stride(1))
    rowwise = recipe == "rowwise"
    amax_shape = (R, 1) if rowwise else ()
    used = None if amax is None else _given_amax(amax, R if rowwise else 1, x.device)
    key = seen = None
    if x.is_cuda and not env.interpreting() and lean_launch_enabled():
        key = (x.device.index, env.capability(x.device), x.dtype, R, C, stride_r, stride_c, fmt.dtype, rowwise,
               x.data_ptr() % 16 == 0, None if used is None else used.data_ptr() % 16 == 0)
        seen = _LAUNCHES.get(key)
    if seen is None:
        check_cast_device(x)
    upcast = env.interpreting()
    current = torch.zeros(amax_shape, device=x.device, dtype=torch.float32)
    scale = torch.empty(amax_shape, device=x.device, dtype=torch.float32)
    data = torch.empty(R, C, device=x.device, dtype=torch.float32 if upcast else fmt.dtype)
    if seen is not None:   # this signature launched before: straight to the compiled kernels
        amax_launch, cast_launch = seen
        if used is None:
            amax_launch(x.device.index, x, current)
        cast_launch(x.device.index, x, data, current if used is None else used, current, scale)
        return ScaledFp8(data, scale, fmt, recipe, current)
    grid = (triton.cdiv(R, TILE["BLOCK_R"]), triton.cdiv(C, TILE["BLOCK_C"]))
    amax_launch = None
    if used is None:
        args = (x, current, R, C, stride_r, stride_c)
        kwargs = dict(ROWWISE=rowwise, **TILE)
        compiled = _amax_kernel[grid](*args, **kwargs, num_warps=NUM_WARPS)
        amax_launch = None if key is None else compiled_launch(_amax_kernel, compiled, grid, args, kwargs, n_tensors=2)
    args = (x, data, current if used is None else used, current, scale, R, C, stride_r, stride_c, data.stride(0))
    kwargs = dict(FMAX=fmt.max_finite, MBITS=fmt.mantissa_bits, EMIN=fmt.emin, ROWWISE=rowwise, GIVEN=used is not None, UPCAST=upcast, **TILE)
    compiled = _cast_kernel[grid](*args, **kwargs, num_warps=NUM_WARPS)
    if key is not None:
        cast_launch = compiled_launch(_cast_kernel, compiled, grid, args, kwargs, n_tensors=5)
        if cast_launch is not None and (used is not None or amax_launch is not None):
            _LAUNCHES[key] = (amax_launch, cast_launch)
    if upcast:
        data = data.to(fmt.dtype)   # torch's cast rounds to nearest even (the values are already clamped)
    return ScaledFp8(data, scale, fmt, recipe, current)


# (device, capability, dtype, R, C, strides, fp8 dtype, rowwise, alignments) -> (amax launch or None, cast launch)
_LAUNCHES: dict = {}


def _given_amax(amax, n: int, device) -> torch.Tensor:
    """A given amax as the cast kernel reads it: n contiguous fp32 values on ``device`` (no copy
    when it already is one, as the delayed recipe's history amax is)."""
    amax = torch.as_tensor(amax)
    if amax.numel() != n:
        raise ValueError(f"the given amax has {amax.numel()} values; give {'one per row' if n > 1 else 'one'} ({n})")
    return amax.to(device=device, dtype=torch.float32).contiguous()
