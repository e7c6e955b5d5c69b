"""One optimizer step at GPT-2 small's size: the fused 16-bit AdamW against torch's fused AdamW (chapter 10).

    python -m mpgpt.bench optim16
    python -m mpgpt.bench optim16 --variants bf16-sr,bf16-mantissa --out-dir results

An optimizer step does almost no arithmetic per byte, so its time is the bytes it moves divided
by the memory bandwidth. Every configuration updates GPT-2 small's parameter count (the shapes of
``GPTConfig.preset("gpt2")``, tied embedding counted once) with random gradients (never zeros):

* torch's fused AdamW (``torch.optim.AdamW(fused=True)``) over the model's list of fp32
  parameters with fp32 gradients: the usual fp32 master weights step (28 bytes moved/parameter);
* the same over bf16 parameters and gradients (pure bf16, round to nearest; 14 bytes);
* `mpgpt.kernels.adamw16.adamw16_fused`, one launch over one flat buffer, for each variant of
  `mpgpt.optim16` (bytes: `bytes_moved`).

Each time is the median of ``triton.testing.do_bench`` (CUDA events).

``--parts launches`` times the optimizer's kernels over GPT-2 small's own parameters, in the
trainer's two groups (matrices, and biases with LayerNorm gains), each recorded as a CUDA graph:
one launch per group (`FusedAdamW16`, each block finding its tensor in a table) against one
launch per tensor (`adamw16_fused` on each parameter and its slice of the state); and the
gradients' norm for the clip, `FusedAdamW16.grad_norm` against torch's multi-tensor norms.

``--parts training`` adds GPT-2 small (its 50,304-entry output layer kept) trained for 2000 steps
of 16 x 256 tokens of the course's character-level Markov text with every variant
(`mpgpt.kernels.adamw16.FusedAdamW16` over the model cast to bf16), from one seed and one batch
sequence, next to the usual recipe (fp32 weights, bf16 autocast, torch's fused AdamW): loss
curves, validation loss, ms per step and peak memory (`mpgpt.bench.longrun`).

Prints a table and writes
optim16_<gpu>_<date>.json into --out-dir (default: the current folder) with the GPU, driver,
CUDA, torch and triton versions, the date, the command and the commit (mpgpt.results).
"""
from __future__ import annotations

import argparse
import shlex
import sys

import torch

from mpgpt import runtime
from mpgpt.bench.longrun import RunConfig, corpus_dataset, long_run
from mpgpt.kernels.adamw16 import FusedAdamW16, adamw16_fused
from mpgpt.model import GPT, GPTConfig
from mpgpt.optim16 import VARIANTS, bytes_per_param, coefficients, new_state, step_seed
from mpgpt.results import check_tag, write_result
from mpgpt.trainer import param_groups, total_norm

__all__ = ["gpt2_shapes", "bytes_moved", "bench_optimizers", "launch_cases", "bench_launches", "main"]


def gpt2_shapes(preset: str = "gpt2") -> list[tuple[int, ...]]:
    """The parameter shapes of the preset's GPT (built on the meta device: no memory used)."""
    with torch.device("meta"):
        model = GPT(GPTConfig.preset(preset))
    return [tuple(p.shape) for p in model.parameters()]


def bytes_moved(variant: str) -> int:
    """Bytes one step reads and writes per parameter: weights, moments and the extra buffer are
    read and written, the gradient only read."""
    b = bytes_per_param(variant)
    return 2 * (b["weights"] + b["exp_avg"] + b["exp_avg_sq"] + b["extra"]) + b["grads"]


# torch's fused AdamW: fp32 params (4) + exp_avg (4) + exp_avg_sq (4) read and written, fp32 grad read
TORCH_BYTES = {"torch-fused-fp32": 2 * 12 + 4, "torch-fused-bf16": 2 * 6 + 2}


def _median_ms(fn) -> float:
    from triton.testing import do_bench

    fn()  # compiles
    torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def _torch_case(shapes, dtype) -> float:
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=dtype) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
    ms = _median_ms(opt.step)
    del opt, params
    torch.cuda.empty_cache()
    return ms


def _fused_case(n, variant) -> float:
    w = (torch.randn(n, device="cuda") * 0.02).to(torch.bfloat16)
    g = (torch.randn(n, device="cuda") * 1e-3).to(torch.bfloat16)
    state = new_state(w, variant)
    steps = [0]
    coef, one = torch.zeros(8, device="cuda"), torch.ones(1, device="cuda")

    def step():  # the host part of a real step too: the step's scalars (copied without a sync) and Philox key
        steps[0] += 1
        c = coefficients(1e-4, 0.9, 0.999, 1e-8, 0.1, steps[0])
        coef.copy_(torch.tensor(c.values(), dtype=torch.float32, pin_memory=True), non_blocking=True)
        adamw16_fused(w, g, state, variant, coef, step_seed(0, steps[0]), grad_div=one)

    ms = _median_ms(step)
    del w, g, state
    torch.cuda.empty_cache()
    return ms


