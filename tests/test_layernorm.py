"""Tests for mpgpt/fast/layernorm.py: the residual add with its LayerNorm, the backward in one pass.

The reference is torch's LayerNorm in float64 with float64 autograd, on the same (already rounded)
inputs. The kernel evaluates the formulas in fp32, so in fp32 its gradients agree to fp32 rounding
over a row of C terms and a column of M terms (relative 1e-6 or so), bounded at 1e-5. Stored in
bf16, dx' carries one more rounding (2^-8 relative per element, a few 1e-3 as a norm): bounded at
1e-2. The weight and bias gradients are always fp32 sums: 1e-5. Each bound is far below what a
missing term of the formula, a row group left out of the column sums or a residual gradient not
added gives (O(1)).

Through the model, the fused blocks must give the unfused model's loss and gradients to bf16
accuracy, as test_model's bounds say; for an fp32 model under autocast, where every rounding to
bf16 happens at the same place in both, the loss bit for bit and the gradients to 1e-4.
"""

import pytest
import torch
import torch.nn.functional as F

from mpgpt.fast import convert
from mpgpt.kernels import env
from mpgpt.fast import layernorm
from mpgpt.model import GPT
from compile_check import assert_compiles_like_eager
from path_check import assert_took, take_path
from test_mlp import rel_err, small_model  # the same norm-relative error and tiny model
from test_model import assert_same_loss_and_gradients

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 2e-2

pytestmark = pytest.mark.skipif(env.TRITON_IMPORT_ERROR is not None, reason=str(env.TRITON_IMPORT_ERROR))


def inputs(M, C, dtype, shift=0.0):
    """Fresh random x', dy, dx'_res and LayerNorm weight (around 1) and bias, and x''s mean and rstd."""
    x = (torch.randn(M, C, device=DEVICE) + shift).to(dtype)
    dy, dres = torch.randn(M, C, device=DEVICE).to(dtype), torch.randn(M, C, device=DEVICE).to(dtype)
    w = (1 + 0.2 * torch.randn(C, device=DEVICE)).to(dtype)
    b = (0.2 * torch.randn(C, device=DEVICE)).to(dtype)
    var, mean = torch.var_mean(x.float(), dim=1, correction=0)
    return x, dy, dres, w, b, mean, torch.rsqrt(var + 1e-5)


def float64_grads(x, dy, w, b, dres):
    """dx' (+ dres), dw, db from torch's LayerNorm in float64."""
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    F.layer_norm(leaves[0], (x.shape[1],), leaves[1], leaves[2], 1e-5).backward(dy.double())
    dx = leaves[0].grad + (dres.double() if dres is not None else 0)
    return dx, leaves[1].grad, leaves[2].grad


# ----------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_res", [True, False])
@pytest.mark.parametrize("shape,config", [((37, 48), None), ((37, 48), (16, 8, 1)), ((5, 100), (8, 2, 1)),
                                          ((130, 64), (32, 32, 1)), ((37, 300), (16, 4, 1)),
                                          ((37, 48), (16, 8, 1, "two-pass")), ((5, 100), (8, 2, 1, "two-pass")),
                                          ((70, 48), (32, 4, 1, "whole-rows", 2)),
                                          ((37, 300), (16, 4, 1, "two-pass")), ((9, 1100), (8, 4, 1, "two-pass"))])
def test_layer_norm_backward_matches_float64(dtype, with_res, shape, config):
    """Shapes with edges: M not a multiple of the rows per program, C not a power of two (48, 100),
    several programs whose partial sums the last sum adds, rows wider than one chunk (300, 1100);
    a mean far from zero (shift 3). Both kernels: whole rows, and the two passes."""
    x, dy, dres, w, b, mean, rstd = inputs(*shape, dtype, shift=3.0)
    dres = dres if with_res else None
    dx, dw, db = layernorm.layer_norm_backward(dy, x, mean, rstd, w, dres, config=config)
    ref_dx, ref_dw, ref_db = float64_grads(x, dy, w, b, dres)
    assert dx.shape == x.shape and dx.dtype == dtype and dw.dtype == db.dtype == torch.float32
    assert rel_err(dx, ref_dx) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert rel_err(dw, ref_dw) < 1e-5 and rel_err(db, ref_db) < 1e-5
    # the torch formulas the CPU path uses agree to the same bounds
    r_dx, r_dw, r_db = layernorm.layer_norm_backward_reference(dy, x, mean, rstd, w, dres)
    assert rel_err(r_dx, ref_dx) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert rel_err(r_dw, ref_dw) < 1e-5 and rel_err(r_db, ref_db) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_res", [True, False])
