"""Figures and widgets the chapters share (matplotlib; ipywidgets for the explorers).

Every plotting function returns its matplotlib Figure, so a notebook cell shows it and the book
renders it from the committed output. Widgets do not render in the static book: each one has a
static figure that shows the same thing.

Chapter 1 (number formats): `plot_bit_layouts`, `plot_value_bits`, `plot_representable`,
`plot_accumulation`, `format_explorer`.

Chapters 2 and 3 (training): `plot_loss_curves` (runs against loss floors), `plot_train_benchmark`
(step time and peak memory from a `python -m mpgpt.bench train` result).
Chapters 4 and 5 (loss scaling): `plot_gradient_exponents`, `plot_loss_scale`.
Chapter 6 (Triton kernels): `arithmetic_intensity`, `plot_kernel_tflops`, `plot_roofline`.
Chapter 7 (putting it together): `ladder_rows`, `plot_train_ladder`, `plot_batch_sweep`,
`plot_real_run` (the recorded GPT-2-small training ladder).

Functions take data (tensors, Histories, result dicts), never file names: mpgpt.results loads
records and result files.
"""
from __future__ import annotations

import html

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from mpgpt import formats as F
from mpgpt.results import describe as describe_result

FIELD_COLORS = {"sign": "#e07a5f", "exponent": "#81b29a", "mantissa": "#3d85c6"}
FORMAT_COLORS = {"fp32": "#222222", "fp16": "#d62728", "bf16": "#1f77b4",
                 "e4m3fn": "#9467bd", "e5m2": "#ff7f0e"}


def _field_of_bit(i: int, f: F.FloatFormat) -> str:
    """Which field bit i (0 = most significant) belongs to."""
    return "sign" if i == 0 else "exponent" if i <= f.exponent_bits else "mantissa"


def _draw_bits(ax, f: F.FloatFormat, y: float, pattern: str | None = None) -> None:
    """One row of unit boxes, one per bit, colored by field; digits written in if given."""
    digits = pattern.replace("|", "") if pattern else None
    for i in range(f.total_bits):
        ax.add_patch(Rectangle((i, y), 1, 0.8, facecolor=FIELD_COLORS[_field_of_bit(i, f)],
                               edgecolor="white", linewidth=1.0))
        if digits:
            ax.text(i + 0.5, y + 0.4, digits[i], ha="center", va="center", fontsize=8, color="white")


def plot_bit_layouts(formats=None) -> Figure:
    """The bit layout of each format: sign, exponent and mantissa boxes, with range and eps."""
    fs = [F.get_format(f) for f in (formats or F.FORMATS)]
    fig, ax = plt.subplots(figsize=(11, 0.75 * len(fs) + 0.8))
    for row, f in enumerate(fs):
        y = len(fs) - 1 - row
        _draw_bits(ax, f, y)
        ax.text(-0.6, y + 0.4, f.name, ha="right", va="center", fontsize=11, fontweight="bold")
        ax.text(f.total_bits + 0.6, y + 0.4,
                f"1+{f.exponent_bits}+{f.mantissa_bits} bits   max {f.max_finite:.3g}   "
                f"eps {f.eps:.2g}", ha="left", va="center", fontsize=9)
    for label, color in FIELD_COLORS.items():
        ax.add_patch(Rectangle((0, 0), 0, 0, facecolor=color, label=label))
    ax.legend(loc="upper center", bbox_to_anchor=(0.35, 0.0), ncol=3, frameon=False)
    ax.set_xlim(-6, 52)
    ax.set_ylim(-0.3, len(fs))
    ax.axis("off")
    ax.set_title("Bit layouts: sign | exponent | mantissa")
    fig.tight_layout()
    return fig


def plot_value_bits(x: float, formats=None) -> Figure:
    """What a number becomes in each format: its bits, the stored value and the relative error.
    The static twin of `format_explorer`."""
    fs = [F.get_format(f) for f in (formats or F.FORMATS)]
    fig, ax = plt.subplots(figsize=(11, 0.75 * len(fs) + 0.8))
    for row, f in enumerate(fs):
        y = len(fs) - 1 - row
        _draw_bits(ax, f, y, F.bits(x, f))
        ax.text(-0.6, y + 0.4, f.name, ha="right", va="center", fontsize=11, fontweight="bold")
        stored = F.round_to(x, f)
        rel = F.rounding_error(x, f, relative=True)
        ax.text(f.total_bits + 0.6, y + 0.4, f"{stored:.8g}   (rel. error {rel:+.1e})",
                ha="left", va="center", fontsize=9)
    ax.set_xlim(-6, 56)
    ax.set_ylim(-0.1, len(fs))
    ax.axis("off")
    ax.set_title(f"x = {x!r} stored in each format")
    fig.tight_layout()
    return fig


