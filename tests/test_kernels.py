"""Tests for mpgpt/kernels (chapter 6): the Triton matmul and TritonLinear.

On a CPU these run through Triton's interpreter (small shapes: it executes one program at a
time in numpy). Tests marked sm80 run compiled on a GPU with compute capability >= 8.0.

What "correct" means here. The reference is float64 on the *same* bf16/fp16 inputs, so the only
differences are the kernel's own roundings: fp32 accumulation (relative error ~ sqrt(K) * 2^-24,
negligible) and one rounding of the result to the output dtype, a relative error of at most
2^-8 = 3.9e-3 per element for bf16 (8 significant bits) and 2^-11 = 4.9e-4 for fp16, about
half that as a norm over many elements. So ||out - ref|| / ||ref|| must stay below 1e-2 for bf16
and 2e-3 for fp16: loose enough for any correct kernel, orders of magnitude below what a wrong
index, a missed K-tile or an unwritten tile gives (~1). NaN never passes.
"""
import importlib
import itertools
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from mpgpt import kernels
from mpgpt.kernels import TritonLinear, env, gelu_tanh_grad, grouped, launch, matmul, plan
from mpgpt.kernels.hopper import tma, ws

mm = importlib.import_module("mpgpt.kernels.matmul")  # the module (the package re-exports the function)

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
# fp32 GELU backward: gelu' takes an exp, a division and about a dozen multiply-adds in fp32, each
# rounding by up to 2^-24, and its two terms partly cancel, so one element can be off by 10-20 ulps
# (~1e-6 relative). Over a handful of elements the norm does not average that away: the worst of
# 400 random (1, 5) inputs on the CPU interpreter was 1.8e-6. 5e-6 allows it; a wrong term is O(1).
GELU_FP32_TOL = 5e-6
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(out, ref):
    """||out - ref|| / ||ref|| in float64 (inf if out has a NaN)."""
    out = out.double()
    if not torch.isfinite(out).all():
        return math.inf
    denom = ref.norm().item()
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)


def reference(a, b, bias=None, activation=None):
    """act(a @ b + bias) in float64 on the same (already rounded) inputs."""
    z = a.double() @ b.double()
    if bias is not None:
        z = z + bias.double()
    if activation == "gelu":
        return F.gelu(z, approximate="tanh")
    if activation == "relu":
        return F.relu(z)
    return z


def rand(*shape, dtype=torch.bfloat16, device=DEVICE):
    return torch.randn(*shape, device=device).to(dtype)


class FakeCuda(torch.Tensor):
    """A tensor that claims to live on cuda:0, with shape, strides, dtype and an address but no
    memory: enough for matmul.plan, which only reads metadata, to plan for a GPU on a machine
    without one. View ops (.t(), .view) are computed on the meta device; anything else raises."""

    @staticmethod
    def __new__(cls, shape, strides=None, dtype=torch.bfloat16, ptr=0, offset=0):
        if strides is None:
            strides = torch.empty(shape, device="meta").stride()
        t = torch.Tensor._make_wrapper_subclass(cls, shape, strides=strides, dtype=dtype, device="cuda:0",
                                                storage_offset=offset)
        t._ptr = ptr
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    def data_ptr(self):
        return self._ptr

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        fake = next(x for x in tree_leaves((args, kwargs)) if isinstance(x, FakeCuda))

        def to_meta(x):
            if not isinstance(x, FakeCuda):
                return x
            return torch.empty(0, dtype=x.dtype, device="meta").as_strided(x.shape, x.stride(), x.storage_offset())

        def back(m):
            if not isinstance(m, torch.Tensor):
                return m
            ptr = fake._ptr + (m.storage_offset() - fake.storage_offset()) * m.element_size()
            return FakeCuda(m.shape, m.stride(), m.dtype, ptr, m.storage_offset())

        return tree_map(back, func(*tree_map(to_meta, args), **tree_map(to_meta, kwargs or {})))


def fake_cuda(*shape, dtype=torch.bfloat16, ptr=0):
    """A contiguous FakeCuda tensor; ptr: its address (ptr=2 is 2 bytes past an aligned one)."""
    return FakeCuda(shape, dtype=dtype, ptr=ptr)


@pytest.fixture
def fake_gpu(monkeypatch):
    """fake_gpu(cc, sms=132): make mpgpt.kernels plan as on a GPU of compute capability cc,
    by patching only the package's own view of the device (env.capability, env.num_sms,
    env.interpreting); torch and Triton are untouched."""
    def use(cc, sms=132):
        monkeypatch.setattr(env, "interpreting", lambda: False)
        monkeypatch.setattr(env, "capability", lambda device=None: cc)
        monkeypatch.setattr(env, "num_sms", lambda device=None: sms)
        monkeypatch.setattr(env, "device_name", lambda device=None: f"Fake sm_{cc[0]}{cc[1]}")
    return use


def test_compiled_launch_passes_arguments_in_parameter_order():
    """launch.compiled_launch: the remembered launch hands the new tensors, then every other
    argument in the kernel's parameter order (constexprs included, launch options such as
    num_warps left out), to CompiledKernel.run with the grid evaluated once."""
    from mpgpt.kernels.launch import compiled_launch
    calls = []

    class Compiled:  # what Triton's launch returns: .run, .function, .packed_metadata
        function, packed_metadata = "function", "metadata"

        def run(self, *args):
            calls.append(args)

    jit_fn = SimpleNamespace(arg_names=["x_ptr", "y_ptr", "n", "stride", "BLOCK"])
    launch = compiled_launch(jit_fn, Compiled(), lambda meta: (meta["n"] // meta["BLOCK"],),
                             ("x", "y", 64), {"BLOCK": 16, "stride": 3, "num_warps": 4}, n_tensors=2,
                             get_stream=lambda device: f"stream{device}")
    launch(1, "x2", "y2")
    assert calls == [(4, 1, 1, "stream1", "function", "metadata", None, None, None, "x2", "y2", 64, 3, 16)]
    # Anything unexpected keeps the ordinary path: a missing argument, no .function, no result.
    assert compiled_launch(jit_fn, Compiled(), (1,), ("x", "y"), {"BLOCK": 16}, 2, get_stream=str) is None
    assert compiled_launch(jit_fn, SimpleNamespace(run=None), (1,), ("x", "y", 1, 1), {"BLOCK": 1}, 2,
                           get_stream=str) is None
    assert compiled_launch(jit_fn, None, (1,), ("x", "y", 1, 1), {"BLOCK": 1}, 2, get_stream=str) is None


# A stand-in for triton 3.6's CUDA launcher (triton/backends/nvidia/driver.py), the layout
# launch.descriptor_maps reads: CudaLauncher.launch is wrap_handle_tensordesc's `inner`, closing over
# the C launcher, the descriptor parameters' positions and their metadata; make_tensordesc_arg turns
# one descriptor into the C launcher's arguments (the encoded map, then shape and strides).
_FAKE_DRIVER = "fake_triton_driver"
_ENCODED = []  # the base address of every descriptor the fake encodes


def _fake_make_tensordesc_arg(arg, metadata):
    _ENCODED.append(arg.base.data_ptr())
    return [("map", arg.base.data_ptr(), tuple(arg.shape), tuple(arg.strides), metadata["swizzle"]),
            *arg.shape, *arg.strides]


def _fake_wrap(launcher, tensordesc_indices, tensordesc_meta):
    def inner(*args):  # triton 3.6's: the 13 leading arguments, then each descriptor expanded in place
        final_args = list(args[:13])
        tensordesc_idx = 0
        for i, arg in enumerate(args[13:]):
            if i in tensordesc_indices:
                final_args.extend(_fake_make_tensordesc_arg(arg, tensordesc_meta[tensordesc_idx]))
                tensordesc_idx += 1
            else:
                final_args.append(arg)
        return launcher(*final_args)
    return inner


class _FakeCudaLauncher:
    def __init__(self, launcher, indices, metas, scratch=0):
        self.launch = _fake_wrap(launcher, indices, metas)
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):  # triton 3.6's CudaLauncher.__call__
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    None, None, *args)


_FakeCudaLauncher.__module__ = _FAKE_DRIVER


def test_descriptor_maps_pass_what_tritons_own_launcher_passes(monkeypatch):
    """CompiledLaunch.with_descriptors: the C launcher must receive exactly what Triton's own path
    hands it (here a stand-in with triton 3.6's layout), and each descriptor is encoded once per
    (address, shape, strides): again for new tensors or another view at the same address, not
    again for tensors seen before. Where the launcher does not have the expected layout (scratch
    memory, other closure variables, a module without the 13 leading arguments), the ordinary call
    runs instead, with the same arguments."""
    import types
    from mpgpt.kernels.launch import HostDescriptor, compiled_launch, descriptor_maps
    fake = types.ModuleType(_FAKE_DRIVER)
    fake._BASE_ARGS_FORMAT_LEN, fake.make_tensordesc_arg = 13, _fake_make_tensordesc_arg
    monkeypatch.setitem(sys.modules, _FAKE_DRIVER, fake)
    calls = []
    metas = [{"swizzle": 128}, {"swizzle": 64}]
    jit_fn = SimpleNamespace(arg_names=["a_desc", "c_desc", "bias_ptr", "n", "BLOCK"])

    def remembered(scratch=0):
        compiled = SimpleNamespace(run=_FakeCudaLauncher(lambda *args: calls.append(args), {0, 1}, metas, scratch),
                                   function="function", packed_metadata="metadata")
        return compiled_launch(jit_fn, compiled, (3,), ("a", "c", "bias", 64), {"BLOCK": 16}, n_tensors=3,
                               get_stream=lambda device: f"stream{device}")

    a, c, bias = torch.randn(8, 4), torch.randn(4, 8), torch.randn(8)
    lean = remembered()
    _ENCODED.clear()
    lean.with_descriptors(0, (a, c), bias)
    lean(0, HostDescriptor(a), HostDescriptor(c), bias)  # Triton's own path
    assert len(calls) == 2 and calls[0] == calls[1]
    assert calls[0][:13] == (3, 1, 1, "stream0", "function", False, True, None, None, "metadata", None, None, None)
    assert calls[0][13:] == (("map", a.data_ptr(), (8, 4), (4, 1), 128), 8, 4, 4, 1,
                             ("map", c.data_ptr(), (4, 8), (8, 1), 64), 4, 8, 8, 1, bias, 64, 16)
    assert len(_ENCODED) == 4  # two by with_descriptors, two by the ordinary call
    lean.with_descriptors(0, (a, c), bias)
    assert len(_ENCODED) == 4 and calls[-1] == calls[0]  # seen before: no encoding
    a2 = torch.randn(8, 4)
    lean.with_descriptors(0, (a2, c), bias)
    assert _ENCODED[4:] == [a2.data_ptr(), c.data_ptr()] and calls[-1][13] == ("map", a2.data_ptr(), (8, 4), (4, 1), 128)
    at = a.view(4, 8)  # the same address, another shape and strides: a map of its own
    lean.with_descriptors(0, (at, c), bias)
    assert calls[-1][13] == ("map", a.data_ptr(), (4, 8), (8, 1), 128)
    monkeypatch.setattr(launch, "MAX_DESCRIPTOR_MAPS", 3)  # bounded: the oldest entry goes first
    a3 = torch.randn(8, 4)
    lean.with_descriptors(0, (a3, c), bias)
    def key(*ts):
        return tuple((t.data_ptr(), t.shape, t.stride()) for t in ts)
    assert list(lean._maps.maps) == [key(a2, c), key(at, c), key(a3, c)]  # (a, c), the first, went

    # Other layouts: the ordinary call, the same arguments.
    assert descriptor_maps(remembered(scratch=64).kernel, 2) is None
    assert descriptor_maps(remembered().kernel, 3) is None  # not the kernel's descriptor count
    no_meta = SimpleNamespace(run=_FakeCudaLauncher(lambda *args: None, {0, 1}, [None, None]))
    assert descriptor_maps(no_meta, 2) is None  # no metadata: Triton passes the descriptor's parts
    monkeypatch.setattr(fake, "_BASE_ARGS_FORMAT_LEN", 14)
    assert descriptor_maps(remembered().kernel, 2) is None
    monkeypatch.setattr(fake, "_BASE_ARGS_FORMAT_LEN", 13)
    other = remembered()
    other.kernel.run.launch = lambda *args: calls.append(("wrapper",) + args)  # closes over nothing
    assert descriptor_maps(other.kernel, 2) is None
    n = len(calls)
    other.with_descriptors(0, (a, c), bias)
    assert other._maps is None and calls[n][0] == "wrapper" and isinstance(calls[n][14], HostDescriptor)


