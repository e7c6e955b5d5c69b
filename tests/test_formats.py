"""Tests for mpgpt/formats.py: derived properties against torch.finfo, field decoding against
torch's bit views, and the pure-Python round-to-nearest-even against torch's casts, bit for bit,
on fresh random inputs aimed at the hard cases (halfway ties, subnormals, overflow edges)."""
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from mpgpt import formats as F

LOW = ["fp16", "bf16", "e4m3fn", "e5m2"]  # the formats torch reaches from float32
ALL = ["fp32"] + LOW
INT_VIEW = {32: torch.int32, 16: torch.int16, 8: torch.uint8}


def torch_value_of_pattern(patterns: torch.Tensor, f: F.FloatFormat) -> torch.Tensor:
    """Reinterpret unsigned patterns (int64) as fmt numbers, returned as float64."""
    width = f.total_bits
    signed = patterns - ((patterns >> (width - 1)) & 1) * (1 << width) if width > 8 else patterns
    return signed.to(INT_VIEW[width]).view(f.dtype).to(torch.float64)


def same_bits(mine: int, ref: int, f: F.FloatFormat) -> bool:
    """Equal patterns; any NaN matches any NaN (payloads are not part of the contract)."""
    a, b = F.decode_bits(mine, f), F.decode_bits(ref, f)
    return (a.kind == "nan" and b.kind == "nan") or mine == ref


# ----------------------------------------------------------------------------- properties

@pytest.mark.parametrize("name", ALL)
def test_properties_match_finfo(name):
    f = F.get_format(name)
    fi = torch.finfo(f.dtype)
    assert f.total_bits == fi.bits
    assert f.max_finite == fi.max
    assert f.smallest_normal == fi.smallest_normal == fi.tiny
    assert f.eps == fi.eps
    assert f.resolution == pytest.approx(fi.resolution, rel=1e-12)
    # the smallest subnormal is pattern 1, survives a cast, and half of it (a tie with 0) is 0
    assert F.decode_bits(1, f).value == Fraction(f.smallest_subnormal)
    assert F.round_to(f.smallest_subnormal, f) == f.smallest_subnormal
    assert F.round_to(f.smallest_subnormal / 2, f) == 0.0
    # eps: 1 + eps is the next number after 1; 1 + eps/2 is a tie that rounds to even (1)
    assert F.round_to(1 + f.eps, f) == 1 + f.eps
    assert F.round_to(1 + f.eps / 2, f) == 1.0


def test_known_values():
    assert F.bits(1.0, "fp16") == "0|01111|0000000000"
    assert F.bits(-2.0, "bf16") == "1|10000000|0000000"
    assert F.bits(0.1, "fp32") == "0|01111011|10011001100110011001101"
    assert F.bits(448, "e4m3fn") == "0|1111|110"
    assert F.bits(57344, "e5m2") == "0|11110|11"
    assert F.bits(float("inf"), "e5m2") == "0|11111|00"
    assert F.round_to(70000, "fp16") == math.inf and F.round_to(70000, "bf16") == 70144.0
    # e4m3fn has no inf: this torch either saturates (2.13) or makes NaN (2.11); the pure-Python
    # rounding follows whichever it does, and must match it.
    for big in (1e6, float("inf")):
        if F.e4m3fn_saturates():
            assert F.round_to(big, "e4m3fn") == 448.0 == F.round_nearest_even(big, "e4m3fn")
        else:
            assert math.isnan(F.round_to(big, "e4m3fn")) and math.isnan(F.round_nearest_even(big, "e4m3fn"))
    d = F.decode(2.0 ** -24, "fp16")
    assert (d.kind, d.exponent_field, d.mantissa_field, d.value) == ("subnormal", 0, 1, Fraction(1, 2 ** 24))
    d = F.decode(-1.5, "bf16")
    assert (d.sign, d.exponent, d.value, d.kind) == (1, 0, Fraction(-3, 2), "normal")
    assert F.decode(float("nan"), "e4m3fn").kind == "nan"
    assert F.decode(-0.0, "fp16").pattern == "1|00000|0000000000"


