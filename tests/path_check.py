"""Shared fixture body for the fused layers' two backward paths (test_qkv, test_layernorm): run a
test once on the torch ops and once on the Triton pass, and check that the path named, and only it,
was taken.

A GPU takes the Triton pass by itself where the dtype allows; on a CPU it is forced, and the
kernel runs in Triton's interpreter."""
import pytest
import torch


def take_path(path, monkeypatch, device, gate_owner, gate, spied_owner, triton_fn, torch_fn):
    """Make ``gate_owner.gate`` (the module-level switch that picks the Triton pass) choose ``path``
    ("torch" or "triton"), and spy on ``spied_owner.triton_fn`` and ``spied_owner.torch_fn``.
    Returns the spies' record, for `assert_took`."""
    calls = {"triton": [], "torch": []}
    if path == "triton":
        if device == "cpu":
            monkeypatch.setattr(gate_owner, gate, lambda *t: True)
        elif not getattr(gate_owner, gate)(torch.empty(1, device=device, dtype=torch.bfloat16)):
            pytest.skip("bf16 Triton kernels need compute capability >= 8.0")
    elif device == "cuda":
        monkeypatch.setattr(gate_owner, gate, lambda *t: False)
    for which, name in (("triton", triton_fn), ("torch", torch_fn)):
        fn = getattr(spied_owner, name)
        monkeypatch.setattr(spied_owner, name, lambda *a, _f=fn, _c=calls[which], **kw: _c.append(a) or _f(*a, **kw))
    return calls


def assert_took(calls, path):
    other = "torch" if path == "triton" else "triton"
    assert calls[path] and not calls[other], f"expected the {path} path only, got {[k for k, v in calls.items() if v]}"
