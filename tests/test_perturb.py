"""scripts/perturb.py: the stand-in for another CPU's summation order that the checked notebook
outputs are proven against. It must move what another order can move, by a few ulps, and nothing
else; and repeat itself, as a deterministic CPU does."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import perturb  # noqa: E402


@pytest.fixture
def mode():
    m = perturb.Perturb(seed=3, ulps=2)
    with m:
        yield m


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()


def test_products_move_by_at_most_two_ulps_and_most_of_them_move(mode):
    torch.manual_seed(0)
    a, b = torch.randn(64, 48), torch.randn(48, 32)
    with torch._C._DisableTorchDispatch():
        exact = a @ b
    moved = a @ b
    apart = ulps_apart(moved, exact)
    assert apart.max() <= 2 and (apart > 0).float().mean() > 0.5


def test_the_same_computation_repeats_its_bits_and_another_seed_differs():
    torch.manual_seed(0)
    a = torch.randn(32, 32)
    with perturb.Perturb(seed=1):
        first, again = a @ a, a.clone() @ a.clone()
    with perturb.Perturb(seed=2):
        other = a @ a
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_exact_results_and_16_bit_results_are_left_alone(mode):
    assert torch.ones(1000).sum().item() == 1000.0                 # a count: every order gets it right
    assert (torch.full((64, 64), 0.5) @ torch.full((64, 64), 2.0) == 64.0).all()
    h = torch.randn(16, 16).bfloat16()
    with torch._C._DisableTorchDispatch():
        exact16 = h @ h
    assert torch.equal(h @ h, exact16)                              # fp32 accumulation, one rounding


def test_no_finite_value_becomes_inf_nan_or_changes_sign():
    m = perturb.Perturb(seed=0, ulps=2, wide=True)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        info = torch.finfo(dtype)
        x = torch.tensor([0.0, -0.0, info.tiny * 2**-10, -info.tiny * 2**-10, info.max, -info.max, 1.5, -2.5]).to(dtype)
        for _ in range(50):
            y = m._move(x, "op", (torch.randn(3),))
            assert torch.isfinite(y).all() and torch.equal(torch.signbit(y), torch.signbit(x)), (dtype, y)
