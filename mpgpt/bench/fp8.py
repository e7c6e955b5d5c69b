"""Benchmark fp8 on one GPU with fp8 tensor cores (chapter 9).

    python -m mpgpt.bench fp8
    python -m mpgpt.bench fp8 --parts gemm,crossover --out-dir results

Three parts, each timed with `triton.testing.do_bench` (CUDA events, median; do_bench clears the L2
cache between runs) on random inputs (never zeros):

1. gemm: the package's fp8 GEMM (mpgpt.kernels.fp8_matmul; tensorwise and rowwise scales, with and
   without promotion, and with an fp8 output plus its amax; promoted on sm_90 it runs the Gluon
   kernel of fp8_ws.py, and `triton_tensorwise_tl_dot` times the Triton kernel's
   `max_num_imprecise_acc` promotion beside it) against torch._scaled_mm (tensorwise
   and rowwise, with and without use_fast_accum) and bf16 cuBLAS (torch.matmul) at 4096^3 and
   8192^3. b is an (N, K) row-major tensor, read as b.T. The casts are done once, outside the
   timing: this part times the GEMMs alone.
2. crossover: mpgpt.fp8.Fp8Linear forward + backward (three fp8 GEMMs through torch._scaled_mm,
   casts and amaxes included) per recipe, against nn.Linear under bf16 autocast (fp32 weights in
   both), at GPT-2 small's layer shapes and at square widths up to 8192, 8192 tokens. A ratio
   above 1 means fp8 is faster. torchao's Float8Linear joins if torchao imports.
3. accumulation: long-K products of positive fp8 values (the running sum only grows, so an
   accumulator that keeps few bits loses the most) through torch._scaled_mm with and without
   use_fast_accum and through the Triton GEMM with and without promotion, each against float64
   of the same fp8 inputs; next to them the CPU model of a 14-bit accumulator (mpgpt.fp8.accumulate_model).
4. training: GPT-2 small (its 50,304-entry output layer kept, on the course's character-level
   Markov text) trained for 2000 steps of 16 x 256 tokens under bf16 autocast, three ways from the
   same seed and batches: bf16 everywhere (twice: seeds 0 and 1, whose gap is the noise any
   comparison must beat), fp8 (tensorwise, Fp8Linear) in the output layer only, and fp8 in every
   linear layer. Loss curves, validation loss, ms per step and peak memory (mpgpt.bench.longrun).

Prints a table and writes fp8_<gpu>_<date>.json into --out-dir (default: the current folder),
after each part, with the GPU, driver, CUDA, torch and triton versions, the date, the command and
the commit (mpgpt.results). The record chapter 9 shows is mpgpt.results' "fp8-h200".
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time

import torch
from torch import nn

from mpgpt import fp8, runtime
from mpgpt.bench.longrun import RunConfig, corpus_dataset, long_run
from mpgpt.kernels import fp8_matmul as kfp8
from mpgpt.model import GPT, GPTConfig
from mpgpt.results import check_tag, environment, write_result

PARTS = ("gemm", "crossover", "accumulation", "training")
GEMM_SHAPES = [("4096^3", 4096, 4096, 4096), ("8192^3", 8192, 8192, 8192)]
TOKENS = 8192  # 8 sequences of 1024: GPT-2 small's batch per step in chapter 7
GPT2_LAYERS = [  # (label, in, out)
    ("c_attn", 768, 2304),
    ("attn.c_proj", 768, 768),
    ("c_fc", 768, 3072),
    ("mlp.c_proj", 3072, 768),
    ("lm_head", 768, 50304),
]
WIDTHS = [1024, 2048, 4096, 8192]     # square d -> d layers; 768 is among the GPT-2 shapes
LAYER_RECIPES = ("tensorwise", "rowwise", "delayed")  # block scales run emulated: not timed here
ACCUM_K = [1024, 4096, 16384, 65536]
ACCUM_MN = 128


def empty_cache(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def median_ms(fn, grad_to_none=None, rep=100) -> float:
    from triton.testing import do_bench

    fn()  # compiles and autotunes: keep it out of do_bench's estimate
    torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def attempt(fn):
    """Run one measurement; a failure (an unsupported option in this torch) becomes a recorded error."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the record says what failed instead of losing the run
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}


def rel_error(c: torch.Tensor, exact: torch.Tensor) -> float:
    """||c - exact|| / ||exact|| in float64."""
    return ((c.double() - exact).norm() / exact.norm()).item()