def test_checked_2d_skips_checks_only_for_metadata_it_accepted(monkeypatch):
    """matmul.checked_2d remembers the metadata of arguments _check accepted, and skips _check only
    for an equal key: other shapes, dtypes, options or a non-tensor still get _check's error; a
    3-D input comes back as a 2-D view of itself; a copy (a non-viewable input) is not remembered;
    another GPU generation makes another key. The key is only made where compiled kernels run on
    a CUDA tensor: here that gate and the capability are patched, the checks run as on a CPU."""
    assert mm.accepted_key(rand(4, 8, device="cpu"), rand(8, 4, device="cpu"), None, None, "auto", None) is None
    calls = []
    real = mm._check
    monkeypatch.setattr(mm, "_check", lambda *args, **kw: calls.append(1) or real(*args, **kw))
    monkeypatch.setattr(mm, "_ACCEPTED", set())
    monkeypatch.setattr(mm, "_checks_can_be_skipped", lambda a: True)
    monkeypatch.setattr(env, "capability", lambda device=None: (9, 0))
    a, b, bias = rand(2, 3, 32, device="cpu"), rand(16, 32, device="cpu").t(), rand(16, device="cpu")
    first = mm.checked_2d(a, b, bias, "gelu")
    fresh = rand(2, 3, 32, device="cpu")
    second = mm.checked_2d(fresh, b, bias, "gelu")
    assert len(calls) == 1 and first[1] == second[1] == (2, 3, 16) and second[0].shape == (6, 32)
    assert second[0].data_ptr() == fresh.data_ptr() and second[0]._base is fresh  # a view of the new input
    with pytest.raises(ValueError, match="activation"):
        mm.checked_2d(a, b, bias, "tanh")
    with pytest.raises(ValueError, match="inner dimensions"):
        mm.checked_2d(rand(6, 16, device="cpu"), b, bias, "gelu")
    with pytest.raises(TypeError, match="same dtype"):
        mm.checked_2d(a, b.float(), bias, "gelu")
    mm.checked_2d(a, b, None, None, split_k=1)
    with pytest.raises(ValueError, match="split_k"):
        mm.checked_2d(a, b, None, None, split_k=True)  # True == 1, but not a split_k
    with pytest.raises(TypeError, match="torch.Tensor"):
        mm.checked_2d([[1.0]], b, bias, "gelu")
    strided = rand(3, 2, 32, device="cpu").transpose(0, 1)  # (2, 3, 32) that no view makes 2-D
    n = len(calls)
    mm.checked_2d(strided, b, None, None)
    mm.checked_2d(strided, b, None, None)
    assert len(calls) == n + 2  # copied to become 2-D: checked every time
    key = mm.accepted_key(a, b, bias, "gelu", "auto", None)
    monkeypatch.setattr(env, "capability", lambda device=None: (7, 5))  # bf16 is refused below sm_80
    assert mm.accepted_key(a, b, bias, "gelu", "auto", None) != key


def test_tma_store_needs_aligned_row_major_outputs():
    """The TMA kernel stores through descriptors only where one can address the output:
    row-major, 16-byte-aligned base and row pitch, for c and (if given) z."""
    c = torch.empty(64, 64, dtype=torch.bfloat16)
    assert tma.store_ok(c, None) and tma.store_ok(c, torch.empty_like(c))
    assert not tma.store_ok(c.t(), None)                                  # column-major
    assert not tma.store_ok(torch.empty(64, 72, dtype=torch.bfloat16)[:, 1:65], None)  # base off by 2 bytes
    assert not tma.store_ok(torch.empty(64, 68, dtype=torch.bfloat16)[:, :64], None)  # pitch 136 bytes
    assert not tma.store_ok(c, torch.empty(64, 72, dtype=torch.bfloat16)[:, 1:65])  # z misaligned


def test_launch_switches_are_read_at_call_time(monkeypatch):
    """MPGPT_LEAN_LAUNCH and MPGPT_AUTOTUNE take effect when set in a running process, and the
    autotuning switch is part of the lean launch cache's key (a fixed-config launch is not
    replayed for an autotuned call)."""
    monkeypatch.setenv("MPGPT_LEAN_LAUNCH", "0")
    assert not launch.lean_launch_enabled()
    monkeypatch.setenv("MPGPT_LEAN_LAUNCH", "1")
    assert launch.lean_launch_enabled() == (env.TRITON_IMPORT_ERROR is None)
    monkeypatch.setenv("MPGPT_AUTOTUNE", "0")
    assert not launch.autotune_enabled()
    monkeypatch.setattr(env, "capability", lambda device=None: (9, 0))
    a, b, c = fake_cuda(64, 32), fake_cuda(32, 48), fake_cuda(64, 48)
    fixed = launch.signature(a, b, c, None, None, None, "auto", None)
    monkeypatch.delenv("MPGPT_AUTOTUNE")
    assert launch.autotune_enabled()
    assert launch.signature(a, b, c, None, None, None, "auto", None) != fixed


# ------------------------------------------------------------------------------------------------
# forward, on the interpreter (CPU) or whatever device is present
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (17, 33, 64), (64, 17, 33), (33, 64, 1)])
@pytest.mark.parametrize("use_bias,activation", [(False, None), (True, "gelu"), (True, "relu")])
def test_matmul_matches_float64(dtype, M, N, K, use_bias, activation):
    a, b = rand(M, K, dtype=dtype), rand(K, N, dtype=dtype)
    bias = rand(N, dtype=dtype) if use_bias else None
    out = matmul(a, b, bias, activation)
    assert out.shape == (M, N) and out.dtype == dtype
    assert rel_err(out, reference(a, b, bias, activation)) < TOL[dtype]


def test_poisoned_output_is_fully_written():
    """Fill `out` with NaN first: a tile the kernel forgets to write stays NaN and fails."""
    M, N, K = 65, 70, 40  # three tiles along M and N with the interpreter's 32x32 tiles
    a, b, bias = rand(M, K), rand(K, N), rand(N)
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = matmul(a, b, bias, "gelu", out=out)
    assert got is out
    assert not torch.isnan(out).any()
    assert rel_err(out, reference(a, b, bias, "gelu")) < TOL[torch.bfloat16]


def test_strided_and_transposed_operands():
    """Transposed views and column slices are read through their strides."""
    M, N, K = 33, 40, 48
    a_t = rand(K, M).t()                    # (M, K), column-major
    b_t = rand(N, K).t()                    # (K, N) = nn.Linear weight transposed
    a_sl = rand(M, 2 * K)[:, ::2]           # every other column: stride 2 along K
    out_t = torch.full((N, M), float("nan"), dtype=torch.bfloat16, device=DEVICE).t()  # strided out
    for a in (a_t, a_sl):
        for b in (b_t, rand(K, N)):
            assert rel_err(matmul(a, b), reference(a, b)) < TOL[torch.bfloat16]
    matmul(a_t, b_t, out=out_t)
    assert rel_err(out_t, reference(a_t, b_t)) < TOL[torch.bfloat16]


def test_batch_dimensions_are_flattened():
    a = rand(2, 3, 5, 24)
    b, bias = rand(24, 20), rand(20)
    out = matmul(a, b, bias, "relu")
    assert out.shape == (2, 3, 5, 20)
    assert rel_err(out, reference(a, b, bias, "relu")) < TOL[torch.bfloat16]
    a_nc = rand(5, 3, 24).transpose(0, 1)  # batch dims that cannot be merged in place
    assert rel_err(matmul(a_nc, b), reference(a_nc, b)) < TOL[torch.bfloat16]
    v = rand(24)  # a single vector: (K,) @ (K, N) -> (N,)
    assert matmul(v, b).shape == (20,)


def test_fp32_output_buffer():
    """out may be fp32: the accumulator is stored without rounding to bf16 (used for dW)."""
    a, b = rand(20, 36), rand(36, 24)
    out = torch.empty(20, 24, dtype=torch.float32, device=DEVICE)
    matmul(a, b, out=out)
    assert rel_err(out, reference(a, b)) < 1e-5  # fp32 accumulation only


@pytest.mark.parametrize("M,N,K,split_k", [(33, 40, 100, 3), (64, 17, 129, 4), (5, 7, 64, 2), (20, 24, 33, 8)])
def test_split_k_matches_float64(M, N, K, split_k):
    """Split-K (a weight-gradient layout: A column-major) into fp32 and bf16 outputs. The slices'
    partials start as NaN in the interpreter, so a slice never written fails. (20, 24, 33, 8): more
    slices than K-tiles, the extra slices add zeros."""
    a, b = rand(K, M).t(), rand(K, N)
    ref = reference(a, b)
    out32 = torch.full((M, N), float("nan"), device=DEVICE)
    matmul(a, b, out=out32, split_k=split_k)
    assert rel_err(out32, ref) < 1e-5  # fp32 partials, fp32 sum: accumulation error only
    assert rel_err(matmul(a, b, split_k=split_k), ref) < TOL[torch.bfloat16]


def test_auto_split_k_only_for_few_tiles_and_long_k():
    # With 132 SMs (H200): GPT-2's weight gradients (out x in, K = 12288 tokens) are split so
    # there are at least two waves of programs; the forward and dX shapes (M = 12288) are not.
    pick = grouped.auto_split_k
    assert pick(768, 768, 12288, 132) == 8        # attn.c_proj dW: 36 tiles
    assert pick(2304, 768, 12288, 132) == 3       # c_attn dW: 108 tiles
    assert pick(3072, 768, 12288, 132) == 2       # c_fc dW: 144 tiles
    assert pick(12288, 768, 768, 132) == 1        # attn.c_proj forward: 576 tiles
    assert pick(12288, 768, 3072, 132) == 1       # mlp.c_proj dX
    assert pick(768, 768, 1024, 132) == 1         # short K: nothing to split
    assert pick(128, 128, 10**6, 132) == 16       # capped


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 1000), (4097,), (2, 3, 5)])
def test_gelu_backward_matches_float64(dtype, shape):
    g, z = rand(*shape, dtype=dtype), (3 * torch.randn(*shape, device=DEVICE)).to(dtype)
    ref = g.double() * gelu_tanh_grad(z).double()
    out = kernels.gelu_backward(g, z)
    assert out.shape == g.shape and out.dtype == dtype
    # one rounding of the fp32 result to dtype (see TOL); fp32: rounding of the fp32 formula
    assert rel_err(out, ref) < {torch.float32: GELU_FP32_TOL}.get(dtype, TOL.get(dtype))
    assert kernels.gelu_backward(g[:0], z[:0]).numel() == 0
    with pytest.raises(ValueError, match="same shape"):
        kernels.gelu_backward(g, z[..., :1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,config", [((300, 200), None), ((300, 200), (64, 16, 32, 1)), ((1, 5), None),
                                          ((129, 64), (32, 32, 64, 1))])
def test_gelu_backward_bias_matches_float64(dtype, shape, config):
    """dZ as gelu_backward computes it, and the bias gradient: dZ summed over the rows. Shapes with
    edges in both dimensions, and tile configurations that loop over several row blocks per
    program and spread the rows over several programs."""
    g, z = rand(*shape, dtype=dtype), (3 * torch.randn(*shape, device=DEVICE)).to(dtype)
    z64 = z.double().requires_grad_()
    F.gelu(z64, approximate="tanh").backward(g.double())
    ref = z64.grad  # float64 throughout
    dz, db = kernels.gelu_backward_bias(g, z, config=config)
    assert dz.shape == g.shape and dz.dtype == dtype and db.shape == shape[1:] and db.dtype == torch.float32
    assert rel_err(dz, ref) < {torch.float32: GELU_FP32_TOL}.get(dtype, TOL.get(dtype))
    # db sums the unrounded fp32 dZ: fp32 evaluation and summation errors only, whatever dtype
    # dZ is stored in. Summed over the wrong axis, or with a row block missed, it is off by ~1.
    assert rel_err(db, ref.sum(0)) < 1e-5


def test_gelu_backward_bias_errors():
    g = rand(4, 6)
    with pytest.raises(ValueError, match="same shape"):
        kernels.gelu_backward_bias(g, g[:, :2])
    with pytest.raises(ValueError, match="reshape to"):
        kernels.gelu_backward_bias(g.view(2, 2, 6), g.view(2, 2, 6))
    with pytest.raises(ValueError, match="multiple of BLOCK_M"):
        kernels.gelu_backward_bias(g, g, config=(48, 32, 64, 1))
    with pytest.raises(ValueError, match="powers of two"):
        kernels.gelu_backward_bias(g, g, config=(48, 48, 64, 1))
    with pytest.raises(ValueError, match="num_warps must be a power of two"):
        kernels.gelu_backward_bias(g, g, config=(64, 64, 64, 3))
    with pytest.raises(ValueError, match=r"config must be \(ROWS, BLOCK_M, BLOCK_N, num_warps\)"):
        kernels.gelu_backward_bias(g, g, config=(64, 64, 64))


class _GridSpy:
    """Stands in for a Triton kernel: records the grid of each launch and runs nothing."""

    def __init__(self):
        self.grids = []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return lambda *args, **kwargs: None