@pytest.mark.parametrize("shape,config", [((37, 48), (16, 8, 1)), ((37, 300), (16, 4, 1)), ((70, 48), None),
                                          ((37, 300), (16, 4, 1, "two-pass")), ((70, 48), (32, 8, 1, "whole-rows", 3))])
def test_layer_norm_backward_sums_dx_for_a_bias_added_into_x(dtype, with_res, shape, config):
    """sum_dx: a fourth result, dx' (with dx'_res added) summed over the rows in fp32, the gradient
    of a bias added into x'. Against float64, 1e-5 like dw and db (fp32 sums of fp32 terms); rows
    past M (37 and 70 rows are not multiples of the rows per program) and padding columns (48 and
    300 wide) must add nothing. dx', dw and db are the same bits as without sum_dx."""
    x, dy, dres, w, b, mean, rstd = inputs(*shape, dtype, shift=3.0)
    dres = dres if with_res else None
    dx, dw, db, dbias = layernorm.layer_norm_backward(dy, x, mean, rstd, w, dres, config=config, sum_dx=True)
    ref_dx, _, _ = float64_grads(x, dy, w, b, dres)
    assert dbias.shape == (shape[1],) and dbias.dtype == torch.float32
    assert rel_err(dbias, ref_dx.sum(0)) < 1e-5
    plain = layernorm.layer_norm_backward(dy, x, mean, rstd, w, dres, config=config)
    assert all(torch.equal(a, b) for a, b in zip((dx, dw, db), plain))
    r_dbias = layernorm.layer_norm_backward_reference(dy, x, mean, rstd, w, dres, sum_dx=True)[3]
    assert rel_err(r_dbias, ref_dx.sum(0)) < 1e-5


def test_layer_norm_backward_reads_a_strided_weight():
    x, dy, dres, w, b, mean, rstd = inputs(20, 16, torch.float32)
    wide = torch.randn(32, device=DEVICE)
    wide[::2] = w
    got = layernorm.layer_norm_backward(dy, x, mean, rstd, wide[::2], dres)
    want = layernorm.layer_norm_backward(dy, x, mean, rstd, w, dres)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_the_custom_operators_pass_torch_opcheck(path, monkeypatch):
    """torch.library.opcheck: schema, fake (meta) implementation, no aliasing, and the dispatcher's
    other checks, for LayerNorm's backward and the head merge, on both paths."""
    from mpgpt.fast import heads, qkv
    monkeypatch.setattr(layernorm, "_triton_backward", lambda *t: path == "triton")
    monkeypatch.setattr(qkv, "_triton_merge", lambda t: path == "triton")
    x, dy, dres, w, b, mean, rstd = inputs(20, 48, torch.bfloat16)
    torch.library.opcheck(layernorm.ln_backward_op, (dy, x, mean, rstd, w, dres, False, torch.float32))
    torch.library.opcheck(layernorm.ln_backward_op, (dy, x, mean, rstd, w, None, False, torch.bfloat16))
    torch.library.opcheck(layernorm.ln_backward_op, (dy, x, mean, rstd, w, dres, True, torch.bfloat16))
    dq, dk, dv = (torch.randn(2, 3, 7, 16, device=DEVICE).bfloat16() for _ in range(3))
    torch.library.opcheck(qkv.merge_heads_op, (dq, dk, dv, True, torch.bfloat16))
    torch.library.opcheck(qkv.merge_heads_op, (dq, dk, dv, False, torch.float32))


