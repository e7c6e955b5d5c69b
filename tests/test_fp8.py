"""mpgpt.fp8 and mpgpt.kernels.fp8_matmul: casts, recipes, scaled matmul, Fp8Linear, the fp8 GEMM.

Every fp8 result is compared with a float64 reference under a bound derived from the formats
(mpgpt.fp8.quantization_error_bound, matmul_error_bound): round-to-nearest with m mantissa bits
errs by at most u = 2^-(m+1) relative (e4m3 2^-4, e5m2 2^-3) plus half the smallest subnormal
absolute, so a product of two cast values errs by at most 2u + u^2 relative and a K-long dot
product by at most that fraction of sum |a_k b_k|. The inputs are fresh random numbers on every
run (conftest seeds from the OS), with rows of very different magnitudes where the recipe matters.
"""
import math

import pytest
import torch

from mpgpt import fp8, runtime
from mpgpt.fp8 import E4M3, E5M2

FORMATS = [E4M3, E5M2]


def spread_rows(R, K, decades=4.0):
    """(R, K) normal values whose rows differ in scale by up to 10^decades: never zeros."""
    return torch.randn(R, K) * torch.logspace(-decades / 2, decades / 2, R).unsqueeze(1)


# --- formats, casts, scales ------------------------------------------------------------------
def test_unit_roundoff_and_underflow_come_from_the_bit_widths():
    assert fp8.unit_roundoff(E4M3) == 2.0**-4 and fp8.unit_roundoff(E5M2) == 2.0**-3
    assert fp8.underflow_error(E4M3) == 2.0**-10 and fp8.underflow_error(E5M2) == 2.0**-17
    assert E4M3.max_finite == 448 and E5M2.max_finite == 57344


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_saturating_cast_clamps_overflow_and_keeps_nan(fmt):
    big = (torch.rand(64) + 1.01) * fmt.max_finite * torch.where(torch.rand(64) < 0.5, -1.0, 1.0)
    out = fp8.saturating_cast(big, fmt).float()
    assert torch.equal(out, big.sign() * fmt.max_finite)          # never NaN (e4m3fn) or inf (e5m2)
    inside = torch.randn(1000) * fmt.max_finite / 8
    assert torch.equal(fp8.saturating_cast(inside, fmt).float(), inside.to(fmt.dtype).float())
    assert fp8.saturating_cast(torch.tensor([float("nan")]), fmt).float().isnan().all()
    assert fp8.saturating_cast(big, fmt).dtype == fmt.dtype


def test_saturating_cast_refuses_a_16_bit_format():
    with pytest.raises(ValueError, match="e4m3fn or e5m2"):
        fp8.saturating_cast(torch.randn(4), "bf16")


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_scale_puts_the_amax_in_the_top_binade(fmt):
    amax = torch.rand(100).double().exp2().mul(torch.logspace(-20, 20, 100, dtype=torch.float64)).float()
    s = fp8.scale_from_amax(amax, fmt)
    assert torch.equal(s.log2(), s.log2().round())                   # powers of two: exact rescaling
    landed = amax * s
    assert (landed <= fmt.max_finite).all() and (landed > fmt.max_finite / 2).all()
    assert fp8.scale_from_amax(torch.tensor(0.0), fmt).item() == 1.0   # an all-zero tensor: no inf


# --- the recipes -------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "block", "delayed"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_every_recipe_rounds_within_the_format_bound(recipe, fmt):
    x = spread_rows(16, 256)
    q = fp8.quantize(x, fmt, recipe)
    err = (q.dequantize().double() - x.double()).abs()
    bound = fp8.quantization_error_bound(q, x)
    assert (err <= bound).all(), f"worst error/bound {(err / bound).max():.3f}"
    assert q.data.float().abs().max() <= fmt.max_finite                # nothing saturated, nothing inf/NaN
    expected = {"tensorwise": (), "delayed": (), "rowwise": (16, 1), "block": (16, 2)}[recipe]
    assert tuple(q.scale.shape) == expected