def _fits_cuda_grid(grid) -> bool:
    """CUDA launches at most 2^31 - 1 programs along the grid's first axis, 65535 along the others."""
    return grid[0] < 2**31 and all(g <= 65535 for g in grid[1:])


def test_column_sum_kernels_launch_within_cuda_grid_limits(monkeypatch):
    """GELU's backward with the bias sums and the head merge put one program per row group: with
    millions of rows (a layer of small width over a long batch) that must stay a grid CUDA can
    launch. The interpreter enforces no limit, so the grid is checked, not run."""
    from mpgpt.kernels import gelu
    from mpgpt.fast import heads
    M = 70_000 * 128  # more row groups than 65535 at the GPU's and the interpreter's ROWS
    spy = _GridSpy()
    monkeypatch.setattr(gelu, "_gelu_backward_bias_kernel", spy)
    g = torch.zeros(M, 1, device=DEVICE)
    gelu.gelu_backward_bias(g, g)
    gelu.gelu_backward_bias(g, g, config=gelu._BIAS_CONFIG)
    monkeypatch.setattr(heads, "_merge_heads_sum_kernel", spy)
    d = torch.zeros(1, 1, M, 1, device=DEVICE)
    heads.merge_heads_bias(d, d, d)
    heads.merge_heads_bias(d, d, d, config=heads._CONFIG)
    assert len(spy.grids) == 4
    assert all(_fits_cuda_grid(grid) for grid in spy.grids), spy.grids


def test_gelu_backward_bias_edge_inputs():
    """No rows (db is zeros, not garbage), and a non-contiguous grad: the same result as its copy."""
    dz, db = kernels.gelu_backward_bias(rand(0, 7), rand(0, 7))
    assert dz.shape == (0, 7) and torch.equal(db, torch.zeros(7, device=DEVICE))
    g, z = rand(9, 40).t(), rand(40, 9)
    dz, db = kernels.gelu_backward_bias(g, z)
    dz_c, db_c = kernels.gelu_backward_bias(g.contiguous(), z)
    assert torch.equal(dz, dz_c) and torch.equal(db, db_c)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: matmul(torch.randn(4, 4), torch.randn(4, 4)), TypeError, "bfloat16 or float16"),
    (lambda: matmul(rand(4, 4), rand(4, 4, dtype=torch.float16)), TypeError, "same dtype"),
    (lambda: matmul(rand(4, 4), rand(4)), ValueError, "must be 2-D"),
    (lambda: matmul(rand(4, 4), rand(2, 4, 4)), ValueError, "must be 2-D"),
    (lambda: matmul(rand(4, 5), rand(4, 3)), ValueError, "inner dimensions"),
    (lambda: matmul(rand(4, 4), rand(4, 3), bias=rand(4)), ValueError, "length N=3"),
    (lambda: matmul(rand(4, 4), rand(4, 3), bias=rand(3, dtype=torch.float16)), TypeError, "bias must be"),
    (lambda: matmul(rand(4, 4), rand(4, 3), activation="swish"), ValueError, "tanh approximation"),
    (lambda: matmul(rand(4, 4), rand(4, 3), out=rand(4, 4)), ValueError, "out has shape"),
    (lambda: matmul(rand(4, 4), rand(4, 3), bias=rand(3), split_k=2), ValueError, "no bias"),
    (lambda: matmul(rand(4, 4), rand(4, 3), split_k=0), ValueError, "split_k must be"),
    (lambda: matmul(rand(4, 4), rand(4, 3), split_k=2, kernel="tma"), ValueError, "grouped kernel"),
    (lambda: matmul(rand(4, 4), rand(4, 3), split_k=2, kernel="ws"), ValueError, "grouped kernel"),
    (lambda: matmul(rand(4, 4), rand(4, 3), kernel="cutlass"), ValueError, "kernel must be one of"),
    (lambda: TritonLinear(4, 3, activation="gelu_exact"), ValueError, "activation"),
    (lambda: TritonLinear.from_linear(nn.Conv1d(1, 1, 1)), TypeError, "nn.Linear"),
])
def test_clear_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_error_without_triton(monkeypatch):
    monkeypatch.setattr(env, "TRITON_IMPORT_ERROR", "Triton is not installed (ImportError); it supports Linux only.")
    with pytest.raises(RuntimeError, match="Linux only"):
        matmul(rand(4, 4), rand(4, 4))
    with pytest.raises(RuntimeError, match="Linux only"):
        plan(rand(4, 4), rand(4, 4))


def test_importing_mpgpt_kernels_without_triton_never_fails():
    """With `import triton` failing (as on macOS/Windows), `import mpgpt.kernels` still works
    and the entry points say why they cannot run."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch; import mpgpt.kernels as k\n"
            "ok, why = k.kernels_available(); assert not ok and 'Linux only' in why, why\n"
            "a = torch.zeros(4, 4, dtype=torch.bfloat16)\n"
            "try:\n    k.matmul(a, a)\nexcept RuntimeError as e:\n    print('raised:', e)\n")
    root = str(Path(__file__).resolve().parents[1])
    envvars = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=envvars, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "raised: Triton is not installed" in done.stdout


def test_error_on_old_gpu_names_it(monkeypatch):
    """bf16 on a T4 (sm_75) gives one line naming the GPU and the way out; fp16 is let through.
    Faked through the package's own view of the device (env.capability, env.device_name)."""
    monkeypatch.setattr(env, "interpreting", lambda: False)
    monkeypatch.setattr(env, "capability", lambda device=None: (7, 5))
    monkeypatch.setattr(env, "device_name", lambda device=None: "Tesla T4")
    fake = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"Tesla T4 is sm_75.*fp16"):
        kernels.check_device(fake)
    kernels.check_device(SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.float16))
    with pytest.raises(RuntimeError, match=r"Tesla T4 is sm_75.*fp16"):
        plan(fake_cuda(64, 64), fake_cuda(64, 64))  # plan raises what matmul would
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA tensors"):
            kernels.check_device(torch.zeros(1, dtype=torch.bfloat16))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter check applies without a GPU")
def test_old_interpreter_with_new_numpy_gets_a_clear_error(monkeypatch):
    # Triton < 3.7's interpreter calls int() on 1-element arrays, which new NumPy refuses: the
    # kernels must say so in one line instead of failing deep inside the interpreter.
    monkeypatch.setattr(env, "_numpy_refuses_int_of_1d_array", lambda: True)
    monkeypatch.setattr(env.triton, "__version__", "3.6.0")
    ok, why = kernels.kernels_available()
    assert not ok and "triton>=3.7" in why
    with pytest.raises(RuntimeError, match="triton>=3.7"):
        matmul(rand(4, 4), rand(4, 4))
    monkeypatch.setattr(env.triton, "__version__", "3.7.0")
    assert env.interpreter_problem() is None


def test_kernels_available_reports_a_reason():
    ok, why = kernels.kernels_available()
    assert ok and isinstance(why, str) and why
    if not torch.cuda.is_available():
        assert kernels.interpreting() and "interpreter" in why


# ------------------------------------------------------------------------------------------------
# TritonLinear
# ------------------------------------------------------------------------------------------------
def test_gelu_tanh_grad_matches_autograd():
    z = torch.randn(1000, dtype=torch.float64) * 4
    z.requires_grad_(True)
    F.gelu(z, approximate="tanh").sum().backward()
    assert torch.allclose(gelu_tanh_grad(z.detach()).double(), z.grad, rtol=1e-5, atol=1e-6)


def linear_reference(x, weight, bias, activation, grad, dtype):
    """Float64 forward and backward on the dtype-rounded inputs (what the kernel sees)."""
    leaves = [t.detach().to(dtype).double().requires_grad_(True) for t in (x, weight, bias)]
    xd, wd, bd = leaves
    y = reference(xd, wd.t(), bd, activation)
    y.backward(grad.double())
    return y.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("activation", [None, "gelu", "relu"])
def test_triton_linear_autocast_forward_and_backward(activation):
    """Under autocast, fp32 master weights: bf16 output, fp32 gradients, close to float64."""
    lin = nn.Linear(40, 36).to(DEVICE)
    layer = TritonLinear.from_linear(lin, activation=activation)
    x = torch.randn(3, 11, 40, device=DEVICE, requires_grad=True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y = layer(x)
    grad = torch.randn(y.shape, device=DEVICE).to(torch.bfloat16)
    y.backward(grad)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 11, 36)
    assert x.grad.dtype == lin.weight.grad.dtype == lin.bias.grad.dtype == torch.float32
    y_ref, (dx, dw, db) = linear_reference(x, lin.weight, lin.bias, activation, grad, torch.bfloat16)
    assert rel_err(y, y_ref) < 1e-2
    assert rel_err(x.grad, dx) < 1e-2  # bf16 dX (like autocast's nn.Linear), then upcast
    # dW is written in fp32 straight from the fp32 accumulator; the residual is dZ's bf16
    # rounding (GELU/ReLU case) and the reference's: well under 1e-2.
    assert rel_err(lin.weight.grad, dw) < 1e-2
    assert rel_err(lin.bias.grad, db) < 1e-2


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("activation", [None, "gelu", "relu"])
def test_triton_linear_backward_ignores_the_autocast_state(activation, grad_dtype):
    """TritonLinear's Function has no custom_fwd/custom_bwd: its backward takes the dtype from
    what forward saved, so running backward inside an autocast region (the autocast state reaches
    the backward pass there) gives the gradients it gives outside, bit for bit. Only an operation
    on fp32 inputs can come out differently under autocast, hence an fp32 upstream gradient too."""
    torch.manual_seed(0)
    lin = nn.Linear(40, 36).to(DEVICE)
    layer = TritonLinear.from_linear(lin, activation=activation)
    x = torch.randn(3, 11, 40, device=DEVICE, requires_grad=True)
    grad = torch.randn(3, 11, 36, device=DEVICE).to(grad_dtype)
    grads = []
    for inside in (False, True):
        x.grad = lin.weight.grad = lin.bias.grad = None
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            y = layer(x)
            if inside:
                y.backward(grad)
        if not inside:
            y.backward(grad)
        grads.append([t.grad.clone() for t in (x, lin.weight, lin.bias)])
    for outside, inside in zip(*grads):
        assert outside.dtype == inside.dtype == torch.float32
        assert torch.equal(outside, inside)
    assert all(g.abs().sum() > 0 for g in grads[0])  # real gradients, not zeros on both sides


