"""A learner's solution to ch1-rounding, on integers (shifts and masks).

The grading tests plant bugs into this file by replacing the lines marked # PLANT: name."""

LAYOUT = {"fp16": (5, 10, 15), "bf16": (8, 7, 127)}  # exponent bits, mantissa bits, bias


def round_fp32_bits(bits: int, fmt: str) -> int:
    e_bits, m_bits, bias = LAYOUT[fmt]
    sign = (bits >> 31) << (e_bits + m_bits)  # PLANT: sign
    exp = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    top = (1 << e_bits) - 1
    if exp == 0xFF:  # inf or NaN
        return sign | (top << m_bits) | ((1 << (m_bits - 1)) if man else 0)  # PLANT: nan
    if exp == 0 and man == 0:
        return sign
    # value = sig * 2**(e - 23) with sig an integer of up to 24 bits
    if exp == 0:
        sig, e = man, -126
    else:
        sig, e = man | (1 << 23), exp - 127
    e_new = max(e, 1 - bias)  # PLANT: subnormal
    shift = 23 - m_bits + (e_new - e)  # drop this many low bits of sig
    if shift > 25:
        return sign  # far below half the smallest subnormal
    kept, dropped = sig >> shift, sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    if dropped > half or (dropped == half and kept & 1):  # PLANT: round
        kept += 1
    # kept is the significand with its leading 1 at bit m_bits (normal) or below (subnormal)
    if kept >> (m_bits + 1):  # the carry reached the next binade
        kept >>= 1
        e_new += 1
    if kept >> m_bits == 0:  # subnormal (or zero): exponent field 0
        return sign | kept
    field = e_new + bias
    if field >= top:
        return sign | (top << m_bits)  # PLANT: overflow
    return sign | (field << m_bits) | (kept & ((1 << m_bits) - 1))