def bench_optimizers(variants, preset="gpt2") -> list[dict]:
    shapes = gpt2_shapes(preset)
    n = sum(torch.Size(s).numel() for s in shapes)
    rows = []

    def add(name, ms, per_param):
        row = {"name": name, "ms": round(ms, 4), "bytes_per_param_moved": per_param,
               "gb_per_s": round(per_param * n / ms / 1e6, 1)}
        rows.append(row)
        ratio = f" {ms / rows[0]['ms']:.2f}x torch fp32" if rows[0] is not row else ""
        print(f"{name:>20}: {ms * 1e3:8.0f} us  {per_param:3d} B/param  {row['gb_per_s']:7.1f} GB/s{ratio}", flush=True)

    add("torch-fused-fp32", _torch_case(shapes, torch.float32), TORCH_BYTES["torch-fused-fp32"])
    add("torch-fused-bf16", _torch_case(shapes, torch.bfloat16), TORCH_BYTES["torch-fused-bf16"])
    for variant in variants:
        add(variant, _fused_case(n, variant), bytes_moved(variant))
    base = rows[0]["ms"]
    for row in rows:
        row["vs_torch_fused_fp32"] = round(row["ms"] / base, 3)
    return rows


def launch_cases(variant: str = "bf16-mantissa", preset: str = "gpt2", device="cuda"):
    """(optimizer, per_group, per_tensor) over the preset's parameters in bf16, with random
    gradients, in the trainer's two groups: two ways to launch the same update. per_group() is
    FusedAdamW16's step (a launch per group); per_tensor() launches adamw16_fused once per
    parameter on its slice of the same state, with the same coefficients and Philox key."""
    torch.manual_seed(0)
    with torch.device(device):
        named = [(f"p{i}", torch.nn.Parameter((torch.randn(s) * 0.02).to(torch.bfloat16)))
                 for i, s in enumerate(gpt2_shapes(preset))]
    for _, p in named:
        p.grad = (torch.randn(p.shape, device=device) * 1e-3).to(torch.bfloat16)
    opt = FusedAdamW16(param_groups(named, 0.1), lr=1e-4, variant=variant)
    opt.prepare(1)
    key = step_seed(0, 1)

    def per_group():
        for i, (group, flat, offset) in enumerate(zip(opt.param_groups, opt.flat, opt.group_offsets)):
            opt._update_group(group["params"], flat, offset, None, key, i)

    def per_tensor():
        for i, group in enumerate(opt.param_groups):
            for p in group["params"]:
                state = opt.state[p]
                adamw16_fused(p.view(-1), p.grad.view(-1), state, variant, opt.coef[i], key, state["offset"],
                              grad_div=opt.one)

    return opt, per_group, per_tensor


def _replayed_ms(fn) -> float:
    """fn recorded once as a CUDA graph (after a warm-up call that compiles and builds the tables
    outside the recording) and timed by replaying it: the GPU's time, no host work."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return round(_median_ms(graph.replay), 4)


def bench_launches(variant: str = "bf16-mantissa", preset: str = "gpt2") -> dict:
    """The two ways of launch_cases, each recorded as a CUDA graph (as the recorded training step
    runs it) and replayed under do_bench: the GPU's time for the optimizer, no host work."""
    opt, per_group, per_tensor = launch_cases(variant, preset)
    res = {"variant": variant, "tensors": sum(len(g["params"]) for g in opt.param_groups),
           "groups": len(opt.param_groups)}
    for name, fn in (("per_group", per_group), ("per_tensor", per_tensor)):
        res[f"{name}_ms"] = _replayed_ms(fn)
    res["speedup"] = round(res["per_tensor_ms"] / res["per_group_ms"], 3)
    print(f"{variant}: one launch per group ({res['groups']}) {res['per_group_ms'] * 1e3:.0f} us, one per tensor "
          f"({res['tensors']}) {res['per_tensor_ms'] * 1e3:.0f} us: {res['speedup']:.2f}x", flush=True)
    # The clip's norm of the same gradients: FusedAdamW16.grad_norm (a launch per group, through the
    # same tables) against the trainer's torch path (total_norm: torch's multi-tensor norms).
    grads = [p.grad for g in opt.param_groups for p in g["params"]]
    for name, fn in (("norm_per_group", opt.grad_norm), ("norm_torch", lambda: total_norm(grads))):
        res[f"{name}_ms"] = _replayed_ms(fn)
    res["norm_speedup"] = round(res["norm_torch_ms"] / res["norm_per_group_ms"], 3)
    print(f"{variant}: the gradients' norm in a launch per group {res['norm_per_group_ms'] * 1e3:.0f} us, "
          f"torch's multi-tensor norm {res['norm_torch_ms'] * 1e3:.0f} us: {res['norm_speedup']:.2f}x", flush=True)
    return res