@pytest.mark.parametrize("config,match", [((16, 4, "two-pass"), "num_warps must be a power of two"),
                                          ((16, 4, 4, "two-pass", 1, 1), r"config must be \(ROWS, BLOCK_M"),
                                          ((16, 4), r"config must be \(ROWS, BLOCK_M")])
def test_a_misplaced_config_field_is_refused(config, match):
    """A method left in the num_warps slot would otherwise run the whole-rows kernel silently."""
    x, dy, dres, w, b, mean, rstd = inputs(8, 48, torch.float32)
    with pytest.raises(ValueError, match=match):
        layernorm.layer_norm_backward(dy, x, mean, rstd, w, dres, config=config)


def test_layer_norm_backward_errors():
    x, dy, dres, w, b, mean, rstd = inputs(6, 8, torch.float32)
    with pytest.raises(ValueError, match="one shape"):
        layernorm.layer_norm_backward(dy[:, :4], x, mean, rstd, w)
    with pytest.raises(ValueError, match="reshape to"):
        layernorm.layer_norm_backward(dy.view(2, 3, 8), x.view(2, 3, 8), mean, rstd, w)
    with pytest.raises(ValueError, match="mean and rstd"):
        layernorm.layer_norm_backward(dy, x, mean[:3], rstd, w)
    with pytest.raises(ValueError, match="multiple of BLOCK_M"):
        layernorm.layer_norm_backward(dy, x, mean, rstd, w, config=(6, 4, 1))
    with pytest.raises(ValueError, match="power of two"):
        layernorm.layer_norm_backward(dy, x, mean, rstd, w, config=(6, 3, 1))
    with pytest.raises(ValueError, match="positive multiple"):
        layernorm.layer_norm_backward(dy, x, mean, rstd, w, config=(0, 4, 1))
    with pytest.raises(ValueError, match="'whole-rows' or 'two-pass'"):
        layernorm.layer_norm_backward(dy, x, mean, rstd, w, config=(8, 4, 1, "chunks"))
    with pytest.raises(ValueError, match="stages must be a positive integer"):
        layernorm.layer_norm_backward(dy, x, mean, rstd, w, config=(8, 4, 1, "whole-rows", 0))
    with pytest.raises(ValueError, match="stages must be a positive integer"):
        layernorm.layer_norm_backward(dy, x, mean, rstd, w, config=(8, 4, 1, "two-pass", 2))


def test_layer_norm_backward_with_no_rows_gives_zeros():
    x, dy, dres, w, b, mean, rstd = inputs(0, 8, torch.float32)
    dx, dw, db = layernorm.layer_norm_backward(dy, x, mean, rstd, w, dres)
    assert dx.shape == (0, 8) and torch.equal(dw, torch.zeros(8, device=DEVICE)) and torch.equal(db, dw)


# ----------------------------------------------------------------------------------------------
# The autograd Function
# ----------------------------------------------------------------------------------------------
@pytest.fixture(params=["torch", "triton"])
def backward_path(request, monkeypatch):
    """The backward as torch ops or as the Triton pass. A GPU takes the Triton pass by itself; on a
    CPU it is forced here, and runs in Triton's interpreter. Spies on both check that the path
    named, and only it, is taken."""
    calls = take_path(request.param, monkeypatch, DEVICE, layernorm, "_triton_backward", layernorm,
                      "_layer_norm_backward_packed", "layer_norm_backward_reference")
    yield request.param
    assert_took(calls, request.param)


def make_ln(C, dtype, bias=True):
    ln = torch.nn.LayerNorm(C, bias=bias).to(DEVICE)
    with torch.no_grad():
        ln.weight.copy_(1 + 0.2 * torch.randn(C, device=DEVICE))
        if bias:
            ln.bias.copy_(0.2 * torch.randn(C, device=DEVICE))
    return ln.to(dtype)


def float64_function(x, branch, ln, grads_out):
    """(x', y) of the unfused add + LayerNorm in float64, and the gradients of x, branch, w, b."""
    leaves = [t.detach().double().requires_grad_() if t is not None else None
              for t in (x, branch, ln.weight, ln.bias)]
    xs = leaves[0] + leaves[1] if branch is not None else leaves[0]
    y = F.layer_norm(xs, (x.shape[-1],), leaves[2], leaves[3], ln.eps)
    outs = (xs, y) if branch is not None else (y,)
    torch.autograd.backward(outs, [g.double() for g in grads_out])
    return [o.detach() for o in outs], [t.grad if t is not None else None for t in leaves]