def test_finer_scales_keep_the_small_rows():
    # One scale for rows spanning 10^8 pushes the small rows into e4m3's subnormals (or to zero);
    # a scale per row or per block keeps every row at full relative precision.
    x = spread_rows(8, 256, decades=8)
    small = x[0].double()
    rel = {}
    for recipe in ("tensorwise", "rowwise", "block"):
        q = fp8.quantize(x, E4M3, recipe)
        rel[recipe] = ((q.dequantize()[0].double() - small).norm() / small.norm()).item()
    assert rel["rowwise"] <= 2.0**-4 and rel["block"] <= 2.0**-4
    assert rel["tensorwise"] > 0.5                                      # mostly flushed to zero


def test_block_recipe_refuses_a_ragged_reduction():
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8.quantize(torch.randn(4, 100), E4M3, "block")


def test_unknown_recipe_and_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="choose one of"):
        fp8.quantize(torch.randn(4, 8), E4M3, "perchannel")
    with pytest.raises(ValueError, match="2-D"):
        fp8.quantize(torch.randn(2, 4, 8), E4M3)


def test_delayed_scaling_uses_the_history_and_saturates_a_spike():
    rec = fp8.DelayedScaling(history=4)
    x = torch.randn(32, 64)
    q0 = rec.quantize(x)                                       # first step: its own amax
    assert torch.equal(q0.scale, 1 / fp8.scale_from_amax(x.abs().max()))
    spike = x * 1000                                           # 1000x the history's amax
    q1 = rec.quantize(spike)
    assert torch.equal(q1.scale, q0.scale)                     # the scale came from the history
    assert q1.data.float().abs().max() == 448 and not q1.data.float().isnan().any()
    q2 = rec.quantize(spike)                                   # the spike is in the history now
    assert q2.data.float().abs().max() <= 448 and (q2.dequantize() - spike).abs().max() < spike.abs().max() * 2.0**-4
    for _ in range(4):
        rec.quantize(x)
    assert len(rec.amaxes) == 4 and max(rec.amaxes) == pytest.approx(x.abs().max().item())


# --- scaled matmul ---------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "block", "delayed"])
@pytest.mark.parametrize("fmt_a", FORMATS, ids=lambda f: f.name)
def test_emulated_scaled_matmul_is_within_the_derived_bound(recipe, fmt_a):
    a, b = spread_rows(24, 384), spread_rows(40, 384, decades=2) / 20
    qa, qb = fp8.quantize(a, fmt_a, recipe), fp8.quantize(b, E4M3, recipe)
    c = fp8.scaled_matmul(qa, qb)
    ref = a.double() @ b.double().t()
    bound = fp8.matmul_error_bound(qa, a, qb, b)
    err = (c.double() - ref).abs()
    assert (err <= bound).all(), f"worst error/bound {(err / bound).max():.3f}"
    if recipe in ("rowwise", "block"):
        # and the bound is not vacuous: with a scale per row, underflow is negligible and the bound
        # is (2u + u^2) of sum |a_k b_k| (u of each operand's format), to within a percent
        u_a, u_b = fp8.unit_roundoff(fmt_a), fp8.unit_roundoff(E4M3)
        assert (bound <= 1.01 * (u_a + u_b + u_a * u_b) * (a.double().abs() @ b.double().abs().t())).all()


def test_scaled_matmul_checks_shapes():
    qa, qb = fp8.quantize(torch.randn(4, 32)), fp8.quantize(torch.randn(4, 16))
    with pytest.raises(ValueError, match="same K"):
        fp8.scaled_matmul(qa, qb)


def fake_runtime(name, capability):
    return runtime.Runtime("cuda", name, capability, 16 * 2**30, "3.6.0")


@pytest.mark.parametrize("name, cc, recipe, expected", [
    ("Tesla T4", (7, 5), "tensorwise", "no fp8 tensor cores"),
    ("NVIDIA A100", (8, 0), "rowwise", "no fp8 tensor cores"),
    ("NVIDIA L4", (8, 9), "tensorwise", "torch._scaled_mm"),
    ("NVIDIA H200", (9, 0), "rowwise", "torch._scaled_mm"),
    ("NVIDIA H200", (9, 0), "block", "block scales"),
])
def test_backend_is_decided_from_the_runtime(monkeypatch, name, cc, recipe, expected):
    monkeypatch.setattr(runtime, "current", lambda device=None: fake_runtime(name, cc))
    q = fp8.quantize(torch.randn(32, 256), E4M3, recipe)
    path, why = fp8.matmul_backend(q, q)
    assert expected in why and path == ("torch" if "_scaled_mm" in expected else "emulated")
    if path == "emulated":
        with pytest.raises(RuntimeError, match="cannot run"):
            fp8.matmul_backend(q, q, backend="torch")


