"""Perturb PyTorch's floating-point results the way another CPU's kernels would.

Two CPUs run the same float program with different kernels: AVX2 or AVX-512 or AMX, another BLAS
blocking, another thread split. Each sums in its own order, so a result that is not exactly
representable can come out a few units in the last place (ulps) higher or lower. A checked notebook
cell must print the same text whatever the order; this mode lets one machine play every other.

`enable(seed, ulps)` installs a TorchDispatchMode that, after each matrix product and reduction
(forward and backward: mm, addmm, bmm, sums, means, softmax, layer norm, attention ...), moves every
element whose exact value the output dtype cannot hold by a seeded random whole number of ulps in
[-ulps, ulps]: an fp32 result by its own ulps; a bf16 or fp16 result, which CPUs accumulate in fp32
and round once, by fp32 ulps before that rounding. The exact value is taken from the same operation
in float64. An element the dtype
holds exactly (a count, a sum of a few small integers, a power-of-two scaling of an exact value) is
left alone: every summation order gets those right, so no real CPU moves them either.

    python scripts/output_stability.py --perturb 1        # every chapter, seeded perturbation
"""
from __future__ import annotations

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
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _double(x):
    return x.double() if isinstance(x, torch.Tensor) and x.dtype in DTYPES else x


class Perturb(TorchDispatchMode):
    """Move inexact results of order-dependent operations by up to `ulps` ulps, seeded."""

    def __init__(self, seed: int = 0, ulps: int = 2, wide: bool = False):
        super().__init__()
        self.generator = torch.Generator().manual_seed(seed)
        self.ulps, self.wide = ulps, wide
        self.calls = 0

    def _move(self, out: torch.Tensor, exact: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(out, torch.Tensor) or out.dtype not in DTYPES or out.numel() == 0 or out.device.type != "cpu":
            return out
        steps = torch.randint(-self.ulps, self.ulps + 1, out.shape, generator=self.generator).double()
        known = isinstance(exact, torch.Tensor) and exact.shape == out.shape
        if known and out.dtype != torch.float32 and not self.wide:
            # A CPU computes a bf16 or fp16 product or sum in fp32 and rounds it once at the end: another
            # order moves the fp32 value by a few of its ulps, and the 16-bit result only where that
            # crosses a rounding boundary.
            moved = (exact * (1 + steps * torch.finfo(torch.float32).eps)).float().to(out.dtype)
        else:
            moved = (out.double() * (1 + steps * torch.finfo(out.dtype).eps)).to(out.dtype)
        keep = ~torch.isfinite(out)
        if known:
            keep |= exact.to(out.dtype).double() == exact  # the dtype holds the exact value: leave it
        self.calls += 1
        return torch.where(keep, out, moved)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.overloadpacket not in PACKETS or func._schema.is_mutable:
            return out
        try:
            exact = func(*[_double(a) for a in args], **{k: _double(v) for k, v in kwargs.items()})
        except Exception:  # an operation without a float64 kernel: treat every element as inexact
            exact = None
        if isinstance(out, tuple):
            exacts = exact if isinstance(exact, tuple) else (None,) * len(out)
            return tuple(self._move(o, e) for o, e in zip(out, exacts))
        return self._move(out, exact)


_ACTIVE: list[Perturb] = []


def enable(seed: int = 0, ulps: int = 2, wide: bool = False) -> Perturb:
    """Install the mode for the rest of the process (the notebook kernel's main thread). ``wide``
    moves bf16 and fp16 results by their own ulps too, as a CPU that does fp16 arithmetic natively
    might: harsher than any fp32-accumulating kernel, for claims about training runs."""
    mode = Perturb(seed, ulps, wide)
    mode.__enter__()
    _ACTIVE.append(mode)
    return mode
