"""Bit-level views of the floating-point formats used in mixed-precision training (chapter 1).

Five formats: fp32, fp16, bf16 and the two fp8 formats e4m3fn and e5m2. A `FloatFormat`
describes one by its bit counts; range and precision follow from those bits alone, and the tests
check them against `torch.finfo`.

Two ways to round a number into a format live side by side:

- the reference, torch's own casts (`encode`, `round_to`, `bits`, `decode`), and
- the teaching version in pure Python (`round_nearest_even`, `encode_nearest_even`,
  `decode_bits`): round-to-nearest, ties-to-even on the significand with exact `Fraction`
  arithmetic, gradual underflow into subnormals, overflow to inf (or saturation for e4m3fn).
  tests/test_formats.py checks the two agree bit for bit.

One subtlety: torch converts float64 to fp16/bf16/fp8 *through float32*, so a float64 input is
rounded twice. `round_to` follows torch; `round_nearest_even` rounds once, exactly. The two can
differ on float64 inputs that sit a hair above a halfway point (chapter 1, exercise 3); on float32
inputs they always agree.

References: IEEE 754-2019; Goldberg (1991), "What every computer scientist should know about
floating-point arithmetic"; Micikevicius et al. (2022), "FP8 formats for deep learning".
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Iterable, Union

import torch

Number = Union[int, float, Fraction]


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format: 1 sign bit, `exponent_bits`, `mantissa_bits` (stored
    fraction bits, without the implicit leading 1) and an exponent `bias`.

    `has_inf=False` describes e4m3fn ("fn" = finite, NaN): no infinities, only the all-ones
    pattern S.1111.111 is NaN, so the top exponent holds ordinary numbers. Casts of values past
    ±448 either saturate to ±448 or become NaN, depending on the torch release (see
    :func:`e4m3fn_saturates`).
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    dtype: torch.dtype
    has_inf: bool = True

    @property
    def total_bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal number (exponent field 1)."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Unbiased exponent of the largest finite number. IEEE formats reserve the all-ones
        exponent field for inf/NaN; e4m3fn uses it for numbers."""
        top_field = 2 ** self.exponent_bits - 1
        return (top_field - 1 if self.has_inf else top_field) - self.bias

    @property
    def max_finite(self) -> float:
        # IEEE: significand 1.11...1 = 2 - 2^-m. e4m3fn: 1.11...1 in the top binade is NaN,
        # so the largest significand there is 1.11...10 = 2 - 2^-(m-1).
        ulps_missing = 1 if self.has_inf else 2
        significand = 2 - Fraction(ulps_missing, 2 ** self.mantissa_bits)
        return float(significand * Fraction(2) ** self.emax)

    @property
    def smallest_normal(self) -> float:
        return 2.0 ** self.emin

    @property
    def smallest_subnormal(self) -> float:
        """Exponent field 0, mantissa field 1: 2^(emin - m)."""
        return 2.0 ** (self.emin - self.mantissa_bits)

    @property
    def eps(self) -> float:
        """Machine epsilon: the gap between 1 and the next representable number, 2^-m.
        Rounding to nearest has relative error at most eps/2 (the unit roundoff) in the normal range."""
        return 2.0 ** -self.mantissa_bits

    @property
    def decimal_digits(self) -> float:
        """Significant decimal digits carried by the m+1 significand bits: (m+1) log10 2."""
        return (self.mantissa_bits + 1) * math.log10(2)

    @property
    def resolution(self) -> float:
        """torch.finfo's `resolution`: 10^-floor(-log10 eps), the decimal step you can trust."""
        return 10.0 ** -math.floor(-math.log10(self.eps))

    def __str__(self) -> str:
        return f"{self.name} (1 sign, {self.exponent_bits} exponent, {self.mantissa_bits} mantissa bits)"


FORMATS: dict[str, FloatFormat] = {
    f.name: f
    for f in (
        FloatFormat("fp32", 8, 23, 127, torch.float32),
        FloatFormat("fp16", 5, 10, 15, torch.float16),
        FloatFormat("bf16", 8, 7, 127, torch.bfloat16),
        FloatFormat("e4m3fn", 4, 3, 7, torch.float8_e4m3fn, has_inf=False),
        FloatFormat("e5m2", 5, 2, 15, torch.float8_e5m2),
    )
}

