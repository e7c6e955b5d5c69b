"""fp8 training numerics from scratch: saturating casts, scaling recipes, scaled matmul, Fp8Linear (chapter 9).

Two 8-bit formats (chapter 1 decodes them bit by bit, mpgpt.formats):

    e4m3fn   3 mantissa bits, largest 448, no infinity        forward operands (activations, weights)
    e5m2     2 mantissa bits, largest 57344, has infinity     output gradients (more range, less precision)

Neither has the range for all tensors of a network at once, so each tensor gets its own *scale*:
``q = cast(x * s)`` with ``s`` chosen so that the tensor's largest magnitude (its *amax*) lands
near the format's largest value, and ``x ≈ q / s``. One loss scale cannot do this job (Transformer
Engine's fp8 primer), and "skip the step when a gradient is inf" no longer protects anything:
e4m3fn has no inf, and an overflowing cast saturates or becomes NaN depending on the torch release.
So :func:`saturating_cast` clamps explicitly, and every recipe below keeps the amax in range.

The recipes differ in how many values share one scale (the *granularity*):

    tensorwise   one scale per tensor, from this step's amax ("current" or dynamic scaling)
    rowwise      one scale per row (torchao's rowwise recipe, its choice for accuracy)
    block        one scale per 1 x 128 block of a row (DeepSeek-V3's activation scaling)
    delayed      one scale per tensor, from the largest amax of the last few steps
                 (Transformer Engine's DelayedScaling; see DelayedScaling)

A matrix product ``c = a @ b.T`` (a: (M, K), b: (N, K), nn.Linear's weight layout) always scales
each operand along its *reduction* dimension K, so the scales factor out of every dot product:
``c[m, n] = sum_k qa[m, k] qb[n, k] / (sa[m] sb[n])`` for rowwise scales, and per block of K for
block scales. :func:`scaled_matmul` runs it emulated (dequantise to fp32, matmul in fp32: correct
everywhere, fast nowhere) or, on fp8 tensor cores (sm_89+), through ``torch._scaled_mm``.

Tolerances are derived from the formats, not tuned (:func:`quantization_error_bound`,
:func:`matmul_error_bound`): round-to-nearest into a format with m mantissa bits has a relative
error of at most u = 2^-(m+1) in the normal range (e4m3: 2^-4, e5m2: 2^-3), plus an absolute
error of half the smallest subnormal (in scaled units) below it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from mpgpt import runtime
from mpgpt.formats import FloatFormat, get_format

E4M3 = get_format("e4m3fn")
E5M2 = get_format("e5m2")
RECIPES = ("tensorwise", "rowwise", "block", "delayed")
BLOCK = 128  # DeepSeek-V3's 1 x 128 activation blocks; also where its GEMMs promote partial sums


def unit_roundoff(fmt) -> float:
    """Largest relative error of round-to-nearest in the normal range: 2^-(m+1) (e4m3 2^-4, e5m2 2^-3)."""
    return 2.0 ** -(get_format(fmt).mantissa_bits + 1)


def underflow_error(fmt) -> float:
    """Largest absolute error of a cast below the normal range: half the smallest subnormal
    (e4m3 2^-10, e5m2 2^-17), in the units of the scaled tensor."""
    return get_format(fmt).smallest_subnormal / 2


def saturating_cast(x: torch.Tensor, fmt=E4M3) -> torch.Tensor:
    """``x`` (already scaled) cast to the fp8 format, values past the largest finite one clamped to
    it. Explicit, because torch's own cast disagrees across releases for e4m3fn (2.13 saturates
    to 448, 2.11 gave NaN) and turns e5m2 overflow into inf. NaN stays NaN."""
    fmt = get_format(fmt)
    if fmt.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"saturating_cast casts to e4m3fn or e5m2, not {fmt.name}; use x.to(dtype) for 16-bit formats")
    return x.float().clamp(-fmt.max_finite, fmt.max_finite).to(fmt.dtype)


def scale_from_amax(amax: torch.Tensor, fmt=E4M3, power_of_two: bool = True) -> torch.Tensor:
    """The multiplier ``s`` that maps an amax onto the format's largest value: fmax / amax.

    With ``power_of_two`` (the default) it is rounded *down* to a power of two, so the amax lands in
    (fmax/2, fmax] and multiplying or dividing by ``s`` is exact in fp32: only the cast rounds.
    An amax of 0 (an all-zero tensor or row) gets s = 1 instead of infinity."""
    fmax = get_format(fmt).max_finite
    amax = amax.float()
    s = torch.where(amax > 0, fmax / amax.clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(amax))
    if power_of_two:
        s = torch.exp2(torch.floor(torch.log2(s)))
        s = torch.where(amax * s > fmax, s * 0.5, s)  # fmax / amax rounded up onto a power of two
    return s


@dataclass
class ScaledFp8:
    """An fp8 tensor with its dequantisation scale: ``value ≈ data * scale`` (``scale`` = 1/s).

    data: (R, K) in e4m3fn or e5m2. scale: fp32, shape () for one scale per tensor, (R, 1) per row,
    (R, K // block) per 1 x block block. ``amax`` is the input's largest magnitude at the scale's
    granularity, which a delayed recipe records."""

    data: torch.Tensor
    scale: torch.Tensor
    fmt: FloatFormat
    recipe: str
    amax: torch.Tensor
    block: int | None = None

    def expanded_scale(self) -> torch.Tensor:
        """The scale broadcast to every element of ``data``: (R, K), or () / (R, 1) to broadcast."""
        if self.block is None:
            return self.scale
        return self.scale.repeat_interleave(self.block, dim=-1)  # (R, K // block) -> (R, K)

    def dequantize(self) -> torch.Tensor:
        """The fp32 tensor this one stands for."""
        return self.data.float() * self.expanded_scale()


def amax_of(x: torch.Tensor, recipe: str, block: int = BLOCK) -> torch.Tensor:
    """Largest magnitude at the recipe's granularity: () tensorwise/delayed, (R, 1) rowwise,
    (R, K // block) block."""
    check_recipe(recipe)
    a = x.detach().abs().float()
    if recipe in ("tensorwise", "delayed"):
        return a.amax()
    if recipe == "rowwise":
        return a.amax(dim=-1, keepdim=True)
    R, K = x.shape
    if K % block:
        raise ValueError(f"block scaling needs the reduction dimension ({K}) to be a multiple of {block}; "
                         "pad it, or use the rowwise recipe")
    return a.view(R, K // block, block).amax(dim=-1)


def quantize(x: torch.Tensor, fmt=E4M3, recipe: str = "tensorwise", amax: torch.Tensor | None = None,
             block: int = BLOCK, power_of_two: bool = True) -> ScaledFp8:
    """Scale and cast a 2-D tensor ``x`` (R, K) to fp8, scaled along its last dimension K.

    ``amax`` replaces the tensor's own amax (the delayed recipe passes the largest of its
    history); values beyond it saturate at the format's largest value rather than overflow."""
    if x.dim() != 2:
        raise ValueError(f"quantize takes a 2-D tensor (rows, K), got shape {tuple(x.shape)}; reshape it first")
    fmt = get_format(fmt)
    current = amax_of(x, recipe, block)
    used = current if amax is None else amax.to(current.device, torch.float32)
    s = scale_from_amax(used, fmt, power_of_two)                       # quantisation multiplier
    is_block = recipe == "block"
    s_full = s.repeat_interleave(block, dim=-1) if is_block else s     # broadcastable to (R, K)
    data = saturating_cast(x.float() * s_full, fmt)
    return ScaledFp8(data, 1.0 / s, fmt, recipe, current, block if is_block else None)


def check_recipe(recipe: str) -> str:
    if recipe not in RECIPES:
        raise ValueError(f"unknown fp8 recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
    return recipe


@dataclass
class DelayedScaling:
    """Transformer Engine's delayed scaling for one tensor: the scale of step t comes from the largest
    amax of the previous ``history`` steps, so it is known before the tensor exists (a fused kernel
    can cast on the fly). The first step, with no history yet, uses its own amax. A tensor that
    grows faster than the history saturates, silently. torchao removed the recipe in 2025; its users
    preferred current (tensorwise) scaling. The history stays on the tensor's device: no host sync."""

    history: int = 16
    amax_history: torch.Tensor | None = None   # (history,), newest first
    steps: int = 0

    def quantize(self, x: torch.Tensor, fmt=E4M3, record: bool = True, cast=None) -> ScaledFp8:
        """Cast with the scale the history gives; ``record=False`` for a second cast of the same
        tensor in one step (the backward pass casts x, w and g twice). ``cast``: the function that
        quantizes (default :func:`quantize`; Fp8Linear passes the fused Triton cast on fp8 GPUs)."""
        amax = self.amax_history.amax() if self.steps else None
        q = (cast or quantize)(x, fmt, "delayed", amax=amax)
        if record:
            self.record(q.amax)
        return q

    def record(self, amax: torch.Tensor) -> None:
        """Push this step's amax into the history (the oldest one drops out)."""
        if self.amax_history is None:
            self.amax_history = torch.zeros(self.history, device=amax.device, dtype=torch.float32)
        self.amax_history = torch.roll(self.amax_history, 1)
        self.amax_history[0] = amax
        self.steps += 1

    @property
    def amaxes(self) -> list[float]:
        """The recorded amaxes, newest first (a host copy, for display)."""
        if self.amax_history is None:
            return []
        return self.amax_history[: min(self.steps, self.history)].tolist()


# ---------------------------------------------------------------------------------------------
# The scaled matrix product c = a @ b.T, emulated or on fp8 tensor cores.
# ---------------------------------------------------------------------------------------------
def matmul_backend(a: ScaledFp8, b: ScaledFp8, backend: str = "auto") -> tuple[str, str]:
    """Which path ``scaled_matmul(a, b)`` takes here, and why: ("torch", ...) for torch._scaled_mm
    on fp8 tensor cores, ("emulated", ...) otherwise. Decided from mpgpt.runtime, so patching
    ``runtime.capability`` makes it decide as on another GPU."""
    if backend not in ("auto", "torch", "emulated"):
        raise ValueError(f"backend {backend!r}: choose auto, torch or emulated")
    if backend == "emulated":
        return "emulated", "asked for emulation"
    why = tensor_core_problem(runtime.current(a.data.device), (a.recipe, b.recipe), (a.data.dtype, b.data.dtype),
                              (*a.data.shape, b.data.shape[0]))
    if why is None:
        return "torch", "fp8 tensor cores through torch._scaled_mm"
    if backend == "torch":
        raise RuntimeError(f"torch._scaled_mm cannot run this product: {why}")
    return "emulated", why


def tensor_core_problem(rt: runtime.Runtime, recipes, dtypes, dims) -> str | None:
    """Why torch._scaled_mm cannot multiply two fp8 operands on ``rt``'s device, or None if it can:
    ``recipes`` and ``dtypes`` of both operands, ``dims`` = (M, K, N). Asked before the casts too,
    by Fp8Linear, which casts with the fused Triton kernel only when the product runs on tensor cores."""
    if not rt.on_gpu:
        return "no GPU: emulated (dequantise, matmul in fp32)"
    if not rt.fp8:
        return f"{rt.name} (sm_{rt.capability[0]}{rt.capability[1]}) has no fp8 tensor cores (sm_89+): emulated"
    if "block" in recipes:
        return "block scales: emulated (torch._scaled_mm is used for tensorwise and rowwise scales only)"
    if all(d == torch.float8_e5m2 for d in dtypes):
        return "e5m2 x e5m2 has no tensor-core instruction: emulated"
    if any(d % 16 for d in dims):
        return "a dimension is not a multiple of 16 (torch._scaled_mm needs that): emulated"
    return None


def scaled_matmul(a: ScaledFp8, b: ScaledFp8, out_dtype=torch.float32, backend: str = "auto",
                  use_fast_accum: bool = False) -> torch.Tensor:
    """``c = a @ b.T`` for a: (M, K), b: (N, K) fp8 operands with their scales -> (M, N) in out_dtype.

    Emulated: dequantise both to fp32 and multiply in fp32 (each fp8 x fp8 product is exact in fp32,
    and power-of-two scales are exact too, so only the fp32 sum rounds). On sm_89+ with tensorwise
    or rowwise scales: torch._scaled_mm, which takes the *dequantisation* scales and wants its
    second operand column-major (b.data.t() of a row-major (N, K) tensor is exactly that);
    ``use_fast_accum`` lets it skip promoting partial sums to fp32 (faster, less accurate)."""
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"a is {tuple(a.data.shape)} and b is {tuple(b.data.shape)}: both must be (rows, K) with the same K")
    path, _ = matmul_backend(a, b, backend)
    if path == "emulated":
        return (a.dequantize() @ b.dequantize().t()).to(out_dtype)            # (M, K) @ (K, N)
    rowwise = a.scale.dim() > 0 or b.scale.dim() > 0
    scale_a = a.scale.expand(a.data.shape[0], 1).contiguous() if rowwise else a.scale
    scale_b = b.scale.expand(b.data.shape[0], 1).t().contiguous() if rowwise else b.scale  # (1, N)
    mm_dtype = torch.bfloat16 if rowwise else out_dtype                        # rowwise wants bf16 output
    # cuBLASLt multiplies only a row-major a by a column-major b. .contiguous() returns a row-major
    # tensor itself, without a copy: the fused cast writes the backward pass's transposed operands
    # (g.T, x.T, w.T) row-major already; the unfused quantize casts strided views, copied here (1 byte each)
    out = torch._scaled_mm(a.data.contiguous(), b.data.contiguous().t(), scale_a=scale_a, scale_b=scale_b, out_dtype=mm_dtype,
                           use_fast_accum=use_fast_accum)
    return out.to(out_dtype)


# ---------------------------------------------------------------------------------------------
# Error bounds derived from the formats.
# ---------------------------------------------------------------------------------------------
def quantization_error_bound(q: ScaledFp8, x: torch.Tensor) -> torch.Tensor:
    """Per element, the largest |dequantize(q) - x| round-to-nearest allows when nothing saturates:
    u |x| + (half the smallest subnormal) * scale, in float64."""
    scale = q.expanded_scale().double()
    return unit_roundoff(q.fmt) * x.double().abs() + underflow_error(q.fmt) * scale


def matmul_error_bound(a: ScaledFp8, a_ref: torch.Tensor, b: ScaledFp8, b_ref: torch.Tensor,
                       accumulate_bits: int = 24) -> torch.Tensor:
    """Per element of c = a_ref @ b_ref.T, a bound on |scaled_matmul(a, b) - c| (float64, (M, N)).

    With per-element cast errors |da| <= ea and |db| <= eb (quantization_error_bound), each product
    errs by at most ea|b| + |a|eb + ea eb, so in a dot product of length K the errors add up to
    ea @ |b|.T + |a| @ eb.T + ea @ eb.T: a relative error of at most u_a + u_b + u_a u_b of
    sum_k |a_k b_k| (e4m3 x e4m3: 0.129; e5m2 x e4m3: 0.195), whatever K is. For random signs the errors mostly
    cancel, so the error seen is far smaller, growing like sqrt(K) rather than K. Summing K terms
    in an accumulator with p significant bits adds at most gamma_K = K 2^-p / (1 - K 2^-p) of the
    sum of |products| (Higham); fp32 (p = 24) makes that negligible up to K of about a million."""
    ea, eb = quantization_error_bound(a, a_ref), quantization_error_bound(b, b_ref)
    A, B = a_ref.double().abs(), b_ref.double().abs()
    K = a_ref.shape[1]
    gamma = K * 2.0**-accumulate_bits / (1 - K * 2.0**-accumulate_bits)
    qa, qb = a.dequantize().double().abs(), b.dequantize().double().abs()
    return ea @ B.t() + A @ eb.t() + ea @ eb.t() + gamma * (qa @ qb.t())


# ---------------------------------------------------------------------------------------------
# Fp8Linear: nn.Linear with fp8 operands in all three GEMMs.
# ---------------------------------------------------------------------------------------------
class _Fp8LinearFunction(torch.autograd.Function):
    """y = x @ w.T + bias with fp8 GEMMs. Forward: x and w in e4m3. Backward: the output gradient in
    e5m2, x and w again in e4m3, each re-cast from the saved high-precision tensor along the
    reduction dimension of its GEMM:

        dx = g @ w      (M, N) @ (N, K): a = g (M, N), b = w.T (K, N), reduced over N
        dw = g.T @ x    (N, M) @ (M, K): a = g.T (N, M), b = x.T (K, M), reduced over M
    """

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        ctx.layer = layer
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        # The output dtype nn.Linear would give: the autocast dtype under autocast (LayerNorm hands
        # over fp32 there, and fp32 logits would double the output's bytes), else the input's.
        device_type = x.device.type
        out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        with torch.autocast(device_type, enabled=False):
            y = layer._mm(x, weight, "x", "w", E4M3, E4M3, out_dtype)        # (M, K) . (N, K) -> (M, N)
            if bias is not None:
                y = y + bias.to(y.dtype)
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        layer = ctx.layer
        with torch.autocast(g.device.type, enabled=False):
            g = g.contiguous()
            # transposed operands are passed untransposed with a flag: the fused cast reads them in place
            dx = layer._mm(g, weight, "g", "w", E5M2, E4M3, x.dtype, (True, False), (False, True))  # (M, N) . (K, N) -> (M, K)
            dw = layer._mm(g, x, "g", "x", E5M2, E4M3, weight.dtype, (False, False), (True, True))   # (N, M) . (K, M) -> (N, K)
            db = g.float().sum(0).to(weight.dtype) if ctx.has_bias else None
        return dx, dw, db, None


class Fp8Linear(nn.Module):
    """A drop-in nn.Linear whose three GEMMs (forward, input gradient, weight gradient) run in fp8
    with the given recipe (block: 1 x 128 blocks where the GEMM's reduction dimension is a multiple
    of 128, one scale per row where it is not). Parameters stay in their own dtype (fp32 master weights); the casts,
    amaxes and scales are computed on every call and count in its time.

    On sm_89+ tensorwise, rowwise and delayed recipes run on fp8 tensor cores (torch._scaled_mm);
    block scales, a CPU and GPUs without fp8 (T4, A100) run emulated — the same numbers up to
    summation order, at fp32 speed. ``backend_reason()`` says which. On fp8 tensor cores with
    Triton, the casts run as mpgpt.kernels.fp8_cast's fused kernels (the same bits, two launches
    each instead of about a dozen torch operations, transposed operands read in place)."""

    _fused: bool | None = None   # the fused cast: None decides from the device; True/False force it (tests)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: str = "tensorwise",
                 backend: str = "auto", history: int = 16, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.recipe = check_recipe(recipe)
        self.backend = backend
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.history = {name: DelayedScaling(history) for name in ("x", "w", "g")}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        ref = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        with torch.no_grad():
            self.weight.copy_(ref.weight)
            if self.bias is not None:
                self.bias.copy_(ref.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: str = "tensorwise", backend: str = "auto") -> "Fp8Linear":
        """An Fp8Linear sharing ``linear``'s parameters (the same tensors, not copies)."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, recipe=recipe,
                    backend=backend, device=linear.weight.device, dtype=linear.weight.dtype)
        layer.weight, layer.bias = linear.weight, linear.bias
        return layer

    def _quantize(self, t: torch.Tensor, name: str, fmt, record: bool, transpose: bool = False,
                  fused: bool = False) -> ScaledFp8:
        """``t`` (or ``t.T`` with ``transpose``) cast to fp8 with the layer's recipe."""
        if fused:
            from mpgpt.kernels.fp8_cast import fused_quantize  # imported here: Triton is optional
            cast = functools.partial(fused_quantize, transpose=transpose)
        else:
            cast, t = quantize, (t.t() if transpose else t)
        if self.recipe == "delayed":
            return self.history[name].quantize(t, fmt, record, cast=cast)
        if self.recipe == "block" and t.shape[1] % BLOCK:
            return quantize(t, fmt, "rowwise")  # a reduction shorter than a block, or ragged: one scale per row
        return cast(t, fmt, self.recipe)

    def _fuse_casts(self, a_shape, b_shape, a_fmt, b_fmt, device) -> bool:
        """Whether to cast with the fused Triton kernels: when the product runs on fp8 tensor cores
        (the decision matmul_backend makes after the casts) and Triton compiles for the GPU."""
        if self.recipe == "block":
            return False              # block scales vary along K: mpgpt.fp8.quantize casts them
        if self._fused is not None:
            return self._fused
        if self.backend == "emulated":
            return False
        rt = runtime.current(device)
        if tensor_core_problem(rt, (self.recipe,), (a_fmt.dtype, b_fmt.dtype), (*a_shape, b_shape[0])) is not None:
            return False
        from mpgpt.kernels import env  # imported here: Triton is optional
        return not env.interpreting() and env.kernels_available()[0]

    def _mm(self, a, b, a_name, b_name, a_fmt, b_fmt, out_dtype, record=(True, True), transpose=(False, False)):
        """a (R, K) . b (C, K) -> (R, C), both cast to fp8 along K; ``record``: whether each cast
        enters the delayed recipe's amax history (once per tensor and step); ``transpose``: whether
        a and b are given as (K, R) and (K, C), to be cast transposed."""
        a_shape = a.shape[::-1] if transpose[0] else a.shape
        b_shape = b.shape[::-1] if transpose[1] else b.shape
        fused = self._fuse_casts(a_shape, b_shape, a_fmt, b_fmt, a.device)
        qa = self._quantize(a, a_name, a_fmt, record[0], transpose[0], fused)
        qb = self._quantize(b, b_name, b_fmt, record[1], transpose[1], fused)
        return scaled_matmul(qa, qb, out_dtype=out_dtype, backend=self.backend)

    def backend_reason(self, device=None) -> str:
        """Which path the forward GEMM takes on ``device`` (default: where the weight is), and why."""
        probe = quantize(torch.ones(16, 16, device=device or self.weight.device), E4M3,
                         "tensorwise" if self.recipe == "delayed" else self.recipe, block=16)
        return matmul_backend(probe, probe, self.backend)[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Fp8Linear expects inputs (..., {self.in_features}), got {tuple(x.shape)}")
        lead = x.shape[:-1]
        y = _Fp8LinearFunction.apply(x.reshape(-1, self.in_features), self.weight, self.bias, self)
        return y.reshape(*lead, self.out_features)                      # (..., in) -> (..., out)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, recipe={self.recipe}"


# ---------------------------------------------------------------------------------------------
# A model of a limited-precision accumulator (the accumulation experiment).
# ---------------------------------------------------------------------------------------------
def round_to_bits(x: torch.Tensor, bits: int, mode: str = "truncate") -> torch.Tensor:
    """``x`` (float64) kept to ``bits`` significant bits, by truncation (toward zero) or to nearest."""
    m, e = torch.frexp(x)                          # x = m * 2^e, 0.5 <= |m| < 1
    scaled = m * 2.0**bits
    scaled = torch.trunc(scaled) if mode == "truncate" else torch.round(scaled)
    return torch.ldexp(scaled * 2.0**-bits, e)


def accumulate_model(a: torch.Tensor, b: torch.Tensor, bits: int | None = 14, chunk: int = 32,
                     promote_every: int | None = None, mode: str = "truncate") -> torch.Tensor:
    """``a @ b.T`` (a: (M, K), b: (N, K), fp8-representable values) through a model accumulator.

    Each ``chunk`` of K (the K of one fp8 tensor-core instruction is 32) is summed exactly, then
    added to a running sum kept to ``bits`` significant bits (DeepSeek-V3 measured about 14 on
    Hopper; ``None`` = exact float64). With ``promote_every`` the running sum is added to an fp32
    total and restarted every that many elements of K, as DeepGEMM does every 128. A model, not the
    hardware: where and how the real accumulator rounds is not documented."""
    A, B = a.double(), b.double()
    M, K = A.shape
    N = B.shape[0]
    total = torch.zeros(M, N, dtype=torch.float64)
    running = torch.zeros(M, N, dtype=torch.float64)
    for k0 in range(0, K, chunk):
        part = A[:, k0:k0 + chunk] @ B[:, k0:k0 + chunk].t()    # exact: few fp8 products in float64
        running = running + part
        if bits is not None:
            running = round_to_bits(running, bits, mode)
        if promote_every and (k0 + chunk) % promote_every == 0:
            total = (total + running).float().double()            # promotion: an fp32 addition
            running = torch.zeros_like(running)
    return (total + running).float().double()
