"""Tests for mpgpt/kernels/partials.py: the last sum of a table of partial sums, rounded once.

The reference is each row of the table summed in float64. The kernel sums in fp32: each row's R
partial sums in 128 lanes, then a tree over the lanes, so about R / 128 + 7 additions lead to each
result and its error stays within that many units of 2^-24 of the row's sum of magnitudes (under
1e-6 of it here); bounded at 1e-5 of it. Stored in fp16 or bf16 the result carries one more
rounding, at most half a unit in the last place: 2^-11 or 2^-8 relative, plus 2^-25 absolute where
an fp16 result is subnormal. Each bound is far below what a partial sum left out or counted twice
gives: about 1 / R of the row's sum of magnitudes, 2.6e-3 at R = 384.
"""

import pytest
import torch

from mpgpt.kernels import env, partials
from mpgpt.fast import heads, layernorm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.skipif(env.TRITON_IMPORT_ERROR is not None, reason=str(env.TRITON_IMPORT_ERROR))

ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float64: 2.0**-23}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(1536, 384), (37, 5), (3, 129), (1, 1), (17, 256)])
def test_each_row_is_summed_and_rounded_once(shape, dtype):
    """Shapes cover a table as LayerNorm leaves it at GPT-2's size, rows not a multiple of the
    block, and partial sums on both sides of the loop's step."""
    part = torch.randn(*shape, device=DEVICE)
    got = partials.sum_partials(part, dtype)
    assert got.dtype == dtype and got.shape == (shape[0],)
    ref = part.double().sum(1)
    bound = 1e-5 * part.double().abs().sum(1) + ULP[dtype] / 2 * ref.abs() + 2.0**-25
    assert ((got.double() - ref).abs() <= bound).all()


def test_the_rounding_happens_once_after_the_fp32_sum():
    """The 16-bit results are the fp32 result rounded: nothing was rounded on the way."""
    part = torch.randn(300, 200, device=DEVICE)
    fp32 = partials.sum_partials(part)
    for dtype in (torch.float16, torch.bfloat16):
        assert torch.equal(partials.sum_partials(part, dtype), fp32.to(dtype))


def test_the_sum_is_the_same_on_every_call():
    part = torch.randn(1536, 384, device=DEVICE)
    assert torch.equal(partials.sum_partials(part), partials.sum_partials(part))


def test_a_table_with_no_rows_or_no_partial_sums():
    assert partials.sum_partials(torch.empty(0, 4, device=DEVICE)).shape == (0,)
    got = partials.sum_partials(torch.empty(5, 0, device=DEVICE), torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, torch.zeros(5, dtype=torch.bfloat16, device=DEVICE))


def test_a_table_that_is_not_2d_fp32_is_refused():
    with pytest.raises(ValueError, match=r"\(N, R\) fp32 table"):
        partials.sum_partials(torch.randn(4, device=DEVICE))
    with pytest.raises(ValueError, match=r"\(N, R\) fp32 table"):
        partials.sum_partials(torch.randn(4, 3, device=DEVICE).half())


def test_the_one_pass_kernels_hand_back_their_column_sums_in_the_dtype_asked():
    """LayerNorm's dw and db, and the head merge's db, in bf16 are their fp32 results rounded once."""
    M, C = 200, 48
    x, dy, dres = (torch.randn(M, C, device=DEVICE) for _ in range(3))
    w = 1 + 0.2 * torch.randn(C, device=DEVICE)
    var, mean = torch.var_mean(x, dim=1, correction=0)
    rstd = torch.rsqrt(var + 1e-5)
    _, dwb32 = layernorm._layer_norm_backward_packed(dy, x, mean, rstd, w, dres)
    _, dwb16 = layernorm._layer_norm_backward_packed(dy, x, mean, rstd, w, dres, dwb_dtype=torch.bfloat16)
    assert dwb32.dtype == torch.float32 and torch.equal(dwb16, dwb32.to(torch.bfloat16))
    dq, dk, dv = (torch.randn(2, 3, 7, 16, device=DEVICE) for _ in range(3))
    _, db32 = heads.merge_heads_bias(dq, dk, dv)
    _, db16 = heads.merge_heads_bias(dq, dk, dv, db_dtype=torch.bfloat16)
    assert torch.equal(db16, db32.to(torch.bfloat16))


@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32])
def test_the_fused_layers_ask_for_their_parameters_dtype(bias_dtype, monkeypatch):
    """In a bf16 model, LayerNorm's backward, GELU's and the head merge ask for their column sums in
    bf16, so no cast follows them; where a bias is kept in fp32 beside a bf16 weight, they ask for
    fp32. Either way every gradient arrives in its parameter's dtype."""
    from mpgpt.fast import mlp, qkv
    from test_mlp import small_model

    model = small_model(torch.bfloat16)
    if bias_dtype != torch.bfloat16:  # the biases whose gradients these three passes make
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in ("ln_1", "ln_2", "ln_f", "c_attn", "c_fc"):
                module.bias = torch.nn.Parameter(module.bias.detach().to(bias_dtype))
    from mpgpt.fast import convert

    convert(model, fused_ln=True, triton="mlp+qkv")
    asked = {"layer norm": [], "gelu": [], "merge": []}
    for module, name, key in ((layernorm, "ln_backward_impl", "layer norm"), (mlp, "gelu_backward_impl", "gelu"),
                              (qkv, "merge_heads_impl", "merge")):
        impl = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=impl, _k=key: asked[_k].append(a[-1]) or _f(*a))
    idx = torch.randint(0, 65, (2, 16), device=DEVICE)
    model(idx, idx.roll(1, 1))[1].backward()
    # 2 blocks: 5 LayerNorms (ln_1, ln_2 each, and ln_f), 2 MLPs, 2 attention inputs
    assert asked == {"layer norm": [bias_dtype] * 5, "gelu": [bias_dtype] * 2, "merge": [bias_dtype] * 2}
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype, name