_ALIASES = {
    "float32": "fp32", "float": "fp32", "single": "fp32",
    "float16": "fp16", "half": "fp16",
    "bfloat16": "bf16",
    "e4m3": "e4m3fn", "fp8_e4m3": "e4m3fn", "fp8_e4m3fn": "e4m3fn", "float8_e4m3fn": "e4m3fn",
    "fp8_e5m2": "e5m2", "float8_e5m2": "e5m2",
}

# torch views each format's bits through a same-width integer dtype.
_INT_VIEW = {32: torch.int32, 16: torch.int16, 8: torch.uint8}


def get_format(fmt: Union[str, torch.dtype, FloatFormat]) -> FloatFormat:
    """Look a format up by name ("fp16", "bfloat16", "e4m3", ...), torch dtype, or pass one through."""
    if isinstance(fmt, FloatFormat):
        return fmt
    if isinstance(fmt, torch.dtype):
        for f in FORMATS.values():
            if f.dtype == fmt:
                return f
        raise ValueError(f"no FloatFormat for {fmt}; use one of {', '.join(FORMATS)}")
    key = str(fmt).lower().replace("torch.", "")
    key = _ALIASES.get(key, key)
    if key not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    return FORMATS[key]


# --------------------------------------------------------------------------------------------
# The reference: torch casts (round-to-nearest-even; e4m3fn overflow: see e4m3fn_saturates).
# --------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def e4m3fn_saturates() -> bool:
    """Does this torch cast values past e4m3fn's range to ±448 (saturation) rather than NaN?

    e4m3fn has no infinity, so an overflowing cast must pick one of the two (the OCP FP8 spec
    allows both modes). Seen on 2026-11-30: torch 2.13 saturates, torch 2.11 returns NaN.
    """
    return torch.tensor(1e6, dtype=torch.float32).to(torch.float8_e4m3fn).float().item() == 448.0