def plot_representable(formats=("e4m3fn", "e5m2")) -> Figure:
    """Every positive finite value of small formats on a log axis: the gaps double each binade,
    so the relative spacing stays the same; subnormals thin out at the bottom."""
    fs = [F.get_format(f) for f in formats]
    fig, ax = plt.subplots(figsize=(10, 0.9 * len(fs) + 1))
    for row, f in enumerate(fs):
        if f.total_bits > 8:
            raise ValueError(f"plot_representable enumerates every value; {f.name} has too many")
        decoded = [F.decode_bits(p, f) for p in range(2 ** (f.total_bits - 1))]  # sign bit 0
        normal = [float(d.value) for d in decoded if d.kind == "normal"]
        sub = [float(d.value) for d in decoded if d.kind == "subnormal"]
        y = len(fs) - 1 - row
        ax.vlines(normal, y - 0.3, y + 0.3, color=FORMAT_COLORS.get(f.name, "k"), linewidth=0.8)
        ax.vlines(sub, y - 0.3, y + 0.3, color="gray", linewidth=0.8)
        ax.text(f.smallest_subnormal / 2, y, f.name, ha="right", va="center", fontweight="bold")
    ax.set_xscale("log", base=2)
    ax.set_yticks([])
    ax.set_xlabel("value (log scale); gray = subnormal")
    ax.set_title("Every positive finite fp8 value")
    ax.set_ylim(-0.7, len(fs) - 0.3)
    fig.tight_layout()
    return fig


DEFAULT_ACCUMULATION_CASES = (("fp32", None), ("fp16", None), ("bf16", None),
                              ("fp16", "fp32"), ("bf16", "fp32"))
# 16-bit values summed into an fp32 accumulator: a lighter shade of the format's own color.
MIXED_ACCUMULATION_COLORS = {("fp16", "fp32"): "#ff9896", ("bf16", "fp32"): "#9ecae1",
                             ("e4m3fn", "fp32"): "#c5b0d5", ("e5m2", "fp32"): "#ffbb78"}


def plot_accumulation(values, cases=DEFAULT_ACCUMULATION_CASES) -> Figure:
    """Running sums of `values` for each (storage format, accumulator format) case, against the
    exact (float64) running sum."""
    import torch

    v = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    steps = torch.arange(1, v.numel() + 1)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(steps, torch.cumsum(v, 0), color="0.6", linewidth=4, alpha=0.5, label="exact (fp64)")
    for fmt, acc in cases:
        f = F.get_format(fmt)
        partial = F.running_sum(v, f, acc)
        label = f"{f.name} values, {F.get_format(acc).name if acc else f.name} accumulator"
        acc_name = F.get_format(acc).name if acc else f.name
        color = (FORMAT_COLORS.get(f.name) if acc_name == f.name
                 else MIXED_ACCUMULATION_COLORS.get((f.name, acc_name)))
        ax.plot(steps, partial, color=color,
                linestyle="--" if acc else "-", label=f"{label}: {float(partial[-1]):.4g}")
    ax.set_xlabel("number of values added")
    ax.set_ylabel("running sum")
    ax.set_title("Summing many small numbers, one at a time")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def explorer_html(x: float, formats=None) -> str:
    """The explorer's table for one number, as HTML: bits (colored by field), stored value,
    neighbours and rounding error in each format."""
    fs = [F.get_format(f) for f in (formats or F.FORMATS)]
    rows = []
    for f in fs:
        pattern = F.bits(x, f)
        s, e, m = pattern.split("|")
        colored = "".join(
            f'<span style="background:{FIELD_COLORS[field]};color:white;padding:0 2px">{d}</span>'
            for field, d in (("sign", s), ("exponent", e), ("mantissa", m)))
        d = F.decode(x, f)
        stored = F.round_to(x, f)
        try:
            lo, hi = F.neighbors(x, f)
            around = f"{lo:.6g} … {hi:.6g}"
        except (ValueError, OverflowError):
            around = "–"
        rel = F.rounding_error(x, f, relative=True)
        rows.append(f"<tr><td><b>{f.name}</b></td><td style='font-family:monospace'>{colored}</td>"
                    f"<td>{d.kind}</td><td>{stored:.10g}</td><td>{html.escape(around)}</td>"
                    f"<td>{rel:+.2e}</td></tr>")
    head = ("<tr><th>format</th><th>sign | exponent | mantissa</th><th>kind</th>"
            "<th>stored value</th><th>neighbours</th><th>rel. error</th></tr>")
    return f"<table>{head}{''.join(rows)}</table>"