def test_backend_on_the_cpu_is_emulation():
    q = fp8.quantize(torch.randn(16, 16))
    assert fp8.matmul_backend(q, q) == ("emulated", "no GPU: emulated (dequantise, matmul in fp32)")


# --- Fp8Linear -----------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "block", "delayed"])
def test_fp8_linear_forward_and_backward_are_within_the_bound(recipe):
    M, K, N = 128, 256, 128          # multiples of 128: the block recipe uses blocks in all three GEMMs
    layer = fp8.Fp8Linear(K, N, recipe=recipe)
    x = torch.randn(M, K, requires_grad=True)
    g = torch.randn(M, N) * 1e-3      # a gradient's typical size: far below 1
    y = layer(x)
    y.backward(g)
    q = "tensorwise" if recipe == "delayed" else recipe   # the first delayed step uses its own amaxes
    w, x64, g64 = layer.weight.detach(), x.detach(), g
    checks = [  # (result, a, fmt_a, b, reference)
        (y.detach() - layer.bias.detach(), x64, E4M3, w, x64.double() @ w.double().t()),
        (x.grad, g64, E5M2, w.t(), g64.double() @ w.double()),
        (layer.weight.grad, g64.t(), E5M2, x64.t(), g64.double().t() @ x64.double()),
    ]
    for name, (out, a, fa, b, ref) in zip(("y", "dx", "dw"), checks):
        bound = fp8.matmul_error_bound(fp8.quantize(a, fa, q), a, fp8.quantize(b, E4M3, q), b)
        bound = bound + 2.0**-23 * ref.abs()     # y - bias and the fp32 output round once more
        err = (out.double() - ref).abs()
        assert (err <= bound).all(), f"{recipe} {name}: worst error/bound {(err / bound).max():.3f}"
    assert torch.allclose(layer.bias.grad, g.sum(0), rtol=1e-5, atol=1e-7)


def test_fp8_linear_is_a_drop_in_for_nn_linear():
    lin = torch.nn.Linear(64, 48)
    layer = fp8.Fp8Linear.from_linear(lin, recipe="rowwise")
    assert layer.weight is lin.weight and layer.bias is lin.bias
    x = torch.randn(2, 5, 64)
    y, ref = layer(x), lin(x)
    assert y.shape == (2, 5, 48)
    # rowwise e4m3 in both operands: within (2u + u^2) of sum |x||w| (the derived bound, loosely)
    assert ((y - ref).abs() <= 0.13 * (x.abs() @ lin.weight.abs().t()) + 1e-5).all()
    with pytest.raises(ValueError, match=r"\(\.\.\., 64\)"):
        layer(torch.randn(3, 63))
    with pytest.raises(ValueError, match="choose one of"):
        fp8.Fp8Linear(4, 4, recipe="per-channel")


def test_delayed_fp8_linear_records_each_tensor_once_a_step():
    layer = fp8.Fp8Linear(32, 16, recipe="delayed", history=8)
    for _ in range(3):
        layer(torch.randn(8, 32, requires_grad=True)).sum().backward()
    assert {k: len(v.amaxes) for k, v in layer.history.items()} == {"x": 3, "w": 3, "g": 3}


# --- the accumulator model -------------------------------------------------------------------------
def test_round_to_bits_keeps_that_many_significant_bits():
    x = torch.randn(1000, dtype=torch.float64) * 1e3
    for mode in ("truncate", "nearest"):
        r = fp8.round_to_bits(x, 14, mode)
        m, e = torch.frexp(r)
        assert torch.equal(m * 2**14, (m * 2**14).round())
        limit = 2.0**-14 if mode == "truncate" else 2.0**-15
        assert ((r - x).abs() <= limit * 2 * x.abs()).all()
    assert ((fp8.round_to_bits(x, 14, "truncate")).abs() <= x.abs()).all()   # toward zero


