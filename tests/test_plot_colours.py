"""Every figure mpgpt/plots.py draws gives each legend entry its own colour.

A reader matches a curve, a bar or a point to its legend entry by colour; two entries drawn in one
colour (a line style or a marker is easy to miss, and lost in print) make the figure ambiguous. Each
figure function is called here with the data the book gives it (the shipped records) or with
random data of the same shape, and the colour of every legend handle is compared.
"""
import random
import re

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

from mpgpt import plots  # noqa: E402
from mpgpt.results import load_record  # noqa: E402
from mpgpt.train import History  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _colour(handle) -> str:
    """The colour a legend handle shows (line colour, bar face, marker face)."""
    if hasattr(handle, "get_color") and not hasattr(handle, "get_facecolor"):
        return to_hex(handle.get_color())
    face = handle.get_facecolor()
    if hasattr(face, "ndim") and face.ndim == 2:  # a scatter's PathCollection: one row per point
        face = face[0]
    return to_hex(face)


def legend_colours(fig) -> list[list[tuple[str, str]]]:
    """(label, colour) of every entry of every legend in a figure, one list per legend."""
    found = []
    legends = [ax.get_legend() for ax in fig.axes] + list(fig.legends)
    for legend in legends:
        if legend is None:
            continue
        handles = getattr(legend, "legend_handles", None) or legend.legendHandles
        labels = [t.get_text() for t in legend.get_texts()]
        found.append([(label, _colour(h)) for label, h in zip(labels, handles)])
    return found


def series_of(label: str) -> str:
    """The series a legend entry belongs to: `plot_loss_curves` labels one run's training line and
    its validation dots "NAME (train...)" and "NAME (validation)" — one run, one colour."""
    return re.sub(r" \((train\b[^)]*|validation)\)$", "", label)


def shared_colours(fig) -> list[str]:
    """Human-readable descriptions of the legend entries that share a colour."""
    problems = []
    for entries in legend_colours(fig):
        by_colour: dict = {}
        for label, colour in entries:
            by_colour.setdefault(colour, set()).add(series_of(label))
        problems += [f"{colour}: {sorted(labels)}" for colour, labels in by_colour.items() if len(labels) > 1]
    return problems


def _history(n=30):
    return History(step=list(range(n)), loss=(torch.rand(n) + torch.linspace(3, 1, n)).tolist(),
                   val_step=[n // 2, n - 1], val_loss=(torch.rand(2) + 1).tolist())


def _kernel_result(kernels):
    rng = random.Random()
    rows = []
    for label, M, N, K in [("a", 128, 256, 64), ("b", 4096, 4096, 4096)]:
        ms = rng.uniform(0.01, 2.0)
        flops = 2.0 * M * N * K
        row = {"shape": label, "M": M, "N": N, "K": K, "cublas_ms": ms, "cublas_tflops": flops / ms * 1e-9}
        for k in kernels:
            kms = ms / rng.uniform(0.3, 1.1)
            row[k] = {"ms": kms, "tflops": flops / kms * 1e-9, "vs_cublas": ms / kms}
        rows.append(row)
    return {"environment": {"gpu": "Test GPU", "date": "2026-01-02"}, "kernels": list(kernels), "matmul": rows}


FIGURES = {
    "plot_bit_layouts": lambda: plots.plot_bit_layouts(),
    "plot_value_bits": lambda: plots.plot_value_bits(random.uniform(-10, 10)),
    "plot_representable": lambda: plots.plot_representable(["e4m3fn", "e5m2"]),
    "plot_accumulation": lambda: plots.plot_accumulation([1e-4] * 3000),
    "plot_loss_curves": lambda: plots.plot_loss_curves(
        {f"run {i}": _history() for i in range(6)}, floors={"floor a": 1.0, "floor b": 0.5, "floor c": 2.0}),
    "plot_gradient_exponents": lambda: plots.plot_gradient_exponents(
        {f"sample {i}": torch.randn(500) * 2.0 ** -(8 * i) for i in range(4)}, "fp16"),
    "plot_loss_scale": lambda: plots.plot_loss_scale([2.0**16] * 10 + [2.0**15] * 10,
                                                     [False] * 9 + [True] + [False] * 10,
                                                     loss=torch.rand(20).tolist()),
    "plot_kernel_tflops (record)": lambda: plots.plot_kernel_tflops(load_record("kernels-h200")),
    "plot_kernel_tflops (unknown kernels)": lambda: plots.plot_kernel_tflops(
        _kernel_result(["grouped", "tma", "ws", "auto", "new_a", "new_b"])),
    "plot_roofline (record)": lambda: plots.plot_roofline(load_record("kernels-h200"), bandwidth_tbs=4.3,
                                                          extra={"decode": (1, 3072, 768)}),
    "plot_roofline (unknown kernels)": lambda: plots.plot_roofline(
        _kernel_result(["grouped", "tma", "ws", "auto", "new_a", "new_b"]), bandwidth_tbs=3.0),
    "plot_train_ladder": lambda: plots.plot_train_ladder(
        load_record("train-h200"), anchors={"anchor a": 4e5, "anchor b": 5e5, "anchor c": 6e5, "anchor d": 3e5}),
    "plot_train_benchmark": lambda: plots.plot_train_benchmark(load_record("train-h200")),
    "plot_batch_sweep": lambda: plots.plot_batch_sweep(load_record("train-h200")),
    "plot_real_run": lambda: plots.plot_real_run(load_record("train-h200"), floor=0.88),
}


@pytest.mark.parametrize("name", FIGURES)
def test_every_legend_entry_has_its_own_colour(name):
    try:
        fig = FIGURES[name]()
    except ValueError as exc:  # a record without the rows this figure needs
        pytest.skip(f"{name}: {exc}")
    assert not shared_colours(fig), f"{name}: legend entries share a colour: {shared_colours(fig)}"


def test_the_checker_sees_a_shared_colour():
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1], color="#d62728", label="a")
    ax.plot([0, 1], [1, 0], color="#d62728", linestyle="--", label="b")
    ax.bar([0], [1], color="#1f77b4", label="c")
    ax.scatter([0], [1], color="#1f77b4", label="d")
    ax.legend()
    assert sorted(shared_colours(fig)) == ["#1f77b4: ['c', 'd']", "#d62728: ['a', 'b']"]
    # one run's training line and its validation dots are one series, in one colour
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1], color="#d62728", label="fp16 (train)")
    ax.scatter([1], [1], color="#d62728", label="fp16 (validation)")
    ax.legend()
    assert shared_colours(fig) == []


def test_every_figure_function_is_covered():
    drawn = {name.split(" ")[0] for name in FIGURES}
    functions = {n for n in dir(plots) if n.startswith("plot_") and callable(getattr(plots, n))}
    assert functions <= drawn, f"figure functions without a colour check: {sorted(functions - drawn)}"
