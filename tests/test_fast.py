"""Tests for mpgpt/fast: the converter keeps every Parameter and state_dict key, so a checkpoint
moves between the reference model and the fast one, and converting back gives the reference again."""
import pytest
import torch

from mpgpt.checkpoint import load_checkpoint, save_checkpoint
from mpgpt.fast import FastGPT, convert, to_reference
from mpgpt.model import GPT, MLP, CausalSelfAttention, GPTConfig
from mpgpt.recipe import parse

FASTEST = parse("fastest").convert_options()


def tiny(**overrides):
    return GPT(GPTConfig.preset("tiny", vocab_size=64, n_layer=2, n_embd=32, n_head=2, block_size=16, **overrides))


def test_the_converter_keeps_the_parameters_and_the_keys_and_undoes_itself():
    model = tiny()
    keys, params = list(model.state_dict()), {n: p for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters())  # built before: must keep working after
    convert(model, **FASTEST)
    assert type(model) is FastGPT and list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    idx = torch.randint(0, 64, (2, 16))
    _, loss = model(idx, idx)
    loss.backward()
    optimizer.step()
    to_reference(model)
    assert type(model) is GPT and list(model.state_dict()) == keys
    assert all(type(b.attn) is CausalSelfAttention and type(b.mlp) is MLP for b in model.transformer.h)
    assert not any(hasattr(model, a) for a in ("fused_loss", "fused_layer_norm", "fused_embedding"))


def test_a_checkpoint_moves_between_the_reference_and_the_fast_model(tmp_path):
    """Saved from the fast model, loaded into a fresh reference (and back): the same tensors, and the
    same fp32 loss up to the order of sums (the fused loss and LayerNorm sum in another order)."""
    fast = convert(tiny(), **FASTEST)
    idx = torch.randint(0, 64, (2, 16))
    save_checkpoint(tmp_path / "fast.pt", {"model": fast.state_dict()})
    reference = tiny()
    reference.load_state_dict(load_checkpoint(tmp_path / "fast.pt")["model"])
    for (name, a), b in zip(fast.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name
    torch.testing.assert_close(reference(idx, idx)[1], fast(idx, idx)[1], rtol=1e-5, atol=1e-6)
    save_checkpoint(tmp_path / "reference.pt", {"model": reference.state_dict()})
    again = convert(tiny(), **FASTEST)
    again.load_state_dict(load_checkpoint(tmp_path / "reference.pt")["model"])
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), reference.state_dict().values()))


def test_the_converter_refuses_what_it_cannot_convert_before_changing_anything():
    class Mine(GPT):
        pass

    with pytest.raises(TypeError, match="convert takes an mpgpt.model.GPT, got Mine"):
        convert(Mine(tiny().config), fused_loss=True)
    model = tiny(bias=False)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untied
    with pytest.raises(RuntimeError, match="share one matrix"):
        convert(model, triton="mlp", fused_emb=True)
    assert type(model) is GPT and all(type(b.mlp) is MLP for b in model.transformer.h)  # untouched
    with pytest.raises(ValueError, match="pass fused_ln=True too"):
        convert(tiny(), bias_in_add=True)
