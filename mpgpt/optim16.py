"""Weights and optimizer state in 16 bits: one AdamW, several ways to store it (chapter 10).

A bf16 number keeps 8 significant bits, so adding an update smaller than about 2^-9 of a weight
rounds it away: the weight never moves (chapter 3 shows the stall). Every variant below runs
the *same* AdamW arithmetic in fp32 and differs only in how the weights and the two moments are
stored between steps, and how the fp32 result is rounded into that storage:

| variant           | weights stored as                         | moments | bytes / parameter |
| ----------------- | ----------------------------------------- | ------- | ----------------- |
| `fp32-master`     | bf16 copy + fp32 master (the reference)   | fp32    | 2+2+4+4 +4 = 16   |
| `bf16`            | bf16, round to nearest even               | fp32    | 2+2+4+4    = 12   |
| `bf16-sr`         | bf16, stochastic rounding                 | fp32    | 2+2+4+4    = 12   |
| `bf16-kahan`      | bf16 + bf16 Kahan compensation            | fp32    | 2+2+4+4 +2 = 14   |
| `bf16-mantissa`   | bf16 + 16-bit remainder (= fp32 exactly)  | fp32    | 2+2+4+4 +2 = 14   |
| `bf16-moments`    | bf16 + 16-bit remainder                   | bf16, round to nearest | 2+2+2+2 +2 = 10 |
| `bf16-moments-sr` | bf16 + 16-bit remainder                   | bf16, stochastic       | 2+2+2+2 +2 = 10 |
| `all-bf16-sr`     | bf16, stochastic rounding                 | bf16, stochastic       | 2+2+2+2    =  8 |

(bytes: weights + gradients + first moment + second moment + extra buffer; the model's weights
and gradients are bf16 in every variant.)

The rounding is done on the integer bits of the fp32 result, which is exact and portable: the
same code runs in torch on a CPU and in Triton's interpreter (which mishandles bf16 arithmetic),
and the fused kernel (`mpgpt.kernels.adamw16`) reproduces it bit for bit. Stochastic rounding
adds 16 random bits below the kept ones before truncating (llm.c's approach), so it rounds up
with probability equal to the fraction cut off: unbiased. The random bits come from Philox4x32-10,
a counter-based generator: the bits for element ``i`` at step ``t`` are a pure function of
(seed, t, i), so runs are reproducible and any kernel can recompute them in place.

The mantissa buffer keeps the 16 low bits an fp32 master would have: the weight the forward
reads is the fp32 value rounded to nearest (ties away from zero), and the buffer holds the exact
signed remainder, which always fits in 16 bits. Rebuilt, the pair *is* the fp32 master weight,
so the variant matches `fp32-master` bit for bit (whose bf16 copy uses the same rounding).

A parameter may be bf16 or float32. A float32 parameter is treated as bf16 storage: the
optimizer writes only bf16-representable values into it. The chapter's CPU runs use that so the
forward pass runs at fp32 speed on exactly the bf16 weights.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

__all__ = [
    "VARIANTS", "Variant", "bytes_per_param", "AdamW16", "adamw16_update", "new_state", "Coefficients",
    "coefficients", "philox4x32", "random_bits", "round_nearest_bits", "round_stochastic_bits",
    "split_mantissa", "join_mantissa", "bits_of", "float_of", "store_bits", "load_bits", "step_seed",
]


@dataclass(frozen=True)
class Variant:
    """How one variant stores its weights and moments (see the module's table)."""

    name: str
    weights: str   # "fp32-master" | "nearest" | "stochastic" | "kahan" | "mantissa"
    moments: str   # "fp32" | "nearest" | "stochastic"
    summary: str

    @property
    def extra_buffer(self) -> str | None:
        return {"fp32-master": "master", "kahan": "compensation", "mantissa": "mantissa"}.get(self.weights)


VARIANTS: dict[str, Variant] = {v.name: v for v in [
    Variant("fp32-master", "fp32-master", "fp32", "bf16 weights, fp32 master copy and moments: the reference"),
    Variant("bf16", "nearest", "fp32", "bf16 weights rounded to nearest: small updates vanish"),
    Variant("bf16-sr", "stochastic", "fp32", "bf16 weights, stochastic rounding (llm.c)"),
    Variant("bf16-kahan", "kahan", "fp32", "bf16 weights plus a bf16 Kahan compensation buffer"),
    Variant("bf16-mantissa", "mantissa", "fp32", "bf16 weights plus their 16 missing bits: exact fp32 master"),
    Variant("bf16-moments", "mantissa", "nearest", "exact weights, both Adam moments in bf16 (nearest)"),
    Variant("bf16-moments-sr", "mantissa", "stochastic", "exact weights, both Adam moments in bf16 (stochastic)"),
    Variant("all-bf16-sr", "stochastic", "stochastic", "everything in bf16 with stochastic rounding"),
]}


def bytes_per_param(variant: str) -> dict:
    """Bytes per parameter of model weights, gradients, the two moments and the extra buffer."""
    v = _variant(variant)
    moment = 4 if v.moments == "fp32" else 2
    extra = {"fp32-master": 4, "kahan": 2, "mantissa": 2}.get(v.weights, 0)
    out = {"weights": 2, "grads": 2, "exp_avg": moment, "exp_avg_sq": moment, "extra": extra}
    out["total"] = sum(out.values())
    return out


# ---------------------------------------------------------------------------------------------
# Bits. An fp32 value's 32 bits are held as a non-negative int64 ("unsigned"), a bf16 value's
# 16 bits as an int64 in [0, 65536): integer arithmetic on them is exact on every CPU.
# ---------------------------------------------------------------------------------------------
_MASK32 = 0xFFFFFFFF
_QNAN16 = 0x7FC0


def bits_of(x: torch.Tensor) -> torch.Tensor:
    """The 32 bits of fp32 ``x`` as int64 in [0, 2^32)."""
    return x.to(torch.float32).view(torch.int32).to(torch.int64) & _MASK32


def float_of(bits32: torch.Tensor) -> torch.Tensor:
    """fp32 values from 32-bit patterns held in int64 (the inverse of bits_of)."""
    signed = torch.where(bits32 >= 2**31, bits32 - 2**32, bits32)
    return signed.to(torch.int32).view(torch.float32)


def load_bits(t: torch.Tensor) -> torch.Tensor:
    """The bf16 bit patterns (int64 in [0, 65536)) of a bf16 tensor, or of a float32 tensor that
    holds bf16 values (its low 16 bits must be zero)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).to(torch.int64) & 0xFFFF
    return bits_of(t) >> 16


def store_bits(t: torch.Tensor, bits16: torch.Tensor) -> None:
    """Write bf16 bit patterns into ``t`` in place: bf16 storage, or float32 holding bf16 values."""
    if t.dtype == torch.bfloat16:
        signed = torch.where(bits16 >= 2**15, bits16 - 2**16, bits16)
        t.view(torch.int16).copy_(signed.view_as(t).to(torch.int16))
    else:
        t.copy_(float_of(bits16 << 16).view_as(t))


def round_nearest_bits(u: torch.Tensor) -> torch.Tensor:
    """fp32 bits -> bf16 bits, rounded to nearest, ties to even (what ``x.to(torch.bfloat16)``
    does). NaN stays NaN."""
    hi = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return torch.where(_is_nan(u), _QNAN16 | (u >> 16) & 0x8000, hi)


def round_stochastic_bits(u: torch.Tensor, r16: torch.Tensor) -> torch.Tensor:
    """fp32 bits -> bf16 bits, rounded up in magnitude with probability (cut-off bits) / 2^16.

    ``r16`` are uniform random integers in [0, 2^16). Adding them to the 16 bits that are cut off
    carries into the kept bits exactly when r16 >= 2^16 - cut, i.e. with probability cut / 2^16:
    the rounded value's expectation is the fp32 value (sign and magnitude are separate in IEEE
    formats, so this holds for negative values too)."""
    return torch.where(_is_nan(u), _QNAN16 | (u >> 16) & 0x8000, (u + r16) >> 16)


def split_mantissa(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 bits -> (bf16 bits rounded to nearest with ties away from zero, signed remainder).

    The remainder ``u - hi * 2^16`` lies in [-2^15, 2^15): it fits an int16, so the pair holds
    the fp32 value exactly. (Ties to even would need 2^16 + 1 remainders.)"""
    hi = (u + 0x8000) >> 16
    return hi, u - (hi << 16)