def test_promotion_rescues_a_long_sum_in_a_short_accumulator():
    K = 4096
    a = fp8.quantize(torch.rand(4, K) + 0.5).dequantize()   # positive: the running sum keeps growing
    b = fp8.quantize(torch.rand(4, K) + 0.5).dequantize()
    exact = a.double() @ b.double().t()
    rel = {}
    for label, kw in {"fp64": dict(bits=None), "14 bits": dict(bits=14),
                      "14 bits, promoted": dict(bits=14, promote_every=128)}.items():
        rel[label] = ((fp8.accumulate_model(a, b, **kw) - exact).abs() / exact).max().item()
    assert rel["fp64"] <= 2.0**-24
    assert rel["14 bits"] > 4 * rel["14 bits, promoted"]
    assert rel["14 bits, promoted"] <= 2.0**-13 * 128 / 32      # at most one 2^-13 loss per chunk of a block


# --- the fp8 Triton GEMM (interpreter on a CPU, compiled on sm_89+) --------------------------------------
def kernel_or_skip():
    from mpgpt.kernels import env
    from mpgpt.kernels import fp8_matmul as km

    ok, why = env.kernels_available()
    if not ok:
        pytest.skip(why)
    return km


def device_for_kernel():
    if torch.cuda.is_available():
        if not runtime.current().fp8:
            pytest.skip("the fp8 kernel needs fp8 tensor cores (sm_89+)")
        return "cuda"
    return "cpu"


def accumulator_bits(device):
    """Significant bits the kernel's sum keeps: fp32 (24) in the interpreter; on fp8 tensor cores
    about 14 within each promoted block of K (DeepSeek-V3's measurement), so 13 to allow truncation."""
    return 13 if device == "cuda" else 24


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_kernel_matches_the_emulated_product(recipe):
    km, dev = kernel_or_skip(), device_for_kernel()
    M, N, K = 70, 45, 100                                  # ragged: exercises every mask
    a, b = spread_rows(M, K).to(dev), spread_rows(N, K).to(dev)
    qa, qb = fp8.quantize(a, E4M3, recipe), fp8.quantize(b, E4M3, recipe)
    c = km.fp8_linear_matmul(qa, qb, out_dtype=torch.float32)
    ref = fp8.scaled_matmul(qa, qb, backend="emulated").double()
    # Both sum the same exact fp8 products, in different orders: each is within gamma_K * sum |products|
    # of the exact sum (Higham), so they differ by at most twice that.
    p = accumulator_bits(dev)
    gamma = K * 2.0**-p / (1 - K * 2.0**-p)
    slack = 2 * gamma * (qa.dequantize().double().abs() @ qb.dequantize().double().abs().t())
    assert ((c.double() - ref).abs() <= slack + 1e-30).all()


def test_fp8_kernel_writes_fp8_output_and_its_amax():
    km, dev = kernel_or_skip(), device_for_kernel()
    a, b = torch.randn(64, 96, device=dev), torch.randn(40, 96, device=dev)
    qa, qb = fp8.quantize(a), fp8.quantize(b)
    ref = fp8.scaled_matmul(qa, qb, backend="emulated")
    s = fp8.scale_from_amax(ref.abs().max()) * 4           # too large on purpose: some outputs saturate
    c8, amax = km.fp8_matmul(qa.data, qb.data, qa.scale, qb.scale, out_dtype=torch.float8_e4m3fn, out_scale=s)
    assert c8.dtype == torch.float8_e4m3fn and not c8.float().isnan().any()
    acc = 96 * 2.0**-accumulator_bits(dev)              # gamma_K of the kernel's sum, K = 96 (loosely)
    assert amax.item() == pytest.approx(ref.abs().max().item(), rel=acc)
    target = (ref * s).clamp(-448, 448).double()
    # one e4m3 rounding of the scaled value (relative 2^-4, or half a subnormal), plus the sum's own error
    # (bounded by gamma_K * sum |products|, at most 10x |c| for these inputs: checked loosely here)
    assert ((c8.float().double() - target).abs() <= 2.0**-4 * target.abs() + 2.0**-10 + 10 * acc * target.abs().max()).all()
    assert (c8.float().abs() == 448).any()


