"""kernels_available answers for the dtype asked: a T4 (sm_75) runs the fp16 kernels, not the bf16
ones, so chapter 10's bf16 kernel cell skips there with the reason instead of stopping."""
import pytest
import torch

from mpgpt.kernels import env


@pytest.mark.parametrize("cc, dtype, ok", [((7, 5), torch.bfloat16, False), ((7, 5), torch.float16, True),
                                           ((7, 5), None, True), ((8, 0), torch.bfloat16, True)])
def test_kernels_available_on_a_pretend_gpu(monkeypatch, cc, dtype, ok):
    if env.TRITON_IMPORT_ERROR is not None:
        pytest.skip(env.TRITON_IMPORT_ERROR)
    monkeypatch.setattr(env, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(env, "capability", lambda device=None: cc)
    monkeypatch.setattr(env, "device_name", lambda device=None: "Pretend GPU")
    got, why = env.kernels_available(dtype)
    assert got == ok, why
    assert "\n" not in why and (ok or "sm_80" in why)
