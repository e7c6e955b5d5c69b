"""Precision policies: device defaults, refusals with a way out, and O2 master weights."""
import pytest
import torch
from torch import nn

from mpgpt import runtime
from mpgpt.precision import POLICIES, MasterWeights, default_precision, resolve_precision


def _fake_gpu(monkeypatch, capability, name):
    # mpgpt.runtime is where the package asks about the GPU (its docstring says why it is patched there).
    monkeypatch.setattr(runtime, "capability", lambda device=None: capability)
    monkeypatch.setattr(runtime, "device_name", lambda device=None: name)


def test_cpu_default_is_fp32_and_tf32_is_refused():
    assert default_precision("cpu") == "fp32"
    assert resolve_precision(None, "cpu").name == "fp32"
    with pytest.raises(ValueError, match="use fp32"):
        resolve_precision("tf32", "cpu")


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16", "bf16-master", "fp16-master"])
def test_cpu_runs_every_policy_but_tf32(name):
    assert resolve_precision(name, "cpu") is POLICIES[name]


def test_t4_defaults_to_fp16_and_refuses_bf16_naming_the_gpu(monkeypatch):
    # A T4 answers True to torch.cuda.is_bf16_supported() (emulation); the capability says no.
    _fake_gpu(monkeypatch, (7, 5), "Tesla T4")
    assert default_precision("cuda") == "fp16"
    with pytest.raises(ValueError, match=r"Tesla T4 is sm_75.*use fp16"):
        resolve_precision("bf16", "cuda")
    with pytest.raises(ValueError, match="use fp16-master"):
        resolve_precision("bf16-master", "cuda")
    assert resolve_precision("fp16", "cuda").loss_scaling


def test_ampere_defaults_to_bf16(monkeypatch):
    _fake_gpu(monkeypatch, (8, 0), "NVIDIA A100-SXM4-40GB")
    assert default_precision("cuda") == "bf16"
    assert resolve_precision(None, "cuda").autocast_dtype is torch.bfloat16


def test_unknown_precision_lists_choices():
    with pytest.raises(ValueError, match="choose one of fp32, tf32, bf16"):
        resolve_precision("fp8", "cpu")


def test_only_fp16_policies_scale_the_loss():
    assert {n for n, p in POLICIES.items() if p.loss_scaling} == {"fp16", "fp16-master"}


def test_autocast_context_sets_the_dtype_of_a_matmul():
    x = torch.randn(4, 8)
    w = torch.randn(8, 3)
    with resolve_precision("bf16", "cpu").autocast("cpu"):
        assert (x @ w).dtype is torch.bfloat16
    with resolve_precision("fp32", "cpu").autocast("cpu"):
        assert (x @ w).dtype is torch.float32


def test_master_weights_keep_small_updates_that_bf16_weights_lose():
    # Weights near 1.0 in bf16 are spaced 2^-7 apart, so an update of 1e-3 (< half a spacing) rounds
    # away every time in a pure-bf16 weight; the fp32 master accumulates it.
    torch.manual_seed(0)
    pure = nn.Linear(4, 4).to(torch.bfloat16)
    with torch.no_grad():
        pure.weight.fill_(1.0)
    model = nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(1.0)
    mw = MasterWeights(model, torch.bfloat16)
    assert model.weight.dtype is torch.bfloat16 and mw.params[0].dtype is torch.float32
    for _ in range(100):
        with torch.no_grad():
            pure.weight.add_(1e-3)
            mw.params[0].add_(1e-3)
        mw.master_to_model()
    assert torch.all(pure.weight == 1.0)                       # stalled
    assert torch.allclose(mw.params[0], torch.full((4, 4), 1.1), atol=1e-5)
    assert torch.all(model.weight == torch.tensor(1.1).to(torch.bfloat16))  # model follows its master


def test_master_weights_grads_are_fp32_copies():
    model = nn.Linear(5, 3)
    mw = MasterWeights(model, torch.float16)
    x = torch.randn(7, 5, dtype=torch.float16)
    model(x).float().sum().backward()
    mw.grads_to_master()
    for master, p in zip(mw.params, model.parameters()):
        assert master.grad.dtype is torch.float32
        assert torch.equal(master.grad, p.grad.float())