def test_fp8_kernel_takes_scales_as_numbers_or_tensors():
    """Python-number scales are filled in on the device (no host copy); they must mean the same as tensors."""
    km, dev = kernel_or_skip(), device_for_kernel()
    qa, qb = fp8.quantize(torch.randn(48, 64, device=dev)), fp8.quantize(torch.randn(32, 64, device=dev))
    sa, sb = qa.scale.item(), qb.scale.item()
    c_num = km.fp8_matmul(qa.data, qb.data, sa, sb, out_dtype=torch.float32)
    c_ten = km.fp8_matmul(qa.data, qb.data, qa.scale, qb.scale, out_dtype=torch.float32)
    assert torch.equal(c_num, c_ten)
    assert torch.equal(km.fp8_matmul(qa.data, qb.data, 2 * sa, sb, out_dtype=torch.float32), 2 * c_ten)


def test_fp8_kernel_refuses_bad_operands():
    km, dev = kernel_or_skip(), device_for_kernel()
    q = fp8.quantize(torch.randn(32, 256, device=dev))
    with pytest.raises(TypeError, match="fp8 operands"):
        km.fp8_matmul(torch.randn(4, 8), torch.randn(4, 8), 1.0, 1.0)
    g = fp8.quantize(torch.randn(32, 256), E5M2)
    with pytest.raises(TypeError, match="e5m2 x e5m2"):
        km.fp8_matmul(g.data, g.data, g.scale, g.scale)
    with pytest.raises(ValueError, match="out_scale"):
        km.fp8_matmul(q.data, q.data, q.scale, q.scale, out_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="one per row"):
        km.fp8_matmul(q.data, q.data, torch.ones(3), q.scale)
    blocks = fp8.quantize(torch.randn(32, 256), E4M3, "block")
    with pytest.raises(ValueError, match="block"):
        km.fp8_linear_matmul(blocks, blocks)