@pytest.mark.parametrize("name", ["a", "fp64", "int8", "e4m3fnuz"])
def test_unknown_format_names(name):
    with pytest.raises(ValueError, match="unknown format"):
        F.get_format(name)
    with pytest.raises(ValueError):
        F.bits(1.0, name)


def test_aliases_and_dtypes():
    assert F.get_format("half") is F.FORMATS["fp16"]
    assert F.get_format(torch.bfloat16) is F.FORMATS["bf16"]
    assert F.get_format("float8_e4m3fn") is F.FORMATS["e4m3fn"]
    with pytest.raises(ValueError, match="no FloatFormat"):
        F.get_format(torch.float64)


# ----------------------------------------------------------------------------- decoding

@pytest.mark.parametrize("name", ALL)
def test_decode_bits_matches_torch(name):
    """Every fp8 pattern; 20,000 fresh random patterns for the wider formats."""
    f = F.get_format(name)
    n = 2 ** f.total_bits
    patterns = torch.arange(n) if n <= 256 else torch.randint(0, n, (20_000,), dtype=torch.int64)
    ref = torch_value_of_pattern(patterns, f).tolist()
    for p, r in zip(patterns.tolist(), ref):
        d = F.decode_bits(p, f)
        if math.isnan(r):
            assert d.kind == "nan", (p, d)
        else:
            assert float(d.value) == r, (p, d, r)
            assert math.copysign(1, r) == (-1 if d.sign else 1)


@pytest.mark.parametrize("name", LOW)
def test_encode_roundtrips_every_fp8_and_sampled_patterns(name):
    f = F.get_format(name)
    n = 2 ** f.total_bits
    patterns = range(n) if n <= 256 else torch.randint(0, n, (5_000,)).tolist()
    for p in patterns:
        d = F.decode_bits(p, f)
        if d.kind == "nan":
            continue
        x = float(d.value) if d.kind != "zero" else (-0.0 if d.sign else 0.0)
        assert F.encode_nearest_even(x, f) == p
        assert F.encode(x, f) == p


# ----------------------------------------------------------------------------- rounding

def hard_inputs(f: F.FloatFormat, n: int) -> torch.Tensor:
    """Float32 inputs aimed at the places rounding goes wrong (or float64 ones for fp32)."""
    src = torch.float64 if f.name == "fp32" else torch.float32
    src_int = torch.int64 if src == torch.float64 else torch.int32
    lim = 2 ** (63 if src == torch.float64 else 31) - 1
    parts = [torch.randint(-lim, lim, (n,), dtype=src_int).view(src).to(torch.float64)]  # any bits
    # exact midpoints between neighbours (ties), and one source-ulp either side of them
    p = torch.randint(0, 2 ** f.total_bits, (n,), dtype=torch.int64)
    lo, hi = torch_value_of_pattern(p, f), torch_value_of_pattern((p + 1) % 2 ** f.total_bits, f)
    ok = torch.isfinite(lo) & torch.isfinite(hi) & ((p + 1) % 2 ** (f.total_bits - 1) != 0)
    mid = ((lo[ok] + hi[ok]) / 2).to(src)
    assert torch.equal(mid.to(torch.float64), (lo[ok] + hi[ok]) / 2), "midpoints must be exact"
    inf = torch.tensor(math.inf, dtype=src)
    parts += [mid, torch.nextafter(mid, inf), torch.nextafter(mid, -inf)]
    # subnormal range and the normal/subnormal border
    parts.append((torch.rand(n, dtype=torch.float64) * 4 - 2) * f.smallest_normal)
    # magnitudes spread log-uniformly over the whole range and beyond, with random signs
    lg = torch.empty(n, dtype=torch.float64).uniform_(math.log2(f.smallest_subnormal) - 3,
                                                      math.log2(f.max_finite) + 2)
    parts.append(torch.exp2(lg) * (torch.randint(0, 2, (n,)) * 2 - 1))
    # overflow edges: max, the halfway point above it (rounds to inf / saturates), neighbours
    top_ulp = 2.0 ** (f.emax - f.mantissa_bits)
    edges = torch.tensor([f.max_finite, f.max_finite + top_ulp / 2, f.max_finite + top_ulp,
                          2 * f.max_finite, math.inf, math.nan, 0.0, -0.0], dtype=src)
    edges = torch.cat([edges, torch.nextafter(edges, inf), torch.nextafter(edges, -inf)])
    parts += [edges, -edges]
    return torch.cat([x.to(src) for x in parts])


