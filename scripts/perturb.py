"""Perturb PyTorch's floating-point results the way another CPU's kernels would.

Two CPUs run the same float program with different kernels: AVX2 or AVX-512 or AMX, another BLAS
blocking, another thread split. Each sums in its own order, so a result that is not exactly
representable can come out a few units in the last place (ulps) higher or lower. A checked notebook
cell must print the same text whatever the order; this mode lets one machine play every other.

`enable(seed, ulps)` installs a TorchDispatchMode that, after each matrix product and reduction
(forward and backward: mm, addmm, bmm, sums, means, softmax, layer norm, attention ...), moves every
fp32 element by a seeded random whole number of ulps in [-ulps, ulps] (on its bit pattern, so
exactly that many representable numbers). Two kinds of result are left alone, because every
summation order gets them right: an element whose last 8 significand bits are zero (a count, a
power of two, a sum of a few short numbers: an inexact result ends in eight zero bits once in 256),
and a bf16 or fp16 result, which CPUs accumulate in fp32 and round once, so that another order
changes it only where the fp32 sum lies within a few fp32 ulps of a rounding boundary.
`wide=True` moves bf16 and fp16 results by their own ulps too, as a CPU that does fp16 arithmetic
natively might: harsher than any fp32-accumulating kernel, for claims about training runs.

    python scripts/output_stability.py --perturb 1        # every chapter, seeded perturbation
"""
from __future__ import annotations

import hashlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# The operations whose result depends on a summation order: products, reductions, and the fused
# kernels built from them (softmax, layer norm, attention), with their backward passes.
PACKETS = {
    aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.dot, aten.mv, aten.addmv,
    aten.sum, aten.mean, aten.var, aten.std, aten.var_mean, aten.std_mean, aten.norm, aten.linalg_vector_norm,
    aten.cumsum, aten.prod,
    aten._softmax, aten._log_softmax, aten._softmax_backward_data, aten._log_softmax_backward_data,
    aten.native_layer_norm, aten.native_layer_norm_backward,
    aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention_for_cpu_backward,
    aten.nll_loss_forward, aten.nll_loss_backward,
}
BITS = {torch.float32: (torch.int32, 23), torch.float16: (torch.int16, 10), torch.bfloat16: (torch.int16, 7)}
INF_BITS = {torch.float32: 0x7F800000, torch.float16: 0x7C00, torch.bfloat16: 0x7F80}  # +inf's bit pattern


class Perturb(TorchDispatchMode):
    """Move inexact results of order-dependent operations by up to `ulps` ulps, seeded. The steps
    depend on the seed, the operation and its inputs, so a repeated computation repeats its bits."""

    def __init__(self, seed: int = 0, ulps: int = 2, wide: bool = False):
        super().__init__()
        self.generator = torch.Generator()
        self.seed, self.ulps, self.wide = seed, ulps, wide
        self.calls = 0

    def _steps(self, func, args, shape, int_type):
        """The ulp steps for one result: a function of the seed, the operation and its inputs' bits,
        so that the same computation repeated gives the same bits, as on any deterministic CPU."""
        key = [self.seed, str(func)]
        for a in args:
            if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype in BITS and a.numel():
                # tolist(), not item(): a chapter may count the item() calls it makes
                key.append(a.detach().reshape(-1).view(BITS[a.dtype][0]).sum(dtype=torch.int64).tolist())
                key.append(tuple(a.shape))
        digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()  # stable across processes
        self.generator.manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
        return torch.randint(-self.ulps, self.ulps + 1, shape, generator=self.generator, dtype=int_type)

    def _move(self, out, func=None, args=()):
        if not isinstance(out, torch.Tensor) or out.dtype not in BITS or out.device.type != "cpu" or out.numel() == 0:
            return out
        if out.dtype != torch.float32 and not self.wide:
            return out
        int_type, mantissa = BITS[out.dtype]
        bits = out.view(int_type)
        steps = self._steps(func, args, out.shape, int_type)
        short = (bits & 0xFF) == 0 if mantissa > 8 else bits.new_zeros(bits.shape, dtype=torch.bool)
        # The bit pattern is sign and magnitude: a step changes the magnitude by that many ulps, and
        # must not cross zero (into the sign bit) or the largest finite number (into inf and NaN).
        inf_bits = INF_BITS[out.dtype]
        magnitude = bits & inf_bits | (bits & ((1 << mantissa) - 1))
        edge = (magnitude <= self.ulps) | (magnitude >= inf_bits - self.ulps)
        steps.masked_fill_(short | edge, 0)
        self.calls += 1
        return (bits + steps).view(out.dtype)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket not in PACKETS or func._schema.is_mutable:
            return out
        if isinstance(out, tuple):
            return tuple(self._move(o, (func, i), args) for i, o in enumerate(out))
        return self._move(out, func, args)


_ACTIVE: list[Perturb] = []


def enable(seed: int = 0, ulps: int = 2, wide: bool = False) -> Perturb:
    """Install the mode for the rest of the process (the notebook kernel's main thread). ``wide``
    moves bf16 and fp16 results by their own ulps too, as a CPU that does fp16 arithmetic natively
    might: harsher than any fp32-accumulating kernel, for claims about training runs."""
    mode = Perturb(seed, ulps, wide)
    mode.__enter__()
    _ACTIVE.append(mode)
    return mode