@pytest.mark.parametrize("bias_grad", [True, False])
def test_triton_linear_gelu_backward_sums_the_bias_in_its_own_pass(bias_grad, monkeypatch):
    """With GELU and a bias that needs its gradient, dZ and db come from one pass
    (gelu_backward_bias); a frozen bias takes the plain pass and no db is made."""
    from mpgpt.kernels import gelu
    calls = []
    for name in ("gelu_backward", "gelu_backward_bias"):
        real = getattr(gelu, name)
        monkeypatch.setattr(gelu, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    layer = TritonLinear(24, 40, activation="gelu").to(DEVICE)
    layer.bias.requires_grad_(bias_grad)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y = layer(torch.randn(5, 24, device=DEVICE))
    y.float().sum().backward()
    assert calls == (["gelu_backward_bias"] if bias_grad else ["gelu_backward"])
    assert (layer.bias.grad is not None) == bias_grad and layer.weight.grad is not None


@pytest.mark.parametrize("activation", [None, "gelu"])
def test_triton_linear_gradients_on_another_kernel(activation, monkeypatch):
    """INPUT_GRAD_KERNEL and WEIGHT_GRAD_KERNEL = "tma" put dX and dW on the TMA kernel (counted;
    the interpreter runs it as the grouped kernel) and give the default path's gradients: dW (fp32)
    within fp32 accumulation error, dX (rounded to bf16 once, from sums in another order) within
    bf16's rounding. On a GPU, a layer whose products the kernel cannot read (an odd width: no
    descriptor) falls back to "auto"."""
    from mpgpt.kernels import linear
    kinds = []
    real = mm._matmul_2d
    monkeypatch.setattr(mm, "_matmul_2d", lambda *a, **k: kinds.append(k.get("kernel", "auto")) or real(*a, **k))
    monkeypatch.setattr(importlib.import_module("mpgpt.kernels.ops"), "_matmul_2d", mm._matmul_2d)
    grads = {}
    for choice in ("auto", "tma"):
        monkeypatch.setattr(linear, "INPUT_GRAD_KERNEL", choice)
        monkeypatch.setattr(linear, "WEIGHT_GRAD_KERNEL", choice)
        torch.manual_seed(0)
        lin = nn.Linear(64, 48, device=DEVICE)
        x = torch.randn(3, 32, 64, device=DEVICE, requires_grad=True)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            y = TritonLinear.from_linear(lin, activation=activation)(x)
        kinds.clear()
        y.float().square().sum().backward()
        assert kinds == [choice, choice], kinds  # dX, then dW
        grads[choice] = (x.grad, lin.weight.grad, lin.bias.grad)
    (dx, dw, db), (dx_sk, dw_sk, db_sk) = grads["auto"], grads["tma"]
    assert rel_err(dw_sk, dw.double()) < 1e-5 and rel_err(dx_sk, dx.double()) < TOL[torch.bfloat16]
    assert torch.equal(db_sk, db)  # not a matmul: the same kernel either way
    from mpgpt.kernels import ops
    with pytest.raises(ValueError, match="kernel must be one of"):  # a typo is an error, not a fallback
        ops.matmul_impl(rand(32, 48), rand(48, 16), torch.float32, "t-m-a")
    if env.interpreting() or env.capability(torch.device(DEVICE)) < (9, 0):
        return  # only Hopper runs the TMA kernel, and refuses what it cannot read
    lin = nn.Linear(36, 20, device=DEVICE)  # 36 bf16 inputs: 72-byte rows, no descriptor
    x = torch.randn(16, 36, device=DEVICE, requires_grad=True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y = TritonLinear.from_linear(lin)(x)
    kinds.clear()
    with pytest.warns(UserWarning, match="kernel='tma' cannot run this .* running kernel='auto' instead"):
        y.float().sum().backward()
    assert kinds == ["auto", "auto"] and torch.isfinite(lin.weight.grad).all()


def test_triton_linear_operators_pass_torch_opcheck():
    """torch.library.opcheck on TritonLinear's three custom operators: schema, fake (meta)
    implementation against the real one, no aliasing."""
    from mpgpt.kernels import ops
    x, w, b = rand(10, 32), rand(48, 32), rand(48)
    torch.library.opcheck(ops.linear_forward, (x, w, b, "gelu", True))
    torch.library.opcheck(ops.linear_forward, (x, w, None, None, False))
    torch.library.opcheck(ops.matmul, (x, w.t(), torch.float32))
    torch.library.opcheck(ops.matmul, (rand(64, 32).t(), rand(64, 48), torch.float32, "tma"))
    g, z = rand(10, 48), rand(10, 48)
    torch.library.opcheck(ops.gelu_backward, (g, z, True))
    torch.library.opcheck(ops.gelu_backward, (g, z, False))


def test_operators_have_no_python_layer_at_the_autograd_key():
    """library.py registers the per-layer operators with torch.library.Library: the dispatcher
    calls our function directly. torch.library.custom_op would put a Python autograd step in front
    of every call (about 15 us of host time a call on an H100 machine, 100-200 calls a compiled
    step). Every per-layer operator the package uses must be registered that way: a kernel for
    CPU and CUDA alike (CompositeExplicitAutograd), none at the Autograd key, and a fake."""
    import mpgpt.fast.layernorm  # noqa: F401  (each module registers its operators on import)
    import mpgpt.fast.mlp  # noqa: F401
    import mpgpt.fast.qkv  # noqa: F401
    from mpgpt.kernels import library
    from torch._subclasses.fake_tensor import FakeTensorMode

    expected = {"linear_forward", "matmul", "gelu_backward", "gelu_linear", "gelu_backward_bias",
                "product_gelu_backward", "layer_norm_backward", "merge_heads_bias"}
    assert expected <= set(library.DEFINED)
    for name in library.DEFINED:
        qualified = f"mpgpt::{name}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeExplicitAutograd"), name
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "Autograd"), name
    with FakeTensorMode():  # the fake gives the shapes without running a kernel
        a, b = torch.empty(10, 32), torch.empty(32, 48)
        out = torch.ops.mpgpt.matmul.default(a, b, torch.bfloat16, "auto")
    assert out.shape == (10, 48) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("activation,use_bias,grad_kernel", [("gelu", True, "auto"), (None, False, "auto"),
                                                             ("gelu", "frozen", "auto"), ("gelu", True, "tma")])
def test_triton_linear_compiles_in_one_graph(activation, use_bias, grad_kernel, monkeypatch):
    """torch.compile traces TritonLinear under autocast without a graph break (its kernels are
    custom operators, ops.py) and the compiled forward and backward give exactly eager's
    numbers, also with the gradient products on another kernel (decided inside the operator,
    where the tensors are real). Backend aot_eager: Dynamo and AOTAutograd trace as they do for
    inductor, then the graph runs op by op, so this also runs on a CPU."""
    from mpgpt.kernels import linear
    monkeypatch.setattr(linear, "INPUT_GRAD_KERNEL", grad_kernel)
    monkeypatch.setattr(linear, "WEIGHT_GRAD_KERNEL", grad_kernel)
    torch.manual_seed(0)
    layer = TritonLinear(64, 96, bias=bool(use_bias), activation=activation).to(DEVICE)
    if use_bias == "frozen":  # GELU's backward without the bias sums
        layer.bias.requires_grad_(False)
    x = torch.randn(4, 8, 64, device=DEVICE, requires_grad=True)

    def loss_fn(x):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            return layer(x).float().square().sum()

    explained = torch._dynamo.explain(loss_fn)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    grads = []
    for fn in (loss_fn, torch.compile(loss_fn, backend="aot_eager", fullgraph=True)):
        x.grad = None
        layer.zero_grad(set_to_none=True)
        loss = fn(x)
        loss.backward()
        grads.append([loss.detach(), x.grad] + [p.grad for p in layer.parameters() if p.requires_grad])
    for eager, compiled in zip(*grads):
        assert torch.equal(eager, compiled)


@pytest.mark.parametrize("activation,use_bias", [("gelu", True), (None, False)])
def test_triton_linear_lowers_through_inductor(activation, use_bias):
    """torch.compile's default backend, Inductor, lowers each custom operator to a call of
    FallbackKernel.create(kernel, *args, **kwargs): an operator argument named `kernel` made that
    fail ("got multiple values for argument 'kernel'"), so the model's Triton rows did not compile.
    Compiled by Inductor, TritonLinear must run and match eager: the custom operators run the same
    kernels, and only the fp32 square-and-sum around them may be fused and summed in another
    order (768 terms of similar size: a relative 1e-5 is far above fp32's rounding of the sum)."""
    torch.manual_seed(0)
    layer = TritonLinear(64, 96, bias=use_bias, activation=activation).to(DEVICE)
    x = torch.randn(8, 64, device=DEVICE, requires_grad=True)

    def loss_fn(x):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            return layer(x).float().square().sum()

    torch._dynamo.reset()
    results = []
    for fn in (loss_fn, torch.compile(loss_fn, fullgraph=True)):
        x.grad = None
        layer.zero_grad(set_to_none=True)
        loss = fn(x)
        loss.backward()
        results.append([loss.detach(), x.grad] + [p.grad for p in layer.parameters()])
    torch._dynamo.reset()
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def test_triton_linear_bf16_parameters_without_autocast():
    layer = TritonLinear(24, 20, activation="gelu").to(DEVICE, torch.bfloat16)
    x = rand(7, 24).requires_grad_(True)
    y = layer(x)
    grad = rand(7, 20)
    y.backward(grad)
    assert layer.weight.grad.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    y_ref, (dx, dw, db) = linear_reference(x, layer.weight, layer.bias, "gelu", grad, torch.bfloat16)
    for got, ref in ((y, y_ref), (x.grad, dx), (layer.weight.grad, dw), (layer.bias.grad, db)):
        assert rel_err(got, ref) < 1e-2


def test_triton_linear_fp32_without_autocast_is_nn_linear():
    """An fp32 model outside autocast computes exactly what nn.Linear + GELU computes."""
    lin = nn.Linear(16, 12).to(DEVICE)
    layer = TritonLinear.from_linear(lin, activation="gelu")
    x = torch.randn(5, 16, device=DEVICE)
    assert torch.equal(layer(x), F.gelu(lin(x), approximate="tanh"))


def test_gradients_scale_linearly_for_loss_scaling():
    """Loss scaling multiplies every gradient by the (power-of-two) scale, exactly."""
    lin = nn.Linear(16, 16).to(DEVICE)
    layer = TritonLinear.from_linear(lin, activation="relu")
    x = torch.randn(9, 16, device=DEVICE)
    grads = []
    for scale in (1.0, 1024.0):
        lin.zero_grad()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = layer(x).float().pow(2).mean()
        (loss * scale).backward()
        grads.append(lin.weight.grad.clone())
    assert torch.equal(grads[1], grads[0] * 1024.0)


def test_state_dict_and_shared_parameters_match_nn_linear():
    lin = nn.Linear(10, 6)
    layer = TritonLinear.from_linear(lin, activation="gelu")
    assert layer.weight is lin.weight and layer.bias is lin.bias
    assert list(layer.state_dict()) == list(lin.state_dict()) == ["weight", "bias"]
    back = layer.to_linear()
    assert isinstance(back, nn.Linear) and back.weight is lin.weight and back.bias is lin.bias
    fresh = TritonLinear(10, 6)
    fresh.load_state_dict(lin.state_dict())  # loads without key or shape errors
    assert torch.equal(fresh.weight, lin.weight)
    assert fresh.weight.shape == (6, 10)
    no_bias = TritonLinear.from_linear(nn.Linear(4, 3, bias=False))
    assert no_bias.bias is None and list(no_bias.state_dict()) == ["weight"]
    assert no_bias.to_linear().bias is None


def test_init_matches_nn_linear_distribution():
    torch.manual_seed(1234)
    ref = nn.Linear(64, 32)
    torch.manual_seed(1234)
    ours = TritonLinear(64, 32)
    assert torch.equal(ours.weight, ref.weight) and torch.equal(ours.bias, ref.bias)


def test_ws_kernel_only_where_it_can_run():
    """The warp-specialised Gluon kernel (ws.py) is taken only on sm_90, for the forward
    layout a @ w.t() with aligned rows and no activation; never on a CPU or in the interpreter,
    where matmul runs the grouped kernel whatever `kernel` says (as for "tma")."""
    a, w, bias = rand(64, 48), rand(40, 48), rand(40)
    c = torch.empty(64, 40, dtype=torch.bfloat16, device=DEVICE)
    on_sm90 = DEVICE == "cuda" and env.capability(a.device) == (9, 0) and not env.interpreting()
    assert ws.ws_eligible(a, w.t(), c, bias, None, None) == (on_sm90 and ws.WS_IMPORT_ERROR is None)
    # The operands' half of the decision, on any device:
    fit = ws.ws_operands_fit
    assert fit(a, w.t(), c, bias, None, None) and fit(a.half(), w.half().t(), c.half(), None, None, None)
    assert not fit(a, w.t(), c, None, "gelu", None)                    # no activation epilogue
    assert not fit(a, w.t(), c, None, None, c)                         # no saved pre-activation
    assert fit(a, w.t().contiguous(), c, None, None, None)             # a row-major B, as dX = dY @ W reads W
    assert ws.b_row_major(w.t()) is False and ws.b_row_major(w.t().contiguous()) is True
    assert not fit(a, rand(96, 80)[::2, ::2], c, None, None, None)     # B with no unit stride
    assert ws.b_row_major(rand(96, 80)[::2, ::2]) is None
    assert not fit(a, w.t(), c.float(), None, None, None)              # output in a's dtype
    assert not fit(a.float(), w.float().t(), c.float(), None, None, None)  # bf16/fp16 only
    assert not fit(rand(64, 40)[:, :36], rand(40, 36).t(), c, None, None, None)  # 72-byte rows: no TMA
    assert not fit(a[:8], w.t(), c[:8], None, None, None)              # M < 16
    if DEVICE == "cpu":
        assert rel_err(matmul(a, w.t(), kernel="ws"), reference(a, w.t())) < TOL[torch.bfloat16]


def test_ws_preferred_where_its_tiles_fill_the_waves():
    """kernel="auto" takes the 128 x 192-tile kernel unless the TMA kernel's 128 x 256 tiles fill
    the waves of 132 SMs clearly better: at GPT-2's N = 768 outputs 384 tiles (2.9 waves) beat
    288 (2.2, run as 3); at 4096^3, 704 tiles (5.3 waves) lose to 512 (3.9)."""
    for M, N in [(12288, 768), (12288, 2304), (12288, 3072), (12288, 50304), (8192, 8192)]:
        assert ws.ws_preferred(M, N, 132), (M, N)
    assert not ws.ws_preferred(4096, 4096, 132)
    assert ws._wave_efficiency(384, 132) == 384 / 396 and ws._wave_efficiency(288, 132) == 288 / 396


