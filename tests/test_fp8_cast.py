"""mpgpt.kernels.fp8_cast: the fused fp8 cast, and Fp8Linear's use of it.

The fused cast is not an approximation of mpgpt.fp8.quantize but the same computation: a power-of-two
scale makes the multiplication exact, so the only rounding is the final cast to nearest even, and
the scale comes from the same rule. So every comparison here is bit for bit (torch.equal on the
fp8 data viewed as bytes, on the scales and on the amaxes), never within a tolerance. On a CPU the
kernels run in Triton's interpreter (small shapes, a fraction of a second each); the GPU tests
repeat the comparison on the device.
"""
import pytest
import torch

from mpgpt import fp8, runtime
from mpgpt.fp8 import E4M3, E5M2

FORMATS = [E4M3, E5M2]


def kernels_or_skip():
    from mpgpt.kernels import env
    from mpgpt.kernels import fp8_cast

    ok, why = env.kernels_available()
    if not ok:
        pytest.skip(why)
    return fp8_cast


def device_or_skip():
    if torch.cuda.is_available():
        if not runtime.current().fp8:
            pytest.skip("the fused cast needs fp8 conversion instructions (sm_89+)")
        return "cuda"
    return "cpu"


@pytest.fixture(autouse=True)
def _tensors_where_the_kernels_run():
    """On a GPU machine the kernels compile for the GPU (no interpreter), so every test's tensors
    are made there; on a CPU they stay on the CPU, for the interpreter."""
    if not torch.cuda.is_available():
        yield
        return
    torch.set_default_device("cuda")
    try:
        yield
    finally:
        torch.set_default_device("cpu")


def spread_rows(R, K, decades=4.0, dtype=torch.float32, device=None):
    """(R, K) normal values whose rows differ in scale by up to 10^decades (never zeros)."""
    x = torch.randn(R, K) * torch.logspace(-decades / 2, decades / 2, R).unsqueeze(1)
    return x.to(device=device or x.device, dtype=dtype)


def history_amax(x, factor_range=(0.5, 2.0)):
    """A delayed recipe's amax: the tensor's own, times a random factor (below 1: it saturates)."""
    lo, hi = factor_range
    return x.detach().abs().float().amax() * (lo + (hi - lo) * torch.rand((), device=x.device))


def assert_same(q, ref):
    assert q.data.dtype == ref.data.dtype and q.data.shape == ref.data.shape
    assert q.data.is_contiguous()                                               # row-major, for torch._scaled_mm
    assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8))   # bit for bit, NaN-safe
    assert q.scale.shape == ref.scale.shape and torch.equal(q.scale, ref.scale)
    assert q.amax.shape == ref.amax.shape and torch.equal(q.amax, ref.amax)
    assert q.recipe == ref.recipe and q.fmt == ref.fmt and q.block is None