def format_explorer(value: str | float = "0.1", formats=None):
    """An ipywidgets explorer: type a number, see its bits and rounding in each format.
    Accepts anything float() reads ("1e-8", "inf", "nan"). Returns the widget (a VBox)."""
    import ipywidgets as widgets

    box = widgets.Text(value=str(value), description="x =", continuous_update=False)
    out = widgets.HTML()

    def show(_=None):
        try:
            x = float(box.value)
        except ValueError:
            out.value = f"<i>Cannot read {html.escape(box.value)!r} as a number; try 0.1 or 1e-8.</i>"
            return
        out.value = explorer_html(x, formats)

    box.observe(show, names="value")
    show()
    return widgets.VBox([box, out])


# ------------------------------------------------------------------------------------------------
# Chapters 2 and 3: loss curves and training benchmarks
# ------------------------------------------------------------------------------------------------
RUN_COLORS = ("#222222", "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")


def _curve(run):
    """(steps, losses, val_steps, val_losses) from a History-like object or a (steps, losses) pair."""
    if hasattr(run, "loss"):
        steps = list(run.step) if getattr(run, "step", None) else list(range(len(run.loss)))
        return steps, list(run.loss), list(getattr(run, "val_step", []) or []), list(getattr(run, "val_loss", []) or [])
    steps, losses = run
    return list(steps), list(losses), [], []


def moving_average(values, window: int):
    """Trailing moving average over `window` points (the first points average what exists so far)."""
    if window <= 1:
        return list(values)
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_loss_curves(runs, floors=None, *, smooth: int = 1, logy: bool = False, ax=None,
                     title: str = "Training loss", ylabel: str = "loss (nats per token)") -> Figure:
    """Loss curves of one or more runs, with horizontal reference lines ("floors").

    ``runs`` maps a label to a :class:`mpgpt.trainer.History` (training loss per step, and its
    validation losses drawn as dots) or to a ``(steps, losses)`` pair. ``floors`` maps a label to a
    loss value drawn as a dashed line, e.g. the corpus's entropy rate. ``smooth`` > 1 shows a
    trailing moving average of that many steps over the raw curve (drawn faint). Pass ``ax`` to
    draw into an existing axes; the Figure it belongs to is returned.
    """
    if not runs:
        raise ValueError("plot_loss_curves needs at least one run: {label: History or (steps, losses)}")
    if smooth < 1:
        raise ValueError(f"smooth must be >= 1 (a window in steps), got {smooth}")
    fig, ax = plt.subplots(figsize=(8, 4.5)) if ax is None else (ax.figure, ax)
    for k, (label, run) in enumerate(runs.items()):
        steps, losses, val_steps, val_losses = _curve(run)
        if len(steps) != len(losses):
            raise ValueError(f"run {label!r}: {len(steps)} steps but {len(losses)} losses")
        color = RUN_COLORS[k % len(RUN_COLORS)]
        if smooth > 1:
            ax.plot(steps, losses, color=color, alpha=0.2, linewidth=0.8)
            ax.plot(steps, moving_average(losses, smooth), color=color, label=f"{label} (train, {smooth}-step mean)")
        else:
            ax.plot(steps, losses, color=color, label=label if not val_steps else f"{label} (train)")
        if val_steps:
            ax.plot(val_steps, val_losses, "o", color=color, markersize=5, label=f"{label} (validation)")
    for k, (label, value) in enumerate((floors or {}).items()):
        ax.axhline(value, color="0.35", linestyle=("--", ":", "-.")[k % 3], linewidth=1.2)
        ax.annotate(f"{label}: {value:.3f}", xy=(1.0, value), xycoords=("axes fraction", "data"),
                    xytext=(-4, 3), textcoords="offset points", ha="right", va="bottom", fontsize=8, color="0.25")
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right" if not floors else "center right")
    fig.tight_layout()
    return fig