def test_balanced_programs_keep_the_waves_and_even_out_the_tiles():
    """The persistent kernel's program count: GPT-2's N = 768 products (384 tiles) on 132 SMs get
    128 programs of 3 tiles, not 120 of 3 and 12 of 2; fewer tiles than SMs get one program each;
    and for every count, no program runs more tiles than with one program per SM, while one
    program fewer would have to."""
    assert ws.balanced_programs(384, 132) == 128
    assert ws.balanced_programs(96, 132) == 96 and ws.balanced_programs(132, 132) == 132
    assert ws.balanced_programs(25152, 132) == 132          # lm_head: 191 waves either way
    for sms in (1, 7, 40, 132):
        for tiles in range(1, 1000):
            p = ws.balanced_programs(tiles, sms)
            most = -(-tiles // p)
            assert 1 <= p <= min(tiles, sms) and most == -(-tiles // sms), (tiles, sms)
            assert p == 1 or -(-tiles // (p - 1)) > most, (tiles, sms)
    with pytest.raises(ValueError, match="positive"):
        ws.balanced_programs(0, 132)


def test_split_for_and_split_preferred_follow_the_fitted_cost_model():
    """launch_split's slices of K (split_for, from split_cost): attn.c_proj's dW (24 tiles of
    128 x 192, 192 K-steps) takes 5 slices, 120 units in one wave of 132; the MLP's (96 tiles)
    none, since summing 5 planes of 768 x 3072 costs more than the 36 idle multiprocessors (as
    measured); no slice is ever empty (at most one per K-step); the output layer's 1572 tiles
    are not split either."""
    assert ws.split_for(768, 768, 12288, 132) == 5
    assert ws.split_for(768, 3072, 12288, 132) == ws.split_for(3072, 768, 12288, 132) == 1
    assert ws.split_for(50304, 768, 12288, 132) == 1
    for k_steps in range(1, 40):  # one tile, a short K: never more slices than K-steps
        assert 1 <= ws.split_for(128, 128, 64 * k_steps, 132) <= k_steps
    assert ws.split_for(128, 128, 64 * 200, 132) > 1  # one tile, a long K: sliced
    for M, N, K in [(768, 768, 12288), (768, 3072, 12288), (2304, 768, 12288), (300, 200, 5000)]:
        best = ws.split_for(M, N, K, 132)
        costs = {s: ws.split_cost(M, N, K, s, 132) for s in range(1, 17)}
        assert costs[best] == min(costs.values()), (M, N, K)
    # Splitting costs the planes' sum: for an output that fills the GPU on its own, one slice.
    assert ws.split_cost(12288, 768, 12288, 2, 132) > ws.split_cost(12288, 768, 12288, 1, 132)
    # Against the TMA kernel unsplit (tma_cost): the MLP's and attn.c_proj's dW go to launch_split;
    # c_attn's (108 tiles of 128 x 128, one wave) and the output layer's stay on the TMA kernel.
    assert ws.split_preferred(768, 768, 12288, 132) and ws.split_preferred(3072, 768, 12288, 132)
    assert ws.split_preferred(768, 3072, 12288, 132)
    assert not ws.split_preferred(2304, 768, 12288, 132) and not ws.split_preferred(50304, 768, 12288, 132)
    # The model against the H100's measurements it was fitted to (µs): within 20 %.
    for (M, N, split), measured in {(768, 768, 5): 41.0, (768, 768, 2): 57.5, (768, 3072, 1): 101.0,
                                    (768, 3072, 4): 114.1, (2304, 768, 3): 91.3}.items():
        assert abs(ws.split_cost(M, N, 12288, split, 132) / measured - 1) < 0.2, (M, N, split)
    assert abs(ws.tma_cost(2304, 768, 12288, 132) / 77.2 - 1) < 0.2
    # The narrow tiles against their measurements: the MLP's dW unsplit on 120 of them, 97.3-98.3 µs.
    for M, N in ((768, 3072), (3072, 768)):
        assert abs(ws.split_cost(M, N, 12288, 1, 132, ws.NARROW_EXTRA_N) / 97.8 - 1) < 0.2, (M, N)


def test_split_tile_narrows_only_unsplit_products_that_fill_more_of_the_gpu():
    """split_tile: the MLP's weight gradients (96 wide tiles, one wave on 132 multiprocessors, or
    120 narrow ones) take 128 x 160 tiles, measured 2 % faster; a sliced product and the output
    layer's (1572 wide tiles, 12 waves, against 15 narrow waves) keep 128 x 192; and the choice
    is the cheaper of the two by split_cost."""
    assert ws.split_tile(768, 3072, 12288, 1, 132) == ws.split_tile(3072, 768, 12288, 1, 132) == ws.NARROW_EXTRA_N
    assert ws.split_tile(768, 768, 12288, 5, 132) == ws.split_tile(768, 3072, 12288, 2, 132) == ws.EXTRA_N
    assert ws.split_tile(50304, 768, 12288, 1, 132) == ws.EXTRA_N
    for M, N, K in [(768, 3072, 12288), (50304, 768, 12288), (296, 200, 5000), (4096, 4096, 4096)]:
        cheaper = min((ws.EXTRA_N, ws.NARROW_EXTRA_N), key=lambda e: ws.split_cost(M, N, K, 1, 132, e))
        assert ws.split_tile(M, N, K, 1, 132) == cheaper, (M, N, K)
    # The narrow tile is launch_split's alone: the other epilogues keep their shared-memory plan.
    a = torch.empty(256, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="launch_split's products only"):
        ws.ws_launch(a, a, a, None, 132, extra_n=ws.NARROW_EXTRA_N)


def test_split_operands_fit_only_the_weight_gradient_layout():
    """launch_split takes A transposed (dY.t()), B row-major or as w.t(), an fp32 or 16-bit output,
    and no epilogue; a row-major A belongs to the plain kernel."""
    g, x, w = rand(256, 64), rand(256, 96), rand(96, 256)
    c32 = torch.empty(64, 96, device=DEVICE)
    fit = ws.split_operands_fit
    assert ws.a_transposed(g.t()) is True and ws.a_transposed(g) is False
    assert ws.a_transposed(rand(96, 80)[::2, ::2]) is None
    assert fit(g.t(), x, c32, None, None, None) and fit(g.t(), w.t(), c32.bfloat16(), None, None, None)
    assert not fit(g.t().contiguous(), x, c32, None, None, None)       # A row-major: the plain kernel
    assert not fit(g.t(), x, c32, rand(96), None, None)                # no bias
    assert not fit(g.t(), x, c32, None, "gelu", None)                  # no activation
    assert not fit(g.t(), x, c32.half(), None, None, None)             # output fp32 or a's dtype
    assert not fit(g.t()[:8], x, c32[:8], None, None, None)            # M < 16


def test_group_rows_narrow_outputs_sweep_four_tile_rows():
    """Outputs at most four 192-wide tiles across (GPT-2's N = 768) take GROUP_M 4; wider ones,
    the output layer among them, keep the module's GROUP_M."""
    assert ws.group_rows(768) == ws.group_rows(700) == 4
    assert ws.group_rows(769) == ws.group_rows(3072) == ws.group_rows(50304) == ws.GROUP_M == 8
    # counted in the tiles launched: 768 is five narrow (160-wide) tiles across
    assert ws.group_rows(768, ws.NARROW_EXTRA_N) == ws.GROUP_M and ws.group_rows(640, ws.NARROW_EXTRA_N) == 4


def test_two_mma_partitions_only_for_plain_products_with_a_bias(monkeypatch):
    """The ping-pong schedule (two MMA partitions taking tiles in turn) where it measured faster:
    a plain product of whole tiles with a bias. Without a bias, with a GELU epilogue (which has an
    epilogue partition of its own) or with K in slices, one partition; PINGPONG_ROLES = 1 turns
    it off."""
    assert ws.mma_roles(0, 1, True, 2304) == ws.mma_roles(0, 1, True, 3072) == 2
    assert ws.mma_roles(0, 1, False, 2304) == 1
    assert ws.mma_roles(1, 1, True, 3072) == ws.mma_roles(2, 1, True, 768) == 1
    assert ws.mma_roles(3, 1, False, 3072) == ws.mma_roles(3, 5, False, 768) == 1
    # An N = 768 output takes the sliced store on one partition, bias or not, unless it is off.
    assert ws.mma_roles(0, 1, True, 768) == 1
    monkeypatch.setattr(ws, "SLICED_STORE", False)
    assert ws.mma_roles(0, 1, True, 768) == 2
    monkeypatch.setattr(ws, "PINGPONG_ROLES", 1)
    assert ws.mma_roles(0, 1, True, 2304) == 1


def test_ws_launch_passes_the_schedule_its_rules_choose(monkeypatch):
    """ws_launch's host side, with the kernel replaced by a recorder (it runs only on sm_90): the
    sliced store with the deeper ring on one partition for an N = 768 output, bias or not; two
    partitions and four stages for a wide output with a bias; the weight gradient's units with
    five stages, on 128 x 160 tiles when asked (the descriptors' boxes set the tile); programs
    balanced over the units. Descriptors of CPU tensors: only shapes and strides matter here."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    calls = []

    class Recorder:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                calls.append((grid, args, kwargs))
                return "compiled"
            return run

    monkeypatch.setattr(ws, "matmul_ws_kernel", Recorder(), raising=False)
    bf = torch.bfloat16
    x, bias = torch.empty(1024, 256, dtype=bf), torch.empty(768, dtype=bf)
    for with_bias in (False, True):
        ws.ws_launch(x, torch.empty(768, 256, dtype=bf).t(), torch.empty(1024, 768, dtype=bf),
                     bias if with_bias else None, 132)
        grid, args, kw = calls[-1]
        assert kw["SLICED"] and kw["STAGES"] == ws.DEEP_STAGES and kw["ROLES"] == 1, kw
        assert kw["num_warps"] == ws.NUM_WARPS and kw["GROUP_M"] == 4 and kw["HAS_BIAS"] == with_bias, kw
        assert grid == (32,)  # 8 x 4 tiles of 128 x 192, fewer than 132 multiprocessors: one each
    ws.ws_launch(x, torch.empty(2304, 256, dtype=bf).t(), torch.empty(1024, 2304, dtype=bf),
                 torch.empty(2304, dtype=bf), 132)
    grid, args, kw = calls[-1]
    assert not kw["SLICED"] and kw["STAGES"] == ws.STAGES and kw["ROLES"] == ws.PINGPONG_ROLES, kw
    assert kw["num_warps"] == ws.NUM_WARPS // ws.PINGPONG_ROLES and grid == (96,), (grid, kw)
    g, xs = torch.empty(4096, 768, dtype=bf), torch.empty(4096, 3072, dtype=bf)  # dW = g.t() @ xs
    for extra_n in (ws.EXTRA_N, ws.NARROW_EXTRA_N):
        part = torch.empty(1, 768, 3072)
        ws.ws_launch(g.t(), xs, g, None, 132, epilogue=3, part=part, split_k=1, extra_n=extra_n)  # g: C's stand-in
        grid, args, kw = calls[-1]
        assert kw["A_T"] and kw["B_ROW_MAJOR"] and kw["STAGES"] == ws.DEEP_STAGES and not kw["SLICED"], kw
        assert [d.block_shape for d in args[:3]] == [[ws.BLOCK_K, ws.BLOCK_M], [ws.BLOCK_K, ws.BLOCK_N],
                                                     [ws.BLOCK_K, extra_n]]
        assert grid == (6 * -(-3072 // (ws.BLOCK_N + extra_n)),)  # 96 wide tiles or 120 narrow ones
    ws.ws_launch(g.t(), xs, g, None, 132, epilogue=3, part=torch.empty(4, 768, 3072), split_k=4)
    assert calls[-1][0] == (128,) and calls[-1][2]["SPLIT_K"] == 4  # 384 units: three waves of 128 programs
    assert len(calls) == 6


def test_sliced_store_only_for_plain_unsplit_narrow_outputs(monkeypatch):
    """The sliced store (one staging buffer, a fifth load stage) where it measured faster: plain
    products whose output is at most four 192-wide tiles across (GPT-2's N = 768: attn.c_proj,
    mlp.c_proj, the input gradients of c_fc and attn.c_proj); not the wide outputs (c_attn's
    2304, c_fc's 3072, the output layer's 50304), nor the GELU epilogues or sliced K."""
    assert ws.sliced_store(0, 1, 768) and ws.sliced_store(0, 1, 200) and ws.sliced_store(0, 1, 16)
    assert not ws.sliced_store(0, 1, 769) and not ws.sliced_store(0, 1, 2304) and not ws.sliced_store(0, 1, 50304)
    assert not ws.sliced_store(1, 1, 768) and not ws.sliced_store(2, 1, 768) and not ws.sliced_store(3, 1, 768)
    assert not ws.sliced_store(0, 2, 768)
    # The same outputs group four tile rows (group_rows): one notion of a narrow output.
    for N in (200, 768, 769, 3072):
        assert ws.sliced_store(0, 1, N) == (ws.group_rows(N) == 4), N
    monkeypatch.setattr(ws, "SLICED_STORE", False)
    assert not ws.sliced_store(0, 1, 768)
    # Shared memory: five 40 KiB stages and one 128 x 64 staging buffer fit in a block's 227 KiB;
    # with the 128 x 128 buffer as well, they would not.
    stage = (ws.BLOCK_M + ws.BLOCK_N + ws.EXTRA_N) * ws.BLOCK_K * 2
    limit = 227 * 1024
    assert ws.DEEP_STAGES * stage + ws.BLOCK_M * ws.EXTRA_N * 2 <= limit
    assert ws.DEEP_STAGES * stage + ws.BLOCK_M * (ws.BLOCK_N + ws.EXTRA_N) * 2 > limit


# ------------------------------------------------------------------------------------------------
# plan(): which kernel matmul runs, and why (CPU: the GPU generation faked through env)
# ------------------------------------------------------------------------------------------------
def _forward(M, K, N, dtype=torch.bfloat16):
    """x (M, K) and b = w.t() for a row-major (N, K) weight: nn.Linear's forward layout."""
    return fake_cuda(M, K, dtype=dtype), fake_cuda(N, K, dtype=dtype).t()


def _weight_grad(tokens, fout, fin):
    """dW = dY.t() @ X: A = dY.t() column-major (fout, tokens), B = X (tokens, fin) row-major."""
    return fake_cuda(tokens, fout).t(), fake_cuda(tokens, fin)


def test_plan_in_the_interpreter_is_the_grouped_kernel():
    if not env.interpreting():
        pytest.skip("runs where Triton's interpreter is on (no GPU)")
    a, b = rand(40, 48), rand(48, 36)
    for kernel in ("auto", "grouped", "tma", "ws"):
        p = plan(a, b, kernel=kernel)
        assert (p.kernel, p.split_k, p.interpreted) == ("grouped", 1, True), (kernel, p)
        assert "interpreter" in p.reason
    assert plan(a, b, split_k=3) == kernels.Plan("grouped", 3, True, plan(a, b, split_k=3).reason)
    assert plan(a, b, split_k=3).split_k == 3
    with pytest.raises(dataclasses_frozen_error()):
        plan(a, b).kernel = "tma"  # a Plan is frozen


def dataclasses_frozen_error():
    import dataclasses
    return dataclasses.FrozenInstanceError


@pytest.mark.parametrize("cc,dtype,name", [((7, 5), torch.float16, "T4"), ((8, 0), torch.bfloat16, "A100"),
                                           ((8, 9), torch.bfloat16, "L4")])
def test_plan_below_sm90_is_always_the_grouped_kernel(fake_gpu, cc, dtype, name):
    """Below sm_90 neither Hopper kernel is ever chosen, in any layout the model uses; the weight
    gradient still splits K; forcing a Hopper kernel is a clear error. (A T4 takes fp16 only.)"""
    fake_gpu(cc)
    where = f"sm_{cc[0]}{cc[1]}"
    x, wt = _forward(12288, 768, 768, dtype)
    bias = fake_cuda(768, dtype=dtype)
    for args in ((x, wt), (x, wt, bias), (x, wt, bias, "gelu"), (fake_cuda(12288, 768, dtype=dtype),
                                                                  fake_cuda(768, 3072, dtype=dtype))):
        p = plan(*args)
        assert (p.kernel, p.split_k, p.interpreted) == ("grouped", 1, False), (name, p)
        assert where in p.reason and "need sm_90" in p.reason
    g_t, x_in = fake_cuda(12288, 768, dtype=dtype).t(), fake_cuda(12288, 768, dtype=dtype)
    assert (plan(g_t, x_in).kernel, plan(g_t, x_in).split_k) == ("grouped", 8)
    for kernel, match in (("tma", "TMA kernel needs"), ("ws", "warp-specialised kernel needs")):
        with pytest.raises(ValueError, match=match):
            plan(x, wt, kernel=kernel)
    assert plan(x, wt, kernel="grouped").kernel == "grouped"


def test_plan_on_sm90_takes_the_tma_kernel_where_its_layout_fits(fake_gpu):
    """Hopper: the TMA kernel for every aligned layout a linear layer uses (forward with an
    activation, dX with B row-major, dW with A transposed when split-K would be 2 or 3); the
    grouped kernel where a descriptor cannot address an operand."""
    fake_gpu((9, 0))
    x, wt = _forward(12288, 768, 3072)
    bias = fake_cuda(3072)
    p = plan(x, wt, bias, "gelu")
    assert (p.kernel, p.split_k) == ("tma", 1) and "forward layout" in p.reason, p
    # dX = dY @ W (B row-major) into fp32, which the ws kernel does not write
    p = plan(fake_cuda(12288, 3072), fake_cuda(3072, 768), out=FakeCuda((12288, 768), dtype=torch.float32))
    assert (p.kernel, p.split_k) == ("tma", 1) and "row-major" in p.reason, p
    p = plan(*_weight_grad(12288, 2304, 768))  # c_attn's dW: the TMA kernel's 108 tiles fill a wave
    assert grouped.auto_split_k(2304, 768, 12288, 132) == 3
    assert (p.kernel, p.split_k) == ("tma", 1) and "split-K 3" in p.reason, p
    # dW for the output layer (1572 ws tiles: no need to split K): the TMA kernel
    p = plan(*_weight_grad(12288, 50304, 768))
    assert (p.kernel, p.split_k) == ("tma", 1) and "transposed" in p.reason, p
    p = plan(*_weight_grad(12288, 2304, 768), kernel="tma")  # forced: unsplit
    assert (p.kernel, p.split_k) == ("tma", 1), p
    assert grouped.auto_split_k(2304, 768, 12288, 132) == 3
    p = plan(*_weight_grad(12288, 2304, 768), kernel="grouped")  # forced grouped: split K as chosen
    assert (p.kernel, p.split_k) == ("grouped", 3), p
    # An fp32 output (dW for fp32 master weights) is fine for TMA loads, not for the ws kernel.
    p = plan(x, wt, out=FakeCuda((12288, 3072), dtype=torch.float32))
    assert p.kernel == "tma", p
    # Operands a descriptor cannot address: a base 2 bytes off, 72-byte rows, M < 16.
    for a, b in ((fake_cuda(12288, 768, ptr=2), wt), (fake_cuda(64, 36), fake_cuda(40, 36).t()),
                 (fake_cuda(8, 768), wt)):
        p = plan(a, b)
        assert (p.kernel, p.split_k) == ("grouped", 1) and "cannot address" in p.reason, (a.shape, p)
        with pytest.raises(ValueError, match="TMA kernel needs"):
            plan(a, b, kernel="tma")
    # Forced kernels where they can run.
    assert plan(x, wt, bias, "gelu", kernel="grouped").kernel == "grouped"
    assert plan(x, wt, bias, "gelu", kernel="tma").kernel == "tma"


def test_plan_on_sm90_splits_k_for_a_weight_gradient_with_few_tiles(fake_gpu, monkeypatch):
    """attn.c_proj's dW (768 x 768 output, K = 12288 tokens): with Gluon, the warp-specialised
    kernel in 5 slices of K. Without it: 36 tiles of 128 x 128, split-K 8 >= 4, so the grouped
    kernel, which can split K; forcing TMA runs it unsplit; an explicit split is kept."""
    fake_gpu((9, 0))
    a, b = _weight_grad(12288, 768, 768)
    if ws.WS_IMPORT_ERROR is None:  # with Gluon, the warp-specialised kernel splits K itself
        p = plan(a, b)
        assert (p.kernel, p.split_k) == ("ws", 5) and "5 slices" in p.reason and "split_preferred" in p.reason, p
        assert (plan(a, b, kernel="ws").kernel, plan(a, b, kernel="ws", split_k=3).split_k) == ("ws", 3)
        with pytest.raises(ValueError, match="split_k must be between 1 and the 192 K-steps"):
            plan(a, b, kernel="ws", split_k=193)  # an empty slice: refused by plan, as by matmul
        with pytest.raises(ValueError, match="transposed A"):
            plan(*_forward(12288, 768, 768), kernel="ws", split_k=2)  # a row-major A: ws does not split it
    monkeypatch.setattr(ws, "split_eligible", lambda *args: False)  # as on a Triton without Gluon
    p = plan(a, b)
    assert (p.kernel, p.split_k) == ("grouped", 8) and "split-K 8" in p.reason, p
    assert (plan(a, b, kernel="grouped").kernel, plan(a, b, kernel="grouped").split_k) == ("grouped", 8)
    assert (plan(a, b, kernel="tma").kernel, plan(a, b, kernel="tma").split_k) == ("tma", 1)
    assert (plan(a, b, split_k=1).kernel, plan(a, b, split_k=4).split_k) == ("tma", 4)
    assert plan(a, b, split_k=4).kernel == "grouped"
    # With fewer SMs the same product needs fewer slices: 2 * 16 / 36 tiles -> no split, TMA.
    fake_gpu((9, 0), sms=16)
    assert (plan(a, b).kernel, plan(a, b).split_k) == ("tma", 1)
    # An epilogue never splits.
    fake_gpu((9, 0))
    assert plan(a, b, fake_cuda(768)).split_k == 1
    with pytest.raises(ValueError, match="no bias"):
        plan(a, b, fake_cuda(768), split_k=2)
    with pytest.raises(ValueError, match="grouped kernel"):
        plan(a, b, split_k=2, kernel="tma")


@pytest.mark.skipif(ws.WS_IMPORT_ERROR is not None, reason="this Triton has no Gluon")
def test_plan_on_sm90_takes_the_ws_kernel_where_preferred(fake_gpu):
    """sm_90, forward layout, no activation: the warp-specialised kernel where its 128 x 192 tiles
    fill the waves (every GPT-2 shape, 8192^3), the TMA kernel where they do not (4096^3); never
    with an activation, a saved pre-activation, a B it cannot address, an fp32 output or on sm_100."""
    fake_gpu((9, 0))
    for M, K, N in [(12288, 768, 768), (12288, 3072, 768), (12288, 768, 2304), (8192, 8192, 8192)]:
        x, wt = _forward(M, K, N)
        for bias in (None, fake_cuda(N)):
            p = plan(x, wt, bias)
            assert (p.kernel, p.split_k, p.interpreted) == ("ws", 1, False), (M, K, N, p)
            assert "ws_preferred" in p.reason and "sm_90" in p.reason
    x, wt = _forward(12288, 768, 768)
    assert plan(fake_cuda(2, 6144, 768), wt).kernel == "ws"  # batch dimensions flattened
    p = plan(*_forward(4096, 4096, 4096))
    assert p.kernel == "tma" and "not ws_preferred" in p.reason, p
    assert plan(*_forward(4096, 4096, 4096), kernel="ws").kernel == "ws"  # forced: eligible is enough
    assert plan(x, wt, fake_cuda(768), "relu").kernel == "tma"
    assert plan(x, wt, out=FakeCuda((12288, 768), dtype=torch.float32)).kernel == "tma"
    # dX = dY @ W reads W row-major: the ws kernel takes it too, by the same wave rule.
    dy, w = fake_cuda(12288, 3072), fake_cuda(3072, 768)
    p = plan(dy, w)
    assert p.kernel == "ws" and "row-major" in p.reason and "(ws_preferred)" in p.reason, p
    assert plan(dy, w, kernel="ws").kernel == "ws"
    for args, kw in (((x, wt, fake_cuda(768), "gelu"), {}), ((fake_cuda(12288, 768), FakeCuda((768, 764), (764, 1))), {}),
                     ((x, wt), {"out": FakeCuda((12288, 768), dtype=torch.float32)})):
        with pytest.raises(ValueError, match="warp-specialised kernel needs"):
            plan(*args, kernel="ws", **kw)
    with pytest.raises(ValueError, match="grouped kernel"):
        plan(x, wt, kernel="ws", split_k=2)
    fake_gpu((10, 0))  # Blackwell has no wgmma: TMA, never ws
    assert plan(x, wt).kernel == "tma"
    with pytest.raises(ValueError, match="warp-specialised kernel needs"):
        plan(x, wt, kernel="ws")


def test_matmul_runs_what_plan_says(fake_gpu, monkeypatch):
    """matmul's dispatch follows plan(): with the three kernels' launchers replaced by recorders,
    every call launches exactly the kernel and split-K that plan() returns for the same
    arguments, and a second call with the same signature replays the remembered launch."""
    calls = []

    def recorder(name):
        def run(a, b, c, *args, split_k=1, **kwargs):
            calls.append((name, split_k))
            return lambda *tensors: calls.append((name, "replay"))
        return run

    for module in (grouped, tma, ws):
        monkeypatch.setattr(module, "launch", recorder(module.__name__.rsplit(".", 1)[1]))
    monkeypatch.setattr(ws, "launch_split", recorder("ws_split"))
    monkeypatch.setattr(launch, "CACHE", {})
    monkeypatch.delenv("MPGPT_LEAN_LAUNCH", raising=False)
    for cc in ((8, 0), (9, 0)):
        fake_gpu(cc)
        x, wt = _forward(12288, 768, 768)
        cases = [((x, wt), {}), ((x, wt, fake_cuda(768), "gelu"), {}), (_weight_grad(12288, 768, 768), {}),
                 (_weight_grad(12288, 2304, 768), {}), (_weight_grad(12288, 3072, 768), {}),
                 ((fake_cuda(12288, 768, ptr=2), wt), {}),
                 ((x, wt), {"kernel": "grouped"}), ((fake_cuda(300, 200), fake_cuda(200, 100)), {"split_k": 3})]
        for args, kw in cases:
            expected = plan(*args, **kw)
            out = FakeCuda((args[0].shape[0], args[1].shape[1]))
            calls.clear()
            matmul(*args, out=out, **kw)
            # a transposed A on the ws kernel goes through launch_split (K in slices), never ws.launch
            name = "ws_split" if expected.kernel == "ws" and ws.a_transposed(args[0]) else expected.kernel
            assert calls == [(name, expected.split_k)], (cc, expected)
            matmul(*args, out=out, **kw)  # same signature: the remembered launch
            assert calls[1:] == [(name, "replay")], (cc, expected)
    assert {p.kernel for p, _ in launch.CACHE.values()} >= {"grouped", "tma"}
    if ws.WS_IMPORT_ERROR is None:  # attn.c_proj's dW (5 slices) and c_fc's (1) went through launch_split
        assert {p.split_k for p, _ in launch.CACHE.values() if p.kernel == "ws"} >= {1, 5}


def test_every_capability_decision_goes_through_env_capability():
    """So that patching env.capability alone fakes the GPU generation: outside env.py no module of
    mpgpt.kernels asks torch for the capability (mpgpt/bench/kernels.py only records it in its result
    file's environment), and none imports env's device functions by name (a patch of the module
    attribute would not reach such a copy)."""
    import mpgpt.kernels as pkg
    for path in Path(pkg.__file__).parent.glob("*.py"):
        src = path.read_text()
        if path.name != "env.py":
            uses = [line for line in src.splitlines() if "get_device_capability" in line]
            allowed = ['    env["compute_capability"] = list(torch.cuda.get_device_capability(0))']
            assert [u for u in uses if u not in allowed] == [], path.name
        for line in src.splitlines():
            if line.startswith("from .env import") and path.name != "__init__.py":  # __init__: re-exports
                names = {n.strip() for n in line.split("import", 1)[1].split("#")[0].split(",")}
                assert not names & {"capability", "num_sms", "interpreting", "check_device", "device_name"}, \
                    (path.name, line)


def test_grouped_configs_follow_the_planned_capability(fake_gpu):
    """The grouped kernel's autotuner tries the configurations written for the GPU generation
    env.capability reports (the first launch decides; importing never initialises CUDA)."""
    named = {"a_ptr": fake_cuda(64, 64)}
    fake_gpu((8, 0))
    assert grouped._prune_by_arch(grouped.CONFIGS_SM90 + grouped.CONFIGS_SM80, named) == grouped.CONFIGS_SM80
    fake_gpu((9, 0))
    assert grouped._prune_by_arch(grouped.CONFIGS_SM90 + grouped.CONFIGS_SM80, named) == grouped.CONFIGS_SM90
    every = grouped.CONFIGS_SM90 + grouped.CONFIGS_SM80 + grouped.CONFIGS_SM75
    fake_gpu((7, 5))  # a T4: only the two-stage configurations that fit its 64 KB of shared memory
    assert grouped._prune_by_arch(every, named) == grouped.CONFIGS_SM75
    assert all(c.num_stages <= 2 for c in grouped.CONFIGS_SM75)
    fake_gpu((8, 9))
    assert grouped._prune_by_arch(every, named) == grouped.CONFIGS_SM80


# ------------------------------------------------------------------------------------------------
# GPU (compiled) tests: run on the H200 before GPU work is resolved
# ------------------------------------------------------------------------------------------------
def _gpu_kernels():
    names = ["grouped"]
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0):
        names.append("tma")
    return names


@pytest.mark.sm80
@pytest.mark.parametrize("M,N,K", [(1, 768, 768), (77, 3072, 768), (1000, 1000, 1000), (513, 50304, 768)])
def test_gpu_matmul_large_shapes(M, N, K):
    for kernel in _gpu_kernels():
        for use_bias, act in ((False, None), (True, "gelu"), (True, "relu")):
            a, w = rand(M, K), rand(N, K)  # fresh inputs for every variant
            bias = rand(N) if use_bias else None
            out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
            kern = kernel if (kernel != "tma" or min(M, N, K) >= 16) else "grouped"
            matmul(a, w.t(), bias, act, out=out, kernel=kern)
            torch.cuda.synchronize()
            err = rel_err(out, reference(a, w.t(), bias, act))
            assert err < 1e-2, (kernel, M, N, K, act, err)


@pytest.mark.sm80
def test_gpu_matmul_transposed_and_fp16():
    for kernel in _gpu_kernels():
        for dtype in (torch.bfloat16, torch.float16):
            a = rand(1024, 3000, dtype=dtype).t()  # (3000, 1024), column-major, like dY^T
            b = rand(1024, 520, dtype=dtype)
            out = torch.full((3000, 520), float("nan"), dtype=torch.float32, device="cuda")
            matmul(a, b, out=out, kernel=kernel)
            assert rel_err(out, reference(a, b)) < 1e-5, (kernel, dtype)  # fp32 out: accumulation only
            got = matmul(a, b, kernel=kernel)
            assert rel_err(got, reference(a, b)) < TOL[dtype], (kernel, dtype)


@pytest.mark.sm80
def test_gpu_split_k_and_gelu_backward():
    # The weight-gradient shapes of GPT-2 small (K = 12288 tokens): automatic and forced split-K,
    # autotuned, against float64; and the fused GELU backward on a (tokens, 3072) tensor.
    for out_f, in_f in [(768, 768), (2304, 768), (3072, 768)]:
        g_t, x = rand(12288, out_f).t(), rand(12288, in_f)  # dY^T (column-major), X
        ref = reference(g_t, x)
        for split_k in (None, 1, 4):
            out = torch.full((out_f, in_f), float("nan"), device="cuda")
            matmul(g_t, x, out=out, split_k=split_k)
            # fp32 sums of 12288 products: relative error up to ~sqrt(K) * 2^-24 = 7e-6; a missed
            # slice or tile gives ~1.
            assert rel_err(out, ref) < 5e-5, (out_f, in_f, split_k)
    g, z = rand(12288, 3072), (3 * torch.randn(12288, 3072, device="cuda")).to(torch.bfloat16)
    ref = g.double() * gelu_tanh_grad(z).double()
    assert rel_err(kernels.gelu_backward(g, z), ref) < 1e-2
    # With the bias gradient beside it, at GPT-2's shape and one with edges in both dimensions.
    # Every element of dZ within bf16's rounding (2^-8 relative) of the float64 value, plus the
    # fast reciprocal's error (2 ulp of fp32) carried through gelu' (|gelu'| < 1.2): a tile left
    # unwritten or computed from the wrong rows fails it.
    for M, N in [(12288, 3072), (1000, 200)]:
        g, z = rand(M, N), (3 * torch.randn(M, N, device="cuda")).to(torch.bfloat16)
        ref = g.double() * gelu_tanh_grad(z).double()
        dz, db = kernels.gelu_backward_bias(g, z)
        assert ((dz.double() - ref).abs() <= 2**-8 * ref.abs() + 1e-6 * g.double().abs()).all(), (M, N)
        assert rel_err(db, ref.sum(0)) < 1e-5, (M, N)


@pytest.mark.sm80
@pytest.mark.parametrize("dx_kernel,dw_kernel", [("auto", "auto"), ("ws", "tma")])
@pytest.mark.parametrize("activation", [None, "gelu"])
def test_gpu_triton_linear_backward(activation, dx_kernel, dw_kernel, monkeypatch):
    """Forward and both gradients against float64, with the gradient products on `auto`'s kernels
    and on the ws (dX) and TMA (dW) kernels (where those cannot run, `auto` runs instead)."""
    from mpgpt.kernels import linear
    monkeypatch.setattr(linear, "INPUT_GRAD_KERNEL", dx_kernel)
    monkeypatch.setattr(linear, "WEIGHT_GRAD_KERNEL", dw_kernel)
    planned = []
    real_plan = mm._plan_2d
    monkeypatch.setattr(mm, "_plan_2d", lambda *a: planned.append(real_plan(*a).kernel) or real_plan(*a))
    monkeypatch.setattr(launch, "lean_launch_enabled", lambda: False)  # every launch plans
    gelu_launches = []
    real_gelu_forward = ws.gelu_forward
    monkeypatch.setattr(ws, "gelu_forward", lambda *a: gelu_launches.append(a) or real_gelu_forward(*a))
    lin = nn.Linear(768, 3072, device="cuda")
    layer = TritonLinear.from_linear(lin, activation=activation)
    x = torch.randn(8, 512, 768, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    grad = torch.randn(y.shape, device="cuda").to(torch.bfloat16)
    y.backward(grad)
    y_ref, (dx, dw, db) = linear_reference(x, lin.weight, lin.bias, activation, grad, torch.bfloat16)
    assert rel_err(y, y_ref) < 1e-2
    assert rel_err(x.grad, dx) < 1e-2
    assert rel_err(lin.weight.grad, dw) < 1e-2
    assert rel_err(lin.bias.grad, db) < 1e-2
    if dx_kernel != "auto" and env.capability(x.device) == (9, 0):
        assert {"ws", "tma"} <= set(planned), planned  # the gradient products ran where asked
    # GELU with Z kept for backward: the warp-specialised GELU epilogue wherever it runs (ops.py)
    assert len(gelu_launches) == (activation == "gelu" and ws.runs_here(x))


@pytest.mark.sm80
def test_gpu_every_tma_config_is_correct(monkeypatch):
    """The autotuner may pick any of the TMA kernel's configurations (TMA stores, subtiled
    epilogue, warp specialisation, two programs per SM) for some shape: each one, forced in
    turn, must be right at an odd shape (edges in M, N and K), with and without the GELU epilogue
    and its saved pre-activation, and with an output the TMA cannot store (falls back to pointers)."""
    if "tma" not in _gpu_kernels():
        pytest.skip("the TMA kernel needs sm_90")
    monkeypatch.setenv("MPGPT_AUTOTUNE", "0")
    monkeypatch.setenv("MPGPT_LEAN_LAUNCH", "0")
    M, N, K = 1000, 776, 1000
    for cfg in tma.CONFIGS:
        fixed = dict(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        monkeypatch.setattr(tma, "FIXED", fixed)
        a, w, bias = rand(M, K), rand(N, K), rand(N)
        c = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
        z = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
        mm._matmul_2d(a, w.t(), c, bias=bias, z=z, activation="gelu", kernel="tma")
        wide = torch.full((M, N + 3), float("nan"), dtype=torch.bfloat16, device="cuda")
        plain = wide[:, 1:N + 1]  # misaligned rows: no TMA store possible
        mm._matmul_2d(a, w.t(), plain, kernel="tma")
        torch.cuda.synchronize()
        assert rel_err(c, reference(a, w.t(), bias, "gelu")) < 1e-2, fixed
        assert rel_err(z, reference(a, w.t(), bias)) < 1e-2, fixed
        assert rel_err(plain, reference(a, w.t())) < 1e-2, fixed
        assert torch.isnan(wide[:, 0]).all() and torch.isnan(wide[:, N + 1:]).all(), fixed  # nothing outside


def _ws_available():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.sm80
@pytest.mark.parametrize("sliced", [True, False])
@pytest.mark.parametrize("roles", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_ws_kernel_against_float64(dtype, roles, sliced, monkeypatch):
    """The warp-specialised kernel at shapes with edges in M, N and K (N not a multiple of its
    192-wide tile; N = 200 leaves the 64-wide part of the last tile wholly outside), with and
    without bias, on every SM or on only 7 programs (each then runs many tiles back to back, so
    the ring of stages wraps around many times), with B as w.t() (the forward layout) and
    row-major (dX = dY @ W), with one MMA partition and, where there is a bias (ws.mma_roles),
    with two taking the tiles in turn. With 7 programs each partition runs several tiles: 5 or 6
    a program at the first shape, and at K = 64 11 or 12 tiles of a single K-step each, where the
    turns' barrier is hardest to get right. Outputs at most four tiles across (N = 200, 192, 768)
    go out in slices through one staging buffer beside five load stages (ws.sliced_store), or,
    with that switched off, as the wider outputs do. The output is a NaN-filled view inside a
    wider buffer: every element must be written, and nothing outside it."""
    if not _ws_available():
        pytest.skip("the warp-specialised kernel needs sm_90")
    monkeypatch.setattr(ws, "PINGPONG_ROLES", roles)
    monkeypatch.setattr(ws, "SLICED_STORE", sliced)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for M, K, N in [(1000, 1000, 776), (77, 3072, 200), (300, 64, 192), (2000, 64, 776), (12288, 768, 768)]:
        for use_bias, programs, row_major in [(False, None, False), (True, None, False), (True, 7, False),
                                              (False, 7, False), (False, None, True), (True, 7, True)]:
            a = rand(M, K, dtype=dtype)  # fresh inputs every time
            b = rand(K, N, dtype=dtype) if row_major else rand(N, K, dtype=dtype).t()
            bias = rand(N, dtype=dtype) if use_bias else None
            wide = torch.full((M, N + 8), float("nan"), dtype=dtype, device="cuda")
            c = wide[:, :N]
            assert ws.ws_eligible(a, b, c, bias, None, None) and ws.b_row_major(b) is row_major
            ws.ws_launch(a, b, c, bias, num_sms, num_programs=programs)
            torch.cuda.synchronize()
            case = (M, K, N, use_bias, programs, row_major, dtype, roles, sliced)
            assert rel_err(c, reference(a, b, bias)) < TOL[dtype], case
            assert torch.isnan(wide[:, N:]).all(), case


@pytest.mark.sm80
def test_gpu_ws_split_weight_grad_against_float64():
    """The warp-specialised kernel reading A transposed, K split into fp32 planes (launch_split):
    dW = dY.t() @ X at shapes with edges in M, N and K, 1 to 7 slices (one of them more slices than
    waves need, so programs run several units), B row-major and as w.t(), into fp32 and bf16, the
    output a NaN-filled view inside a wider buffer (every element written, nothing outside).
    Tolerances: every product of two 16-bit inputs is exact in fp32, and K <= 5000 fp32 additions
    (in the tensor cores, then in the planes' sum) leave a relative error of a few 1e-6 in the
    Frobenius norm; 2e-5 allows it, where a slice summed twice or left out is O(1). A bf16 output
    adds its rounding, 2^-9 relative at most: TOL. The same call twice gives the same bits. Each
    shape runs on the wide 128 x 192 tiles and on the narrow 128 x 160 ones, whose
    edges fall elsewhere (200 = 160 + 40, 392 = 2 x 160 + 72, 1000 = 6 x 160 + 40)."""
    if not _ws_available():
        pytest.skip("the warp-specialised kernel needs sm_90")
    for M, N, K, split, row_major in [(296, 200, 5000, 3, True), (768, 768, 4096, 5, True), (1000, 776, 2000, 4, False),
                                      (776, 392, 3000, 1, True), (136, 200, 1111, 7, True), (64, 1000, 640, 2, False),
                                      (768, 3072, 1024, 1, True), (1000, 776, 2000, 1, False)]:
        for out_dtype, narrow in itertools.product((torch.float32, torch.bfloat16), (False, True)):
            g = rand(K, M)  # dY (tokens, out): the product reads its transpose, fresh inputs every time
            b = rand(K, N) if row_major else rand(N, K).t()
            a = g.t()
            wide = torch.full((M, N + 4), float("nan"), dtype=out_dtype, device="cuda")
            c = wide[:, :N]
            assert ws.split_eligible(a, b, c, None, None, None)
            ws.launch_split(a, b, c, split, narrow)
            again = torch.full((M, N), float("nan"), dtype=out_dtype, device="cuda")
            ws.launch_split(a, b, again, split, narrow)
            torch.cuda.synchronize()
            case = (M, N, K, split, row_major, out_dtype, narrow)
            assert rel_err(c, reference(a, b)) < (2e-5 if out_dtype == torch.float32 else TOL[torch.bfloat16]), case
            assert torch.isnan(wide[:, N:]).all(), case
            assert torch.equal(c, again), case
    with pytest.raises(ValueError, match="split_k must be between 1 and the 2 K-steps"):
        ws.launch_split(rand(100, 64).t(), rand(100, 64), torch.empty(64, 64, device="cuda"), 3)


@pytest.mark.sm80
def test_gpu_auto_takes_the_ws_kernel_for_plain_forward_products(monkeypatch):
    """kernel="auto" on sm_90: the forward layout without activation (with or without bias) goes
    to the warp-specialised kernel, with GELU to the TMA kernel; kernel="ws" where it cannot run
    is a clear error."""
    if not _ws_available():
        pytest.skip("the warp-specialised kernel needs sm_90")
    monkeypatch.delenv("MPGPT_LEAN_LAUNCH", raising=False)  # the cache records what ran
    launch.CACHE.clear()
    a, w, bias = rand(2048, 768), rand(768, 768), rand(768)
    for b_, act, kind in ((None, None, "ws"), (bias, None, "ws"), (bias, "gelu", "tma")):
        p = plan(a, w.t(), b_, act)
        assert p.kernel == kind, (act, p)
        out = matmul(a, w.t(), b_, act)
        assert [entry[0] for entry in launch.CACHE.values()][-1] == p  # what ran is what plan said
        assert rel_err(out, reference(a, w.t(), b_, act)) < 1e-2
    with pytest.raises(ValueError, match="warp-specialised"):
        matmul(a, w.t(), bias, "gelu", kernel="ws")


@pytest.mark.sm80
def test_gpu_lean_launch_repeats_the_ordinary_launch(monkeypatch):
    """The second call with a signature skips Triton's Python launch path (launch.CACHE,
    launch.py). On fresh inputs it must give bit for bit what the ordinary path gives, and be
    right against float64; a misaligned view (Triton specialises on 16-byte alignment) must get a
    plan of its own. Cases: the forward layout with bias+GELU (TMA kernel on sm_90), with bias
    only (warp-specialised kernel on sm_90), a strided grouped launch, a weight gradient that
    splits K, and on sm_90 a row-major B on the warp-specialised kernel."""
    monkeypatch.delenv("MPGPT_LEAN_LAUNCH", raising=False)
    launch.CACHE.clear()

    def operands(case):
        if case == "forward":
            return rand(2048, 768), rand(3072, 768).t(), rand(3072), "gelu", "auto"
        if case == "ws":  # no activation: the warp-specialised kernel on sm_90 (host-built descriptors)
            return rand(2048, 768), rand(768, 768).t(), rand(768), None, "auto"
        if case == "grouped":
            return rand(1000, 300)[:, :250], rand(250, 333), None, None, "grouped"
        if case == "split":  # dW = dY^T X with 12288 tokens: few output tiles, long K
            return rand(12288, 768).t(), rand(12288, 768), None, None, "auto"
        if case == "ws_row_major":  # dX = dY @ W on the warp-specialised kernel (sm_90)
            return rand(2048, 3072), rand(3072, 768), None, None, "ws"
        big = rand(777 * 512 + 1)  # misaligned: starts 2 bytes past an aligned address
        return big[1:].view(777, 512), rand(512, 640), rand(640), "relu", "auto"

    aligned = rand(777, 512), rand(512, 640), rand(640), "relu", "auto"
    matmul(aligned[0], aligned[1], aligned[2], aligned[3])  # the misaligned case's aligned twin
    hopper = env.capability(torch.device("cuda")) == (9, 0)
    for case in ("forward", "ws", "grouped", "split", "misaligned") + (("ws_row_major",) if hopper else ()):
        first = operands(case)
        n = len(launch.CACHE)
        matmul(first[0], first[1], first[2], first[3], kernel=first[4])
        assert len(launch.CACHE) == n + 1, case  # the first call remembered its launch
        remembered = list(launch.CACHE.values())[-1][0]
        assert remembered == plan(first[0], first[1], first[2], first[3], kernel=first[4]), case
        a, b, bias, act, kern = operands(case)  # fresh inputs, same signature
        lean = matmul(a, b, bias, act, kernel=kern)
        assert len(launch.CACHE) == n + 1, case  # ... and the second one used it
        monkeypatch.setenv("MPGPT_LEAN_LAUNCH", "0")
        plain = matmul(a, b, bias, act, kernel=kern)
        monkeypatch.delenv("MPGPT_LEAN_LAUNCH")
        torch.cuda.synchronize()
        assert torch.equal(lean, plain), case
        assert rel_err(lean, reference(a, b, bias, act)) < 1e-2, case  # bf16 out: one rounding


@pytest.mark.sm80
def test_gpu_descriptor_maps_repeat_the_ordinary_launch(monkeypatch):
    """Repeated launches of the warp-specialised kernel hand Triton's C launcher descriptors
    encoded once per address (launch.DescriptorMaps, written against triton 3.6's launcher). Two
    sets of fresh operands and outputs, used in turn three times (so from the second round on every
    encoding comes from the cache), and a third set at new addresses: each result must equal the
    ordinary path's bit for bit and be right against float64. On triton 3.6 the launch must really
    have gone through DescriptorMaps, with one entry per set of addresses; on another triton the
    launches fall back to the ordinary call, which this then checks the same way."""
    if not _ws_available():
        pytest.skip("the warp-specialised kernel needs sm_90")
    from mpgpt.kernels.launch import DescriptorMaps
    monkeypatch.delenv("MPGPT_LEAN_LAUNCH", raising=False)
    launch.CACHE.clear()
    sets = [(rand(2048, 768), rand(768, 768).t(), rand(768), torch.empty(2048, 768, dtype=torch.bfloat16,
                                                                           device="cuda")) for _ in range(3)]
    plain = []
    monkeypatch.setenv("MPGPT_LEAN_LAUNCH", "0")
    for a, b, bias, _ in sets:
        plain.append(matmul(a, b, bias))
    monkeypatch.delenv("MPGPT_LEAN_LAUNCH")
    for a, b, bias, c in sets[:2] * 3 + sets[2:]:
        c.fill_(float("nan"))
        matmul(a, b, bias, out=c)
        torch.cuda.synchronize()
        i = next(i for i, s in enumerate(sets) if s[3] is c)
        assert torch.equal(c, plain[i]), i
        assert rel_err(c, reference(a, b, bias)) < 1e-2, i  # bf16 out: one rounding
    (p, replay), = launch.CACHE.values()
    assert p.kernel == "ws"
    cells = dict(zip(replay.__code__.co_freevars, (cell.cell_contents for cell in replay.__closure__)))
    maps = cells["remembered"]._maps
    if env.triton.__version__.startswith("3.6"):
        assert isinstance(maps, DescriptorMaps) and len(maps.maps) == 3


@pytest.mark.sm80
def test_gpu_tiny_gpt_trains_like_nn_linear():
    """The tiny GPT trained with TritonLinear tracks the nn.Linear run (same init, same batches,
    both under bf16 autocast). The two runs differ only in rounding (fused vs separate GELU;
    TritonLinear's dW is the fp32 accumulator, split along K, where autocast's nn.Linear rounds
    dW to bf16), and such differences grow along a training trajectory: on the H200 the largest
    10-step gap measured 0.052 nats, with TritonLinear's run the lower one. We require every
    10-step mean within 0.1 nats, TritonLinear's last 10 steps no worse than nn.Linear's + 0.02,
    and the loss well below ln(V). A wrong gradient leaves the loss near ln(V) = 4.2: gaps of nats."""
    from mpgpt.fast import convert
    from mpgpt.model import GPT, GPTConfig

    torch.manual_seed(0)
    vocab = 64
    cfg = GPTConfig.preset("tiny", vocab_size=vocab)
    # Learnable data: each sequence counts up by a random stride modulo the vocabulary.
    n, T = 4096, cfg.block_size + 1
    start = torch.randint(0, vocab, (n, 1))
    stride = torch.randint(1, 8, (n, 1))
    data = ((start + stride * torch.arange(T)) % vocab).cuda()

    def run(use_triton):
        torch.manual_seed(1)
        model = GPT(cfg).cuda()
        if use_triton:
            convert(model, triton="all")
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(2)
        losses = []
        for _ in range(150):
            idx = torch.randint(0, n, (32,), generator=g).cuda()
            xb, yb = data[idx, :-1], data[idx, 1:]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = model(xb, yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return torch.tensor(losses)

    ref, tri = run(False), run(True)
    ref_m, tri_m = ref.view(-1, 10).mean(1), tri.view(-1, 10).mean(1)
    gap = (ref_m - tri_m).abs().max().item()
    print(f"tiny GPT: first {ref[0]:.3f}/{tri[0]:.3f} last10 {ref_m[-1]:.4f}/{tri_m[-1]:.4f} max gap {gap:.4f}")
    assert torch.isfinite(tri).all()
    assert gap < 0.1, gap
    assert tri_m[-1] < ref_m[-1] + 0.02, (tri_m[-1], ref_m[-1])
    assert tri_m[-1] < 0.5 * math.log(vocab)


def test_triton_linear_refuses_a_second_derivative():
    """Its Triton kernels carry no graph: create_graph=True is refused rather than silently wrong."""
    layer = TritonLinear(16, 24, activation="gelu").to(DEVICE)
    x = torch.randn(5, 16, device=DEVICE, requires_grad=True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y = layer(x)
    with pytest.raises(RuntimeError, match=r"TritonLinear computes first derivatives only.*fast\.convert\(model\)"):
        torch.autograd.grad(y.float().sum(), x, create_graph=True)