@pytest.mark.parametrize("with_branch,bias", [(True, True), (False, True), (True, False)])
def test_residual_layer_norm_in_bf16_matches_float64(with_branch, bias, backward_path):
    torch.manual_seed(0)
    C = 48
    ln = make_ln(C, torch.bfloat16, bias)
    x = torch.randn(2, 30, C, device=DEVICE).to(torch.bfloat16).requires_grad_()
    branch = torch.randn(2, 30, C, device=DEVICE).to(torch.bfloat16).requires_grad_() if with_branch else None
    outs = layernorm.residual_layer_norm(x, branch, ln)
    outs = outs if with_branch else (outs,)
    assert all(o.dtype == torch.bfloat16 and o.shape == x.shape for o in outs)
    grads_out = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads_out)
    ref_outs, ref_grads = float64_function(x, branch, ln, grads_out)
    for o, r in zip(outs, ref_outs):
        assert rel_err(o, r) < TOL
    for name, t, r in zip(("x", "branch", "weight", "bias"), (x, branch, ln.weight, ln.bias), ref_grads):
        if t is not None:
            assert t.grad is not None and t.grad.dtype == t.dtype, name
            assert rel_err(t.grad, r) < TOL, f"{name}: {rel_err(t.grad, r):.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_branch_bias_added_in_the_residual_add_gets_its_gradient(dtype, backward_path):
    """x' = x + (branch + branch_bias): the bias a matmul left out, added here. Its gradient is
    dx' summed over the rows; every gradient against float64 within TOL, as above. In fp32 under
    bf16 autocast (the course's default), the bias and its gradient stay fp32."""
    torch.manual_seed(2)
    C = 48
    ln = make_ln(C, dtype)
    x = torch.randn(2, 30, C, device=DEVICE).to(dtype).requires_grad_()
    branch = torch.randn(2, 30, C, device=DEVICE).bfloat16().requires_grad_()
    bb = (0.5 * torch.randn(C, device=DEVICE)).to(dtype).requires_grad_()
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=dtype == torch.float32):
        xs, y = layernorm.residual_layer_norm(x, branch, ln, branch_bias=bb)
    assert xs.dtype == dtype
    grads_out = [torch.randn_like(xs), torch.randn_like(y)]
    torch.autograd.backward((xs, y), grads_out)
    leaves = [t.detach().double().requires_grad_() for t in (x, branch, bb, ln.weight, ln.bias)]
    ref_xs = leaves[0] + leaves[1] + leaves[2]
    ref_y = F.layer_norm(ref_xs, (C,), leaves[3], leaves[4], ln.eps)
    torch.autograd.backward((ref_xs, ref_y), [g.double() for g in grads_out])
    assert rel_err(xs, ref_xs) < TOL and rel_err(y, ref_y) < TOL
    for name, t, r in zip(("x", "branch", "branch_bias", "weight", "bias"), (x, branch, bb, ln.weight, ln.bias),
                          leaves):
        assert t.grad is not None and t.grad.dtype == t.dtype, name
        assert rel_err(t.grad, r.grad) < TOL, f"{name}: {rel_err(t.grad, r.grad):.2e}"


def test_a_branch_bias_needs_a_branch_of_its_width():
    ln = make_ln(8, torch.bfloat16)
    x = torch.randn(3, 8, device=DEVICE).bfloat16()
    with pytest.raises(ValueError, match="branch_bias must be a \\(8,\\) vector"):
        layernorm.residual_layer_norm(x, None, ln, branch_bias=torch.zeros(8, device=DEVICE))
    with pytest.raises(ValueError, match="branch_bias must be a \\(8,\\) vector"):
        layernorm.residual_layer_norm(x, x, ln, branch_bias=torch.zeros(4, device=DEVICE))


