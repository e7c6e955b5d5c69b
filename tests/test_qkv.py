"""Tests for mpgpt/fast/heads.py and qkv.py: c_attn with its backward's head merge and bias
gradient in one pass.

The merge itself is a copy, so d_qkv must equal torch's concatenation of the three gradients bit
for bit, in every dtype and layout. The bias gradient sums those same values in fp32: against a
float64 sum its error is fp32 rounding over at most a few hundred terms here (a relative 1e-6 or
so), bounded at 1e-5 — far below what a missed row block, a column summed into the wrong head or
q's columns summed twice gives (O(1)).

Through the layer (qkv_heads), the reference is the unfused c_attn + head split in float64 on the
same bf16-rounded operands, with float64 autograd. The fused path rounds its products and the
gradients to bf16 (2^-8 relative per element, a few 1e-3 as a norm) and accumulates in fp32, so
every output and gradient must lie within 2e-2 (norm-relative) of it, as in test_mlp.py.

On a CPU the Triton kernel runs in the interpreter where a test calls it directly or forces the
Triton path; on a GPU the layer takes it by itself and the sm80 test checks it at GPT-2's shape,
on the gradients the attention kernel actually returns.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from mpgpt.fast import convert
from mpgpt.kernels import env
from mpgpt.fast import heads, qkv
from mpgpt.model import MLP, CausalSelfAttention
from compile_check import assert_compiles_like_eager
from path_check import assert_took, take_path
from test_mlp import rel_err, small_model  # the same norm-relative error and tiny model
from test_model import assert_same_loss_and_gradients

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 2e-2

pytestmark = pytest.mark.skipif(env.TRITON_IMPORT_ERROR is not None, reason=str(env.TRITON_IMPORT_ERROR))


def grads(B, nh, T, hs, dtype, layout):
    """Fresh random dq, dk, dv of shape (B, nh, T, hs): "bhtd" contiguous each, "btd" as views of
    one (B, T, 3, nh, hs) buffer (the strides of the forward's head split), or "mixed": dq
    contiguous, dk and dv such views (three sets of strides)."""
    contiguous = [torch.randn(B, nh, T, hs, device=DEVICE).to(dtype) for _ in range(3)]
    base = torch.randn(B, T, 3, nh, hs, device=DEVICE).to(dtype)
    views = [base[:, :, i].transpose(1, 2) for i in range(3)]
    return {"bhtd": contiguous, "btd": views, "mixed": contiguous[:1] + views[1:]}[layout]


# ----------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["bhtd", "btd", "mixed"])
@pytest.mark.parametrize("shape,config", [((2, 3, 37, 16), None), ((2, 3, 37, 16), (32, 16, 1)),
                                          ((1, 4, 5, 12), (8, 8, 1)), ((3, 2, 50, 64), (64, 32, 1))])
def test_merge_heads_bias_copies_exactly_and_sums_in_fp32(dtype, layout, shape, config):
    """Shapes with edges: T not a multiple of the rows per program, a head size that is not a
    power of two (hs = 12 in a 16-wide tile), several programs over rows and heads, a row block
    that spans two sequences (T = 5 or 37 against 8 to 64 rows per block)."""
    dq, dk, dv = grads(*shape, dtype, layout)
    d_qkv, db = heads.merge_heads_bias(dq, dk, dv, config=config)
    ref, _ = heads.merge_heads_reference(dq, dk, dv)
    B, nh, T, hs = shape
    assert d_qkv.shape == (B * T, 3 * nh * hs) and d_qkv.dtype == dtype and d_qkv.is_contiguous()
    assert torch.equal(d_qkv, ref)
    assert db.shape == (3 * nh * hs,) and db.dtype == torch.float32
    assert rel_err(db, ref.double().sum(0)) < 1e-5


def test_merge_heads_bias_errors():
    dq = torch.randn(1, 2, 3, 4, device=DEVICE)
    with pytest.raises(ValueError, match="one shape"):
        heads.merge_heads_bias(dq, dq, dq[..., :2])
    with pytest.raises(ValueError, match="one shape"):
        heads.merge_heads_bias(dq[0], dq[0], dq[0])
    with pytest.raises(ValueError, match="one dtype"):
        heads.merge_heads_bias(dq, dq, dq.double())
    with pytest.raises(ValueError, match="multiple of it"):
        heads.merge_heads_bias(dq, dq, dq, config=(48, 32, 1))
    with pytest.raises(ValueError, match="power of two"):
        heads.merge_heads_bias(dq, dq, dq, config=(48, 48, 1))


def test_merge_heads_bias_with_no_tokens_gives_zeros():
    dq = torch.randn(2, 3, 0, 4, device=DEVICE)
    d_qkv, db = heads.merge_heads_bias(dq, dq, dq)
    assert d_qkv.shape == (0, 36) and torch.equal(db, torch.zeros(36, device=DEVICE))


# ----------------------------------------------------------------------------------------------
# The layer
# ----------------------------------------------------------------------------------------------
@pytest.fixture(params=["torch", "triton"])
def merge_path(request, monkeypatch):
    """The merge as torch ops or as the Triton pass. A GPU takes the Triton pass by itself (with a
    bias); on a CPU it is forced here, and runs in Triton's interpreter. Spies on both check that
    the path named, and only it, is taken."""
    calls = take_path(request.param, monkeypatch, DEVICE, qkv, "_triton_merge", heads, "merge_heads_bias",
                      "merge_heads_reference")
    yield request.param
    assert_took(calls, request.param)


def params(C, dtype, device=DEVICE):
    """Fresh random c_attn parameters, W (3C, C) and b (3C,), requiring grad."""
    w = (torch.randn(3 * C, C, device=device) / math.sqrt(C)).to(dtype).requires_grad_()
    return w, torch.randn(3 * C, device=device).to(dtype).requires_grad_()


def float64_reference(x, w, b, n_head, grads_out):
    """q, k, v and the gradients of x, w, b for the unfused c_attn + head split, in float64."""
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (x, w, b)]
    outs = qkv.split_heads(F.linear(*leaves), n_head)
    torch.autograd.backward(outs, [g.double() for g in grads_out])
    return [o.detach() for o in outs], [t.grad if t is not None else None for t in leaves]


# Without a bias the merge is torch's concatenation on every device: nothing is left to fuse.
@pytest.mark.parametrize("bias,merge_path", [(True, "torch"), (False, "torch"), (True, "triton")],
                         indirect=["merge_path"])
def test_qkv_heads_in_bf16_matches_float64(bias, merge_path):
    torch.manual_seed(0)
    B, T, C, nh = 2, 40, 48, 4
    w, b = params(C, torch.bfloat16)
    b = b if bias else None
    x = torch.randn(B, T, C, device=DEVICE).to(torch.bfloat16).requires_grad_()
    q, k, v = qkv.qkv_heads(x, w, b, nh)
    assert all(t.shape == (B, nh, T, C // nh) and t.dtype == torch.bfloat16 for t in (q, k, v))
    grads_out = [torch.randn_like(t) for t in (q, k, v)]
    torch.autograd.backward((q, k, v), grads_out)
    ref_outs, ref_grads = float64_reference(x, w, b, nh, grads_out)
    for out, ref in zip((q, k, v), ref_outs):
        assert rel_err(out, ref) < TOL
    for name, t, ref in zip(("x", "w", "b"), (x, w, b), ref_grads):
        if t is None:
            continue
        assert t.grad is not None and t.grad.dtype == t.dtype, name
        assert rel_err(t.grad, ref) < TOL, f"{name}: {rel_err(t.grad, ref):.2e}"


def test_qkv_heads_under_autocast_gives_fp32_gradients(merge_path):
    """An fp32 layer under bf16 autocast: q, k, v in bf16, the gradients in fp32, c_attn's bias
    gradient summed in fp32 from the bf16 d_qkv."""
    torch.manual_seed(1)
    w, b = params(32, torch.float32)
    x = torch.randn(3, 20, 32, device=DEVICE, requires_grad=True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        q, k, v = qkv.qkv_heads(x, w, b, 2)
    assert q.dtype == torch.bfloat16
    grads_out = [torch.randn_like(t) for t in (q, k, v)]
    torch.autograd.backward((q, k, v), grads_out)
    lp = [t.detach().to(torch.bfloat16) for t in (x, w, b)]  # the operands the fused path multiplies
    _, ref_grads = float64_reference(*lp, 2, grads_out)
    for name, t, ref in zip(("x", "w", "b"), (x, w, b), ref_grads):
        assert t.grad.dtype == torch.float32, name
        assert rel_err(t.grad, ref) < TOL, f"{name}: {rel_err(t.grad, ref):.2e}"


def test_an_fp32_layer_outside_autocast_runs_the_unfused_ops_exactly():
    torch.manual_seed(2)
    w, b = params(16, torch.float32)
    x = torch.randn(2, 5, 16, device=DEVICE)
    plain = F.linear(x, w, b).split(16, dim=2)
    for got, ref in zip(qkv.qkv_heads(x, w, b, 4), plain):
        assert torch.equal(got, ref.view(2, 5, 4, 4).transpose(1, 2))


def test_qkv_heads_refuses_mismatched_shapes():
    w, b = params(16, torch.float32)
    with pytest.raises(ValueError, match="divisible by 3 \\* n_head"):
        qkv.qkv_heads(torch.randn(2, 5, 16, device=DEVICE), w, b, 5)
    with pytest.raises(ValueError, match="x \\(B, T, C\\)"):
        qkv.qkv_heads(torch.randn(5, 16, device=DEVICE), w, b, 4)



def test_convert_mlp_qkv_keeps_the_parameters_and_the_gradients():
    """triton="mlp+qkv": every nn.Linear stays, each attention layer runs c_attn through
    qkv_heads and each MLP through gelu_mlp; a bf16 model's loss and gradients match the unfused
    model's to bf16 accuracy (test_model's bounds); triton="mlp" and the reference drop qkv_heads."""
    torch.manual_seed(4)
    ref = small_model(torch.bfloat16)
    model = small_model(torch.bfloat16)
    model.load_state_dict(ref.state_dict())
    keys, ids = list(model.state_dict()), [id(p) for p in model.parameters()]
    convert(model, triton="mlp+qkv")
    for block in model.transformer.h:
        assert block.attn.fused_qkv is qkv.qkv_heads and block.mlp.fused is not None
        assert type(block.attn.c_attn) is torch.nn.Linear
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == ids
    assert_same_loss_and_gradients(ref, model, DEVICE)
    convert(model, triton="mlp")
    assert all(block.attn.fused_qkv is None and block.mlp.fused is not None for block in model.transformer.h)
    convert(convert(model, triton="mlp+qkv"))
    assert all(type(block.attn) is CausalSelfAttention and type(block.mlp) is MLP for block in model.transformer.h)


def test_qkv_heads_compiles_into_one_graph():
    """torch.compile traces the layer with no graph break, the merge is one node
    (mpgpt::merge_heads_bias) of the backward graph, and compiled gradients equal eager's."""
    torch.manual_seed(5)
    w, b = params(16, torch.bfloat16)
    x = torch.randn(2, 12, 16, device=DEVICE).to(torch.bfloat16).requires_grad_()

    def step(x, w, b):
        q, k, v = qkv.qkv_heads(x, w, b, 2)
        return (q.float() * k.float() + v.float().square()).sum()

    _, backward_code = assert_compiles_like_eager(step, (x, w, b), (x, w, b))
    assert "mpgpt.merge_heads_bias" in backward_code


