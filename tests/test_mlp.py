"""Tests for mpgpt/fast/mlp.py: the MLP with GELU fused into its first matmul.

The reference is the unfused MLP, gelu(x W_fc^T + b_fc) W_proj^T + b_proj, in float64 on the same
(already rounded) bf16 inputs and parameters, with its gradients from float64 autograd. What the
fused path may differ by: its roundings of Z, gelu(Z), dZ and the outputs to bf16, each a
relative error of at most 2^-8 per element (8 significant bits), a few 1e-3 as a norm; on the GPU
also the tanh instruction's error (at most 2^-11 relative, by the PTX manual); the products
accumulate in fp32. So every output and gradient must be within 2e-2 (norm-relative) of the
float64 reference: loose enough for any correct order of roundings, far below what a missing
GELU derivative, a wrong transpose or a bias-gradient term summed over the wrong axis gives (~1).

On a CPU the custom operator takes its torch branch (the autograd bookkeeping, dtypes and the
model wiring are what is tested); on an H200 (sm_90) the same tests run the Gluon kernel, and
the tests marked sm80 check its GELU epilogue on its own, at shapes with edges.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from mpgpt.kernels import env, gelu
from mpgpt.kernels.hopper import ws
from mpgpt.fast import mlp
from mpgpt.fast import convert
from mpgpt.model import GPT, MLP, GPTConfig
from compile_check import assert_compiles_like_eager
from test_model import assert_same_loss_and_gradients

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 2e-2


def rel_err(out, ref):
    out = out.double()
    if not torch.isfinite(out).all():
        return math.inf
    return (out - ref).norm().item() / max(ref.norm().item(), 1e-30)


def params(C, dtype, bias=True, device=DEVICE, scale=1.0):
    """Fresh random MLP parameters (W_fc (4C, C), b_fc, W_proj (C, 4C), b_proj), requiring grad."""
    shapes = [(4 * C, C), (4 * C,), (C, 4 * C), (C,)]
    out = [(torch.randn(s, device=device) * scale / math.sqrt(s[-1] if len(s) == 2 else 4)).to(dtype) for s in shapes]
    if not bias:
        out[1] = out[3] = None
    return [p.requires_grad_() if p is not None else None for p in out]


def float64_reference(x, w_fc, b_fc, w_proj, b_proj, grad_out):
    """Output and gradients (x, w_fc, b_fc, w_proj, b_proj) of the unfused MLP in float64."""
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (x, w_fc, b_fc, w_proj, b_proj)]
    out = F.linear(F.gelu(F.linear(leaves[0], leaves[1], leaves[2]), approximate="tanh"), leaves[3], leaves[4])
    out.backward(grad_out.double())
    return out.detach(), [t.grad if t is not None else None for t in leaves]


@pytest.fixture(params=["torch", "triton"])
def backward_path(request, monkeypatch):
    """GELU's backward as torch ops or as the Triton pass (gelu.gelu_backward_bias). A GPU takes
    the Triton pass by itself; on a CPU it is forced here, and runs in Triton's interpreter."""
    calls = []
    if request.param == "triton":
        if env.TRITON_IMPORT_ERROR is not None:
            pytest.skip(env.TRITON_IMPORT_ERROR)
        if DEVICE == "cpu":
            monkeypatch.setattr(mlp, "_triton_backward", lambda t: True)
        elif not mlp._triton_backward(torch.empty(1, device=DEVICE, dtype=torch.bfloat16)):
            pytest.skip("bf16 Triton kernels need compute capability >= 8.0")
        for name in ("gelu_backward_bias", "gelu_backward"):  # count the kernel calls: the path must be taken
            kernel = getattr(gelu, name)
            monkeypatch.setattr(gelu, name, lambda *a, _k=kernel, **kw: calls.append(a) or _k(*a, **kw))
    elif DEVICE == "cuda":
        monkeypatch.setattr(mlp, "_triton_backward", lambda t: False)
    yield request.param
    assert bool(calls) == (request.param == "triton")