def plot_train_benchmark(result: dict, configs=None) -> Figure:
    """Step time and peak memory per configuration from a ``python -m mpgpt.bench train`` result.

    ``result`` is the parsed JSON (``{"environment": {...}, "rows": [...]}``); rows that recorded an
    error (e.g. out of memory) are left out. ``configs`` selects and orders configurations by name.
    The title names the GPU and the torch version the numbers were recorded with.
    """
    rows = [r for r in result.get("rows", []) if "error" not in r and r.get("ms_per_step_median") is not None]
    if configs is not None:
        by_name = {r["config"]: r for r in rows}
        rows = [by_name[c] for c in configs if c in by_name]
    if not rows:
        raise ValueError("the result has no successful rows to plot (every row is missing or recorded an error)")
    env = result.get("environment", {})
    names = [r["config"] for r in rows]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 0.45 * len(rows) + 1.6), sharey=True)
    ms = [r["ms_per_step_median"] for r in rows]
    ax_t.barh(names, ms, color="#3d85c6")
    for y, v in enumerate(ms):
        ax_t.text(v, y, f" {v:.1f}", va="center", fontsize=8)
    ax_t.set_xlabel("median step time (ms)")
    ax_t.invert_yaxis()
    mem = [r.get("peak_memory_gib") for r in rows]
    if any(m is not None for m in mem):
        vals = [m if m is not None else 0.0 for m in mem]
        ax_m.barh(names, vals, color="#81b29a")
        for y, v in enumerate(mem):
            ax_m.text(v or 0.0, y, f" {v:.1f}" if v is not None else " n/a", va="center", fontsize=8)
        ax_m.set_xlabel("peak memory (GiB)")
    else:
        ax_m.text(0.5, 0.5, "no memory figures\n(not a CUDA run)", ha="center", va="center", transform=ax_m.transAxes)
        ax_m.set_xticks([])
    for ax in (ax_t, ax_m):
        ax.grid(axis="x", alpha=0.3)
        ax.margins(x=0.2)
    preset, batch = rows[0].get("preset", "?"), rows[0].get("batch_size", "?")
    fig.suptitle(f"{env.get('gpu', 'unknown device')} · torch {env.get('torch', '?')} · "
                 f"preset {preset}, batch {batch}", fontsize=10)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------------------
# Chapters 4 and 5: loss scaling — gradient exponents against a format's range, the loss-scale sawtooth
# ------------------------------------------------------------------------------------------------
ZONE_COLORS = {"zero": "#7f7f7f", "subnormal": "#f2cc8f", "overflow": "#e07a5f"}


def _log2_magnitudes(values):
    """log2|v| of the nonzero finite entries of a tensor (or anything torch.as_tensor reads), and the zero count."""
    import torch

    v = torch.as_tensor(values).detach().reshape(-1).double()
    v = v[torch.isfinite(v)]
    nonzero = v[v != 0]
    return torch.log2(nonzero.abs()), int((v == 0).sum())


