"""Tests for the chapter 2-3 plotting helpers in mpgpt/plots.py (loss curves, benchmark figures)."""
import matplotlib

matplotlib.use("Agg")  # no display in tests

import matplotlib.pyplot as plt
import pytest
import torch

from mpgpt import plots
from mpgpt.train import History


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _history(n=20, n_val=3):
    losses = (torch.rand(n) + torch.linspace(3.0, 1.0, n)).tolist()
    val_steps = [(i + 1) * n // n_val for i in range(n_val)]
    return History(step=list(range(n)), loss=losses, val_step=val_steps, val_loss=torch.rand(n_val).add(1).tolist())


def test_moving_average_is_a_trailing_mean():
    values = torch.rand(50).tolist()
    out = plots.moving_average(values, 5)
    assert len(out) == len(values)
    assert out[0] == pytest.approx(values[0])
    assert out[2] == pytest.approx(sum(values[:3]) / 3)
    for i in range(4, 50):
        assert out[i] == pytest.approx(sum(values[i - 4 : i + 1]) / 5)
    assert plots.moving_average(values, 1) == values


def test_loss_curves_draws_runs_validation_and_floors():
    h = _history()
    pair = (list(range(10)), torch.rand(10).tolist())
    fig = plots.plot_loss_curves({"a": h, "b": pair}, floors={"floor": 0.88, "unigram": 3.0})
    ax = fig.axes[0]
    labels = [line.get_label() for line in ax.get_lines()]
    assert "a (train)" in labels and "a (validation)" in labels and "b" in labels
    val_line = ax.get_lines()[labels.index("a (validation)")]
    assert list(val_line.get_xdata()) == h.val_step and list(val_line.get_ydata()) == h.val_loss
    horizontal = [line for line in ax.get_lines() if list(line.get_ydata()) in ([0.88, 0.88], [3.0, 3.0])]
    assert len(horizontal) == 2
    assert any("floor: 0.880" in t.get_text() for t in ax.texts)


def test_loss_curves_smoothing_and_existing_axes():
    h = _history(n=30, n_val=0)
    fig, (left, right) = plt.subplots(1, 2)
    out = plots.plot_loss_curves({"run": h}, smooth=10, ax=right, logy=True)
    assert out is fig
    assert not left.get_lines()
    raw, smoothed = right.get_lines()[:2]
    assert list(raw.get_ydata()) == h.loss
    assert list(smoothed.get_ydata()) == pytest.approx(plots.moving_average(h.loss, 10))
    assert right.get_yscale() == "log"


def test_loss_curves_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one run"):
        plots.plot_loss_curves({})
    with pytest.raises(ValueError, match="smooth"):
        plots.plot_loss_curves({"a": _history()}, smooth=0)
    with pytest.raises(ValueError, match="3 steps but 2 losses"):
        plots.plot_loss_curves({"a": ([0, 1, 2], [1.0, 2.0])})


def _result():
    ms = torch.rand(3).add(1).mul(100).tolist()
    return {
        "environment": {"gpu": "NVIDIA H200", "torch": "2.13.0"},
        "rows": [
            {"config": "fp32", "preset": "gpt2", "batch_size": 12, "ms_per_step_median": ms[0], "peak_memory_gib": 40.0},
            {"config": "tf32", "batch_size": 12, "error": "out of memory"},
            {"config": "bf16", "preset": "gpt2", "batch_size": 12, "ms_per_step_median": ms[1], "peak_memory_gib": 25.5},
            {"config": "fp16", "preset": "gpt2", "batch_size": 12, "ms_per_step_median": ms[2], "peak_memory_gib": 25.0},
        ],
    }


def test_train_benchmark_plots_successful_rows_in_order():
    result = _result()
    fig = plots.plot_train_benchmark(result)
    ax_t, ax_m = fig.axes
    widths = [p.get_width() for p in ax_t.patches]
    ok = [r for r in result["rows"] if "error" not in r]
    assert widths == pytest.approx([r["ms_per_step_median"] for r in ok])
    assert [p.get_width() for p in ax_m.patches] == pytest.approx([40.0, 25.5, 25.0])
    assert "NVIDIA H200" in fig._suptitle.get_text() and "2.13.0" in fig._suptitle.get_text()

    fig = plots.plot_train_benchmark(result, configs=["fp16", "fp32", "tf32", "missing"])
    assert [p.get_width() for p in fig.axes[0].patches] == pytest.approx(
        [result["rows"][3]["ms_per_step_median"], result["rows"][0]["ms_per_step_median"]])


def test_train_benchmark_without_memory_or_rows():
    result = _result()
    for r in result["rows"]:
        r.pop("peak_memory_gib", None)
    fig = plots.plot_train_benchmark(result)
    assert not fig.axes[1].patches
    with pytest.raises(ValueError, match="no successful rows"):
        plots.plot_train_benchmark({"environment": {}, "rows": [{"config": "fp32", "error": "out of memory"}]})