# --- 1. GEMMs -------------------------------------------------------------------------------------
def gemm_cases(a, b, qa_t, qb_t, qa_r, qb_r):
    """label -> a zero-argument function computing one (M, N) product."""
    def scaled_mm(qa, qb, fast):
        return lambda: fp8.scaled_matmul(qa, qb, out_dtype=torch.bfloat16, backend="torch", use_fast_accum=fast)

    # an fp8 output needs a scale before its cast: sized for |c| up to 6 sqrt(K) (unit normal inputs)
    out_scale = fp8.scale_from_amax(torch.tensor(6.0 * a.shape[1] ** 0.5, device=a.device))
    return {
        "bf16_cublas": lambda: torch.matmul(a, b.t()),
        "scaled_mm_tensorwise": scaled_mm(qa_t, qb_t, False),
        "scaled_mm_tensorwise_fast_accum": scaled_mm(qa_t, qb_t, True),
        "scaled_mm_rowwise": scaled_mm(qa_r, qb_r, False),
        "scaled_mm_rowwise_fast_accum": scaled_mm(qa_r, qb_r, True),
        "triton_tensorwise": lambda: kfp8.fp8_linear_matmul(qa_t, qb_t, promote=True),
        "triton_tensorwise_tl_dot": lambda: kfp8.fp8_linear_matmul(qa_t, qb_t, promote=True, kernel="triton"),
        "triton_tensorwise_no_promotion": lambda: kfp8.fp8_linear_matmul(qa_t, qb_t, promote=False),
        "triton_rowwise": lambda: kfp8.fp8_linear_matmul(qa_r, qb_r, promote=True),
        "triton_tensorwise_fp8_out": lambda: kfp8.fp8_matmul(qa_t.data, qb_t.data, qa_t.scale, qb_t.scale,
                                                             out_dtype=torch.float8_e4m3fn, out_scale=out_scale)[0],
    }


def bench_gemm(shapes=GEMM_SHAPES, device="cuda"):
    rows = []
    for label, M, N, K in shapes:
        a = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        b = torch.randn(N, K, device=device, dtype=torch.bfloat16)
        qa_t, qb_t = fp8.quantize(a, fp8.E4M3, "tensorwise"), fp8.quantize(b, fp8.E4M3, "tensorwise")
        qa_r, qb_r = fp8.quantize(a, fp8.E4M3, "rowwise"), fp8.quantize(b, fp8.E4M3, "rowwise")
        exact_t = qa_t.dequantize().double() @ qb_t.dequantize().double().t()
        flops = 2.0 * M * N * K
        row = {"shape": label, "M": M, "N": N, "K": K}
        for name, fn in gemm_cases(a, b, qa_t, qb_t, qa_r, qb_r).items():
            def measure():
                ms = median_ms(fn)
                out = {"ms": ms, "tflops": flops / ms * 1e-9}
                if "tensorwise" in name and "fp8_out" not in name:
                    out["rel_error_vs_float64"] = rel_error(fn(), exact_t)
                return out
            row[name] = attempt(measure)
        row["ratios"] = gemm_ratios(row)
        rows.append(row)
        print_gemm_row(row)
        del a, b, qa_t, qb_t, qa_r, qb_r, exact_t
        empty_cache(device)
    return rows


def gemm_ratios(row: dict) -> dict:
    """Speed ratios (time of the reference / time of ours; > 1: ours is faster), where both ran."""
    pairs = {
        "triton_vs_scaled_mm_tensorwise": ("triton_tensorwise", "scaled_mm_tensorwise"),
        "tl_dot_vs_scaled_mm_tensorwise": ("triton_tensorwise_tl_dot", "scaled_mm_tensorwise"),
        "triton_no_promotion_vs_scaled_mm_fast_accum": ("triton_tensorwise_no_promotion", "scaled_mm_tensorwise_fast_accum"),
        "triton_rowwise_vs_scaled_mm_rowwise": ("triton_rowwise", "scaled_mm_rowwise"),
        "triton_vs_bf16_cublas": ("triton_tensorwise", "bf16_cublas"),
        "triton_no_promotion_vs_bf16_cublas": ("triton_tensorwise_no_promotion", "bf16_cublas"),
        "scaled_mm_tensorwise_vs_bf16_cublas": ("scaled_mm_tensorwise", "bf16_cublas"),
    }
    out = {}
    for key, (ours, ref) in pairs.items():
        if "ms" in row.get(ours, {}) and "ms" in row.get(ref, {}):
            out[key] = row[ref]["ms"] / row[ours]["ms"]
    return out