# ----------------------------------------------------------------------------------------------
# On a GPU, with the attention kernel's own gradients
# ----------------------------------------------------------------------------------------------
@pytest.mark.sm80
def test_gpu_merge_of_sdpa_gradients_at_gpt2_shape():
    """GPT-2 small's attention (batch 4 x 1024, 12 heads of 64): dq, dk, dv from SDPA's backward in
    whatever layout its kernel returns, merged exactly, the bias gradient within fp32 summation."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 Triton kernels need compute capability >= 8.0")
    torch.manual_seed(6)
    qkv_out = torch.randn(4, 1024, 3 * 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = qkv.split_heads(qkv_out, 12)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    dq, dk, dv = torch.autograd.grad(y, (q, k, v), torch.randn_like(y))  # as the kernel returns them
    assert dq.stride() == dk.stride() == dv.stride()  # the one-launch path reads them in place, no copy
    d_qkv, db = heads.merge_heads_bias(dq, dk, dv)
    ref, _ = heads.merge_heads_reference(dq, dk, dv)
    assert torch.equal(d_qkv, ref)
    assert rel_err(db, ref.double().sum(0)) < 1e-5
    # ... and the same through the compiled model path's custom operator
    d_qkv2, db2 = qkv.merge_heads_op(dq, dk, dv, True, torch.float32)
    assert torch.equal(d_qkv2, d_qkv) and torch.equal(db2, db)


@pytest.mark.parametrize("where", ["c_attn", "mlp.c_fc", "mlp.act", "mlp.c_proj", "global"])
def test_a_hook_on_a_fused_layer_runs_on_the_plain_path(where):
    """The fused attention input and the fused MLP never call c_attn's, c_fc's, act's or c_proj's
    forward: with a hook there, the layer takes its plain path, the hook runs, and the loss is the
    plain model's."""
    torch.manual_seed(3)
    plain = small_model(torch.bfloat16)
    model = small_model(torch.bfloat16)
    model.load_state_dict(plain.state_dict())
    convert(model, triton="mlp+qkv")
    block, calls = model.transformer.h[0], []
    hook = lambda *a: calls.append(1) and None  # noqa: E731
    target = {"c_attn": block.attn.c_attn, "mlp.c_fc": block.mlp.c_fc, "mlp.act": block.mlp.act,
              "mlp.c_proj": block.mlp.c_proj}.get(where)
    handle = (target.register_forward_hook(hook) if target is not None
              else torch.nn.modules.module.register_module_forward_hook(hook))
    try:
        idx = torch.randint(0, 65, (2, 16), device=DEVICE)
        _, loss = model(idx, idx)
        assert calls
        if where != "global":  # block 1 keeps its fused layers: same sums, other rounding
            assert abs(loss.item() - plain(idx, idx)[1].item()) < 1e-2
        else:  # every layer on its plain path: the plain model's loss exactly
            assert torch.equal(loss, plain(idx, idx)[1])
    finally:
        handle.remove()


def test_a_second_derivative_through_the_fused_layers_is_refused():
    """The fused attention input and the fused MLP save tensors without a graph: a second
    derivative through them is refused rather than silently wrong."""
    model = convert(small_model(torch.bfloat16), triton="mlp+qkv")
    x = torch.randn(2, 16, 32, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    for layer in (model.transformer.h[0].attn, model.transformer.h[0].mlp):
        with pytest.raises(RuntimeError, match="first derivatives only.*create_graph=True.*fast\\.convert\\(model\\)"):
            torch.autograd.grad(layer(x).float().square().sum(), x, create_graph=True)
        (g,) = torch.autograd.grad(layer(x).float().square().sum(), x)  # the first derivative still works
        assert torch.isfinite(g).all()
