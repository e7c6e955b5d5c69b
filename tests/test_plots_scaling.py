"""Tests for the loss-scaling figures of chapters 4 and 5 in mpgpt/plots.py."""
import math

import matplotlib

matplotlib.use("Agg")  # no display in CI
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from mpgpt import plots  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _bands(ax):
    """(x0, x1) of every shaded vertical band (axvspan draws a Rectangle in data x coordinates)."""
    spans = []
    for patch in ax.patches:
        if hasattr(patch, "get_x") and patch.get_label() and not patch.get_label().startswith("_"):
            if "rounds to 0" in patch.get_label() or "subnormal" in patch.get_label() or "overflow" in patch.get_label():
                spans.append((patch.get_label(), patch.get_x(), patch.get_x() + patch.get_width()))
    return spans


def test_gradient_exponents_draws_fp16_bands_at_the_format_limits():
    g = torch.randn(5000) * 1e-4
    fig = plots.plot_gradient_exponents({"grads": g}, "fp16")
    assert isinstance(fig, Figure)
    bands = {label.split()[0]: (x0, x1) for label, x0, x1 in _bands(fig.axes[0])}
    # Zero below 2^-25 (half the smallest subnormal), subnormal up to 2^-14, overflow from 65504 on.
    assert bands["rounds"][1] == pytest.approx(-25)
    assert bands["subnormal:"] == pytest.approx((-25, -14))
    assert bands["overflow"][0] == pytest.approx(math.log2(65504))


def test_gradient_exponents_bands_follow_the_format():
    fig = plots.plot_gradient_exponents(torch.rand(100) + 0.5, "bf16")
    bands = {label.split()[0]: (x0, x1) for label, x0, x1 in _bands(fig.axes[0])}
    assert bands["subnormal:"][1] == pytest.approx(-126)  # bf16 keeps fp32's exponent range


def test_gradient_exponents_counts_every_nonzero_value_and_reports_zeros():
    g = torch.cat([torch.randn(997), torch.zeros(3), torch.tensor([float("inf")])])
    fig = plots.plot_gradient_exponents({"g": g}, "fp16", xlim=(-40, 20))
    ax = fig.axes[0]
    step_patches = [p for p in ax.patches if p.get_label().startswith("g")]
    assert len(step_patches) == 1 and "3 exact zeros" in step_patches[0].get_label()
    # The drawn histogram holds exactly the nonzero finite values (inf and the zeros are left out):
    # its tallest bar equals the tallest bar of torch's histogram of those values on the same bins.
    kept = g[torch.isfinite(g) & (g != 0)]
    n, _ = torch.histogram(torch.log2(kept.abs().double()).clamp(-40, 20),
                           bins=torch.linspace(-40, 20, 81, dtype=torch.float64))
    assert step_patches[0].get_xy()[:, 1].max() == n.max().item()


def test_gradient_exponents_rejects_empty_and_all_zero_input():
    with pytest.raises(ValueError, match="at least one"):
        plots.plot_gradient_exponents({})
    with pytest.raises(ValueError, match="no exponents"):
        plots.plot_gradient_exponents({"z": torch.zeros(10)})


def test_loss_scale_marks_every_skipped_step_at_its_scale():
    scale = [2.0**16, 2.0**16, 2.0**15, 2.0**15, 2.0**16, 2.0**15]
    skipped = [False, False, True, False, False, True]
    fig = plots.plot_loss_scale(scale, skipped, loss=[3.0, 2.9, float("nan"), 2.8, 2.7, 2.6])
    assert len(fig.axes) == 2
    ax = fig.axes[0]
    crosses = [line for line in ax.lines if line.get_marker() == "x"]
    assert len(crosses) == 1
    assert list(crosses[0].get_xdata()) == [2, 5]
    assert list(crosses[0].get_ydata()) == [15.0, 15.0]  # log2 of the scale after the backoff
    assert "2" in crosses[0].get_label()
    # On the loss panel the nan loss of step 2 is not drawn; step 5 is.
    loss_crosses = [line for line in fig.axes[1].lines if line.get_marker() == "x"]
    assert list(loss_crosses[0].get_xdata()) == [5]


def test_loss_scale_accepts_a_history_and_checks_lengths():
    from mpgpt.train import History

    h = History(scale=[1024.0, 2048.0], skipped=[False, False], loss=[1.0, 0.9])
    assert len(plots.plot_loss_scale(h.scale, h.skipped).axes) == 1
    with pytest.raises(ValueError, match="one entry per step"):
        plots.plot_loss_scale([1.0, 2.0], [False])
    with pytest.raises(ValueError, match="> 0"):
        plots.plot_loss_scale([1.0, 0.0], [False, True])
    with pytest.raises(ValueError, match="at least one"):
        plots.plot_loss_scale([], [])
