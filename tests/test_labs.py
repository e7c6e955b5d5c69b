"""The NaN lab's broken scripts (mpgpt/labs/broken_*.py) fail the way the lab describes, and their
repaired twins (--fixed) train; the lab's hooks name the module where an inf or NaN starts.

The scripts run in this process through their main(argv), on the CPU, with their own seeds."""
import importlib

import pytest
import torch

from mpgpt.labs.nonfinite import first_nonfinite_grad, first_nonfinite_module


@pytest.fixture
def script(capsys):
    """Run `python -m mpgpt.labs.<name> [args]` in process: (exit code, stdout lines)."""
    threads = torch.get_num_threads()

    def run(name, *args):
        module = importlib.import_module(f"mpgpt.labs.{name}")
        code = 0
        try:
            module.main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
            if not isinstance(exc.code, int):
                print(exc.code)
        return code, capsys.readouterr().out.splitlines()

    yield run
    torch.set_num_threads(threads)  # the scripts use one thread on the CPU


def _float_after(line: str, word: str) -> float:
    return float(line.split(word)[1].split()[0].rstrip(","))


def test_clipping_before_unscaling_reports_scaled_norms_and_does_not_learn(script):
    code, broken = script("broken_clipping")
    assert code == 0
    norms = [_float_after(l, "grad norm") for l in broken if "grad norm" in l]
    assert norms and all(n > 1000 for n in norms), norms  # S = 4096 times the true norm, roughly
    first, last = _float_after(broken[-1], "first 5 steps"), _float_after(broken[-1], "last 5")
    assert first - last < 0.15, broken[-1]  # clipped to norm 1/S: SGD barely moves
    code, fixed = script("broken_clipping", "--fixed")
    norms = [_float_after(l, "grad norm") for l in fixed if "grad norm" in l]
    assert code == 0 and all(n < 100 for n in norms), norms
    first, last = _float_after(fixed[-1], "first 5 steps"), _float_after(fixed[-1], "last 5")
    assert first - last > 0.3, fixed[-1]


def test_resuming_without_the_scaler_state_skips_steps_again(script):
    code, broken = script("broken_resume")
    assert code == 0
    after = broken[broken.index(next(l for l in broken if l.startswith("--- resumed"))) + 1:]
    before = broken[: broken.index(next(l for l in broken if l.startswith("--- resumed")))]
    assert "scale 2**24  skipped" in after[0], after[0]  # back at the initial scale, overflowing
    assert all("skipped" in l for l in after[:5])
    code, fixed = script("broken_resume", "--fixed")
    resumed = fixed.index(next(l for l in fixed if l.startswith("--- resumed")))
    last_scale = fixed[resumed - 1].split("scale ")[1].split()[0]
    assert fixed[resumed + 1].split("scale ")[1].split()[0] == last_scale  # continues from the learned scale
    assert not any("skipped" in l for l in fixed[resumed + 1: resumed + 6])
    assert before  # both runs print the same first half


def test_a_large_negative_mask_in_fp16_turns_padding_rows_into_nan(script):
    code, broken = script("broken_mask")
    assert code == 0
    fp32, fp16 = broken
    assert _float_after(fp32, "->") < _float_after(fp32, "loss") - 1.0, fp32  # fp32 trains
    assert _float_after(fp16, "final loss scale") < 1e-6, fp16  # every step skipped: the scale collapses
    code, fixed = script("broken_mask", "--fixed")
    fp32_fixed, fp16_fixed = fixed
    assert fp32_fixed == fp32  # the repair changes nothing in fp32
    assert _float_after(fp16_fixed, "->") < _float_after(fp16_fixed, "loss") - 1.0, fp16_fixed
    assert _float_after(fp16_fixed, "final loss scale") >= 2.0**10, fp16_fixed


def test_adam_eps_in_fp16_weights_gives_nan_and_a_representable_eps_trains(script):
    code, broken = script("broken_adam_eps")
    assert code == 1 and "the loss is nan" in broken[-1], broken
    code, fixed = script("broken_adam_eps", "--fixed")
    assert code == 0
    losses = [_float_after(l, "loss") for l in fixed if l.startswith("step")]
    assert losses[-1] < losses[0] - 0.5, losses


def test_every_broken_script_has_a_test_here():
    from pathlib import Path

    import mpgpt.labs
    names = sorted(p.stem for p in Path(mpgpt.labs.__file__).parent.glob("broken_*.py"))
    source = Path(__file__).read_text(encoding="utf-8")
    assert names and all(f'script("{n}"' in source for n in names), names


def test_forward_hooks_name_the_first_module_and_are_removed():
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 6), torch.nn.ReLU())
    x = torch.rand(4, 6) + 0.1
    assert first_nonfinite_module(model, lambda: model(x)) is None
    with torch.no_grad():
        model[1].weight.fill_(float("inf"))
    assert first_nonfinite_module(model, lambda: model(x)) == "1"
    assert not any(m._forward_hooks for m in model.modules())


def test_backward_hooks_name_the_output_whose_gradient_overflows_fp16():
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 3))
    x = torch.rand(4, 6) + 0.1

    def run(scale):
        def step():
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)                      # fp16 (4, 3)
            (out.float().sum() * scale).backward()  # d loss / d out = scale, stored in fp16
        return step
    assert first_nonfinite_grad(model, run(2.0**10)) is None
    # 2**20 > 65504: the gradient arriving at the last layer's fp16 output is already inf
    assert first_nonfinite_grad(model, run(2.0**20)) == "1"
    assert not any(m._forward_hooks for m in model.modules())
    assert all(not p._backward_hooks for p in model.parameters())


def _lab_gpu_check():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "lab_gpu_check.py"
    spec = importlib.util.spec_from_file_location("lab_gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_counts_only_sync_warnings_and_refuses_a_cpu(capsys):
    import warnings

    check = _lab_gpu_check()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("called a synchronizing CUDA operation (Triggered internally at x.cpp:1.)")
        warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all")
        warnings.warn("something else entirely")
    assert check.sync_messages(caught) == ["called a synchronizing CUDA operation (Triggered internally at x.cpp:1.)"]
    if not torch.cuda.is_available():
        assert check.main([]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_gpu_check_grades_the_package_own_implementations():
    # The GPU run grades these same files with the kernel compiled; here they pass on the CPU.
    check = _lab_gpu_check()
    from mpgpt.kernels import env
    if env.TRITON_IMPORT_ERROR is not None:
        pytest.skip("Triton is not installed")
    results = check.grade_part()
    assert set(results) == set(check.COMPONENTS)
    assert all(not r["failed"] and r["behaviours"] >= 7 for r in results.values()), results