def test_under_autocast_fp32_parameters_get_fp32_gradients(backward_path):
    """An fp32 model under bf16 autocast: y comes back in bf16 (what the next matmul multiplies),
    x' in fp32 (the residual stream's dtype), and every gradient in its input's dtype."""
    torch.manual_seed(1)
    ln = make_ln(32, torch.float32)
    x = torch.randn(40, 32, device=DEVICE, requires_grad=True)
    branch = torch.randn(40, 32, device=DEVICE).bfloat16().requires_grad_()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        xs, y = layernorm.residual_layer_norm(x, branch, ln)
    assert xs.dtype == torch.float32 and y.dtype == torch.bfloat16
    grads_out = [torch.randn_like(xs), torch.randn_like(y)]
    torch.autograd.backward((xs, y), grads_out)
    _, ref_grads = float64_function(x, branch, ln, grads_out)
    for name, t, r in zip(("x", "branch", "weight", "bias"), (x, branch, ln.weight, ln.bias), ref_grads):
        assert t.grad.dtype == t.dtype, name
        assert rel_err(t.grad, r) < TOL, f"{name}: {rel_err(t.grad, r):.2e}"


def test_an_fp32_model_outside_autocast_runs_the_unfused_ops_exactly():
    ln = make_ln(16, torch.float32)
    x, branch = torch.randn(3, 16, device=DEVICE), torch.randn(3, 16, device=DEVICE)
    xs, y = layernorm.residual_layer_norm(x, branch, ln)
    assert torch.equal(xs, x + branch) and torch.equal(y, ln(x + branch))
    assert torch.equal(layernorm.residual_layer_norm(x, None, ln), ln(x))


def test_residual_layer_norm_refuses_a_mismatched_layer_norm():
    with pytest.raises(ValueError, match="affine LayerNorm over the last dimension"):
        layernorm.residual_layer_norm(torch.randn(2, 8, device=DEVICE), None, torch.nn.LayerNorm(4).to(DEVICE))


def test_residual_layer_norm_compiles_into_one_graph():
    """torch.compile traces the Function with no graph break, LayerNorm's backward is one node
    (mpgpt::layer_norm_backward) of the backward graph, and compiled gradients equal eager's."""
    torch.manual_seed(5)
    ln = make_ln(16, torch.bfloat16)
    x = torch.randn(24, 16, device=DEVICE).bfloat16().requires_grad_()
    branch = torch.randn(24, 16, device=DEVICE).bfloat16().requires_grad_()

    def step(x, branch):
        xs, y = layernorm.residual_layer_norm(x, branch, ln)
        return (xs.float().square() + y.float() * 3).sum()

    _, backward_code = assert_compiles_like_eager(step, (x, branch), (x, branch, ln.weight, ln.bias))
    assert "mpgpt.layer_norm_backward" in backward_code


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bias", [True, False])
def test_fused_layer_norm_keeps_the_loss_and_the_gradients(bias, backward_path):
    """The regrouped blocks compute the same sums: a bf16 model's loss and gradients match the
    unfused model's to bf16 accuracy (test_model's bounds), with the fused MLP and attention input
    on too; converting back and activation checkpointing take the unfused blocks."""
    torch.manual_seed(4)
    ref = small_model(torch.bfloat16, bias=bias)
    model = small_model(torch.bfloat16, bias=bias)
    model.load_state_dict(ref.state_dict())
    convert(model, fused_ln=True, triton="mlp+qkv")
    assert_same_loss_and_gradients(ref, model, DEVICE)
    assert model.fused_layer_norm is layernorm.residual_layer_norm
    assert type(convert(model)) is GPT


def autocast_losses(ref, model):
    """Both models' losses on one random batch under bf16 autocast, each followed by its backward pass."""
    idx = torch.randint(0, 65, (2, 16), device=DEVICE)
    losses = []
    for m in (ref, model):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            _, loss = m(idx, idx.roll(1, 1))
        loss.backward()
        losses.append(loss)
    return losses