@pytest.mark.parametrize("bias", [True, False])
def test_the_fused_mlp_in_bf16_matches_float64(bias, backward_path):
    torch.manual_seed(0)
    C, M = 64, 200 if DEVICE == "cpu" else 1000
    w_fc, b_fc, w_proj, b_proj = params(C, torch.bfloat16, bias)
    x = torch.randn(2, M // 2, C, device=DEVICE).to(torch.bfloat16).requires_grad_()
    out = mlp.gelu_mlp(x, w_fc, b_fc, w_proj, b_proj)
    assert out.shape == (2, M // 2, C) and out.dtype == torch.bfloat16
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref_out, ref_grads = float64_reference(x, w_fc, b_fc, w_proj, b_proj, grad_out)
    assert rel_err(out, ref_out) < TOL
    for name, t, ref in zip(("x", "w_fc", "b_fc", "w_proj", "b_proj"), (x, w_fc, b_fc, w_proj, b_proj), ref_grads):
        if t is None:
            continue
        assert t.grad is not None and t.grad.dtype == t.dtype, name
        assert rel_err(t.grad, ref) < TOL, f"{name}: {rel_err(t.grad, ref):.2e}"


def test_under_autocast_fp32_parameters_get_fp32_gradients(backward_path):
    """An fp32 model under bf16 autocast (the course's default GPU setting): the products run in
    bf16, the gradients come back in the parameters' and the input's own dtype, fp32."""
    torch.manual_seed(1)
    C = 32
    w_fc, b_fc, w_proj, b_proj = params(C, torch.float32)
    x = torch.randn(96, C, device=DEVICE, requires_grad=True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = mlp.gelu_mlp(x, w_fc, b_fc, w_proj, b_proj)
    assert out.dtype == torch.bfloat16
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    # The reference sees the bf16-rounded operands the fused path multiplies.
    lp = [t.detach().to(torch.bfloat16) for t in (x, w_fc, b_fc, w_proj, b_proj)]
    ref_out, ref_grads = float64_reference(*lp, grad_out)
    assert rel_err(out, ref_out) < TOL
    for name, t, ref in zip(("x", "w_fc", "b_fc", "w_proj", "b_proj"), (x, w_fc, b_fc, w_proj, b_proj), ref_grads):
        assert t.grad.dtype == torch.float32, name
        assert rel_err(t.grad, ref) < TOL, f"{name}: {rel_err(t.grad, ref):.2e}"


def test_the_weight_gradients_on_a_package_kernel(monkeypatch):
    """weight_grad_kernel="tma": the MLP's two weight gradients go through the package's matmul
    on that kernel (both calls seen, with that kernel), straight into the fp32 parameters'
    dtype, and every gradient still matches float64 as the cuBLAS path's do. (On a GPU other than
    sm_90, or a product it cannot read, ops.matmul falls back to `auto`.)"""
    if env.TRITON_IMPORT_ERROR is not None:
        pytest.skip(env.TRITON_IMPORT_ERROR)
    from mpgpt.kernels import ops
    asked = []
    real = ops.matmul_impl
    monkeypatch.setattr(ops, "matmul_impl", lambda a, b, dt, kernel="auto": asked.append((kernel, dt)) or real(a, b, dt, kernel))
    torch.manual_seed(6)
    C = 32
    w_fc, b_fc, w_proj, b_proj = params(C, torch.float32)
    x = torch.randn(96, C, device=DEVICE, requires_grad=True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = mlp.gelu_mlp(x, w_fc, b_fc, w_proj, b_proj, weight_grad_kernel="tma")
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    assert asked == [("tma", torch.float32)] * 2, asked  # d_w_proj, then d_w_fc
    lp = [t.detach().to(torch.bfloat16) for t in (x, w_fc, b_fc, w_proj, b_proj)]
    _, ref_grads = float64_reference(*lp, grad_out)
    for name, t, ref in zip(("x", "w_fc", "b_fc", "w_proj", "b_proj"), (x, w_fc, b_fc, w_proj, b_proj), ref_grads):
        assert t.grad.dtype == torch.float32, name
        assert rel_err(t.grad, ref) < TOL, f"{name}: {rel_err(t.grad, ref):.2e}"
    for bad in ("stream-k", "cuBLAS"):  # typos: the names are matmul's kernels and "cublas"
        with pytest.raises(ValueError, match="weight_grad_kernel must be one of"):
            mlp.gelu_mlp(x, w_fc, b_fc, w_proj, b_proj, weight_grad_kernel=bad)


def test_an_fp32_model_outside_autocast_runs_the_unfused_ops_exactly():
    torch.manual_seed(2)
    w_fc, b_fc, w_proj, b_proj = params(16, torch.float32)
    x = torch.randn(10, 16, device=DEVICE)
    plain = F.linear(F.gelu(F.linear(x, w_fc, b_fc), approximate="tanh"), w_proj, b_proj)
    assert torch.equal(mlp.gelu_mlp(x, w_fc, b_fc, w_proj, b_proj), plain)


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_gelu_backward_operator_passes_torch_opcheck(path, monkeypatch):
    """torch.library.opcheck on the MLP's backward operator (schema, fake implementation, no
    aliasing), with the bias gradient in fp32 and in bf16, on both paths; its bf16 bias gradient is
    the fp32 one rounded once."""
    if path == "triton" and DEVICE == "cpu":
        monkeypatch.setattr(mlp, "_triton_backward", lambda t: True)
    elif path == "torch":
        monkeypatch.setattr(mlp, "_triton_backward", lambda t: False)
    elif not mlp._triton_backward(torch.empty(1, device=DEVICE, dtype=torch.bfloat16)):
        pytest.skip("bf16 Triton kernels need compute capability >= 8.0")
    h, z = (torch.randn(40, 24, device=DEVICE).bfloat16() for _ in range(2))
    for with_bias, db_dtype in ((True, torch.float32), (True, torch.bfloat16), (False, torch.bfloat16)):
        torch.library.opcheck(mlp.gelu_backward_op, (h, z, with_bias, db_dtype))
    _, db32 = mlp.gelu_backward_impl(h, z, True, torch.float32)
    dz, db16 = mlp.gelu_backward_impl(h, z, True, torch.bfloat16)
    assert db16.dtype == torch.bfloat16 and torch.equal(db16, db32.to(torch.bfloat16))
    assert rel_err(db32, dz.double().sum(0)) < 1e-2  # dz is rounded to bf16; db sums it unrounded


def test_the_product_with_gelus_backward_is_one_operator():
    """mpgpt::product_gelu_backward, (dOut W_proj) * gelu'(Z) and its column sums (the "epilogue"
    form of the MLP's backward): opcheck (schema, fake implementation, no aliasing) with the bias
    gradient in fp32 and bf16 and without it, and off sm_90 exactly the product followed by the
    separate operator: on the CPU that checks the wiring (the same code runs on both sides); on
    sm_90 the kernel runs, and test_gpu_gelu_backward_epilogue_... checks its numbers."""
    g, w, z = (torch.randn(*s, device=DEVICE).bfloat16() for s in ((40, 16), (16, 24), (40, 24)))
    for with_bias, db_dtype in ((True, torch.float32), (True, torch.bfloat16), (False, torch.bfloat16)):
        torch.library.opcheck(mlp.product_gelu_backward_op, (g, w, z, with_bias, db_dtype))
        if ws.gelu_backward_eligible(g, w, z):
            continue
        got = mlp.product_gelu_backward_impl(g, w, z, with_bias, db_dtype)
        want = mlp.gelu_backward_impl(g @ w, z, with_bias, db_dtype)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_operator_returns_gelu_and_its_input():
    """gelu_linear (either branch): (gelu(z), z) for z = x @ w.T + b."""
    torch.manual_seed(3)
    M, K, N = 130, 48, 80
    x, w, b = (torch.randn(*s, device=DEVICE).to(torch.bfloat16) for s in ((M, K), (N, K), (N,)))
    y, z = mlp.gelu_linear_impl(x, w, b)
    ref = x.double() @ w.double().t() + b.double()
    assert y.dtype == z.dtype == torch.bfloat16 and y.shape == z.shape == (M, N)
    assert rel_err(z, ref) < 1e-2
    assert rel_err(y, F.gelu(ref, approximate="tanh")) < 1e-2


def small_model(dtype, **overrides):
    """A two-block GPT on DEVICE in ``dtype``, for the fused layers' model tests (here, test_qkv, test_layernorm)."""
    cfg = GPTConfig.preset("tiny", vocab_size=65, n_layer=2, n_embd=32, n_head=2, block_size=16, **overrides)
    return GPT(cfg).to(DEVICE).to(dtype)


def test_convert_mlp_keeps_the_parameters_and_the_gradients():
    """triton="mlp": every nn.Linear stays (same Parameter objects, same state_dict keys), each
    MLP runs through gelu_mlp, and a bf16 model's loss and gradients match the unfused model's
    to bf16 accuracy (1e-2 on the loss, 3e-2 on each gradient, as test_model's layers="gelu"
    test argues); converting back restores the unfused MLP."""
    torch.manual_seed(4)
    ref = small_model(torch.bfloat16)
    model = small_model(torch.bfloat16)
    model.load_state_dict(ref.state_dict())
    keys, ids = list(model.state_dict()), [id(p) for p in model.parameters()]
    convert(model, triton="mlp")
    assert all(block.mlp.fused is mlp.gelu_mlp for block in model.transformer.h)
    assert all(type(block.mlp.c_fc) is torch.nn.Linear for block in model.transformer.h)
    # From the Triton layers too: triton="mlp" swaps every TritonLinear back to nn.Linear.
    convert(convert(model, triton="all"), triton="mlp")
    for block in model.transformer.h:
        assert type(block.attn.c_attn) is torch.nn.Linear and type(block.mlp.c_fc) is torch.nn.Linear
        assert isinstance(block.mlp.act, torch.nn.GELU) and block.mlp.fused is mlp.gelu_mlp
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == ids
    assert_same_loss_and_gradients(ref, model, DEVICE)
    convert(model)
    assert all(type(block.mlp) is MLP for block in model.transformer.h)
    # The weight gradients' kernel travels with the fused MLP, and only with it.
    convert(model, triton="mlp+qkv", weight_grad_kernel="tma")
    assert all(block.mlp.fused.func is mlp.gelu_mlp and block.mlp.fused.keywords == {"weight_grad_kernel": "tma"}
               for block in model.transformer.h)
    with pytest.raises(ValueError, match="applies to the fused MLP"):
        convert(model, triton="all", weight_grad_kernel="tma")
    with pytest.raises(ValueError, match="must be one of"):
        convert(model, triton="mlp", weight_grad_kernel="fast")
    # GELU's backward in the product's epilogue is withdrawn (fast/mlp.py says why): refused in one line.
    with pytest.raises(ValueError, match="gelu_backward='epilogue' is withdrawn") as info:
        convert(model, triton="mlp", gelu_backward="epilogue")
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="gelu_backward must be one of"):
        convert(model, triton="mlp", gelu_backward="fused")


def test_the_fused_mlp_compiles_into_one_graph():
    """torch.compile sees the fused product as one custom-operator node (mpgpt::gelu_linear) in a
    single graph with no break, GELU's backward as one node (mpgpt::gelu_backward_bias) of the
    backward graph, and the compiled forward and backward equal eager's."""
    torch.manual_seed(5)
    w_fc, b_fc, w_proj, b_proj = params(16, torch.bfloat16)
    x = torch.randn(24, 16, device=DEVICE).to(torch.bfloat16).requires_grad_()

    def step(x, w_fc, b_fc, w_proj, b_proj):
        return mlp.gelu_mlp(x, w_fc, b_fc, w_proj, b_proj).float().square().sum()

    leaves = (x, w_fc, b_fc, w_proj, b_proj)
    forward_code, backward_code = assert_compiles_like_eager(step, leaves, leaves)
    assert "mpgpt.gelu_linear" in forward_code
    # ... and GELU's backward with the bias gradient is one node of the backward graph too
    assert "mpgpt.gelu_backward_bias" in backward_code
    if env.TRITON_IMPORT_ERROR is None:  # the weight gradients on a package kernel: two more operator nodes
        def step_sk(x, w_fc, b_fc, w_proj, b_proj):
            return mlp.gelu_mlp(x, w_fc, b_fc, w_proj, b_proj, weight_grad_kernel="tma").float().square().sum()
        for t in leaves:
            t.grad = None  # the first check left eager's gradients in place
        _, backward_code = assert_compiles_like_eager(step_sk, leaves, leaves)
        assert backward_code.count("mpgpt.matmul.default") == 2


def test_layers_must_be_named():
    with pytest.raises(ValueError, match="'all', 'gelu', 'mlp', 'mlp\\+qkv'"):
        convert(small_model(torch.float32), triton="attention")


# ----------------------------------------------------------------------------------------------
# The GELU epilogue of the Gluon kernel, on an H200
# ----------------------------------------------------------------------------------------------
def _ws_or_skip():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warp-specialised kernel's GELU epilogue needs sm_90")
    if ws.WS_IMPORT_ERROR:
        pytest.skip(ws.WS_IMPORT_ERROR)


# M, K, N with edges: N not a multiple of the 192-wide tile (200: the 64-wide half of the last
# tile lies outside), M not a multiple of 128, and GPT-2's c_fc shape.
SHAPES = [(1000, 776, 200), (77, 3072, 392), (300, 64, 192), (12288, 768, 3072)]


@pytest.mark.sm80
@pytest.mark.parametrize("use_bias", [True, False])
def test_gpu_gelu_epilogue_writes_z_and_gelu_z(use_bias):
    _ws_or_skip()
    for M, K, N in SHAPES:
        a, w = torch.randn(M, K, device="cuda").bfloat16(), (torch.randn(N, K, device="cuda") / math.sqrt(K)).bfloat16()
        bias = torch.randn(N, device="cuda").bfloat16() if use_bias else None
        assert ws.gelu_eligible(a, w, bias)
        strided = torch.randn(2 * N, device="cuda").bfloat16()[::2]  # gelu_forward refuses such a bias
        assert not ws.gelu_eligible(a, w, strided)
        for _ in range(2):  # the first launch, then the lean path's repeat on fresh inputs
            a.copy_(torch.randn_like(a))
            y, z = ws.gelu_forward(a, w, bias)
            torch.cuda.synchronize()
            ref_z = a.double() @ w.double().t() + (bias.double() if use_bias else 0)
            ref_y = F.gelu(ref_z, approximate="tanh")
            assert rel_err(z, ref_z) < 1e-2, (M, K, N)
            assert rel_err(y, ref_y) < 1e-2, (M, K, N)
            # z element by element: fp32 accumulation over K terms (at most K 2^-24 sum|a w| in any
            # order) and one bf16 rounding (2^-8 relative).
            acc = K * 2**-24 * (a.double().abs() @ w.double().abs().t())
            assert ((z.double() - ref_z).abs() <= 2**-8 * ref_z.abs() + acc).all(), (M, K, N)
            # y is GELU of z as stored, the z that GELU's backward reads (and what the unfused model
            # computes under autocast: F.gelu of the bf16 product). Element by element: bf16's
            # rounding of y (2^-8 relative) and tanh.approx's error (about 2^-11 of |t| <= 1 by the
            # PTX manual, so about 2^-12 |z| in y, ws._tanh; allowed twice that). GELU of the
            # unrounded fp32 z, rounded once, can land on the other bf16 neighbour: simulated with
            # torch on 2M values of N(0, 1.5^2), 3.6 % of them broke this bound, none of gelu(bf16 z).
            ref_y = F.gelu(z.double(), approximate="tanh")
            bound = 2**-8 * ref_y.abs() + 2**-11 * z.double().abs()
            assert ((y.double() - ref_y).abs() <= bound).all(), (M, K, N)


@pytest.mark.sm80
@pytest.mark.parametrize("with_bias", [True, False])
def test_gpu_gelu_backward_epilogue_gives_the_separate_passes_gradients(with_bias):
    """dZ = (dOut W_proj) * gelu'(Z) and the bias gradient from one launch (ws.gelu_backward_fused),
    against float64 on the same bf16 inputs, at shapes with edges (tiles past M and N). Element by
    element dZ may differ by two bf16 roundings (of dH, as cuBLAS rounds it, and of dZ: 2^-7
    relative together) and dH's fp32 accumulation (K 2^-24 sum|g w|) times |gelu'(Z)|; gelu' itself
    is evaluated in fp32 (exp, and a division within 2 ulp), within about 1e-6 of its O(1) value, so
    1e-6 |dH| more (where gelu' crosses zero this is the whole error). The bias gradient
    sums the fp32 dZ, whose error is the dH rounding alone, so it lies within the sum of those bounds
    over the column plus fp32's summing error (M 2^-24 sum|dZ|). A tile's partial sum lost would
    break it at the shapes with few rows: simulated in float64 on the CPU at the first three shapes
    (one seed), dropping one tile's part put 156 of 200, 368 of 392 and 185 of 192 columns outside
    the bound. With two programs (each then takes several tiles in turn, so the next tile's Z
    arrives while one is computed, at shapes with edges) dZ and db are bit for bit those of one
    program per multiprocessor: every tile is computed and summed the same way whichever program
    takes it."""
    _ws_or_skip()
    for M, K, N in SHAPES:
        w = (torch.randn(K, N, device="cuda") / math.sqrt(K)).bfloat16()
        for _ in range(2):  # the first launch, then the lean path's repeat on fresh inputs
            g = torch.randn(M, K, device="cuda").bfloat16()
            z = (1.5 * torch.randn(M, N, device="cuda")).bfloat16()
            assert ws.gelu_backward_eligible(g, w, z)
            dz, db = ws.gelu_backward_fused(g, w, z, with_bias, torch.float32)
            torch.cuda.synchronize()
            dh = g.double() @ w.double()
            gp = torch.ops.aten.gelu_backward(torch.ones_like(dh), z.double(), approximate="tanh")
            ref = dh * gp
            acc = K * 2**-24 * (g.double().abs() @ w.double().abs()) * gp.abs()
            assert ((dz.double() - ref).abs() <= 2**-7 * ref.abs() + acc + 1e-6 * dh.abs()).all(), (M, K, N)
            if not with_bias:
                assert db.numel() == 0
                continue
            col = (2**-8 * ref.abs() + acc + 1e-6 * dh.abs()).sum(0) + M * 2**-24 * ref.abs().sum(0)
            assert ((db.double() - ref.sum(0)).abs() <= col).all(), (M, K, N)
        dz2, db2 = ws.gelu_backward_fused(g, w, z, with_bias, torch.float32, num_programs=2)
        assert torch.equal(dz2, dz) and torch.equal(db2, db), (M, K, N)


@pytest.mark.sm80
@pytest.mark.parametrize("gelu_backward", mlp.GELU_BACKWARDS)
def test_gpu_fused_mlp_replays_in_a_cuda_graph(gelu_backward):
    """The lean launch path passes new descriptors each call; recorded in a CUDA graph, a replay on
    new inputs (copied into the recorded buffers) must give what an eager call gives, with GELU's
    backward as its own pass or in the product's epilogue."""
    _ws_or_skip()
    torch.manual_seed(6)
    w_fc, b_fc, w_proj, b_proj = params(768, torch.bfloat16, device="cuda")
    x = torch.randn(2048, 768, device="cuda").bfloat16().requires_grad_()

    def step():
        for t in (x, w_fc, b_fc, w_proj, b_proj):
            t.grad = None
        mlp.gelu_mlp(x, w_fc, b_fc, w_proj, b_proj, gelu_backward=gelu_backward).float().square().mean().backward()

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm up: compile and remember the launches
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    recorded = [t.grad.clone() for t in (x, w_fc, b_fc, w_proj, b_proj)]
    step()
    for got, t in zip(recorded, (x, w_fc, b_fc, w_proj, b_proj)):
        assert torch.equal(got, t.grad)
    # ... and both are the unfused MLP's gradients on these inputs (a replay that read stale or
    # swapped buffers would agree with an eager call taking the same lean path, not with this).
    leaves = [t.detach().clone().requires_grad_() for t in (x, w_fc, b_fc, w_proj, b_proj)]
    F.linear(F.gelu(F.linear(leaves[0], leaves[1], leaves[2]), approximate="tanh"), leaves[3],
             leaves[4]).float().square().mean().backward()
    for got, ref in zip(recorded, leaves):
        assert rel_err(got, ref.grad.double()) < 3e-2