@pytest.mark.parametrize("name", ALL)
def test_pure_python_rounding_matches_torch_bit_for_bit(name):
    f = F.get_format(name)
    x = hard_inputs(f, 1500)
    ref = F.encode(x, f).tolist()
    mismatches = []
    for xi, r in zip(x.tolist(), ref):
        mine = F.encode_nearest_even(xi, f)
        if not same_bits(mine, r, f):
            mismatches.append((xi, F.format_pattern(mine, f), F.format_pattern(r, f)))
        v = F.round_nearest_even(xi, f)
        rv = F.decode_bits(r, f).value
        assert (math.isnan(v) and isinstance(rv, float) and math.isnan(rv)) or v == rv
    assert not mismatches, mismatches[:5]


def test_ties_go_to_even():
    # fp16 has 10 mantissa bits: numbers next to 1 are 1 + k * 2^-10
    assert F.round_nearest_even(1 + 2 ** -11, "fp16") == 1.0                   # tie, 1 is even
    assert F.round_nearest_even(1 + 3 * 2 ** -11, "fp16") == 1 + 2 * 2 ** -10  # tie, up to even
    assert F.round_nearest_even(1 + 2 ** -11 + 2 ** -30, "fp16") == 1 + 2 ** -10  # just above tie
    assert F.round_nearest_even(-(1 + 2 ** -11), "fp16") == -1.0
    assert F.round_nearest_even(65520, "fp16") == math.inf  # halfway above max: ties to "even" inf
    assert F.round_nearest_even(65519.99, "fp16") == 65504.0
    assert F.round_nearest_even(464, "e4m3fn") == 448.0  # halfway to the next (missing) step: to even 448
    past = F.round_nearest_even(470, "e4m3fn")  # past halfway: overflow, saturated or NaN as torch does
    assert past == 448.0 if F.e4m3fn_saturates() else math.isnan(past)
    assert math.copysign(1, F.round_nearest_even(-1e-30, "fp16")) == -1  # underflow keeps the sign


def test_float64_inputs_are_double_rounded_by_torch():
    """torch goes float64 -> float32 -> fp16: 1 + 2^-11 + 2^-40 first becomes the tie 1 + 2^-11,
    which then rounds to even (1.0). Rounding once, exactly, gives 1 + 2^-10."""
    x = 1 + 2 ** -11 + 2 ** -40
    assert F.round_to(x, "fp16") == 1.0
    assert F.round_nearest_even(x, "fp16") == 1 + 2 ** -10
    assert F.round_to(torch.tensor(x, dtype=torch.float32), "fp16") == 1.0