def test_fp8_kernel_refuses_a_gpu_without_fp8(monkeypatch):
    km = kernel_or_skip()
    from mpgpt.kernels import env

    class FakeCuda:
        type = "cuda"

    class FakeTensor:
        device = FakeCuda()

    monkeypatch.setattr(env, "kernels_available", lambda: (True, "compiled"))
    monkeypatch.setattr(env, "capability", lambda device=None: (8, 0))
    monkeypatch.setattr(env, "device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(RuntimeError, match="no fp8 tensor cores"):
        km.check_fp8_device(FakeTensor())


def test_the_gluon_kernels_scope_is_checked_on_the_operands():
    """fp8_ws takes row-major fp8 operands with 16-byte aligned rows and a 16/32-bit output whose rows
    are a multiple of 16 bytes; everything else must go to the Triton kernels, never to a TMA
    descriptor that would fault or read the wrong bytes."""
    from mpgpt.kernels.hopper import fp8_ws
    a = torch.randn(256, 512).to(torch.float8_e4m3fn)
    b = torch.randn(136, 512).to(torch.float8_e4m3fn)
    fits = fp8_ws.fp8_ws_operands_fit
    assert fits(a, b, torch.bfloat16) and fits(a, b, torch.float32) and fits(a, b.to(torch.float8_e5m2), torch.float16)
    assert not fits(a, b, torch.float8_e4m3fn)                         # an fp8 output: the Triton kernels
    assert fits(a[:, :500], b[:, :500], torch.bfloat16)                # rows of 500 bytes in a 512-byte pitch: fine...
    assert not fits(a[:, 4:], b[:, 4:], torch.bfloat16)                # ...but a base 4 bytes past alignment is not
    assert not fits(a, b[:130], torch.bfloat16)                        # 130 bf16 outputs a row: 260 bytes
    assert not fits(a.t().contiguous().t(), b, torch.bfloat16)         # column-major a
    assert not fits(a.float(), b, torch.bfloat16)                      # not fp8
    assert not fp8_ws.fp8_ws_eligible(a, b, torch.bfloat16)            # a CPU tensor: never


def test_fp8_kernel_choice_is_checked():
    km, dev = kernel_or_skip(), device_for_kernel()
    q = fp8.quantize(torch.randn(64, 128, device=dev))
    with pytest.raises(ValueError, match="kernel='cutlass'.*'auto', 'gluon' or 'triton'"):
        km.fp8_matmul(q.data, q.data, q.scale, q.scale, kernel="cutlass")
    if dev == "cpu":
        with pytest.raises(RuntimeError, match="Gluon fp8 kernel cannot run.*kernel='auto'"):
            km.fp8_matmul(q.data, q.data, q.scale, q.scale, kernel="gluon")
    auto = km.fp8_matmul(q.data, q.data, q.scale, q.scale, out_dtype=torch.float32)
    assert torch.equal(auto, km.fp8_matmul(q.data, q.data, q.scale, q.scale, out_dtype=torch.float32, kernel="triton"))


# --- on fp8 tensor cores: against torch._scaled_mm ------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_scaled_mm_backend_agrees_with_emulation_and_the_bound(recipe):
    if not runtime.current().fp8:
        pytest.skip("needs fp8 tensor cores (sm_89+)")
    a, b = spread_rows(256, 512).cuda(), spread_rows(128, 512).cuda()
    qa, qb = fp8.quantize(a, E4M3, recipe), fp8.quantize(b, E4M3, recipe)
    assert fp8.matmul_backend(qa, qb)[0] == "torch"
    ref = (a.double() @ b.double().t())
    bound = fp8.matmul_error_bound(qa, a, qb, b, accumulate_bits=14)  # Hopper's short accumulator, worst case
    for fast in (False, True):
        c = fp8.scaled_matmul(qa, qb, use_fast_accum=fast).double()
        assert ((c - ref).abs() <= bound + 2.0**-8 * ref.abs()).all()  # rowwise: a bf16 output rounds once more


@pytest.mark.gpu
def test_fp8_kernel_agrees_with_scaled_mm():
    km = kernel_or_skip()
    if not runtime.current().fp8:
        pytest.skip("needs fp8 tensor cores (sm_89+)")
    a, b = torch.randn(512, 1024, device="cuda"), torch.randn(384, 1024, device="cuda")
    qa, qb = fp8.quantize(a), fp8.quantize(b)
    ours = km.fp8_linear_matmul(qa, qb, out_dtype=torch.float32, promote=True).double()
    theirs = fp8.scaled_matmul(qa, qb, backend="torch").double()
    exact = qa.dequantize().double() @ qb.dequantize().double().t()
    scale = qa.dequantize().double().abs() @ qb.dequantize().double().abs().t()
    for c in (ours, theirs):   # each within 128 steps of a 14-bit accumulator, then fp32 (DeepSeek-V3's figure)
        assert ((c - exact).abs() <= (128 * 2.0**-13 + 1024 * 2.0**-24) * scale).all()
    assert math.isfinite(ours.sum().item())


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_kernel_replayed_launch_matches_the_first(recipe, out_dtype):
    """A repeat call with the same signature replays the remembered launch (no Triton launch path):
    on new inputs it must give exactly what the ordinary path gives (MPGPT_LEAN_LAUNCH=0)."""
    km = kernel_or_skip()
    if not runtime.current().fp8:
        pytest.skip("needs fp8 tensor cores (sm_89+)")
    out_scale = 2.0**-4 if out_dtype == torch.float8_e4m3fn else None
    for M, N, K in [(512, 384, 1024), (200, 72, 100)]:         # TMA kernel; the pointer kernel (rows of 100 bytes)
        results = []
        for _ in range(3):                                      # first call, then two replays
            qa = fp8.quantize(torch.randn(M, K, device="cuda"), E4M3, recipe)
            qb = fp8.quantize(torch.randn(N, K, device="cuda"), E4M3, recipe)
            got = km.fp8_matmul(qa.data, qb.data, qa.scale, qb.scale, out_dtype=out_dtype, out_scale=out_scale)
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("MPGPT_LEAN_LAUNCH", "0")
                ref = km.fp8_matmul(qa.data, qb.data, qa.scale, qb.scale, out_dtype=out_dtype, out_scale=out_scale)
            if out_dtype == torch.float8_e4m3fn:
                assert torch.equal(got[1], ref[1])               # the same amax
                got, ref = got[0], ref[0]
            assert torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got,
                               ref.view(torch.uint8) if ref.element_size() == 1 else ref)
            results.append(got)
        assert not torch.equal(results[1], results[2])          # new inputs, new products: not a stale output