def _as_tensor(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    return torch.tensor(float(x), dtype=torch.float64)


def encode(x, fmt) -> Union[int, torch.Tensor]:
    """Bit pattern of x after torch casts it to fmt, as an unsigned int (a tensor in, an int64
    tensor of patterns out). Python numbers go in as float64 (torch rounds those via float32)."""
    f = get_format(fmt)
    t = _as_tensor(x).to(f.dtype).view(_INT_VIEW[f.total_bits]).to(torch.int64)
    t = t & ((1 << f.total_bits) - 1)  # two's-complement view -> unsigned pattern
    return int(t) if t.dim() == 0 and not isinstance(x, torch.Tensor) else t


def round_to(x, fmt) -> Union[float, torch.Tensor]:
    """The value x takes when torch stores it in fmt (a float, or a float64 tensor for tensors)."""
    f = get_format(fmt)
    t = _as_tensor(x).to(f.dtype).to(torch.float64)
    return t if isinstance(x, torch.Tensor) else float(t)


def bits(x, fmt) -> str:
    """x stored in fmt, as 'sign|exponent|mantissa', e.g. bits(1.0, "fp16") == "0|01111|0000000000"."""
    f = get_format(fmt)
    return format_pattern(encode(x, f), f)


def format_pattern(pattern: int, fmt) -> str:
    """Group a raw bit pattern as 'sign|exponent|mantissa'."""
    f = get_format(fmt)
    s = format(pattern, f"0{f.total_bits}b")
    return f"{s[0]}|{s[1:1 + f.exponent_bits]}|{s[1 + f.exponent_bits:]}"


@dataclass(frozen=True)
class Decoded:
    """The fields of one stored number. `value` is an exact Fraction for finite numbers and a
    float for inf/NaN; `exponent` is unbiased (None for zero, inf and NaN)."""

    fmt: str
    pattern: str
    sign: int
    exponent_field: int
    mantissa_field: int
    exponent: Union[int, None]
    value: Union[Fraction, float]
    kind: str  # "normal", "subnormal", "zero", "inf" or "nan"

    def __str__(self) -> str:
        v = self.value if isinstance(self.value, float) else float(self.value)
        return f"{self.fmt:>6} {self.pattern}  {self.kind:<9} {v!r}"


def decode(x, fmt) -> Decoded:
    """Store x in fmt with torch, then read the fields back (see `decode_bits`)."""
    return decode_bits(encode(x, fmt), fmt)


def decode_bits(pattern: int, fmt) -> Decoded:
    """Read a raw bit pattern field by field (pure Python):

    normal:    (-1)^s * (1 + M / 2^m) * 2^(E - bias)      for 0 < E < all ones
    subnormal: (-1)^s * (M / 2^m)     * 2^(1 - bias)      for E == 0, M != 0
    """
    f = get_format(fmt)
    m, e_bits = f.mantissa_bits, f.exponent_bits
    if not 0 <= pattern < 2 ** f.total_bits:
        raise ValueError(f"pattern {pattern} does not fit in {f.total_bits} bits")
    sign = pattern >> (f.total_bits - 1)
    e_field = (pattern >> m) & (2 ** e_bits - 1)
    m_field = pattern & (2 ** m - 1)
    top = 2 ** e_bits - 1
    sgn = -1 if sign else 1
    exponent = None
    if f.has_inf and e_field == top:
        kind = "inf" if m_field == 0 else "nan"
        value = sgn * math.inf if m_field == 0 else math.nan
    elif not f.has_inf and e_field == top and m_field == 2 ** m - 1:
        kind, value = "nan", math.nan
    elif e_field == 0:
        kind = "zero" if m_field == 0 else "subnormal"
        value = sgn * Fraction(m_field, 2 ** m) * Fraction(2) ** f.emin
        exponent = f.emin if m_field else None
    else:
        kind = "normal"
        exponent = e_field - f.bias
        value = sgn * (1 + Fraction(m_field, 2 ** m)) * Fraction(2) ** exponent
    return Decoded(f.name, format_pattern(pattern, f), sign, e_field, m_field, exponent, value, kind)


def rounding_error(x, fmt, relative: bool = False) -> float:
    """round_to(x, fmt) - x, computed exactly then shown as a float; relative divides by |x|."""
    r = round_to(x, fmt)
    x = float(x)
    if not (math.isfinite(r) and math.isfinite(x)):
        return math.nan if math.isnan(r) or math.isnan(x) else math.inf
    err = Fraction(r) - Fraction(x)
    if relative:
        return float(err / abs(Fraction(x))) if x != 0 else 0.0
    return float(err)


# --------------------------------------------------------------------------------------------
# The teaching version: rounding in pure Python, on exact fractions.
# --------------------------------------------------------------------------------------------

def _floor_log2(a: Fraction) -> int:
    """floor(log2(a)) for a > 0, exactly (no float log)."""
    e = a.numerator.bit_length() - a.denominator.bit_length()
    # 2^e <= a < 2^(e+1) now holds or is off by one downward
    return e if Fraction(2) ** e <= a else e - 1


def _spacing(a: Fraction, f: FloatFormat) -> Fraction:
    """Gap between representable numbers around magnitude a: 2^(e - m) in binade e; below the
    normal range the exponent stays at emin, so the gap stays 2^(emin - m) (subnormals)."""
    e = max(_floor_log2(a), f.emin) if a > 0 else f.emin
    return Fraction(2) ** (e - f.mantissa_bits)


def neighbors(x: Number, fmt) -> tuple[float, float]:
    """(lo, hi): the largest representable value <= x and the smallest >= x (equal when x is
    representable). Beyond the largest finite value the missing neighbour is ±inf."""
    f = get_format(fmt)
    if isinstance(x, float) and not math.isfinite(x):
        raise ValueError(f"neighbors needs a finite number, got {x}")
    q = Fraction(x)
    step = _spacing(abs(q), f)
    k = q / step
    lo, hi = math.floor(k) * step, math.ceil(k) * step
    big = Fraction(f.max_finite)
    lo = float(lo) if abs(lo) <= big else (f.max_finite if lo > 0 else -math.inf)
    hi = float(hi) if abs(hi) <= big else (math.inf if hi > 0 else -f.max_finite)
    return lo, hi


def round_nearest_even(x: Number, fmt) -> float:
    """Round x to fmt exactly, in pure Python: nearest representable value, ties to the one whose
    last mantissa bit is 0; subnormals below the normal range; past the largest finite value,
    inf for IEEE formats and, for e4m3fn, ±max or NaN as this torch does (e4m3fn_saturates)."""
    f = get_format(fmt)
    if isinstance(x, float) and math.isnan(x):
        return math.nan
    if isinstance(x, float) and math.isinf(x):
        return x if f.has_inf else _no_inf_overflow(f, x)
    q = Fraction(x)
    negative = q < 0 or (isinstance(x, float) and math.copysign(1.0, x) < 0)
    a = abs(q)
    step = _spacing(a, f)
    k, rest = divmod(a, step)  # a = k * step + rest, 0 <= rest < step
    k = int(k)
    if 2 * rest > step or (2 * rest == step and k % 2 == 1):
        k += 1  # past halfway, or exactly halfway with an odd last bit: round up to the even one
    r = k * step  # an even k has mantissa LSB 0, also when k spills into the next binade
    sign = -1.0 if negative else 1.0
    if r > Fraction(f.max_finite):
        # IEEE: anything that rounds past max becomes inf. e4m3fn has no inf (see e4m3fn_saturates).
        return math.copysign(math.inf, sign) if f.has_inf else _no_inf_overflow(f, sign)
    return math.copysign(float(r), sign)  # copysign keeps -0.0 for tiny negatives


def _no_inf_overflow(f: "FloatFormat", sign: float) -> float:
    """Overflow in a format without infinities: saturate to ±max, or NaN, as this torch does."""
    return math.copysign(f.max_finite, sign) if e4m3fn_saturates() else math.nan


def encode_nearest_even(x: Number, fmt) -> int:
    """Bit pattern of round_nearest_even(x, fmt), built field by field (pure Python).
    NaN gets the canonical quiet NaN (sign 0, exponent all ones, top mantissa bit set)."""
    f = get_format(fmt)
    m = f.mantissa_bits
    r = round_nearest_even(x, f)
    top = 2 ** f.exponent_bits - 1
    if math.isnan(r):
        mant = 2 ** m - 1 if not f.has_inf else 2 ** (m - 1)
        return (top << m) | mant
    sign = 1 if math.copysign(1.0, r) < 0 else 0
    a = abs(Fraction(r)) if math.isfinite(r) else None
    if a is None:  # inf
        e_field, m_field = top, 0
    elif a < Fraction(f.smallest_normal):  # zero or subnormal: value = M * 2^(emin - m)
        e_field, m_field = 0, int(a / Fraction(f.smallest_subnormal))
    else:
        e = _floor_log2(a)
        e_field = e + f.bias
        m_field = int((a / Fraction(2) ** e - 1) * 2 ** m)
    return (sign << (f.total_bits - 1)) | (e_field << m) | m_field


# --------------------------------------------------------------------------------------------
# Accumulation: summing many small numbers in a low-precision running sum.
# --------------------------------------------------------------------------------------------

def running_sum(values, fmt, accumulator=None) -> torch.Tensor:
    """Partial sums of `values` added one at a time, as a float64 tensor (n,).

    Each value is first stored in `fmt`; the running sum lives in `accumulator` (default: fmt).
    Every step adds in fp32 and rounds the result into the accumulator format, which is what a
    kernel does when it keeps its running sum in a low-precision register. Once the sum is large,
    adding a value smaller than half its spacing leaves it unchanged: the sum stalls.
    """
    f = get_format(fmt)
    acc_f = get_format(accumulator if accumulator is not None else f)
    v = torch.as_tensor(values, dtype=torch.float64).reshape(-1).to(f.dtype).to(torch.float32)
    acc = torch.zeros((), dtype=acc_f.dtype)
    out = torch.empty(v.numel(), dtype=torch.float64)
    for i in range(v.numel()):
        # fp8 tensors support no arithmetic on CPU, so add in fp32 and cast back every step.
        acc = (acc.to(torch.float32) + v[i]).to(acc_f.dtype)
        out[i] = acc.to(torch.float64)
    return out


def accumulate(values, fmt, accumulator=None) -> float:
    """Sum `values` sequentially: values stored in fmt, running sum kept in accumulator
    (default fmt). accumulate([1e-4] * 10_000, "fp16") stalls at 0.25; with accumulator="fp32"
    it reaches 1.0."""
    partial = running_sum(values, fmt, accumulator)
    return float(partial[-1]) if partial.numel() else 0.0


def format_table(formats: Iterable = None) -> str:
    """A plain-text table of each format's layout, range and precision."""
    fs = [get_format(f) for f in (formats or FORMATS)]
    head = f"{'format':<7} {'s/e/m':<7} {'bias':>4} {'max finite':>11} {'min normal':>11} " \
           f"{'min subnorm':>11} {'eps':>9} {'digits':>6}"
    lines = [head, "-" * len(head)]
    for f in fs:
        lines.append(
            f"{f.name:<7} {f'1/{f.exponent_bits}/{f.mantissa_bits}':<7} {f.bias:>4} "
            f"{f.max_finite:>11.5g} {f.smallest_normal:>11.4g} {f.smallest_subnormal:>11.4g} "
            f"{f.eps:>9.3g} {f.decimal_digits:>6.2f}")
    return "\n".join(lines)