@pytest.mark.parametrize("name", ALL)
def test_neighbors_bracket_and_are_adjacent(name):
    f = F.get_format(name)
    lg = torch.empty(500, dtype=torch.float64).uniform_(math.log2(f.smallest_subnormal),
                                                       math.log2(f.max_finite))
    # Drawn as float32 values: torch converts float64 to fp16 through float32 (two roundings), so a
    # float64 within 2^-29 of a midpoint can round the wrong way; a float32 input rounds once.
    xs = (torch.exp2(lg) * (torch.randint(0, 2, (500,)) * 2 - 1)).float().double().tolist()
    for x in xs:
        lo, hi = F.neighbors(x, f)
        assert lo <= x <= hi
        assert F.round_nearest_even(lo, f) == lo and F.round_nearest_even(hi, f) == hi
        if lo != hi:  # adjacent: their patterns differ by one in magnitude
            a, b = F.encode_nearest_even(abs(lo), f), F.encode_nearest_even(abs(hi), f)
            assert abs(a - b) == 1
            r = F.round_to(x, f)
            assert r in (lo, hi)
            assert abs(Fraction(r) - Fraction(x)) <= min(abs(Fraction(lo) - Fraction(x)),
                                                         abs(Fraction(hi) - Fraction(x)))
    assert F.neighbors(f.max_finite * 1.5, f) == (f.max_finite, math.inf)
    with pytest.raises(ValueError, match="finite"):
        F.neighbors(math.nan, f)


@pytest.mark.parametrize("name", ALL)
def test_relative_rounding_error_is_at_most_half_eps(name):
    f = F.get_format(name)
    # normal range only; fp32 inputs are float64, the others float32 (single rounding)
    lg = torch.empty(2000, dtype=torch.float64).uniform_(f.emin, f.emax)
    xs = torch.exp2(lg)
    if name != "fp32":
        xs = xs.float()
    errs = [abs(F.rounding_error(x, f, relative=True)) for x in xs.tolist()]
    assert max(errs) <= f.eps / 2
    assert max(errs) > f.eps / 8  # and the bound is nearly reached: the check has teeth


# ----------------------------------------------------------------------------- accumulation

def test_accumulation_stalls_where_the_spacing_says():
    vals = [1e-4] * 10_000
    # fp16: adding 1e-4 stops changing the sum once half the spacing exceeds it: at 0.25 the
    # spacing is 2^-2 * 2^-10 = 2.4e-4, half of it 1.2e-4 > 1e-4.
    assert F.accumulate(vals, "fp16") == 0.25
    # bf16 (7 mantissa bits): the same happens already at 2^-5.
    assert F.accumulate(vals, "bf16") == 2.0 ** -5
    # An fp32 accumulator fixes it; the answer is 10,000 times the *stored* value.
    for fmt in ["fp16", "bf16"]:
        stored = F.round_to(1e-4, fmt)
        assert F.accumulate(vals, fmt, accumulator="fp32") == pytest.approx(10_000 * stored, rel=1e-4)
    assert F.accumulate(vals, "fp32") == pytest.approx(1.0, rel=1e-4)
    assert F.accumulate([], "fp16") == 0.0


def test_running_sum_matches_numpy_and_pure_python():
    vals = (torch.rand(1500, dtype=torch.float64) * 1e-2).tolist()
    # numpy adds float16 scalars in float32 and rounds back, like running_sum
    acc16, acc32 = np.float16(0), np.float32(0)
    ref16, ref32 = [], []
    for v in vals:
        acc16 = np.float16(acc16 + np.float16(v)); ref16.append(float(acc16))
        acc32 = np.float32(acc32 + np.float32(v)); ref32.append(float(acc32))
    assert F.running_sum(vals, "fp16").tolist() == ref16
    assert F.running_sum(vals, "fp32").tolist() == ref32
    # bf16 has no numpy type: use the pure-Python rounding on the fp32 sum
    acc, ref = 0.0, []
    for v in vals:
        stored = F.round_nearest_even(float(np.float32(v)), "bf16")
        acc = F.round_nearest_even(float(np.float32(acc) + np.float32(stored)), "bf16")
        ref.append(acc)
    assert F.running_sum(vals, "bf16").tolist() == ref


def test_format_table_lists_every_format():
    table = F.format_table()
    for name in F.FORMATS:
        assert name in table
    assert "65504" in table and "448" in table
