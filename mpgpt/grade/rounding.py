"""ch1-rounding: round an fp32 bit pattern to fp16 or bf16, bit by bit (chapter 1).

The learner writes ``round_fp32_bits(bits, fmt)``: the 32-bit pattern of an fp32 number in, the
16-bit pattern of the nearest fp16 or bf16 number out, ties to even, with subnormals, signed
zeros, infinities and NaN. The expected patterns come from torch's own casts
(``mpgpt.formats.encode``), which round to nearest even; tests/test_formats.py shows that the
package's pure-Python rounding agrees with them bit for bit.
"""
from __future__ import annotations

import random
import struct

import torch

from mpgpt import formats

from .core import Case, Check, Failed, exact

NAME = "ch1-rounding"
OWN = ("mpgpt.formats",)
# A library's cast to a 16-bit format would be graded instead of the learner's rounding: torch's and
# numpy's dtypes and casts, and struct's half-precision format "e".
REFERENCE_ATTRS = ("float16", "bfloat16", "half", "e", "<e", ">e", "=e", "!e", "@e")
LEGEND = ""
FORMATS = ("fp16", "bf16")

STUB = '''"""Chapter 1, graded: round fp32 to fp16 or bf16 on the bit patterns.

Grade it with:  python -m mpgpt.grade ch1-rounding this_file.py
"""


def round_fp32_bits(bits: int, fmt: str) -> int:
    """Round the fp32 number whose 32-bit pattern is ``bits`` to ``fmt``; return its 16-bit pattern.

    bits: an int in [0, 2**32), e.g. 0x3F800000 for 1.0 (struct.pack("<f", x) gives you patterns).
    fmt:  "fp16" (1 sign, 5 exponent, 10 mantissa bits, bias 15) or
          "bf16" (1 sign, 8 exponent, 7 mantissa bits, bias 127).
    Returns an int in [0, 2**16): sign | exponent field | mantissa field.

    What the grader checks, one behaviour at a time:
    - exactly representable numbers keep their value; -0.0 keeps its sign;
    - round to nearest, and on an exact tie to the neighbour whose last mantissa bit is 0;
    - values from 65520 on (the midpoint past fp16's largest finite number, 65504) round to infinity, as IEEE 754 says;
    - fp16's gradual underflow: values below 2**-14 become subnormals (exponent field 0), and
      values at or below half the smallest subnormal (2**-25) round to zero;
    - infinities stay infinities, NaN stays NaN (any NaN pattern will do).
    Work on integers (shifts and masks) or with exact fractions, as chapter 1 does; do not call
    torch or numpy casts, which would be grading them instead of you.
    """
    raise NotImplementedError
'''


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _bits32(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def expected(bits: int | list[int], fmt: str):
    """torch's cast of the fp32 number(s) with pattern(s) ``bits`` to fmt, as 16-bit pattern(s)."""
    many = isinstance(bits, list)
    signed = [b - (1 << 32) if b >= 1 << 31 else b for b in (bits if many else [bits])]
    t = torch.tensor(signed, dtype=torch.int32).view(torch.float32)  # bits -> fp32, exactly
    out = [int(v) for v in formats.encode(t, fmt).tolist()]
    return out if many else out[0]


def _is_nan(pattern: int, fmt: str) -> bool:
    f = formats.get_format(fmt)
    top = (1 << f.exponent_bits) - 1
    return (pattern >> f.mantissa_bits) & top == top and pattern & ((1 << f.mantissa_bits) - 1) != 0


def _is_inf(pattern: int, fmt: str) -> bool:
    f = formats.get_format(fmt)
    top = (1 << f.exponent_bits) - 1
    return (pattern >> f.mantissa_bits) & top == top and pattern & ((1 << f.mantissa_bits) - 1) == 0


HINTS = {
    "nan": "a NaN must stay a NaN: exponent all ones and a nonzero mantissa (keep a mantissa bit set "
           "after the shift, or set the top one)",
    "inf": "an infinity stays an infinity: exponent all ones, mantissa 0",
    "overflow": "past the largest finite number the result is inf (exponent all ones, mantissa 0), "
                "not the largest number; a rounding carry can reach the next binade too",
    "sign": "the sign bit moves to bit 15 whatever the magnitude does (-0.0 and negative results too)",
    "subnormal": "below the smallest normal fp16 keeps exponent field 0 and shifts the significand (with "
                 "its leading 1) right; round the shifted-out bits the same way, ties to even",
    "tie": "exactly half an ulp dropped: round up only if the kept last bit is 1 (ties to even); any "
           "nonzero bit below the halfway bit (a 'sticky' bit) means past halfway",
    "truncates": "look at the dropped mantissa bits: more than half an ulp rounds up (truncating is "
                 "wrong half of the time)",
    "rounds_up": "round up only when more than half an ulp is dropped (or exactly half and the kept "
                 "last bit is 1)",
    "range": "return the 16-bit pattern: an int in [0, 2**16)",
}


def _why(bits: int, got: int, want: int, fmt: str) -> str | None:
    """Which part of rounding a wrong pattern points at (a key of HINTS), or None."""
    f = formats.get_format(fmt)
    if not 0 <= got < 1 << 16:
        return "range"
    if _is_nan(want, fmt):
        return "nan"
    if (got ^ want) & 0x8000:
        return "sign"
    if _is_inf(want, fmt):
        return "inf" if (bits >> 23) & 0xFF == 0xFF else "overflow"
    if want >> f.mantissa_bits == 0 or got >> f.mantissa_bits == 0:  # zero or subnormal
        return "subnormal"
    shift = 23 - f.mantissa_bits
    if (bits >> 23) & 0xFF and (bits & ((1 << shift) - 1)) == 1 << (shift - 1):
        return "tie"
    if got == want - 1:
        return "truncates"
    if got == want + 1:
        return "rounds_up"
    return None


def _cases(*groups: tuple[str, list[int]], what: str) -> Case:
    """prepare(): fp32 patterns per format, and torch's patterns for them."""
    inputs = [{"fmt": fmt, "bits": bits} for fmt, bits in groups]
    return Case({"what": what, "groups": inputs}, [expected(g["bits"], g["fmt"]) for g in inputs])


def _observe(module, inputs) -> list[list[int]]:
    out = []
    for group in inputs["groups"]:
        got = []
        for bits in group["bits"]:
            value = module.round_fp32_bits(bits, group["fmt"])
            got.append(exact(value, int, what=f"round_fp32_bits(0x{bits:08X}, {group['fmt']!r})"))
        out.append(got)
    return out


def _judge(case: Case, observed) -> None:
    """Every case must give torch's pattern (any NaN for a NaN); report the first mismatch and the
    hint for what it points at."""
    what = case.inputs["what"]
    for group, gots, wants in zip(case.inputs["groups"], observed, case.expected, strict=True):
        fmt, cases = group["fmt"], group["bits"]
        wrong = [(b, g, w) for b, g, w in zip(cases, gots, wants, strict=True)
                 if not (_is_nan(g, fmt) if _is_nan(w, fmt) else g == w)]
        if wrong:
            bits, got, want = wrong[0]
            why = _why(bits, got, want, fmt)
            raise Failed(f"{fmt}: {len(wrong)} of {len(cases)} {what} differ, e.g. {_f32(bits)!r} "
                         f"(0x{bits:08X}) -> got 0x{got:04X}, expected 0x{want:04X}", HINTS.get(why))


def _fp32_of(pattern: int, fmt: str) -> int:
    """The fp32 pattern of the 16-bit number ``pattern`` (exact: fp32 holds every fp16/bf16 value)."""
    f = formats.get_format(fmt)
    signed = pattern - (1 << 16) if pattern >= 1 << 15 else pattern
    value = torch.tensor([signed], dtype=torch.int16).view(f.dtype).float()
    return _bits32(value.item())


def _finite_normal_patterns(fmt: str, n: int, rng: random.Random) -> list[int]:
    f = formats.get_format(fmt)
    top = (1 << f.exponent_bits) - 1
    out = []
    while len(out) < n:
        p = rng.getrandbits(16)
        e = (p >> f.mantissa_bits) & top
        if 0 < e < top and (p & ((1 << f.mantissa_bits) - 1)) != (1 << f.mantissa_bits) - 1:
            out.append(p)  # not the last in its binade, so p + 1 ulp is finite too
    return out


def _ties(fmt: str, rng: random.Random) -> list[int]:
    """fp32 numbers exactly halfway between two neighbours of fmt, and one fp32 ulp either side."""
    f = formats.get_format(fmt)
    half = 1 << (23 - f.mantissa_bits - 1)  # half a 16-bit ulp, in fp32 mantissa units
    cases = []
    for p in _finite_normal_patterns(fmt, 300, rng):
        b = _fp32_of(p, fmt) + half
        sign = rng.getrandbits(1) << 31
        cases += [b | sign, (b + 1) | sign, (b - 1) | sign]
    return cases


def _prepare_exact(rng: random.Random) -> Case:
    groups = []
    for fmt in FORMATS:
        values = [1.0, -2.0, 0.5, 3.0, -0.15625, 2.0**-14, 65504.0 if fmt == "fp16" else 2.0**100, 0.0]
        groups.append((fmt, [_bits32(v) for v in values]))
    return _cases(*groups, what="exactly representable numbers")


def _prepare_signed_zero(rng: random.Random) -> Case:
    return _cases(*[(fmt, [0x80000000]) for fmt in FORMATS], what="negative zeros")


def _prepare_random(rng: random.Random) -> Case:
    groups = []
    for fmt in FORMATS:
        f = formats.get_format(fmt)
        cases = []
        while len(cases) < 2000:  # random fp32 patterns whose value lies in fmt's normal range
            b = rng.getrandbits(32)
            if f.smallest_normal <= abs(_f32(b)) < f.max_finite:
                cases.append(b)
        groups.append((fmt, cases))
    return _cases(*groups, what="random fp32 numbers in the normal range")


def _prepare_ties(rng: random.Random) -> Case:
    return _cases(*[(fmt, _ties(fmt, rng)) for fmt in FORMATS], what="halfway cases (and one fp32 ulp either side)")


def _prepare_overflow(rng: random.Random) -> Case:
    fp16 = [65519.0, 65520.0, 65535.0, 1e5, -1e6, 3.0e38]
    bf16 = [3.3e38, 3.39e38, -3.4e38, _f32(0x7F7FFFFF)]
    return _cases(("fp16", [_bits32(v) for v in fp16]), ("bf16", [_bits32(v) for v in bf16]),
                  what="values at and past the largest finite number")


def _prepare_subnormals(rng: random.Random) -> Case:
    cases = [_bits32(v) for v in (2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-26, 2.0**-15, 1e-7, -6e-8)]
    while len(cases) < 1000:
        cases.append(_bits32(rng.uniform(2.0**-26, 2.0**-14) * rng.choice((1, -1))))
    return _cases(("fp16", cases), ("bf16", [_bits32(v) for v in (1e-39, -1e-45, 2.0**-130)]),
                  what="numbers below the smallest normal")


def _prepare_specials(rng: random.Random) -> Case:
    cases = [0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001]  # +inf, -inf, NaNs
    return _cases(*[(fmt, cases) for fmt in FORMATS], what="infinities and NaNs")


def checks() -> list[Check]:
    return [
        Check("exactly representable numbers are unchanged", "split the pattern into sign (1 bit), "
              "exponent (8) and mantissa (23); re-bias the exponent (fp32 bias 127) and keep the top mantissa bits",
              _observe, _judge, _prepare_exact),
        Check("-0.0 keeps its sign", HINTS["sign"], _observe, _judge, _prepare_signed_zero),
        Check("round to nearest (random numbers)", HINTS["truncates"], _observe, _judge, _prepare_random),
        Check("ties round to even", HINTS["tie"], _observe, _judge, _prepare_ties),
        Check("overflow rounds to infinity", HINTS["overflow"], _observe, _judge, _prepare_overflow),
        Check("fp16 subnormals and underflow to zero", HINTS["subnormal"], _observe, _judge, _prepare_subnormals),
        Check("infinities and NaN", "exponent all ones: mantissa 0 is inf, keep it; otherwise a NaN, which must "
              "stay a NaN (keep a mantissa bit set, even after the shift)", _observe, _judge, _prepare_specials),
    ]