def test_an_fp32_model_under_autocast_gets_the_unfused_loss_and_gradients(backward_path):
    """The course's default GPU setting, with the fused loss on: every rounding to bf16 happens at
    the same place fused and unfused (ln_f's output stays fp32, as nn.LayerNorm returns it under
    autocast). Only the fp32 sums inside LayerNorm run in another order, and for some inputs that
    flips a later bf16 rounding by one unit (2^-8 relative on an element). Over 150 seeds the loss
    then moved by at most 7.4e-6 relative and a gradient by at most 4e-3 (a 48-element bias, where
    one flipped element weighs most): bounded at 1e-4 and 2e-2, far below the O(1) error of a
    missing term or a rounding in the wrong place."""
    ref, model = small_model(torch.float32), small_model(torch.float32)
    model.load_state_dict(ref.state_dict())
    convert(model, fused_ln=True, fused_loss=True)
    convert(ref, fused_loss=True)
    losses = autocast_losses(ref, model)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=0)
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert rel_err(b.grad, a.grad.double()) < 2e-2, name


def count_branch_biases(model, monkeypatch):
    """A list that gets one entry per residual add, True where a c_proj bias was added there."""
    seen, add_ln = [], model.fused_layer_norm

    def spy(*args, branch_bias=None, **kwargs):
        seen.append(branch_bias is not None)
        return add_ln(*args, branch_bias=branch_bias, **kwargs)
    monkeypatch.setattr(model, "fused_layer_norm", spy)
    return seen


@pytest.mark.parametrize("layers", [None, "mlp+qkv"])
def test_bias_in_add_keeps_the_loss_and_the_gradients(layers, backward_path, monkeypatch):
    """bias_in_add: every c_proj bias (two blocks, two branches each) moves into the residual add,
    and a bf16 model's loss and gradients, c_proj's bias gradients among them, match the unfused
    model's to bf16 accuracy (test_model's bounds: the bias is added after the matmul's output is
    rounded, one more bf16 rounding), with and without the fused MLP and attention input."""
    torch.manual_seed(6)
    ref, model = small_model(torch.bfloat16), small_model(torch.bfloat16)
    model.load_state_dict(ref.state_dict())
    convert(model, fused_ln=True, bias_in_add=True, triton=layers)
    seen = count_branch_biases(model, monkeypatch)
    assert_same_loss_and_gradients(ref, model, DEVICE)
    assert seen == [False] + [True] * 4  # ln_1 of the first block has no branch
    assert convert(model, fused_ln=True).bias_in_add is False


def test_bias_in_add_under_autocast_keeps_fp32_bias_gradients(backward_path, monkeypatch):
    """An fp32 model under bf16 autocast: the folded biases' gradients come back in fp32 and match
    the unfused model's within the bounds of the test above (the bias is rounded to bf16 before it
    is added in both, as autocast does for F.linear)."""
    torch.manual_seed(7)
    ref, model = small_model(torch.float32), small_model(torch.float32)
    model.load_state_dict(ref.state_dict())
    convert(model, fused_ln=True, bias_in_add=True)
    seen = count_branch_biases(model, monkeypatch)
    losses = [loss.item() for loss in autocast_losses(ref, model)]
    assert abs(losses[1] - losses[0]) < 1e-2 * losses[0] and sum(seen) == 4
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert b.grad.dtype == torch.float32 and rel_err(b.grad, a.grad.double()) < 3e-2, name


