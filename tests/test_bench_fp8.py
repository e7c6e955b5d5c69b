"""mpgpt.bench.fp8: what runs on a CPU — the refusal without fp8 tensor cores, the option checks, the
ratios, and every part end to end at toy sizes (a wall-clock timer instead of CUDA events, the
Triton kernels in the interpreter, torch._scaled_mm on the CPU where this torch has it)."""
import json
import time

import pytest
import torch

from mpgpt import fp8, results, runtime
from mpgpt.bench import __main__ as bench_main
from mpgpt.bench import fp8 as bfp8


def test_fp8_is_a_bench_command():
    assert bench_main.COMMANDS["fp8"] == "mpgpt.bench.fp8"


def test_without_fp8_tensor_cores_it_says_so_and_writes_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # as on a CPU, wherever the test runs (on an fp8 GPU main() would run the whole benchmark)
    monkeypatch.setattr(bfp8.runtime, "current", lambda device=None: runtime.Runtime("cpu", "CPU", None, None, None))
    assert bfp8.main([]) == 1
    assert "needs an L4, H100 or H200" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_unknown_parts_are_refused_up_front(capsys):
    with pytest.raises(SystemExit):
        bfp8.main(["--parts", "gemm,bogus"])
    assert "unknown part(s) bogus" in capsys.readouterr().err


def test_ratios_are_reference_time_over_ours_and_skip_failures():
    row = {"triton_tensorwise": {"ms": 2.0}, "scaled_mm_tensorwise": {"ms": 1.8}, "bf16_cublas": {"ms": 4.0},
           "triton_rowwise": {"error": "RuntimeError: no"}, "scaled_mm_rowwise": {"ms": 1.0}}
    r = bfp8.gemm_ratios(row)
    assert r["triton_vs_scaled_mm_tensorwise"] == pytest.approx(0.9)
    assert r["triton_vs_bf16_cublas"] == pytest.approx(2.0)
    assert "triton_rowwise_vs_scaled_mm_rowwise" not in r


def test_attempt_records_a_failure_instead_of_losing_the_run():
    assert bfp8.attempt(lambda: 1 / 0) == {"error": "ZeroDivisionError: division by zero"}


def test_the_map_covers_gpt2_small_and_widths_up_to_8192():
    shapes = bfp8.layer_shapes()
    assert ("lm_head", 768, 50304) in shapes and max(fout for _, _, fout in shapes if fout != 50304) == 8192


def cpu_scaled_mm_works():
    q = fp8.quantize(torch.randn(16, 32))
    try:
        torch._scaled_mm(q.data, q.data.t(), scale_a=q.scale, scale_b=q.scale, out_dtype=torch.float32)
        return True
    except Exception:  # noqa: BLE001
        return False


def wall_ms(fn, grad_to_none=None, rep=100):
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


@pytest.fixture
def cpu_bench(monkeypatch):
    from mpgpt.kernels import env

    ok, why = env.kernels_available()
    if not ok:
        pytest.skip(why)
    if not env.interpreting():
        pytest.skip("the toy-size run is the CPU's, in Triton's interpreter; on a GPU the benchmark itself runs")
    monkeypatch.setattr(bfp8, "median_ms", wall_ms)
    if cpu_scaled_mm_works():  # let scaled_matmul take torch._scaled_mm on the CPU
        monkeypatch.setattr(fp8, "matmul_backend", lambda a, b, backend="auto": ("torch", "test"))
    return bfp8


def test_every_part_runs_end_to_end_at_toy_sizes(cpu_bench, tmp_path):
    gemm = cpu_bench.bench_gemm([("64^3", 64, 64, 64)], device="cpu")[0]
    for name in ("bf16_cublas", "triton_tensorwise", "triton_rowwise", "triton_tensorwise_fp8_out"):
        assert gemm[name]["ms"] > 0, gemm[name]
    # the same fp8 inputs summed in fp32, then one rounding to the bf16 output: at most 2^-9 relative
    assert gemm["triton_tensorwise"]["rel_error_vs_float64"] <= 2.0**-9
    cross = cpu_bench.bench_crossover([("toy", 64, 32)], tokens=32, device="cpu")[0]
    assert cross["bf16_nn_linear"]["ms"] > 0
    for r in cpu_bench.LAYER_RECIPES:
        assert cross[f"fp8_{r}"]["speedup_vs_bf16"] > 0, cross[f"fp8_{r}"]
    acc = cpu_bench.bench_accumulation(ks=[256], mn=16, device="cpu")[0]
    assert acc["triton_promoted"] < 1e-5 and acc["model_14bit"] > acc["model_14bit_promoted"] >= 0
    path = results.write_result("fp8", {"gemm": [gemm], "crossover": [cross], "accumulation": [acc]}, tmp_path)
    assert json.loads(path.read_text())["gemm"][0]["shape"] == "64^3"


def test_the_training_part_converts_the_named_layers_and_shares_parameters():
    from mpgpt.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", n_layer=2))
    before = {id(p) for p in model.parameters()}
    names = bfp8.to_fp8(model, bfp8.TRAIN_RUNS["fp8_all_linear"][1])
    assert len(names) == 2 * 4 + 1 and "lm_head" in names      # four linears per block, and the head
    assert {id(p) for p in model.parameters()} == before        # the same tensors, not copies
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert bfp8.to_fp8(GPT(GPTConfig.preset("tiny")), ("lm_head",)) == ["lm_head"]


def test_unknown_training_runs_are_refused_up_front(capsys):
    with pytest.raises(SystemExit):
        bfp8.main(["--parts", "training", "--train-runs", "bf16,fp4"])
    assert "--train-runs takes names from" in capsys.readouterr().err
