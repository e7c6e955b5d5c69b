"""Chapter 6 figures in mpgpt/plots.py: kernel benchmark results, TFLOP/s bars and the roofline.

The figures must show the numbers in the result file, not typed ones: the tests build a small
result with random values and read them back out of the drawn artists.
"""
import math
import random

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from mpgpt import plots  # noqa: E402


def fake_results(kernels=("grouped", "tma"), date="2026-01-02T00:00:00+00:00", gpu="Test GPU"):
    """A kernel benchmark result shaped like mpgpt/bench/kernels.py's, with random timings."""
    rng = random.Random()
    rows = []
    for label, M, N, K in [("a", 128, 256, 64), ("b", 4096, 4096, 4096), ("c", 1000, 3, 7)]:
        flops = 2.0 * M * N * K
        ms = rng.uniform(0.01, 2.0)
        row = {"shape": label, "M": M, "N": N, "K": K, "cublas_ms": ms, "cublas_tflops": flops / ms * 1e-9}
        for k in kernels:
            kms = ms / rng.uniform(0.3, 1.1)
            row[k] = {"ms": kms, "tflops": flops / kms * 1e-9, "vs_cublas": ms / kms}
        rows.append(row)
    env = {"date": date, "gpu": gpu, "compute_capability": [9, 0], "driver": "1.2", "cuda": "13.0",
           "torch": "2.11.0", "triton": "3.6.0"}
    return {"environment": env, "kernels": list(kernels), "matmul": rows}


def test_arithmetic_intensity_formula_and_known_values():
    M, N, K = (random.randint(1, 5000) for _ in range(3))
    assert plots.arithmetic_intensity(M, N, K) == pytest.approx(2 * M * N * K / (2 * (M * K + K * N + M * N)))
    assert plots.arithmetic_intensity(M, N, K, bytes_per_element=4) == pytest.approx(
        plots.arithmetic_intensity(M, N, K) / 2)
    # GPT-2's c_attn: 12288 x 2304 x 768 in bf16 does 550 FLOP per byte moved.
    assert round(plots.arithmetic_intensity(12288, 2304, 768)) == 550
    # A square n^3 matmul in bf16 does n/3 FLOP per byte; a matrix-vector product about 1.
    assert plots.arithmetic_intensity(3000, 3000, 3000) == pytest.approx(1000)
    assert plots.arithmetic_intensity(1, 4096, 4096) == pytest.approx(1.0, abs=1e-3)


def test_tflops_bars_show_the_file_values():
    results = fake_results()
    fig = plots.plot_kernel_tflops(results)
    ax = fig.axes[0]
    heights = [[p.get_height() for p in c.patches] for c in ax.containers]
    assert len(heights) == 1 + len(results["kernels"])
    assert heights[0] == pytest.approx([r["cublas_tflops"] for r in results["matmul"]])
    for series, k in zip(heights[1:], results["kernels"]):
        assert series == pytest.approx([r[k]["tflops"] for r in results["matmul"]])
    texts = {t.get_text() for t in ax.texts}
    assert {f"{r[k]['vs_cublas']:.2f}" for r in results["matmul"] for k in results["kernels"]} <= texts
    assert "Test GPU" in ax.get_title() and "triton 3.6.0" in ax.get_title()
    plt.close(fig)


def test_roofline_places_points_at_intensity_and_caps_the_roof():
    results = fake_results(kernels=("tma",))
    bw = random.uniform(1.0, 5.0)
    fig = plots.plot_roofline(results, bandwidth_tbs=bw, extra={"decode": (1, 512, 512)})
    ax = fig.axes[0]
    peak = max(r["cublas_tflops"] for r in results["matmul"])
    roof = ax.lines[0]
    x, y = roof.get_xdata(), roof.get_ydata()
    assert max(y) == pytest.approx(peak)
    assert all(yy == pytest.approx(min(peak, bw * xx)) for xx, yy in zip(x, y))
    cublas, tma, extra = ax.collections[:3]
    want = [(plots.arithmetic_intensity(r["M"], r["N"], r["K"]), r["cublas_tflops"]) for r in results["matmul"]]
    assert [c for p in cublas.get_offsets() for c in p] == pytest.approx([c for p in want for c in p])
    assert [p[1] for p in tma.get_offsets()] == pytest.approx([r["tma"]["tflops"] for r in results["matmul"]])
    i = plots.arithmetic_intensity(1, 512, 512)
    assert tuple(extra.get_offsets()[0]) == pytest.approx((i, min(peak, bw * i)))
    # An explicit peak replaces the measured one.
    fig2 = plots.plot_roofline(results, bandwidth_tbs=bw, peak_tflops=2 * peak)
    assert max(fig2.axes[0].lines[0].get_ydata()) == pytest.approx(2 * peak)
    assert math.isclose(fig2.axes[0].lines[0].get_ydata()[0], bw * fig2.axes[0].lines[0].get_xdata()[0])
    plt.close(fig)
    plt.close(fig2)
