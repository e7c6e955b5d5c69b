"""Chapter 7's helpers in mpgpt/plots.py: the ladder order,
and the figures drawn from a `python -m mpgpt.bench train` result file."""
import random

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from mpgpt import plots  # noqa: E402


def _row(config, batch=12, tps=None, **extra):
    tps = tps if tps is not None else random.randint(10_000, 900_000)
    return {"config": config, "preset": "gpt2", "batch_size": batch, "block_size": 1024,
            "ms_per_step_median": batch * 1024 / tps * 1e3, "tokens_per_s": tps,
            "mfu_vs_989T": round(855383040 * tps / 989e12, 4), "peak_memory_gib": batch * 1.1, **extra}


def _result(gpu, date, rows=None, **extra):
    return {"environment": {"gpu": gpu, "date": date, "torch": "2.x"}, "rows": rows or [_row("bf16")], **extra}


def test_is_gpu_result():
    assert plots.is_gpu_result({"environment": {"gpu": "NVIDIA H200"}})
    for gpu in (None, "", "CPU (x86_64)", "cpu"):
        assert not plots.is_gpu_result({"environment": {"gpu": gpu}})
    assert not plots.is_gpu_result({})


def test_ladder_rows_orders_by_ladder_then_file_and_drops_errors():
    extra = ["bf16-nobias", "fp16+compile"]
    ladder = [c for c in plots.TRAIN_LADDER if random.random() < 0.7] or ["bf16"]
    configs = ladder + extra
    random.shuffle(configs)
    rows = [_row(c) for c in configs] + [{"config": "tf32", "batch_size": 12, "error": "out of memory"}]
    got = [r["config"] for r in plots.ladder_rows({"rows": rows})]
    expect_extra = [c for c in configs if c in extra]  # file order for configurations off the ladder
    assert got == ladder + expect_extra


def test_plot_train_ladder_draws_one_bar_per_successful_row_and_the_anchors():
    tps = [random.randint(50_000, 600_000) for _ in range(4)]
    rows = [_row(c, tps=t) for c, t in zip(["fp32", "tf32", "bf16", "bf16+compile"], tps)]
    rows.append({"config": "bf16+compile+triton", "batch_size": 12, "error": "RuntimeError: no GPU"})
    anchors = {"nanoGPT": 462e3, "llm.c": 497e3}
    fig = plots.plot_train_ladder(_result("NVIDIA H200", "2026-11-30T00:00:00", rows), anchors=anchors)
    ax = fig.axes[0]
    widths = [p.get_width() for p in ax.patches]
    assert widths == pytest.approx([t / 1e3 for t in tps])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["fp32", "tf32", "bf16", "bf16+compile"]
    assert sorted(line.get_xdata()[0] for line in ax.lines) == pytest.approx([462, 497])
    assert "NVIDIA H200" in ax.get_title()
    plt.close(fig)


def test_plot_train_ladder_refuses_a_result_without_rows():
    with pytest.raises(ValueError, match="no successful rows"):
        plots.plot_train_ladder({"rows": [{"config": "fp32", "batch_size": 12, "error": "out of memory"}]})


def test_plot_batch_sweep_includes_the_ladder_point_and_marks_oom():
    sweep = [_row("bf16", b) for b in (16, 32, 64)] + [{"config": "bf16", "batch_size": 128, "error": "out of memory"}]
    result = _result("NVIDIA H200", "2026-11-30", [_row("bf16", 12), _row("fp32", 12)], largest_batch=sweep)
    fig = plots.plot_batch_sweep(result)
    ax_t, ax_m = fig.axes
    assert list(ax_t.lines[0].get_xdata()) == [12, 16, 32, 64]  # bf16 at batch 12 from the ladder, then the sweep
    assert list(ax_m.lines[0].get_ydata()) == pytest.approx([b * 1.1 for b in (12, 16, 32, 64)])
    assert ax_m.lines[1].get_xdata()[0] == 128 and "out of memory" in ax_m.get_legend().texts[0].get_text()
    plt.close(fig)
    with pytest.raises(ValueError, match="largest_batch"):
        plots.plot_batch_sweep(_result("NVIDIA H200", "2026-11-30"))


def test_plot_real_run_draws_every_tenth_step_and_the_floor():
    losses = sorted((random.uniform(1, 11) for _ in range(15)), reverse=True)
    run = {"config": "bf16+compile", "preset": "gpt2", "batch_size": 12, "loss_every_10": losses}
    fig = plots.plot_real_run(_result("NVIDIA H200", "2026-11-30", real_run=run), floor=0.88)
    ax = fig.axes[0]
    assert list(ax.lines[0].get_xdata()) == list(range(0, 150, 10))
    assert list(ax.lines[0].get_ydata()) == losses
    assert ax.lines[1].get_ydata()[0] == 0.88
    plt.close(fig)
    with pytest.raises(ValueError, match="real_run"):
        plots.plot_real_run(_result("NVIDIA H200", "2026-11-30"))


def test_recorded_training_result_is_a_gpu_ladder():
    from mpgpt.results import load_record

    result = load_record("train-h200")
    assert plots.is_gpu_result(result)
    names = [r["config"] for r in plots.ladder_rows(result)]
    assert names[:2] == ["fp32", "tf32"], names  # the ladder starts at the bottom rung


def test_bench_subcommands_pass_their_options_through(monkeypatch):
    # `python -m mpgpt.bench kernels --out-dir DIR` once reached the kernel benchmark with its
    # option and value reordered (an argparse error). Every subcommand now gets its argv intact.
    import importlib

    from mpgpt.bench.__main__ import COMMANDS, main

    for name, module in COMMANDS.items():
        seen = {}
        mod = importlib.import_module(module)
        monkeypatch.setattr(mod, "main", lambda argv, seen=seen: seen.setdefault("argv", argv) and 0)
        assert main([name, "--out-dir", "x y", "--tag", "t"]) == 0
        assert seen["argv"] == ["--out-dir", "x y", "--tag", "t"]


def test_bench_refuses_an_unknown_subcommand(capsys):
    from mpgpt.bench.__main__ import main

    assert main(["trian"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'trian'" in err and "train, kernels, ddp" in err