def plot_gradient_exponents(samples, fmt="fp16", *, bins: int = 80, xlim=None, title=None, ax=None) -> Figure:
    """Histograms of log2|g| for one or more sets of values, on the bands of a format's range.

    ``samples`` maps a label to a tensor of values (e.g. every gradient entry of a model, times a
    loss scale) or is a single tensor. The shaded bands are the fate of a value cast to ``fmt``:
    at or below half the smallest subnormal (2^-25 for fp16) it rounds to zero; up to the smallest
    normal (2^-14) it is subnormal (or rounds up to 2^-24) and keeps fewer significant bits;
    above the largest finite value (65504) it overflows to inf. Exact zeros cannot be drawn on a log
    axis: their count goes into the legend.
    """
    import math

    import torch

    f = F.get_format(fmt)
    if isinstance(samples, torch.Tensor) or not hasattr(samples, "items"):
        samples = {"values": samples}
    if not samples:
        raise ValueError("plot_gradient_exponents needs at least one set of values: {label: tensor}")
    logs = {label: _log2_magnitudes(v) for label, v in samples.items()}
    if all(lg.numel() == 0 for lg, _ in logs.values()):
        raise ValueError("every value is zero, inf or nan: there are no exponents to draw")
    lo_sub, lo_norm = math.log2(f.smallest_subnormal), math.log2(f.smallest_normal)
    lo_zero = lo_sub - 1  # at or below half the smallest subnormal a value rounds to 0 (ties to even)
    hi = math.log2(f.max_finite)
    if xlim is None:
        lo = min(float(lg.min()) for lg, _ in logs.values() if lg.numel())
        top = max(float(lg.max()) for lg, _ in logs.values() if lg.numel())
        xlim = (min(lo, lo_zero - 4) - 1, max(top, hi + 2) + 1)
    fig, ax = plt.subplots(figsize=(9, 4.2)) if ax is None else (ax.figure, ax)
    edges = torch.linspace(xlim[0], xlim[1], bins + 1).tolist()
    ax.axvspan(xlim[0], lo_zero, color=ZONE_COLORS["zero"], alpha=0.18,
               label=f"rounds to 0 in {f.name} (<= 2^{lo_zero:.0f})")
    ax.axvspan(lo_zero, lo_norm, color=ZONE_COLORS["subnormal"], alpha=0.35,
               label=f"subnormal: fewer bits (2^{lo_sub:.0f} to 2^{lo_norm:.0f})")
    ax.axvspan(hi, xlim[1], color=ZONE_COLORS["overflow"], alpha=0.25, label=f"overflow to inf (> {f.max_finite:g})")
    for k, (label, (lg, zeros)) in enumerate(logs.items()):
        color = RUN_COLORS[k % len(RUN_COLORS)]
        clipped = lg.clamp(xlim[0], xlim[1]).tolist()  # values outside the axis pile up in the end bins
        suffix = f" ({zeros} exact zeros)" if zeros else ""
        ax.hist(clipped, bins=edges, histtype="step", linewidth=1.6, color=color, label=f"{label}{suffix}")
    ax.set_xlim(*xlim)
    ax.set_xlabel("log2 |value|")
    ax.set_ylabel("number of values")
    ax.set_title(title or f"Where the values fall in {f.name}'s range")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_loss_scale(scale, skipped, *, loss=None, steps=None, title: str = "Dynamic loss scale") -> Figure:
    """The loss scale per step on a log2 axis, with skipped (overflowed) steps marked by red crosses.

    ``scale`` and ``skipped`` are per-step lists (a :class:`mpgpt.trainer.History` has both), the
    scale being the value *after* that step's update. With ``loss`` a second panel shows the loss,
    skipped steps marked on it too (a skipped step's loss may be inf or nan: then it is not drawn).
    """
    import math

    from matplotlib.ticker import MaxNLocator

    scale, skipped = list(scale), [bool(s) for s in skipped]
    if not scale:
        raise ValueError("plot_loss_scale needs at least one step")
    if len(scale) != len(skipped) or (loss is not None and len(loss) != len(scale)):
        raise ValueError(f"scale ({len(scale)}), skipped ({len(skipped)}) and loss "
                         f"({'-' if loss is None else len(loss)}) must have one entry per step")
    if any(not s > 0 for s in scale):
        raise ValueError("every loss scale must be > 0 to be drawn on a log axis")
    steps = list(range(len(scale))) if steps is None else list(steps)
    rows = 2 if loss is not None else 1
    fig, axes = plt.subplots(rows, 1, figsize=(9, 2.8 * rows + 0.6), sharex=True, squeeze=False)
    ax = axes[0][0]
    log_scale = [math.log2(s) for s in scale]
    ax.step(steps, log_scale, where="post", color="#1f77b4", linewidth=1.5, label="loss scale (after update)")
    bad = [i for i, s in enumerate(skipped) if s]
    ax.plot([steps[i] for i in bad], [log_scale[i] for i in bad], "x", color="#d62728", markersize=8,
            markeredgewidth=2, label=f"skipped step (overflow): {len(bad)}")
    ax.set_ylabel("log2(scale)")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # scales are powers of two: whole exponents
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    if loss is not None:
        ax2 = axes[1][0]
        ax2.plot(steps, loss, color="#222222", linewidth=1.0, label="training loss")
        finite_bad = [i for i in bad if math.isfinite(loss[i])]
        ax2.plot([steps[i] for i in finite_bad], [loss[i] for i in finite_bad], "x", color="#d62728",
                 markersize=7, markeredgewidth=2, label="skipped step")
        ax2.set_ylabel("loss")
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=8, loc="upper right")
    axes[-1][0].set_xlabel("optimizer step")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------
# Chapter 6 (Triton kernels): recorded benchmark results against cuBLAS, and a roofline.
# The figures take a result as written by `python -m mpgpt.bench kernels` (mpgpt.results loads the
# recorded one), so no number in the book is typed by hand.
# ----------------------------------------------------------------------------------------------
KERNEL_STYLE = {  # series name in the result file -> (legend label, color)
    "cublas": ("cuBLAS (torch.matmul)", "#4d4d4d"),
    "grouped": ("Triton: grouped tile order", "#1f77b4"),
    "tma": ("Triton: persistent grid + TMA", "#d62728"),
    "ws": ("Gluon: warp-specialised", "#2ca02c"),
    "auto": ("Triton: kernel='auto'", "#9467bd"),
}
# Colors for series a result file has but KERNEL_STYLE does not know, none of them used above.
SPARE_COLORS = ("#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")