def join_mantissa(hi16: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The fp32 bits that split_mantissa took apart."""
    return ((hi16 << 16) + lo) & _MASK32


def _is_nan(u: torch.Tensor) -> torch.Tensor:
    return (u & 0x7FFFFFFF) > 0x7F800000


# ---------------------------------------------------------------------------------------------
# Random bits: Philox4x32-10 (Salmon et al. 2011), the generator of Triton's tl.randint4x.
# ---------------------------------------------------------------------------------------------
_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # The 64-bit product of 32-bit a and b, split into its halves. It may exceed int64's range:
    # the multiply then wraps modulo 2^64 (two's complement), which keeps all 64 bits intact.
    p = b * a
    return (p >> 32) & _MASK32, p & _MASK32


def philox4x32(counter, key: tuple[int, int], rounds: int = 10):
    """Philox4x32 of the counter blocks ``counter`` = (c0, c1, c2, c3) (int64 tensors holding
    32-bit values) under ``key`` = (k0, k1): four int64 tensors of 32 random bits each."""
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) for c in counter)
    k0, k1 = key
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(_PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(_PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _PHILOX_W0) & _MASK32, (k1 + _PHILOX_W1) & _MASK32
    return c0, c1, c2, c3


def step_seed(seed: int, step: int) -> int:
    """The 64-bit Philox key of one optimizer step: the user's seed above, the step below."""
    if not 0 <= seed < 2**31:
        raise ValueError(f"seed must be in [0, 2^31), got {seed}")
    return (seed << 32) | (step & _MASK32)


def random_bits(key64: int, offset: int, n: int):
    """Three streams of 16 random bits for elements offset .. offset+n-1 (int64 in [0, 2^16)):
    for the weight, the first and the second moment. The same numbers as ``tl.randint4x(key64,
    offset + arange(n))`` in the fused kernel (counter = element index, key = key64)."""
    idx = torch.arange(offset, offset + n, dtype=torch.int64)
    r0, r1, r2, _ = philox4x32((idx & _MASK32, idx >> 32, torch.zeros_like(idx), torch.zeros_like(idx)),
                               (key64 & _MASK32, key64 >> 32))
    return r0 & 0xFFFF, r1 & 0xFFFF, r2 & 0xFFFF


# ---------------------------------------------------------------------------------------------
# The update.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Coefficients:
    """The scalars of one AdamW step, each rounded to fp32 once on the host, so the CPU
    reference and the fused kernel multiply by the very same numbers."""

    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    step_size: float       # lr / (1 - beta1^t)
    inv_sqrt_bc2: float    # 1 / sqrt(1 - beta2^t)
    eps: float
    lr_wd: float           # lr * weight_decay (decoupled decay, as torch.optim.AdamW)

    def values(self) -> list[float]:
        """The eight numbers in field order: the order the fused kernel reads them in."""
        return [self.beta1, self.one_minus_beta1, self.beta2, self.one_minus_beta2, self.step_size,
                self.inv_sqrt_bc2, self.eps, self.lr_wd]

    def as_tensor(self, device) -> torch.Tensor:
        """The eight numbers as an fp32 tensor on ``device`` (exact: each is an fp32 value already)."""
        return torch.tensor(self.values(), dtype=torch.float32, device=device)


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]  # round to the nearest fp32, ties to even