# --- bit for bit with mpgpt.fp8.quantize ----------------------------------------------------------
@pytest.mark.parametrize("transpose", [False, True], ids=["plain", "transposed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_fused_cast_is_bit_identical_to_quantize(recipe, fmt, dtype, transpose):
    fc = kernels_or_skip()
    R, K = torch.randint(40, 140, (2,)).tolist()              # not multiples of the 64 x 64 tile
    x = spread_rows(R, K, dtype=dtype)
    amax = history_amax(x) if recipe == "delayed" else None
    q = fc.fused_quantize(x, fmt, recipe, amax=amax, transpose=transpose)
    assert_same(q, fp8.quantize(x.t() if transpose else x, fmt, recipe, amax=amax))
    assert q.data.shape == ((K, R) if transpose else (R, K))


def test_fused_cast_reads_a_strided_view_and_fp16():
    fc = kernels_or_skip()
    base = spread_rows(90, 200, dtype=torch.float16)
    view = base[5:80:2, 3:150]                                   # neither dimension contiguous
    for transpose in (False, True):
        ref = fp8.quantize(view.t() if transpose else view, E4M3, "rowwise")
        assert_same(fc.fused_quantize(view, E4M3, "rowwise", transpose=transpose), ref)


def test_an_all_zero_row_gets_scale_one():
    fc = kernels_or_skip()
    x = spread_rows(70, 96)
    x[3] = 0.0
    q = fc.fused_quantize(x, E4M3, "rowwise")
    assert_same(q, fp8.quantize(x, E4M3, "rowwise"))
    assert q.scale[3].item() == 1.0 and q.amax[3].item() == 0.0 and not q.data[3].float().any()
    zero = fc.fused_quantize(torch.zeros(20, 30), E5M2, "tensorwise")   # an all-zero tensor: scale 1, no NaN
    assert zero.scale.item() == 1.0 and zero.amax.item() == 0.0 and not zero.data.float().isnan().any()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_delayed_with_a_stale_amax_saturates_and_returns_the_current_one(fmt):
    fc = kernels_or_skip()
    x = spread_rows(66, 100, decades=1.0)
    true_amax = x.abs().amax()
    stale = true_amax * (0.1 + 0.4 * torch.rand(()))          # the history: 2.5x to 10x too small
    for transpose in (False, True):
        q = fc.fused_quantize(x, fmt, "delayed", amax=stale, transpose=transpose)
        assert_same(q, fp8.quantize(x.t() if transpose else x, fmt, "delayed", amax=stale))
        assert torch.equal(q.amax, true_amax)                   # this step's amax, for the history
        assert torch.equal(q.scale, 1 / fp8.scale_from_amax(stale, fmt))
        data = q.data.float()
        assert data.abs().max().item() == fmt.max_finite and data.isfinite().all()   # saturated, not inf/NaN


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_the_scale_rule_at_exact_powers_of_two(fmt):
    # amax = fmax * 2^-j puts fmax / amax exactly on a power of two, where a log2 that rounds either
    # way would pick the wrong binade: s must be 2^j (amax * s = fmax exactly); one ulp above that
    # amax, 2^(j-1); one ulp below, 2^j. One row per amax, so a rowwise cast checks them all at once.
    fc = kernels_or_skip()
    j = torch.arange(-20, 30, dtype=torch.float32)
    exact = fmt.max_finite * torch.exp2(-j)
    bits = exact.view(torch.int32)
    amaxes = torch.cat([exact, (bits + 1).view(torch.float32), (bits - 1).view(torch.float32)])
    expected_s = torch.cat([torch.exp2(j), torch.exp2(j - 1), torch.exp2(j)])
    x = torch.rand(len(amaxes), 70) * amaxes[:, None] * 0.9
    x[:, 7] = -amaxes                                            # each row's amax, reached by a negative value
    q = fc.fused_quantize(x, fmt, "rowwise")
    assert_same(q, fp8.quantize(x, fmt, "rowwise"))
    assert torch.equal(q.scale.squeeze(1), 1 / expected_s)
    assert (q.data[:, 7].float() >= -fmt.max_finite).all()
    for amax, s in [(exact[5], expected_s[5]), (exact[25], expected_s[25])]:   # and one scale per tensor
        xt = torch.rand(33, 65) * amax * 0.9
        xt[4, 9] = amax
        qt = fc.fused_quantize(xt, fmt, "tensorwise")
        assert_same(qt, fp8.quantize(xt, fmt, "tensorwise"))
        assert qt.scale.item() == 1 / s.item()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_rounding_to_nearest_even_at_midpoints(fmt):
    """fp32 values at, just above and just below the midpoints between neighbouring fp8 values, in
    normal and subnormal binades: the kernel's own rounding must pick what torch's cast picks (ties
    to even, everything else to the nearer). A scale of 1 (a given amax of fmax) casts them as they are."""
    fc = kernels_or_skip()
    grid = torch.arange(0, 256, dtype=torch.int32).to(torch.uint8).view(fmt.dtype).float()
    grid = grid[grid.isfinite() & (grid >= 0)].unique()                 # every non-negative fp8 value
    mid = (grid[:-1] + grid[1:]) / 2                                    # exact in fp32
    bits = mid.view(torch.int32)
    above, below = (bits + 1).view(torch.float32), (bits - 1).view(torch.float32)
    x = torch.cat([mid, above, below, grid])
    x = torch.cat([x, -x]).reshape(1, -1)
    amax = torch.tensor(fmt.max_finite)
    q = fc.fused_quantize(x, fmt, "delayed", amax=amax)
    assert q.scale.item() == 1.0
    assert torch.equal(q.data.view(torch.uint8), x.to(fmt.dtype).view(torch.uint8))


def test_bad_input_is_refused_in_one_line():
    fc = kernels_or_skip()
    x = torch.randn(8, 16)
    cases = [
        (lambda: fc.fused_quantize(x, E4M3, "block"), ValueError, "use mpgpt.fp8.quantize"),
        (lambda: fc.fused_quantize(torch.randn(2, 8, 16)), ValueError, "2-D"),
        (lambda: fc.fused_quantize(torch.randint(0, 9, (8, 16))), TypeError, "bf16, fp16 or fp32"),
        (lambda: fc.fused_quantize(x.double()), TypeError, "bf16, fp16 or fp32"),
        (lambda: fc.fused_quantize(x, "bf16"), ValueError, "e4m3fn or e5m2"),
        (lambda: fc.fused_quantize(x, E4M3, "perchannel"), ValueError, "choose one of"),
        (lambda: fc.fused_quantize(x, E4M3, "rowwise", amax=torch.ones(3, 1)), ValueError, "one per row"),
    ]
    for call, error, text in cases:
        with pytest.raises(error, match=text) as info:
            call()
        assert "\n" not in str(info.value)


def test_a_gpu_without_fp8_is_refused(monkeypatch):
    fc = kernels_or_skip()
    from mpgpt.kernels import env

    class FakeTensor:
        device = torch.device("cuda", 0)

    monkeypatch.setattr(env, "interpreting", lambda: False)
    monkeypatch.setattr(env, "kernels_available", lambda: (True, "compiled"))
    monkeypatch.setattr(env, "capability", lambda device=None: (8, 0))
    monkeypatch.setattr(env, "device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(RuntimeError, match="use mpgpt.fp8.quantize"):
        fc.check_cast_device(FakeTensor())


# --- Fp8Linear ------------------------------------------------------------------------------------
def run_layer(layer, x, g, steps):
    """``steps`` forward + backward passes; the outputs and gradients of the last one."""
    for _ in range(steps):
        layer.zero_grad()
        xi = x.detach().clone().requires_grad_(True)
        y = layer(xi)
        y.backward(g)
    return y.detach(), xi.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_fp8_linear_fused_and_unfused_agree_exactly(recipe):
    # The private switch Fp8Linear._fused forces the fused cast (True) or the eager one (False);
    # on a CPU the fused cast then runs in the interpreter and the GEMMs are emulated on both paths.
    kernels_or_skip()
    device = device_or_skip()
    torch.manual_seed(int(torch.randint(0, 2**31, ())))
    lin = torch.nn.Linear(96, 48).to(device)
    x = torch.randn(80, 96, device=device)
    g = torch.randn(80, 48, device=device) * 1e-3
    results = {}
    for fused in (False, True):
        layer = fp8.Fp8Linear.from_linear(lin, recipe=recipe)
        layer._fused = fused
        results[fused] = run_layer(layer, x, g, steps=2 if recipe == "delayed" else 1)   # delayed: use the history
        if recipe == "delayed":
            results[fused] += tuple(h.amax_history for h in layer.history.values())
    for a, b in zip(results[False], results[True]):
        assert torch.equal(a, b)


def test_fp8_linear_fuses_only_where_the_gemm_runs_on_fp8_tensor_cores(monkeypatch):
    fc = kernels_or_skip()
    from mpgpt.kernels import env

    layer = fp8.Fp8Linear(64, 32)
    shapes = ((128, 64), (32, 64), E4M3, E4M3, torch.device("cpu"))
    assert not layer._fuse_casts(*shapes)                             # a CPU: the emulated path, unchanged
    gpu = {"H200": (9, 0), "L4": (8, 9), "A100": (8, 0), "T4": (7, 5)}
    monkeypatch.setattr(env, "interpreting", lambda: False)
    monkeypatch.setattr(env, "kernels_available", lambda: (True, "compiled"))
    for name, cc in gpu.items():
        monkeypatch.setattr(runtime, "current", lambda device=None, cc=cc, name=name: runtime.Runtime(
            "cuda", f"NVIDIA {name}", cc, 80 * 2**30, "3.6.0"))
        assert layer._fuse_casts(*shapes) == (cc >= (8, 9)), name
    assert not layer._fuse_casts((100, 64), (32, 64), E4M3, E4M3, "cuda")   # not a multiple of 16: emulated
    assert not fp8.Fp8Linear(64, 32, recipe="block")._fuse_casts(*shapes)
    forced = fp8.Fp8Linear(64, 32, recipe="block")
    forced._fused = True
    assert not forced._fuse_casts(*shapes)                                  # block: never, even when forced
    assert not fp8.Fp8Linear(64, 32, backend="emulated")._fuse_casts(*shapes)
    monkeypatch.setattr(env, "kernels_available", lambda: (False, "Triton is not installed"))
    assert not layer._fuse_casts(*shapes)
    assert fc is not None


# --- on the GPU: Triton's own fp8 conversion ---------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_fused_cast_is_bit_identical_on_the_gpu(recipe):
    fc = kernels_or_skip()
    if not runtime.current().fp8:
        pytest.skip("needs fp8 conversion instructions (sm_89+)")
    # each signature twice: the second call replays the compiled launch (fp8_cast._LAUNCHES)
    for R, K in [(1000, 770), (768, 3072)]:          # ragged (masks, unaligned strides), and GPT-2 width
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for fmt in FORMATS:
                for transpose in (False, True):
                    for repeat in range(2):
                        x = spread_rows(R, K, dtype=dtype, device="cuda")
                        amax = None if recipe != "delayed" else history_amax(x, (0.1, 2.0))   # often saturating
                        q = fc.fused_quantize(x, fmt, recipe, amax=amax, transpose=transpose)
                        assert_same(q, fp8.quantize(x.t() if transpose else x, fmt, recipe, amax=amax))


@pytest.mark.gpu
def test_fp8_linear_chooses_the_fused_cast_on_fp8_tensor_cores():
    kernels_or_skip()
    if not runtime.current().fp8:
        pytest.skip("needs fp8 tensor cores (sm_89+)")
    layer = fp8.Fp8Linear(768, 3072, device="cuda")
    assert layer._fuse_casts((8192, 768), (3072, 768), E4M3, E4M3, torch.device("cuda"))


# --- compiled ahead of time for the fp8 GPUs (no GPU needed) -------------------------------------------
def compile_cast_kernel(cc: int) -> str:
    """The PTX of the cast kernel for sm_<cc>: bf16 in, e4m3 out, rowwise scales, a given amax
    (every branch that runs on a GPU), transposed read (stride_r = 1, as Triton specialises it)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from mpgpt.kernels import fp8_cast

    ints = ["R", "C", "stride_c", "stride_out"]
    constexprs = dict(FMAX=448.0, MBITS=3, EMIN=-6, ROWWISE=True, GIVEN=True, UPCAST=False, stride_r=1, **fp8_cast.TILE)
    signature = {"x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "amax_ptr": "*fp32", "current_ptr": "*fp32",
                 "scale_ptr": "*fp32"} | {n: "i32" for n in ints} | {n: "constexpr" for n in constexprs}
    source = triton.compiler.ASTSource(fn=fp8_cast._cast_kernel, signature=signature, constexprs=constexprs)
    kernel = triton.compile(source, target=GPUTarget("cuda", cc, 32), options=dict(num_warps=fp8_cast.NUM_WARPS))
    return kernel.asm["ptx"]


def test_the_cast_kernel_compiles_for_fp8_gpus_and_rounds_to_nearest():
    """Compiled for the L4 (sm_89) and Hopper (sm_90) in a child process (TRITON_INTERPRET=0): the
    conversion is cvt.rn.satfinite (round to nearest even, as torch), the scale 1/s a correctly
    rounded division (div.rn: exact for a power of two). The conversion is cvt.rn.satfinite (from
    fp32 with Triton 3.9; through fp16 with 3.6): the kernel's values are fp8 values already
    (_round_to_grid), so either is exact."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.compiler")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, __file__, "89", "90"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    for cc in ("89", "90"):
        assert any(c.startswith("cvt.rn.satfinite.e4m3x2") for c in found[cc]), found[cc]
        assert "div.rn.f32" in found[cc], found[cc]


if __name__ == "__main__":   # the child process of the test above
    import json
    import os
    import re
    import sys

    os.environ["TRITON_INTERPRET"] = "0"
    print(json.dumps({cc: sorted(set(re.findall(r"(?:cvt|div)\.[\w.]+", compile_cast_kernel(int(cc)))))
                      for cc in sys.argv[1:]}))