def test_bias_in_add_keeps_the_bias_where_dropout_follows_c_proj(monkeypatch):
    """Dropout after c_proj in training: dropout(y W + b) is not dropout(y W) + b, so every
    branch keeps its bias; in eval mode (no dropout) they move to the residual add."""
    model = convert(small_model(torch.float32, dropout=0.2), fused_ln=True, bias_in_add=True)
    seen = count_branch_biases(model, monkeypatch)
    idx = torch.randint(0, 65, (2, 16), device=DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        model(idx)
        assert seen == [False] * 5
        model.eval()(idx)
    assert seen[5:] == [False] + [True] * 4


def test_bias_in_add_keeps_the_bias_of_a_hooked_c_proj(monkeypatch):
    """A hook on c_proj must see c_proj's own output, bias included: that branch keeps its bias
    (and the hook runs); the other branches move theirs."""
    model = convert(small_model(torch.float32), fused_ln=True, bias_in_add=True)
    seen, calls = count_branch_biases(model, monkeypatch), []
    handle = model.transformer.h[0].attn.c_proj.register_forward_hook(lambda *a: calls.append(1))
    try:
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            model(torch.randint(0, 65, (2, 16), device=DEVICE))
    finally:
        handle.remove()
    assert calls == [1] and seen == [False, False, True, True, True]


def test_dropout_draws_the_same_masks_fused_and_unfused():
    """With dropout on, the regrouped loop calls the branches in the same order, so one seed gives
    the same masks. Bit-equal logits are not promised: the fused LayerNorm sums in another order,
    which can flip a bf16 rounding and move a logit by a few bf16 units (2^-8 relative; at most
    0.4 % of the largest logit over 1000 seeds). Another mask on a fifth of the activations moves
    the largest change by tens of percent (at least 35 % over the same seeds), so 3 % tells the
    two apart with a margin of about 8 on one side and 12 on the other."""
    ref, model = small_model(torch.float32, dropout=0.2), small_model(torch.float32, dropout=0.2)
    model.load_state_dict(ref.state_dict())
    convert(model, fused_ln=True)
    idx = torch.randint(0, 65, (2, 16), device=DEVICE)
    logits = []
    for m, seed in ((ref, 8), (model, 8), (model, 9)):
        torch.manual_seed(seed)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            logits.append(m(idx)[0].float())  # (B, T, V)
    scale = logits[0].abs().max()
    assert (logits[1] - logits[0]).abs().max() < 0.03 * scale  # same seed: same masks
    assert (logits[2] - logits[0]).abs().max() > 0.03 * scale  # the check can tell masks apart


def test_activation_checkpointing_takes_the_unfused_blocks():
    model = convert(small_model(torch.float32), fused_ln=True).set_activation_checkpointing(True)
    model.fused_layer_norm = lambda *a: pytest.fail("the fused blocks ran under activation checkpointing")
    idx = torch.randint(0, 65, (2, 16), device=DEVICE)
    _, loss = model(idx, idx)
    assert torch.isfinite(loss)


@pytest.mark.parametrize("where", ["block forward", "block backward", "ln_2", "ln_f", "global"])
def test_fused_blocks_refuse_hooks_they_would_skip(where):
    """The regrouped loop never calls Block.forward or a LayerNorm's forward: a hook on either (FSDP2
    adds one to each block) would silently not run, so the forward pass refuses instead."""
    model = convert(small_model(torch.bfloat16), fused_ln=True)
    block, calls = model.transformer.h[1], []
    hook = lambda *a: calls.append(a) and None  # noqa: E731
    handle = {"block forward": lambda: block.register_forward_pre_hook(hook),
              "block backward": lambda: block.register_full_backward_hook(hook),
              "ln_2": lambda: block.ln_2.register_forward_hook(hook),
              "ln_f": lambda: model.transformer.ln_f.register_forward_pre_hook(hook),
              "global": lambda: torch.nn.modules.module.register_module_forward_pre_hook(hook)}[where]()
    try:
        idx = torch.randint(0, 65, (2, 16), device=DEVICE)
        with pytest.raises(RuntimeError, match="hooks are registered"):
            model(idx, idx)
        _, loss = convert(model)(idx, idx)
        loss.backward()
        assert calls  # unfused, the hook runs
    finally:
        handle.remove()


# ----------------------------------------------------------------------------------------------
# On a GPU
# ----------------------------------------------------------------------------------------------
@pytest.mark.sm80
@pytest.mark.parametrize("config", [(16, 4, 4, "two-pass"), (32, 8, 4, "two-pass"), (16, 8, 8, "two-pass")])
def test_gpu_two_pass_layer_norm_backward_at_gpt2_shape(config):
    """The two-pass kernel compiled, at GPT-2's (12288, 768) and a ragged (1000, 1100): the same
    bounds against float64 as the default kernel (its barrier between the passes is what makes the
    row sums visible to every thread; a missing one would show here, not in the interpreter)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 Triton kernels need compute capability >= 8.0")
    for M, C in ((12288, 768), (1000, 1100)):
        x, dy, dres, w, b, mean, rstd = inputs(M, C, torch.bfloat16, shift=1.0)
        dx, dw, db = layernorm.layer_norm_backward(dy, x, mean, rstd, w, dres, config=config)
        ref_dx, ref_dw, ref_db = float64_grads(x, dy, w, b, dres)
        assert rel_err(dx, ref_dx) < 1e-2 and rel_err(dw, ref_dw) < 1e-5 and rel_err(db, ref_db) < 1e-5


@pytest.mark.sm80
def test_gpu_layer_norm_backward_at_gpt2_shape():
    """GPT-2's (12288, 768) in bf16: dx' within bf16 rounding of float64, dw and db within fp32
    summation error, and the compiled custom operator gives the same tensors as the direct call."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 Triton kernels need compute capability >= 8.0")
    torch.manual_seed(6)
    x, dy, dres, w, b, mean, rstd = inputs(12288, 768, torch.bfloat16, shift=1.0)
    dx, dw, db = layernorm.layer_norm_backward(dy, x, mean, rstd, w, dres)
    ref_dx, ref_dw, ref_db = float64_grads(x, dy, w, b, dres)
    assert rel_err(dx, ref_dx) < 1e-2 and rel_err(dw, ref_dw) < 1e-5 and rel_err(db, ref_db) < 1e-5
    again_dx, again_dwb = layernorm.ln_backward_op(dy, x, mean, rstd, w, dres, False, torch.float32)
    assert torch.equal(again_dx, dx) and torch.equal(again_dwb, torch.stack([dw, db]))
    # with dx' summed for a bias, at the tiles that case runs with: the same dx', and the sum within
    # fp32 summation error (1e-5) of float64's
    dx2, dw2, db2, dbias = layernorm.layer_norm_backward(dy, x, mean, rstd, w, dres, sum_dx=True)
    assert rel_err(dx2, ref_dx) < 1e-2 and rel_err(dw2, ref_dw) < 1e-5 and rel_err(dbias, ref_dx.sum(0)) < 1e-5