PARTS = ("step", "launches", "training")


def bench_training(variants, preset="gpt2", cfg=None, n_chars: int = 12_000_000, device="cuda") -> dict:
    """Train the preset once per name in ``variants`` ("torch-amp": the usual mixed-precision way)."""
    cfg = cfg or RunConfig()
    dataset = corpus_dataset(n_chars)
    out = {}
    for name in variants:
        torch.manual_seed(cfg.seed)
        model = GPT(GPTConfig.preset(preset, block_size=cfg.block_size)).to(device)
        hyper = dict(lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
        if name == "torch-amp":
            opt = torch.optim.AdamW(model.parameters(), fused=torch.device(device).type == "cuda", **hyper)
            autocast = torch.bfloat16
        else:
            model = model.to(torch.bfloat16)
            opt = FusedAdamW16(model.parameters(), variant=name, seed=cfg.seed, **hyper)
            autocast = None
        try:
            res = long_run(model, opt, dataset, cfg, device=device, autocast_dtype=autocast)
            print(f"training {name:>16}: final val {res['val_loss'][-1][1]:.4f}, {res['ms_per_step']:.2f} ms/step, "
                  f"{res['tokens_per_s']:,.0f} tokens/s, peak {res['peak_gib'] or 0:.2f} GiB", flush=True)
        except Exception as exc:  # noqa: BLE001 - a diverged or failed variant is a result too
            res = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            print(f"training {name:>16}: {res['error']}", flush=True)
        out[name] = res
        del model, opt
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m mpgpt.bench optim16", description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from: {', '.join(VARIANTS)}")
    parser.add_argument("--preset", default="gpt2", help="model size whose parameter count is updated (default gpt2)")
    parser.add_argument("--out-dir", default=".", help="where the JSON result goes (default: the current folder)")
    parser.add_argument("--tag", default=None, type=check_tag, help="appended to the file name")
    parser.add_argument("--train-steps", type=int, default=RunConfig.steps, help="steps of each training run")
    parser.add_argument("--parts", default="step", help=f"comma-separated, from: {', '.join(PARTS)} (default: step)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="train only the named variants, not torch-amp first (to split one comparison "
                             "across several runs)")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    if args.train_steps < 200:
        print("python -m mpgpt.bench optim16: error: --train-steps must be at least 200 (warm-up is 100 steps)",
              file=sys.stderr)
        return 2
    if not parts or any(p not in PARTS for p in parts):
        print(f"python -m mpgpt.bench optim16: error: --parts takes {', '.join(PARTS)}", file=sys.stderr)
        return 2
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(f"python -m mpgpt.bench optim16: error: unknown variant {unknown[0]!r}; choose from "
              f"{', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("The optimizer benchmark needs a CUDA GPU; on a CPU, chapter 10 shows the recorded result if there is one.")
        return 1
    cap = runtime.capability("cuda")
    if cap < (8, 0):
        print(f"{runtime.device_name('cuda')} is sm_{cap[0]}{cap[1]}: the bf16 Triton kernel needs compute capability "
              ">= 8.0 (A100, L4, H100); chapter 10 shows the recorded result if there is one.")
        return 1
    command = shlex.join(["python", "-m", "mpgpt.bench", "optim16", *argv])
    shapes = gpt2_shapes(args.preset)
    n = sum(torch.Size(s).numel() for s in shapes)
    print(f"{runtime.device_name('cuda')} | torch {torch.__version__} | {n:,} parameters in {len(shapes)} tensors",
          flush=True)
    result = {"preset": args.preset, "parameters": n, "tensors": len(shapes)}
    if "step" in parts:
        result["rows"] = bench_optimizers(variants, args.preset)
        path = write_result("optim16", result, args.out_dir, tag=args.tag, command=command)
    if "launches" in parts:
        result["launches"] = [bench_launches(v, args.preset) for v in variants]
        path = write_result("optim16", result, args.out_dir, tag=args.tag, command=command)
    if "training" in parts:
        cfg = RunConfig(steps=args.train_steps)
        result["training"] = {}
        names = variants if args.no_baseline else ["torch-amp", *variants]
        for name in names:   # recorded after each run: a cut-short run keeps what it measured
            result["training"].update(bench_training([name], args.preset, cfg))
            path = write_result("optim16", result, args.out_dir, tag=args.tag, command=command)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