def print_gemm_row(row):
    parts = [f"{row['shape']:>7}"]
    for name in ("bf16_cublas", "scaled_mm_tensorwise", "scaled_mm_tensorwise_fast_accum", "scaled_mm_rowwise",
                 "triton_tensorwise", "triton_tensorwise_tl_dot", "triton_tensorwise_no_promotion", "triton_rowwise",
                 "triton_tensorwise_fp8_out"):
        r = row.get(name, {})
        parts.append(f"{name} {r['tflops']:.0f} TF/s" if "tflops" in r else f"{name} failed")
    print(" | ".join(parts), flush=True)
    print("        ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in row["ratios"].items()), flush=True)


# --- 2. the crossover map ----------------------------------------------------------------------------
def layer_shapes():
    """(label, in, out) for the GPT-2 small layers, then the square widths."""
    return GPT2_LAYERS + [(f"{d}x{d}", d, d) for d in WIDTHS]


def torchao_layers():
    """recipe -> a function turning an nn.Linear into torchao's Float8Linear, or {} without torchao."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception:  # noqa: BLE001 - torchao is optional
        return {}

    def convert(recipe):
        def make(linear):
            holder = nn.Sequential(linear)
            convert_to_float8_training(holder, config=Float8LinearConfig.from_recipe_name(recipe))
            return holder[0]
        return make
    return {f"torchao_{r}": convert(r) for r in ("tensorwise", "rowwise")}


def bench_crossover(shapes=None, tokens=TOKENS, device="cuda"):
    rows = []
    extra = torchao_layers()
    for label, fin, fout in shapes or layer_shapes():
        lin = nn.Linear(fin, fout, device=device)
        x = torch.randn(tokens, fin, device=device, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(tokens, fout, device=device, dtype=torch.bfloat16)
        params = [x, lin.weight, lin.bias]

        def step(layer):
            def fn():
                with torch.autocast(device, dtype=torch.bfloat16):
                    y = layer(x)
                y.backward(g)
            return fn

        flops = 3 * 2.0 * tokens * fin * fout   # forward + two backward GEMMs
        row = {"layer": label, "tokens": tokens, "in": fin, "out": fout}
        row["bf16_nn_linear"] = attempt(lambda: {"ms": median_ms(step(lin), params)})
        layers = {f"fp8_{r}": (lambda r=r: fp8.Fp8Linear.from_linear(lin, recipe=r)) for r in LAYER_RECIPES}
        layers.update({k: (lambda make=make: make(nn.Linear(fin, fout, device=device))) for k, make in extra.items()})
        for name, make in layers.items():
            def measure():
                layer = make()
                ms = median_ms(step(layer), params + list(layer.parameters()))
                return {"ms": ms}
            row[name] = attempt(measure)
        base = row["bf16_nn_linear"].get("ms")
        for name in ["bf16_nn_linear", *layers]:
            r = row[name]
            if "ms" in r:
                r["tflops"] = flops / r["ms"] * 1e-9
                if base:
                    r["speedup_vs_bf16"] = base / r["ms"]
        rows.append(row)
        print(f"fwd+bwd {label:>11} ({tokens}x{fin}->{fout}): bf16 {row['bf16_nn_linear'].get('ms', float('nan'))*1e3:6.0f} us | "
              + " | ".join(f"{n} {row[n]['speedup_vs_bf16']:.2f}x" if "speedup_vs_bf16" in row[n] else f"{n} failed"
                           for n in layers), flush=True)
        del lin, x, g
        empty_cache(device)
    return rows


# --- 3. accumulation -----------------------------------------------------------------------------------
def bench_accumulation(ks=ACCUM_K, mn=ACCUM_MN, device="cuda"):
    rows = []
    for K in ks:
        a = torch.rand(mn, K, device=device) + 0.5
        b = torch.rand(mn, K, device=device) + 0.5
        qa, qb = fp8.quantize(a), fp8.quantize(b)
        exact = qa.dequantize().double() @ qb.dequantize().double().t()
        cases = {
            "scaled_mm": lambda: fp8.scaled_matmul(qa, qb, backend="torch", use_fast_accum=False),
            "scaled_mm_fast_accum": lambda: fp8.scaled_matmul(qa, qb, backend="torch", use_fast_accum=True),
            "triton_promoted": lambda: kfp8.fp8_linear_matmul(qa, qb, out_dtype=torch.float32, promote=True),
            "triton_promoted_tl_dot": lambda: kfp8.fp8_linear_matmul(qa, qb, out_dtype=torch.float32, promote=True,
                                                                     kernel="triton"),
            "triton_no_promotion": lambda: kfp8.fp8_linear_matmul(qa, qb, out_dtype=torch.float32, promote=False),
        }
        row = {"K": K, "M": mn, "N": mn}
        for name, fn in cases.items():
            row[name] = attempt(lambda fn=fn: max_rel(fn(), exact))
        qa_cpu, qb_cpu = qa.dequantize()[:16].cpu(), qb.dequantize()[:16].cpu()   # the model: a 16 x 16 corner
        exact_cpu = exact[:16, :16].cpu()
        for name, kw in {"model_14bit": dict(bits=14), "model_14bit_promoted": dict(bits=14, promote_every=128)}.items():
            row[name] = max_rel(fp8.accumulate_model(qa_cpu, qb_cpu, **kw), exact_cpu)
        rows.append(row)
        print(f"K={K:>6}: max relative error " + " | ".join(
            f"{n} {row[n]:.1e}" if isinstance(row[n], float) else f"{n} failed" for n in row if n not in ("K", "M", "N")),
            flush=True)
    return rows


# --- 4. training -----------------------------------------------------------------------------------------
TRAIN_RUNS = {  # name -> (seed, which nn.Linear layers become Fp8Linear)
    "bf16": (0, ()),
    "bf16_seed1": (1, ()),
    "fp8_lm_head": (0, ("lm_head",)),
    "fp8_all_linear": (0, ("lm_head", "c_attn", "c_proj", "c_fc")),
}


def to_fp8(model: nn.Module, suffixes, recipe: str = "tensorwise") -> list[str]:
    """Replace each nn.Linear whose name ends with one of ``suffixes`` by an Fp8Linear sharing its
    parameters; return the replaced names."""
    replaced = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and name in suffixes:
                setattr(parent, name, fp8.Fp8Linear.from_linear(child, recipe=recipe))
                replaced.append(f"{parent_name}.{name}".lstrip("."))
    return replaced


def bench_training(runs=TRAIN_RUNS, cfg=None, n_chars: int = 12_000_000, preset: str = "gpt2", device="cuda"):
    cfg = cfg or RunConfig()
    dataset = corpus_dataset(n_chars)
    out = {}
    for name, (seed, layers) in runs.items():
        run_cfg = RunConfig(**{**cfg.__dict__, "seed": seed})
        torch.manual_seed(seed)
        model = GPT(GPTConfig.preset(preset, block_size=run_cfg.block_size)).to(device)
        replaced = to_fp8(model, layers)
        opt = torch.optim.AdamW(model.parameters(), lr=run_cfg.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                fused=torch.device(device).type == "cuda")
        res = attempt(lambda: long_run(model, opt, dataset, run_cfg, device=device, autocast_dtype=torch.bfloat16))
        res["fp8_layers"] = len(replaced)
        out[name] = res
        if "error" in res:
            print(f"training {name}: {res['error']}", flush=True)
        else:
            print(f"training {name:>15}: {len(replaced):2d} fp8 layers, final val {res['val_loss'][-1][1]:.4f}, "
                  f"{res['ms_per_step']:.2f} ms/step, {res['tokens_per_s']:,.0f} tokens/s, "
                  f"peak {res['peak_gib'] or 0:.2f} GiB, {res['wall_s']:.0f} s", flush=True)
        del model, opt
        empty_cache(device)
    return out


def max_rel(c: torch.Tensor, exact: torch.Tensor) -> float:
    """Largest |c - exact| / |exact| (exact > 0 here: positive inputs)."""
    return ((c.double() - exact).abs() / exact.abs()).max().item()


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m mpgpt.bench fp8", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default=".", help="where the JSON result goes (default: the current folder)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from: {', '.join(PARTS)}")
    parser.add_argument("--tag", default=None, type=check_tag, help="appended to the file name")
    parser.add_argument("--train-runs", default=",".join(TRAIN_RUNS),
                        help=f"the training part's runs, comma-separated, from: {', '.join(TRAIN_RUNS)}")
    args = parser.parse_args(argv)
    train_runs = [r for r in args.train_runs.split(",") if r]
    if not train_runs or any(r not in TRAIN_RUNS for r in train_runs):
        parser.error(f"--train-runs takes names from: {', '.join(TRAIN_RUNS)}")
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")

    rt = runtime.current()
    if not rt.fp8:
        where = "no CUDA GPU" if not rt.on_gpu else f"{rt.name} has no fp8 tensor cores (sm_89+ needed)"
        print(f"The fp8 benchmark needs an L4, H100 or H200: {where}. Chapter 9 shows the recorded "
              "result, mpgpt.results.load_record('fp8-h200').")
        return 1
    command = shlex.join(["python", "-m", "mpgpt.bench", "fp8", *argv])
    env = environment(command)
    print(f"{env['gpu']} | driver {env['driver']} | CUDA {env['cuda']} | torch {env['torch']} | triton {env['triton']}",
          flush=True)
    result = {"tokens": TOKENS, "layer_recipes": list(LAYER_RECIPES)}
    run = {"gemm": bench_gemm, "crossover": bench_crossover, "accumulation": bench_accumulation,
           "training": lambda: bench_training({r: TRAIN_RUNS[r] for r in train_runs})}
    path = None
    for part in parts:
        t0 = time.perf_counter()
        result[part] = run[part]()
        result.setdefault("wall_s", {})[part] = round(time.perf_counter() - t0, 1)
        path = write_result("fp8", result, args.out_dir, tag=args.tag, command=command)  # a cut-short run keeps its parts
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