def test_fused_blocks_refuse_a_wrapped_block_or_a_norm_subclass():
    """A block wrapped by checkpoint_wrapper, or a LayerNorm subclass with its own forward, would
    not run its own forward in the regrouped loop: refused, with the way out named."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    class ScaledNorm(torch.nn.LayerNorm):
        def forward(self, x):
            return 2 * super().forward(x)

    idx = torch.randint(0, 65, (2, 16), device=DEVICE)
    wrapped = convert(small_model(torch.float32), fused_ln=True)
    wrapped.transformer.h[1] = checkpoint_wrapper(wrapped.transformer.h[1])
    subclassed = convert(small_model(torch.float32), fused_ln=True)
    subclassed.transformer.h[0].ln_2.__class__ = ScaledNorm
    for model, name in ((wrapped, "CheckpointWrapper"), (subclassed, "ScaledNorm")):
        with pytest.raises(RuntimeError, match=f"holds {name} in their place.*mpgpt\\.fast\\.convert\\(model\\)"):
            model(idx, idx)
        _, loss = convert(model)(idx, idx)
        assert torch.isfinite(loss)


def test_a_second_derivative_through_the_fused_layer_norm_is_refused(backward_path):
    """The saved mean and rstd carry no graph, so a second derivative would silently miss their
    terms: asking the backward pass for a graph fails, and says how to turn the fused form off."""
    x, dy, dres, w, b, mean, rstd = inputs(6, 32, torch.bfloat16)
    x.requires_grad_(True)
    ln = torch.nn.LayerNorm(32, device=DEVICE, dtype=torch.bfloat16)
    y = layernorm.residual_layer_norm(x, None, ln)
    with pytest.raises(RuntimeError, match="the fused LayerNorm computes first derivatives only.*create_graph=True.*fast.convert"):
        torch.autograd.grad((y.float() * dy.float()).sum(), x, create_graph=True)
    (g,) = torch.autograd.grad((y.float() * dy.float()).sum(), x)  # the first derivative still works
    assert torch.isfinite(g).all()
