"""Chunked output layer + cross-entropy against the plain F.cross_entropy(x @ W.T) reference."""
import pytest
import torch
import torch.nn.functional as F

from mpgpt.fast import convert
from mpgpt.fused_loss import chunked_linear_cross_entropy
from mpgpt.model import GPT, GPTConfig


def _inputs(N=37, C=16, V=50, dtype=torch.float32):
    x = torch.randn(N, C, dtype=dtype, requires_grad=True)
    w = torch.randn(V, C, dtype=dtype, requires_grad=True)
    t = torch.randint(0, V, (N,))
    t[::5] = -1  # some ignored positions
    return x, w, t


@pytest.mark.parametrize("chunk_rows", [1, 8, 37, 1000])
def test_matches_the_full_logits_reference_in_float64(chunk_rows):
    # Same maths, different summation order: in float64 the two agree to ~1e-12.
    x, w, t = _inputs(dtype=torch.float64)
    ref = F.cross_entropy(x @ w.t(), t, ignore_index=-1)
    gx_ref, gw_ref = torch.autograd.grad(ref * 3.0, (x, w))  # an upstream gradient other than 1 (a loss scale)
    out = chunked_linear_cross_entropy(x, w, t, chunk_rows)
    gx, gw = torch.autograd.grad(out * 3.0, (x, w))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-10, atol=1e-12)


def test_under_bf16_autocast_it_tracks_the_autocast_reference():
    # Both run the matmuls on bf16 inputs (8 significant bits, eps 2^-8 ~ 3.9e-3); gradients differ
    # by where the bf16 rounding of g happens, so compare with a bf16-sized relative tolerance.
    x, w, t = _inputs(N=64, C=32, V=80)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy((x @ w.t()).float(), t, ignore_index=-1)
        out = chunked_linear_cross_entropy(x, w, t, 16)
    gx_ref, gw_ref = torch.autograd.grad(ref, (x, w))
    gx, gw = torch.autograd.grad(out, (x, w))
    assert abs(out.item() - ref.item()) / ref.item() < 1e-3
    for g, r in ((gx, gx_ref), (gw, gw_ref)):
        assert g.dtype is torch.float32
        assert ((g - r).norm() / r.norm()).item() < 2e-2


def test_the_model_gives_the_same_loss_and_gradients_in_chunked_mode():
    cfg = GPTConfig.preset("tiny", vocab_size=40, n_layer=1, n_embd=32, n_head=2, block_size=16)
    model = GPT(cfg)
    idx, tgt = torch.randint(0, 40, (3, 16)), torch.randint(0, 40, (3, 16))
    logits, loss = model(idx, tgt)
    loss.backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits2, loss2 = convert(model, chunked_loss=7)(idx, tgt)
    loss2.backward()
    assert logits is not None and logits2 is None
    torch.testing.assert_close(loss2, loss, rtol=1e-6, atol=1e-6)  # fp32, different summation order
    for g, p in zip(ref, model.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)


def test_bad_shapes_are_refused():
    x, w, t = _inputs()
    with pytest.raises(ValueError, match="expected x"):
        chunked_linear_cross_entropy(x, w[:, :3], t)
    with pytest.raises(ValueError, match="chunk_rows"):
        chunked_linear_cross_entropy(x, w, t, 0)


def test_a_second_derivative_is_refused_not_silently_wrong():
    """The gradients are computed in the forward pass and only rescaled in the backward pass, so they
    carry no graph: create_graph=True is refused, with the way back to full logits named."""
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(11, 8, requires_grad=True)
    t = torch.randint(0, 11, (6,))
    loss = chunked_linear_cross_entropy(x, w, t, 4)
    with pytest.raises(RuntimeError, match=r"first derivatives only.*mpgpt\.fast\.convert\(model\)"):
        torch.autograd.grad(loss, x, create_graph=True)
    (g,) = torch.autograd.grad(chunked_linear_cross_entropy(x, w, t, 4), x)
    assert torch.isfinite(g).all()