def gluon_or_skip():
    km = kernel_or_skip()
    from mpgpt.kernels import env
    from mpgpt.kernels.hopper import fp8_ws
    if not torch.cuda.is_available() or env.capability() != (9, 0) or fp8_ws.WS_FP8_IMPORT_ERROR:
        pytest.skip(fp8_ws.WS_FP8_IMPORT_ERROR or "the Gluon fp8 kernel is for Hopper (sm_90)")
    return km


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_gluon_fp8_kernel_gives_the_triton_kernels_result(recipe, out_dtype, monkeypatch):
    """Both kernels add the tensor cores' partial sum of each 128 elements of K into fp32, in the same
    order, then apply the scales in the same order: the results must be equal bit for bit, on
    ragged shapes too (a partial last tile in M, N and K; an all-padding second column part)."""
    km = gluon_or_skip()
    monkeypatch.setenv("MPGPT_AUTOTUNE", "0")   # the Triton kernel's first configuration: no autotuning per shape
    for M, N, K in [(512, 512, 1024), (1000, 776, 720), (200, 4104, 1552), (130, 40, 64)]:
        qa = fp8.quantize(spread_rows(M, K).cuda(), E4M3, recipe)
        qb = fp8.quantize(spread_rows(N, K).cuda(), E4M3, recipe)
        ours = km.fp8_matmul(qa.data, qb.data, qa.scale, qb.scale, out_dtype=out_dtype, kernel="gluon")
        ref = km.fp8_matmul(qa.data, qb.data, qa.scale, qb.scale, out_dtype=out_dtype, kernel="triton")
        assert ours.dtype == out_dtype and torch.equal(ours, ref), (M, N, K)


@pytest.mark.gpu
def test_gluon_fp8_kernel_promotes():
    """A long positive sum: promoted, the error stays at fp32's level plus one short accumulation of 128
    (DeepSeek-V3's scheme); without promotion the tensor cores' ~14-bit sum loses far more."""
    km = gluon_or_skip()
    K = 16384
    qa, qb = fp8.quantize(torch.rand(128, K, device="cuda") + 0.5), fp8.quantize(torch.rand(256, K, device="cuda") + 0.5)
    exact = qa.dequantize().double() @ qb.dequantize().double().t()
    err = {}
    for promote in (True, False):
        c = km.fp8_linear_matmul(qa, qb, out_dtype=torch.float32, promote=promote, kernel="gluon").double()
        err[promote] = ((c - exact).abs() / exact).max().item()
    assert err[True] <= 128 * 2.0**-13 + K * 2.0**-24
    assert err[True] * 10 < err[False], err


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_fp8_linear_on_fp8_tensor_cores_is_within_the_bound(recipe):
    if not runtime.current().fp8:
        pytest.skip("needs fp8 tensor cores (sm_89+)")
    layer = fp8.Fp8Linear(512, 256, recipe=recipe, device="cuda")
    assert "torch._scaled_mm" in layer.backend_reason()
    x = torch.randn(256, 512, device="cuda", requires_grad=True)
    g = torch.randn(256, 256, device="cuda") * 1e-3
    y = layer(x)
    y.backward(g)
    q = "tensorwise" if recipe == "delayed" else recipe
    w, x0 = layer.weight.detach(), x.detach()
    checks = [(y.detach() - layer.bias.detach(), x0, E4M3, w), (x.grad, g, E5M2, w.t()), (layer.weight.grad, g.t(), E5M2, x0.t())]
    for out, a, fa, b in checks:
        ref = a.double() @ b.double().t()
        bound = fp8.matmul_error_bound(fp8.quantize(a, fa, q), a, fp8.quantize(b, E4M3, q), b, accumulate_bits=13)
        assert ((out.double() - ref).abs() <= bound + 2.0**-8 * ref.abs()).all()   # rowwise: a bf16 output


def test_fp8_linear_returns_the_dtype_nn_linear_would():
    """Under autocast nn.Linear returns the autocast dtype even for an fp32 input (LayerNorm's
    output); Fp8Linear must too, or a model's logits silently become fp32. Outside autocast: the
    input's dtype. The values stay within the bf16 rounding of the emulated fp32 product."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    layer = fp8.Fp8Linear.from_linear(lin)
    x = torch.randn(16, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_dtype = lin(x).dtype
        y = layer(x)
    assert ref_dtype == torch.bfloat16 and y.dtype == ref_dtype
    plain = layer(x)
    assert plain.dtype == torch.float32
    assert torch.allclose(y.float(), plain, rtol=2.0**-8, atol=2.0**-8 * plain.abs().max().item())