def _kernel_styles(names) -> dict:
    """(label, color) for each series name: KERNEL_STYLE's, else the next spare color, so that no
    two series of one figure share a color."""
    spare = iter(SPARE_COLORS)
    return {name: KERNEL_STYLE.get(name) or (name, next(spare, None)) for name in names}


def arithmetic_intensity(M: int, N: int, K: int, bytes_per_element: int = 2) -> float:
    """FLOP per byte of C = A @ B with A (M, K), B (K, N), C (M, N): 2MNK FLOPs over the bytes
    that must cross from memory at least once (each input read once, the output written once)."""
    return 2.0 * M * N * K / (bytes_per_element * (M * K + K * N + M * N))


def _kernel_names(results: dict) -> list[str]:
    row = results["matmul"][0]
    return [k for k in results.get("kernels", []) if k in row]


def plot_kernel_tflops(results: dict) -> Figure:
    """TFLOP/s of each kernel and of cuBLAS for every benchmarked shape (bars), with the
    fraction of cuBLAS written above each Triton bar."""
    rows = results["matmul"]
    kernels = _kernel_names(results)
    series = ["cublas"] + kernels
    width = 0.8 / len(series)
    styles = _kernel_styles(series)
    fig, ax = plt.subplots(figsize=(11, 4.8))
    for j, name in enumerate(series):
        label, color = styles[name]
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(rows))]
        heights = [r["cublas_tflops"] if name == "cublas" else r[name]["tflops"] for r in rows]
        ax.bar(xs, heights, width=width, label=label, color=color)
        if name != "cublas":
            for x, r in zip(xs, rows):
                ax.text(x, r[name]["tflops"] + 8, f"{r[name]['vs_cublas']:.2f}", ha="center", va="bottom",
                        fontsize=7, rotation=90)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['shape']}\n{r['M']}x{r['N']}x{r['K']}" for r in rows], fontsize=8)
    ax.set_ylabel("TFLOP/s (bf16 in, fp32 accumulate)")
    ax.set_ylim(0, 1.18 * max(max(r["cublas_tflops"], *(r[k]["tflops"] for k in kernels)) for r in rows))
    ax.set_title("Matmul throughput, median of do_bench (numbers: fraction of cuBLAS)\n"
                 + describe_result(results, date=False), fontsize=10)
    ax.legend(fontsize=8, loc="upper left", ncol=len(series))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_roofline(results: dict, bandwidth_tbs: float, peak_tflops: float | None = None,
                  bytes_per_element: int = 2, extra: dict | None = None) -> Figure:
    """The roofline min(peak, bandwidth x intensity) with every benchmarked shape placed at its
    arithmetic intensity and measured TFLOP/s. `peak_tflops` defaults to the fastest cuBLAS
    result in the file (a measured ceiling, not the datasheet's); `bandwidth_tbs` is a memory
    bandwidth in TB/s (pass a measured copy bandwidth and say where it came from). `extra` maps
    a label to an (M, N, K) that was not measured: it is drawn on the roof, at its bound."""
    import numpy as np

    rows = results["matmul"]
    kernels = _kernel_names(results)
    peak = peak_tflops if peak_tflops is not None else max(r["cublas_tflops"] for r in rows)
    ridge = peak / bandwidth_tbs  # FLOP/byte where the two ceilings meet (TFLOP/s / TB/s)
    fig, ax = plt.subplots(figsize=(9, 5.2))
    xs = np.logspace(-0.5, 4, 200)
    ax.plot(xs, np.minimum(peak, bandwidth_tbs * xs), color="k", linewidth=2)
    ax.axvline(ridge, color="0.6", linestyle=":", linewidth=1)
    ax.text(ridge * 1.08, bandwidth_tbs * 1.5, f"ridge {ridge:.0f} FLOP/B", fontsize=8, color="0.35")
    ax.text(1.2, bandwidth_tbs * 1.2 * 1.5, f"memory: {bandwidth_tbs:g} TB/s", fontsize=8, rotation=28)
    ax.text(1.2, peak * 1.08, f"compute: {peak:.0f} TFLOP/s (best cuBLAS in the file)", fontsize=8)
    styles = _kernel_styles(["cublas"] + kernels)
    for name in ["cublas"] + kernels:
        label, color = styles[name]
        pts = [(arithmetic_intensity(r["M"], r["N"], r["K"], bytes_per_element),
                r["cublas_tflops"] if name == "cublas" else r[name]["tflops"]) for r in rows]
        ax.scatter(*zip(*pts), label=label, color=color, s=28, zorder=3,
                   marker="s" if name == "cublas" else "o")
    # Shapes with (nearly) the same intensity share one label; labels step down below the points
    # so that neighbours do not overlap.
    groups: dict = {}
    for r in rows:
        key = round(arithmetic_intensity(r["M"], r["N"], r["K"], bytes_per_element))
        groups.setdefault(key, []).append(r)
    for k, (key, rs) in enumerate(sorted(groups.items())):
        low = min(min(r["cublas_tflops"], *(r[n]["tflops"] for n in kernels)) for r in rs)
        ax.annotate(", ".join(r["shape"] for r in rs) + f" ({key})", (key, low),
                    xytext=(key, peak * 0.3 / 1.45 ** k), fontsize=7, ha="right" if k % 2 == 0 else "left",
                    arrowprops=dict(arrowstyle="-", color="0.6", linewidth=0.6))
    for label, (M, N, K) in (extra or {}).items():
        i = arithmetic_intensity(M, N, K, bytes_per_element)
        bound = min(peak, bandwidth_tbs * i)
        ax.scatter([i], [bound], marker="x", color="#ff7f0e", s=40, zorder=3)
        ax.annotate(f"{label} ({i:.1f}): at most {bound:.0f} TFLOP/s", (i, bound), xytext=(6, -12),
                    textcoords="offset points", fontsize=7, color="#b35900")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(0.5, 1e4)
    ax.set_ylim(bandwidth_tbs * 0.25, peak * 1.6)
    ax.set_xlabel(f"arithmetic intensity (FLOP per byte, {bytes_per_element}-byte elements, each moved once)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title("Roofline of the benchmarked matmuls\n" + describe_result(results, date=False), fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------------------
# Chapter 7 (putting it together): the training ladder from `python -m mpgpt.bench train` results.
# The figures take a result of `python -m mpgpt.bench train` (mpgpt.results loads the recorded one).
# ------------------------------------------------------------------------------------------------
# The rungs in the order the chapter climbs them; configurations a result file lacks are left out.
TRAIN_LADDER = ("fp32", "tf32", "fp16", "fp16-gradscaler", "bf16", "bf16+compile",
                "bf16+compile+cudagraphs", "bf16+compile+triton")
PRECISION_COLORS = {"fp32": "#7f7f7f", "tf32": "#9467bd", "fp16": "#d62728", "bf16": "#1f77b4"}
# Reference lines (public anchors) on the ladder: one color each, none of them a precision's.
ANCHOR_COLORS = ("#e07a5f", "#2ca02c", "#8c564b", "#e377c2", "#17becf", "#bcbd22")


def is_gpu_result(result: dict) -> bool:
    """Whether a result file was recorded on a GPU (``environment.gpu`` names one, not ``CPU (...)``)."""
    gpu = (result.get("environment") or {}).get("gpu")
    return isinstance(gpu, str) and bool(gpu) and not gpu.upper().startswith("CPU")


def ladder_rows(result: dict, order=TRAIN_LADDER) -> list[dict]:
    """The successful rows of a train result: those named in ``order`` first, in that order, then the
    rest in file order. Rows that recorded an error (out of memory, no Triton here) are left out."""
    rows = [r for r in result.get("rows", []) if "error" not in r and r.get("tokens_per_s")]
    rank = {name: i for i, name in enumerate(order)}
    return sorted(rows, key=lambda r: (rank.get(r["config"], len(rank)), rows.index(r)))


def _precision_color(config: str) -> str:
    return PRECISION_COLORS.get(config.split("+")[0].split("-")[0], "#444444")


def plot_train_ladder(result: dict, anchors=None, order=TRAIN_LADDER) -> Figure:
    """Tokens/s of every configuration of a train result (bars, colored by precision, labelled with
    MFU against 989 TFLOP/s), plus optional reference lines ``anchors = {label: tokens_per_s}``."""
    rows = ladder_rows(result, order)
    if not rows:
        raise ValueError("the result has no successful rows to plot (every row is missing or recorded an error)")
    env = result.get("environment", {})
    fig, ax = plt.subplots(figsize=(9.5, 0.42 * len(rows) + 1.9))
    names = [r["config"] for r in rows]
    k = [r["tokens_per_s"] / 1e3 for r in rows]
    ax.barh(names, k, color=[_precision_color(n) for n in names])
    for y, r in enumerate(rows):
        mfu = r.get("mfu_vs_989T")
        label = f" {r['tokens_per_s'] / 1e3:.0f}k" + (f" · MFU {100 * mfu:.1f}%" if mfu is not None else "")
        ax.text(r["tokens_per_s"] / 1e3, y, label, va="center", fontsize=8)
    styles = ["--", ":", "-."]
    for i, (label, tps) in enumerate((anchors or {}).items()):
        ax.axvline(tps / 1e3, color=ANCHOR_COLORS[i % len(ANCHOR_COLORS)], linestyle=styles[i % len(styles)], linewidth=1.3,
                   label=f"{label}: {tps / 1e3:.0f}k")
    if anchors:
        ax.legend(fontsize=8, loc="upper right")  # the first rungs (fp32, tf32) are short bars: room at the top
    ax.invert_yaxis()
    ax.set_xlabel("thousand tokens / s (higher is better)")
    ax.grid(axis="x", alpha=0.3)
    ax.margins(x=0.25)
    preset, batch, block = rows[0].get("preset", "?"), rows[0].get("batch_size", "?"), rows[0].get("block_size", "?")
    ax.set_title(f"{env.get('gpu', 'unknown device')} · torch {env.get('torch', '?')} · {str(env.get('date', '?'))[:10]}"
                 f"\npreset {preset}, batch {batch} x {block} tokens", fontsize=10)
    fig.tight_layout()
    return fig


def plot_batch_sweep(result: dict) -> Figure:
    """Tokens/s and peak memory against batch size from a train result's ``largest_batch`` rows (one
    configuration at growing batches); a batch that ran out of memory is marked on the memory panel."""
    sweep = result.get("largest_batch") or []
    ok = [r for r in sweep if "error" not in r and r.get("tokens_per_s")]
    if not ok:
        raise ValueError("the result has no largest_batch rows; record them with "
                         "`python -m mpgpt.bench train --max-batch-config CONFIG`")
    config = ok[0]["config"]
    same = [r for r in result.get("rows", []) if r.get("config") == config and "error" not in r and r.get("tokens_per_s")]
    pts = sorted({r["batch_size"]: r for r in same + ok}.values(), key=lambda r: r["batch_size"])
    bs = [r["batch_size"] for r in pts]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 3.4))
    ax_t.plot(bs, [r["tokens_per_s"] / 1e3 for r in pts], "o-", color=_precision_color(config))
    ax_t.set_ylabel("thousand tokens / s")
    ax_t.set_ylim(bottom=0)
    mem = [r.get("peak_memory_gib") for r in pts]
    if all(m is not None for m in mem):
        ax_m.plot(bs, mem, "o-", color="#81b29a")
    ax_m.set_ylabel("peak memory (GiB)")
    ax_m.set_ylim(bottom=0)
    for r in sweep:
        if "error" in r:
            ax_m.axvline(r["batch_size"], color="#d62728", linestyle="--", linewidth=1.2,
                         label=f"batch {r['batch_size']}: {r['error']}")
            ax_m.legend(fontsize=8, loc="upper left")
    for ax in (ax_t, ax_m):
        ax.set_xlabel("batch size (sequences)")
        ax.grid(alpha=0.3)
    env = result.get("environment", {})
    fig.suptitle(f"{config} on {env.get('gpu', 'unknown device')}: throughput and memory against batch", fontsize=10)
    fig.tight_layout()
    return fig


def plot_real_run(result: dict, floor: float | None = None) -> Figure:
    """The loss of a train result's ``real_run`` (every 10th step) on the embedded corpus, with the
    corpus's entropy rate as the floor no model can beat, if given."""
    run = result.get("real_run")
    if not run or not run.get("loss_every_10"):
        raise ValueError("the result has no real_run; record one with `python -m mpgpt.bench train --real-run-config CONFIG`")
    losses = run["loss_every_10"]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    ax.plot([10 * i for i in range(len(losses))], losses, "o-", color=_precision_color(run["config"]),
            label=f"{run['config']}, batch {run.get('batch_size', '?')}")
    if floor is not None:
        ax.axhline(floor, color="#222222", linestyle=":", label=f"entropy rate of the corpus ({floor:.2f} nats)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (nats / token)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    env = result.get("environment", {})
    ax.set_title(f"{run.get('preset', '?')} on the embedded corpus, {env.get('gpu', 'unknown device')}", fontsize=10)
    fig.tight_layout()
    return fig