def coefficients(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> Coefficients:
    """AdamW's scalars at ``step`` (1-based), in fp32."""
    return Coefficients(_f32(beta1), _f32(1 - beta1), _f32(beta2), _f32(1 - beta2),
                        _f32(lr / (1 - beta1**step)), _f32(1 / math.sqrt(1 - beta2**step)), _f32(eps),
                        _f32(lr * weight_decay))


def new_state(param: torch.Tensor, variant: str) -> dict:
    """The optimizer state of one parameter: moments and the variant's extra buffer (flat)."""
    v = _variant(variant)
    n = param.numel()
    moment_dtype = torch.float32 if v.moments == "fp32" else torch.bfloat16
    state = {"exp_avg": torch.zeros(n, dtype=moment_dtype, device=param.device),
             "exp_avg_sq": torch.zeros(n, dtype=moment_dtype, device=param.device)}
    if v.weights == "fp32-master":
        state["master"] = param.detach().reshape(-1).to(torch.float32).clone()
    elif v.weights == "kahan":
        state["compensation"] = torch.zeros(n, dtype=torch.bfloat16, device=param.device)
    elif v.weights == "mantissa":
        state["mantissa"] = torch.zeros(n, dtype=torch.int16, device=param.device)
    return state


@torch.no_grad()
def adamw16_update(param: torch.Tensor, grad: torch.Tensor, state: dict, variant: str, c: Coefficients,
                   key64: int = 0, offset: int = 0, grad_div: torch.Tensor | None = None) -> None:
    """One AdamW step of one parameter in place, stored as ``variant`` says: the CPU reference.

    ``offset`` is the index of the parameter's first element in the optimizer's flat numbering
    (the Philox counter); ``key64`` is the step's key (`step_seed`). ``grad_div`` (a one-element
    tensor, or None for 1) divides every gradient first, as a multiplication by its correctly
    rounded reciprocal: gradient clipping's factor. All arithmetic is fp32; the order of
    operations is the fused kernel's, so both give the same bits.
    """
    v = _variant(variant)
    n = param.numel()
    g = grad.reshape(-1).to(torch.float32)                                 # (n,)
    if grad_div is not None:  # times the correctly rounded reciprocal, as the kernel does
        div = grad_div.reshape(1).to(device=g.device, dtype=torch.float32)
        g = g * _div_rn(torch.ones_like(div), div)
    w_bits = load_bits(param.detach().reshape(-1))                         # (n,) bf16 bits
    r_w, r_m, r_v = random_bits(key64, offset, n) if "stochastic" in (v.weights, v.moments) else (None,) * 3

    # 1. the moments, in fp32
    m = state["exp_avg"].to(torch.float32) * c.beta1 + g * c.one_minus_beta1
    s = state["exp_avg_sq"].to(torch.float32) * c.beta2 + (g * g) * c.one_minus_beta2
    if v.moments == "fp32":
        state["exp_avg"].copy_(m)
        state["exp_avg_sq"].copy_(s)
    else:
        rounding = round_nearest_bits if v.moments == "nearest" else None
        m16 = rounding(bits_of(m)) if rounding else round_stochastic_bits(bits_of(m), r_m)
        s16 = rounding(bits_of(s)) if rounding else round_stochastic_bits(bits_of(s), r_v)
        store_bits(state["exp_avg"], m16)
        store_bits(state["exp_avg_sq"], s16)

    # 2. the weight's fp32 value before the step, and the update (decoupled weight decay)
    if v.weights == "fp32-master":
        w = state["master"]
    elif v.weights == "mantissa":
        w = float_of(join_mantissa(w_bits, state["mantissa"].to(torch.int64)))
    else:
        w = float_of(w_bits << 16)
    # sqrt and division through float64, then rounded once to fp32: that is exactly the correctly
    # rounded fp32 result (53 >= 2 * 24 + 2 bits), what the kernel's sqrt_rn / div_rn compute.
    # torch's own fp32 sqrt on a CPU is not always correctly rounded (seen with torch 2.13).
    denom = _sqrt_rn(s) * c.inv_sqrt_bc2 + c.eps
    delta = -(w * c.lr_wd + _div_rn(m, denom) * c.step_size)              # (n,)

    # 3. into storage
    if v.weights == "kahan":
        y = delta + state["compensation"].to(torch.float32)
        new16 = round_nearest_bits(bits_of(w + y))
        comp = y - (float_of(new16 << 16) - w)                             # what the rounding lost
        store_bits(state["compensation"], round_nearest_bits(bits_of(comp)))
    else:
        x = w + delta
        if v.weights == "fp32-master":
            state["master"].copy_(x)
            new16, _ = split_mantissa(bits_of(x))
        elif v.weights == "mantissa":
            new16, lo = split_mantissa(bits_of(x))
            state["mantissa"].copy_(lo.to(torch.int16))
        elif v.weights == "nearest":
            new16 = round_nearest_bits(bits_of(x))
        else:
            new16 = round_stochastic_bits(bits_of(x), r_w)
    store_bits(param.detach().reshape(-1), new16)


class AdamW16(torch.optim.Optimizer):
    """AdamW whose weights and moments are stored as ``variant`` says (see VARIANTS).

        opt = AdamW16(model.parameters(), lr=1e-3, variant="bf16-sr", seed=0)
        loss.backward(); opt.step(); opt.zero_grad()

    The parameters are bf16 (or float32 holding bf16 values, see the module docstring); they are
    rounded to bf16 when the optimizer is built. All parameters share one flat element numbering,
    the counter of the random bits, so the fused kernel over one flat buffer draws the same ones.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 variant: str = "fp32-master", seed: int = 0):
        _variant(variant)
        if lr <= 0 or eps <= 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError("AdamW16 needs lr > 0, eps > 0, weight_decay >= 0 and betas in [0, 1)")
        step_seed(seed, 0)  # checks the seed
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.variant, self.seed, self.steps = variant, seed, 0
        # One flat state per parameter group; self.state[p] holds views of it, so the update can
        # run once over the whole group (or per parameter, with the same result).
        self.flat, self.group_offsets, offset = [], [], 0
        for group in self.param_groups:
            params = group["params"]
            for p in params:
                if p.dtype not in (torch.bfloat16, torch.float32):
                    raise TypeError(f"AdamW16 stores bf16 weights; got a {p.dtype} parameter: cast the model "
                                    "with model.to(torch.bfloat16) (or keep it float32 to emulate bf16 storage)")
            original = torch.cat([p.detach().reshape(-1).float() for p in params])   # (n,) fp32
            flat = new_state(original, variant)          # an fp32 master copies the original values
            hi, lo = split_mantissa(bits_of(original))
            if VARIANTS[variant].weights == "mantissa":
                flat["mantissa"].copy_(lo)
            exact = VARIANTS[variant].weights in ("fp32-master", "mantissa")
            start = 0
            for p in params:
                n = p.numel()
                if p.dtype == torch.float32:  # hold bf16 values from now on
                    bits = hi[start:start + n] if exact else round_nearest_bits(bits_of(original[start:start + n]))
                    store_bits(p.detach().reshape(-1), bits)
                self.state[p] = {name: t[start:start + n] for name, t in flat.items()}
                self.state[p]["offset"] = offset + start
                start += n
            self.flat.append(flat)
            self.group_offsets.append(offset)
            offset += start

    def prepare(self, step: int, lr: float | None = None) -> None:
        """Fix optimizer step number ``step`` (1-based) and, if given, every group's learning rate
        for the next ``step()``.

        A trainer calls this before each step, so the bias corrections follow *its* step count
        (which a checkpoint restores) rather than the optimizer's own. A step recorded as a CUDA
        graph never runs ``step()``'s Python again: the fused optimizer (`FusedAdamW16`) therefore
        writes the step's coefficients here into device tensors that the recorded kernels read.
        """
        if step < 1:
            raise ValueError(f"optimizer steps count from 1, got {step}")
        if lr is not None:
            for group in self.param_groups:
                group["lr"] = lr
        self.steps = step - 1
        self._write_coefficients(self._coefficients(step))
        self._prepared = step

    def _coefficients(self, step: int) -> list[Coefficients]:
        return [coefficients(g["lr"], g["betas"][0], g["betas"][1], g["eps"], g["weight_decay"], step)
                for g in self.param_groups]

    def _write_coefficients(self, coefs: list[Coefficients]) -> None:
        """Where a subclass keeps the step's coefficients for its kernels (nothing to do on the CPU)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.steps += 1
        key = step_seed(self.seed, self.steps)
        coefs = self._coefficients(self.steps)
        if getattr(self, "_prepared", None) != self.steps:  # prepare() wrote this step's already
            self._write_coefficients(coefs)
        self._prepared = None
        # gradient clipping's divisor, set by the caller as for torch's fused AdamW (None: 1)
        grad_div = getattr(self, "grad_scale", None)
        for i, (group, flat, offset) in enumerate(zip(self.param_groups, self.flat, self.group_offsets)):
            self._update_group(group["params"], flat, offset, coefs[i], key, i, grad_div)
        return loss

    def _update_group(self, params, flat: dict, offset: int, c: Coefficients, key: int, index: int = 0,
                      grad_div: torch.Tensor | None = None) -> None:
        """One step over group number ``index`` (a subclass may run it another way, e.g. fused)."""
        if all(p.grad is not None for p in params) and len({p.dtype for p in params}) == 1:
            # the whole group at once: fewer, larger operations (what the fused kernel does)
            w = torch.cat([p.detach().reshape(-1) for p in params])
            g = torch.cat([p.grad.reshape(-1).float() for p in params])
            adamw16_update(w, g, flat, self.variant, c, key, offset, grad_div)
            for p, chunk in zip(params, w.split([p.numel() for p in params])):
                p.detach().copy_(chunk.view_as(p))
        else:
            for p in params:
                if p.grad is not None:
                    state = self.state[p]
                    adamw16_update(p, p.grad, state, self.variant, c, key, state["offset"], grad_div)

    def state_dict(self) -> dict:
        """The flat state of every group (copies), the step count, and torch's param_groups.

        torch.optim.Optimizer's own load_state_dict would cast every state tensor to its
        parameter's dtype, turning fp32 masters and moments into bf16; this pair keeps them."""
        return {"variant": self.variant, "seed": self.seed, "steps": self.steps, "state": {},
                "flat": [{name: t.detach().clone() for name, t in flat.items()} for flat in self.flat],
                "param_groups": super().state_dict()["param_groups"]}

    def load_state_dict(self, state: dict) -> None:
        """Copy a `state_dict` into this optimizer's buffers in place (the parameters' views of them stay)."""
        if state.get("variant") != self.variant or len(state.get("flat", ())) != len(self.flat):
            raise ValueError(f"this state is for variant {state.get('variant')!r} with "
                             f"{len(state.get('flat', ()))} groups; the optimizer is {self.variant!r} with "
                             f"{len(self.flat)}: build the optimizer as the saved run did")
        for saved, flat in zip(state["flat"], self.flat):
            if saved.keys() != flat.keys() or any(saved[k].shape != flat[k].shape for k in flat):
                raise ValueError("the saved optimizer state does not match the parameters' sizes; "
                                 "resume with the model the state was saved from")
        for saved, flat in zip(state["flat"], self.flat):
            for name, t in flat.items():
                t.copy_(saved[name])
        for group, saved in zip(self.param_groups, state["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.seed, self.steps = state["seed"], state["steps"]

    @torch.no_grad()
    def load_fp32_weights(self, weights: dict) -> None:
        """Make ``weights[p]`` (fp32) the value this optimizer holds for each parameter ``p`` given,
        e.g. the weights a model had before it was cast to bf16: a master, or a bf16 weight with its
        16-bit remainder, keeps every bit of it; the other variants round it to nearest."""
        v = VARIANTS[self.variant]
        for p, value in weights.items():
            if p not in self.state or value.numel() != p.numel():
                raise ValueError("load_fp32_weights takes {parameter: tensor of its size} for this optimizer's "
                                 "parameters")
            w = value.detach().reshape(-1).to(device=p.device, dtype=torch.float32)
            hi, lo = split_mantissa(bits_of(w))
            state = self.state[p]
            if v.weights == "fp32-master":
                state["master"].copy_(w)
            elif v.weights == "mantissa":
                state["mantissa"].copy_(lo.to(torch.int16))
            else:
                hi = round_nearest_bits(bits_of(w))
            store_bits(p.detach().reshape(-1), hi)

    def fp32_weight(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 value the optimizer holds for parameter ``p`` (flat): the master, the rebuilt
        bf16 + remainder pair, bf16 + compensation, or the bf16 weight itself."""
        state, v = self.state[p], VARIANTS[self.variant]
        bits = load_bits(p.detach().reshape(-1))
        if v.weights == "fp32-master":
            return state["master"].clone()
        if v.weights == "mantissa":
            return float_of(join_mantissa(bits, state["mantissa"].to(torch.int64)))
        w = float_of(bits << 16)
        return w + state["compensation"].float() if v.weights == "kahan" else w


def _sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(x.double()).float()


def _div_rn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.double() / b.double()).float()


def _variant(name: str) -> Variant:
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; choose one of {', '.join(VARIANTS)}")
    return VARIANTS[name]
