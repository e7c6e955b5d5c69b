"""Benchmark the Triton kernels against cuBLAS (chapter 6).

    python -m mpgpt.bench kernels
    python -m mpgpt.bench kernels --out-dir results --kernels grouped,tma

The measurements, all bf16 on random inputs (never zeros: they run faster than real data),
each the median of `triton.testing.do_bench` (CUDA events; do_bench also clears the L2 cache
between runs so we do not time the cache):

1. matmul TFLOP/s (2*M*N*K / time) of `mpgpt.kernels.matmul` against `torch.matmul` (cuBLAS) at
   the GPT-2-small shapes, M = 12*1024 tokens with (K, N) in (768, 2304) c_attn, (768, 768)
   attn.c_proj, (768, 3072) c_fc, (3072, 768) mlp.c_proj, (768, 50304) lm_head, and 4096^3,
   8192^3. B is read as w.t() of a (N, K) weight, as nn.Linear stores it. Each product is also
   recorded once as a CUDA graph and timed by replaying it (`graph` in each row): at the small
   shapes one call's host time can exceed its GPU time, and then do_bench times the host.
2. the fused linear + bias + GELU(tanh) against torch's F.linear (bias fused by cuBLAS) followed
   by F.gelu, at 12288 x 768 -> 3072 (GPT-2's c_fc); on sm_90 also the warp-specialised kernel's
   GELU epilogue (`ws_gelu_store_z`, the fused MLP's forward product).
3. TritonLinear forward + backward against nn.Linear (+ nn.GELU), under bf16 autocast with fp32
   parameters, as in training; timed twice: called from Python (do_bench), where each call's
   host time shows whenever it exceeds the GPU's, and recorded once as a CUDA graph and timed by
   replaying it, which leaves the GPU's time, as in a training step recorded whole
   (TrainConfig.cuda_graph).
4. GELU's backward with the bias gradient summed beside it (the fused MLP's backward pass), at
   12288 x 3072: torch's ops eager and compiled against `gelu_backward_bias` and its tile sizes.
5. The attention's input gradients merged into c_attn's (tokens, 3C) gradient with its bias
   gradient summed beside it (qkv.py's backward), on the gradients SDPA's backward returns at
   GPT-2's shape: torch's ops eager and compiled against `merge_heads_bias` and its tile sizes.
6. LayerNorm's backward with the residual stream's gradient added and the weight and bias
   gradients (layernorm.py's backward) at 12288 x 768: Inductor's kernels for the same formulas
   against `layer_norm_backward` and its tile sizes.
7. The gradient products of GPT-2 small's four layers (12288 tokens), as replayed CUDA graphs:
   dX = dY @ W on cuBLAS, `auto` and the warp-specialised kernel reading W row-major; dW =
   dY.t() @ X on cuBLAS (bf16 out, as nn.Linear under autocast computes it) against the
   package's kernels writing fp32 (as TritonLinear does for fp32 master weights): `auto`, the
   TMA kernel unsplit and the warp-specialised kernel with K in slices (ws.launch_split). Part 3
   also times TritonLinear with dW on the TMA kernel, and with dX on the ws kernel too
   (`grad_kernels` in each row).
8. The last sums of the one-pass kernels' partial-sum tables, at the tables GPT-2 small's step
   leaves (LayerNorm's, GELU's and the head merge's), with the result in bf16 as a bf16 model
   keeps its parameters: torch's sum followed by the casts, against `partials.sum_partials`, as
   replayed CUDA graphs (so the gaps between launches count, as in a step recorded whole).

9. The tied embedding's gradient added into the output layer's (embedding.py), at GPT-2 small's
   12288 tokens, 50,304 x 768 matrix in bf16, for uniformly random tokens (as the training
   benchmark draws them) and for text-like ones (a Zipf law: long runs of a few tokens): what
   Inductor compiles for the unfused sum (a scatter into zeros, then a dense addition) against
   `embedding_grad_into_` in place, at its default tiles and others, as replayed CUDA graphs.
10. (sm_90) The fused MLP's backward product with GELU's backward in its epilogue
   (`ws.gelu_backward_fused`) at GPT-2's 12288 x 768 -> 3072: cuBLAS's dH = dOut W_proj alone,
   cuBLAS followed by `gelu_backward_bias`, and the one launch, as replayed CUDA graphs.

Prints a table and writes kernels_<gpu>_<date>.json into --out-dir (default: the current folder)
with the GPU, driver, CUDA, torch and triton versions, the date, the command and the commit
(mpgpt.results). The record chapter 6 shows is mpgpt.results.load_record("kernels-h200").
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from mpgpt.kernels import env as kenv
from mpgpt.kernels import gelu, grouped, linear, partials
from mpgpt.kernels.hopper import tma, ws
from mpgpt.fast import embedding, heads, layernorm
from mpgpt.kernels.linear import TritonLinear, gelu_tanh_grad
from mpgpt.kernels.matmul import matmul, plan
from mpgpt.results import environment as base_environment
from mpgpt.results import check_tag, write_result

GPT2_SHAPES = [  # (label, M, N, K)
    ("c_attn", 12288, 2304, 768),
    ("attn.c_proj", 12288, 768, 768),
    ("c_fc", 12288, 3072, 768),
    ("mlp.c_proj", 12288, 768, 3072),
    ("lm_head", 12288, 50304, 768),
]
SQUARE_SHAPES = [("4096^3", 4096, 4096, 4096), ("8192^3", 8192, 8192, 8192)]
GRAD_SHAPES = [  # (label, out, in): dX is (tokens, in), dW (out, in) summed over the tokens
    ("c_attn", 2304, 768),
    ("attn.c_proj", 768, 768),
    ("c_fc", 3072, 768),
    ("mlp.c_proj", 768, 3072),
]
LINEAR_SHAPES = [  # (label, in, out, activation)
    ("c_attn", 768, 2304, None),
    ("attn.c_proj", 768, 768, None),
    ("c_fc+gelu", 768, 3072, "gelu"),
    ("mlp.c_proj", 3072, 768, None),
]


def environment(argv) -> dict:
    """mpgpt.results' environment (GPU, driver, CUDA, torch, triton, date, command, commit) plus the GPU's shape."""
    env = base_environment(command=shlex.join(["python", "-m", "mpgpt.bench", "kernels", *argv]))
    props = torch.cuda.get_device_properties(0)
    env["compute_capability"] = list(torch.cuda.get_device_capability(0))
    env["multiprocessors"] = props.multi_processor_count
    return env


def _median_ms(fn, grad_to_none=None):
    from triton.testing import do_bench

    fn()  # first call compiles and autotunes: keep it out of do_bench's estimate
    torch.cuda.synchronize()
    return do_bench(fn, warmup=50, rep=300, grad_to_none=grad_to_none, return_mode="median")


def _graph_ms(fn, params=()):
    """Median time of ``fn`` recorded once as a CUDA graph and replayed: the GPU's time, with no
    Python between the kernels of one call (do_bench still clears L2 before each replay). ``params`` get fresh gradients inside the recording (set to None before
    it), so every replay writes them instead of adding into the warm-up's."""
    from triton.testing import do_bench

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graph asks
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    for p in params:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = do_bench(graph.replay, warmup=50, rep=300, return_mode="median")
    del graph
    return ms


def _tuning(kernel: str, a, b, bias=None, activation=None) -> dict:
    """Which kernel matmul(a, b, bias, activation, kernel=kernel) runs (matmul.plan), the config
    the autotuner chose at its last tuning run, and every config's time (ms). Call it right
    after the first call of a new shape: later calls of the same shape skip the autotuner (the
    lean launch path, launch.py), so they do not update it."""
    p = plan(a, b, bias, activation, kernel=kernel)
    ran = p.kernel
    if ran == "ws":
        return {"kernel": "ws", "plan": p.reason,
                "best_config": f"fixed: {ws.BLOCK_M}x({ws.BLOCK_N}+{ws.EXTRA_N})x{ws.BLOCK_K}, "
                f"{ws.STAGES} stages, {ws.NUM_WARPS}+1 warps"}
    tuner = tma.matmul_tma_autotuned if ran == "tma" else grouped.matmul_autotuned
    out = {"kernel": ran, "plan": p.reason, "best_config": str(getattr(tuner, "best_config", None))}
    timings = getattr(tuner, "configs_timings", None)
    if timings:
        out["config_ms"] = {str(c): (t[0] if isinstance(t, (list, tuple)) else t) for c, t in timings.items()}
    return out


def bench_matmul(kernels, shapes):
    rows = []
    for label, M, N, K in shapes:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        b = w.t()  # (K, N) view of nn.Linear's layout
        flops = 2.0 * M * N * K
        ms_cublas = _median_ms(lambda: torch.matmul(a, b))
        row = {"shape": label, "M": M, "N": N, "K": K, "cublas_ms": ms_cublas,
               "cublas_tflops": flops / ms_cublas * 1e-9}
        ref = torch.matmul(a, b).float()
        graph_cublas = _graph_ms(lambda: torch.matmul(a, b))
        row["graph"] = {"cublas_ms": graph_cublas}
        for kern in kernels:
            out = matmul(a, b, kernel=kern)
            err = ((out.float() - ref).norm() / ref.norm()).item()  # vs cuBLAS: both bf16-rounded
            ms = _median_ms(lambda: matmul(a, b, kernel=kern))
            row[kern] = {"ms": ms, "tflops": flops / ms * 1e-9, "vs_cublas": ms_cublas / ms,
                         "rel_diff_vs_cublas": err, **_tuning(kern, a, b)}
            graph_ms = _graph_ms(lambda: matmul(a, b, kernel=kern))
            row["graph"][kern] = {"ms": graph_ms, "vs_cublas": graph_cublas / graph_ms}
        rows.append(row)
        _print_row(row, kernels)
        del a, w, b, ref
    return rows


def _print_row(row, kernels):
    parts = [f"{row['shape']:>12} {row['M']:>6}x{row['N']:<6}x{row['K']:<5}",
             f"cuBLAS {row['cublas_tflops']:6.1f} TF/s"]
    for k in kernels:
        r = row[k]
        parts.append(f"{k} {r['tflops']:6.1f} TF/s ({r['vs_cublas']:.2f}x; as a graph {row['graph'][k]['vs_cublas']:.2f}x)")
    print(" | ".join(parts), flush=True)


def bench_fused(kernels, M=12288, K=768, N=3072):
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    res = {"M": M, "N": N, "K": K,
           "torch_linear_bias_ms": _median_ms(lambda: F.linear(x, w, bias)),
           "torch_linear_bias_gelu_ms": _median_ms(lambda: F.gelu(F.linear(x, w, bias), approximate="tanh"))}
    ref = F.gelu(F.linear(x, w, bias).float(), approximate="tanh")
    for kern in kernels:
        out = matmul(x, w.t(), bias, "gelu", kernel=kern)
        ms = _median_ms(lambda: matmul(x, w.t(), bias, "gelu", kernel=kern))
        res[kern] = {"ms": ms, "speedup_vs_torch_unfused": res["torch_linear_bias_gelu_ms"] / ms,
                     "rel_diff": ((out.float() - ref).norm() / ref.norm()).item(),
                     # same (M, N, K) as c_fc: the autotuner reuses that choice, so its
                     # per-config timings would be stale; record only the config.
                     "best_config": _tuning(kern, x, w.t(), bias, "gelu")["best_config"]}
    names = list(kernels)
    if ws.gelu_eligible(x, w):
        # The warp-specialised kernel's GELU epilogue (fast/mlp.py's forward), which also stores
        # the pre-activation z as the layer keeps it for its backward pass.
        out, _ = ws.gelu_forward(x, w, bias)
        ms = _median_ms(lambda: ws.gelu_forward(x, w, bias))
        res["ws_gelu_store_z"] = {"ms": ms, "speedup_vs_torch_unfused": res["torch_linear_bias_gelu_ms"] / ms,
                                  "rel_diff": ((out.float() - ref).norm() / ref.norm()).item()}
        names.append("ws_gelu_store_z")
    line = (f"fused bias+GELU {M}x{K}->{N}: torch linear+bias {res['torch_linear_bias_ms']*1e3:.0f} us, "
            f"+gelu {res['torch_linear_bias_gelu_ms']*1e3:.0f} us")
    for kern in names:
        line += f" | {kern} {res[kern]['ms']*1e3:.0f} us ({res[kern]['speedup_vs_torch_unfused']:.2f}x)"
    print(line, flush=True)
    return res


# Tile configurations (ROWS, BLOCK_M, BLOCK_N, num_warps) of gelu_backward_bias timed beside its default.
# The second line: rows a quarter to a third of GPT-2's c_fc wide, a few at a time. Compiled ahead of
# time for sm_90 with a launch's specialisations (Triton 3.6) they take 48-71 registers a thread, no
# spills, against 72 at the default (64, 64, 64, 4): eight to ten programs per multiprocessor against
# seven. (They were added to the sweep on counts of 56-93 against 185, from compiles without those
# specialisations; they measured slower, record kernels-grads-h200.)
GELU_BACKWARD_CONFIGS = [(128, 32, 128, 4), (128, 64, 64, 4), (256, 64, 64, 4), (128, 64, 32, 4),
                         (128, 32, 64, 4), (32, 32, 64, 4), (16, 16, 64, 4), (64, 32, 64, 2), (128, 128, 64, 8),
                         (128, 4, 256, 4), (64, 4, 256, 4), (128, 8, 256, 8), (64, 2, 512, 4), (256, 4, 512, 4),
                         (128, 2, 1024, 8)]


def bench_gelu_backward(M=12288, N=3072):
    """GELU's backward with c_fc's bias gradient (mlp.py's backward) at GPT-2's (tokens, 4C): torch's two
    ops eager and compiled by Inductor (with and without its mix-order reduction, which chapter 7's
    fastest rows turn off) against gelu_backward_bias at its default and other tile configurations;
    and without a bias, Inductor's pointwise kernel against gelu_backward. Bytes: read dH and Z,
    write dZ, 3 * M * N * 2 B, the floor at the copy bandwidth."""
    import torch._inductor.config as inductor_config

    h = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    z = (3 * torch.randn(M, N, device="cuda")).to(torch.bfloat16)
    ref = (h.double() * gelu_tanh_grad(z).double())
    ref_db = ref.sum(0)

    def torch_pair(h, z):
        dz = torch.ops.aten.gelu_backward(h, z, approximate="tanh")
        return dz, dz.sum(0, dtype=torch.float32)

    def err(out):
        return ((out.double() - ref).norm() / ref.norm()).item()

    res = {"M": M, "N": N, "bytes": 3 * M * N * 2, "torch_eager_ms": _median_ms(lambda: torch_pair(h, z))}
    for name, patch in (("torch_compiled_ms", {}), ("torch_compiled_no_mix_order_ms", {"triton.mix_order_reduction": False})):
        torch._dynamo.reset()
        with inductor_config.patch(patch):
            fn = torch.compile(torch_pair)
            dz, db = fn(h, z)
            res[name] = _median_ms(lambda: fn(h, z))
            res[name.replace("_ms", "_db_rel_err")] = ((db.double() - ref_db).norm() / ref_db.norm()).item()
    torch._dynamo.reset()
    res["configs"] = {}
    for config in [None] + GELU_BACKWARD_CONFIGS:
        dz, db = gelu.gelu_backward_bias(h, z, config=config)
        ms = _median_ms(lambda: gelu.gelu_backward_bias(h, z, config=config))
        key = "default " + str(gelu._BIAS_CONFIG) if config is None else str(config)
        res["configs"][key] = {"ms": ms, "dz_rel_err": err(dz),
                               "db_rel_err": ((db.double() - ref_db).norm() / ref_db.norm()).item()}
    res["fused_ms"] = res["configs"]["default " + str(gelu._BIAS_CONFIG)]["ms"]
    fn = torch.compile(lambda h, z: torch.ops.aten.gelu_backward(h, z, approximate="tanh"))
    fn(h, z)
    res["no_bias"] = {"torch_compiled_ms": _median_ms(lambda: fn(h, z)),
                      "gelu_backward_ms": _median_ms(lambda: gelu.gelu_backward(h, z)),
                      "gelu_backward_rel_err": err(gelu.gelu_backward(h, z))}
    torch._dynamo.reset()
    best = min(res["configs"].items(), key=lambda kv: kv[1]["ms"])
    print(f"GELU backward + bias sum {M}x{N}: torch eager {res['torch_eager_ms']*1e3:.1f} us, compiled "
          f"{res['torch_compiled_ms']*1e3:.1f} us (no mix-order {res['torch_compiled_no_mix_order_ms']*1e3:.1f}) | "
          f"fused {res['fused_ms']*1e3:.1f} us ({res['bytes'] / res['fused_ms'] * 1e-9:.2f} TB/s); "
          f"fastest config {best[0]} {best[1]['ms']*1e3:.1f} us | no bias: compiled "
          f"{res['no_bias']['torch_compiled_ms']*1e3:.1f} us, gelu_backward {res['no_bias']['gelu_backward_ms']*1e3:.1f} us",
          flush=True)
    for key, row in res["configs"].items():
        print(f"    {key:>26}: {row['ms']*1e3:6.1f} us  dz err {row['dz_rel_err']:.1e}  db err {row['db_rel_err']:.1e}")
    return res


# Tile configurations (ROWS, BLOCK_M, num_warps) of merge_heads_bias timed beside its default.
MERGE_HEADS_CONFIGS = [(64, 32, 4), (256, 32, 4), (128, 64, 4), (64, 16, 2), (128, 16, 4), (256, 64, 8),
                       (512, 32, 4)]


def bench_merge_heads(B=12, T=1024, n_head=12, hs=64):
    """c_attn's gradient from the attention's dq, dk, dv, with its bias gradient (qkv.py's backward),
    at GPT-2's shape: torch's concatenation and column sum, eager and compiled by Inductor (with and
    without its mix-order reduction), against merge_heads_bias at its default and other tile
    configurations. The inputs are SDPA's own gradients, in the layout its backward kernel returns.
    Each is timed as a replayed CUDA graph (the GPU's time, as in a step recorded whole: the
    kernel's three launches cost more host time than GPU time) and, as `call_ms`, by do_bench.
    Bytes: read dq, dk, dv and write d_qkv, 2 * 3 * B*T * C * 2 B, the floor at the copy bandwidth."""
    import torch._inductor.config as inductor_config

    C = n_head * hs
    q, k, v = torch.randn(B, T, 3, n_head, hs, device="cuda", dtype=torch.bfloat16).unbind(2)  # as the model splits
    q, k, v = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))  # (B, nh, T, hs) views
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    dq, dk, dv = torch.autograd.grad(y, (q, k, v), torch.randn_like(y))  # as the kernel returns them
    ref, _ = heads.merge_heads_reference(dq, dk, dv)
    ref_db = ref.double().sum(0)

    def db_err(db):
        return ((db.double() - ref_db).norm() / ref_db.norm()).item()

    res = {"B": B, "T": T, "n_head": n_head, "head_size": hs, "grad_strides": list(dq.stride()),
           "same_strides": dq.stride() == dk.stride() == dv.stride(),  # else the kernel copies them first
           "bytes": 2 * 3 * B * T * C * 2,
           "torch_eager_ms": _graph_ms(lambda: heads.merge_heads_reference(dq, dk, dv))}
    for name, patch in (("torch_compiled_ms", {}), ("torch_compiled_no_mix_order_ms", {"triton.mix_order_reduction": False})):
        torch._dynamo.reset()
        with inductor_config.patch(patch):
            fn = torch.compile(heads.merge_heads_reference)
            d_qkv, db = fn(dq, dk, dv)
            res[name] = _graph_ms(lambda: fn(dq, dk, dv))
            res[name.replace("_ms", "_db_rel_err")] = db_err(db)
    torch._dynamo.reset()
    res["configs"] = {}
    for config in [None] + MERGE_HEADS_CONFIGS:
        d_qkv, db = heads.merge_heads_bias(dq, dk, dv, config=config)
        key = "default " + str(heads._CONFIG) if config is None else str(config)
        res["configs"][key] = {"ms": _graph_ms(lambda: heads.merge_heads_bias(dq, dk, dv, config=config)),
                               "call_ms": _median_ms(lambda: heads.merge_heads_bias(dq, dk, dv, config=config)),
                               "exact": bool(torch.equal(d_qkv, ref)), "db_rel_err": db_err(db)}
    res["fused_ms"] = res["configs"]["default " + str(heads._CONFIG)]["ms"]
    best = min(res["configs"].items(), key=lambda kv: kv[1]["ms"])
    print(f"merge heads + bias sum {B * T}x{3 * C} (grad strides {res['grad_strides']}), graph replay: torch eager "
          f"{res['torch_eager_ms']*1e3:.1f} us, compiled {res['torch_compiled_ms']*1e3:.1f} us (no mix-order "
          f"{res['torch_compiled_no_mix_order_ms']*1e3:.1f}) | fused {res['fused_ms']*1e3:.1f} us "
          f"({res['bytes'] / res['fused_ms'] * 1e-9:.2f} TB/s); fastest config {best[0]} {best[1]['ms']*1e3:.1f} us",
          flush=True)
    for key, row in res["configs"].items():
        print(f"    {key:>26}: {row['ms']*1e3:6.1f} us (do_bench {row['call_ms']*1e3:6.1f} us)  exact {row['exact']}  "
              f"db err {row['db_rel_err']:.1e}")
    return res


def partial_tables(M=12288, C=768) -> dict:
    """The partial-sum tables (N, R) that GPT-2 small's one-pass backward kernels leave at their
    GPU tiles, and how many rows of each one parameter's gradient takes (LayerNorm's table holds
    dw's and db's)."""
    return {"layer_norm": ((2 * C, -(-M // layernorm._CONFIG[0])), 2),
            "gelu": ((4 * C, -(-M // gelu._BIAS_CONFIG[0])), 1),
            "merge_heads": ((3 * C, -(-M // heads._CONFIG[0])), 1)}


def bench_partials(dtype=torch.bfloat16):
    """Part 8: torch's `part.sum(1)` and then one cast per parameter, against one launch of
    sum_partials, for each table; both replayed from a CUDA graph."""
    res = {}
    for name, ((N, R), params) in partial_tables().items():
        part = torch.randn(N, R, device="cuda")

        def torch_sum_then_cast():
            s = part.sum(1)
            return [t.to(dtype) for t in s.chunk(params)]  # the casts the callers made, one per parameter

        ref = part.double().sum(1)
        got = partials.sum_partials(part, dtype)
        row = {"N": N, "R": R, "params": params,
               "torch_ms": _graph_ms(torch_sum_then_cast),
               "sum_partials_ms": _graph_ms(lambda: partials.sum_partials(part, dtype)),
               "rel_err": ((got.double() - ref).norm() / ref.norm()).item(),
               "rel_err_torch": ((torch.cat(torch_sum_then_cast()).double() - ref).norm() / ref.norm()).item()}
        res[name] = row
        print(f"last sum of {name}'s table ({N} x {R}) into {str(dtype).split('.')[-1]}, graph replay: torch's sum "
              f"and {params} cast(s) {row['torch_ms']*1e3:.2f} us, sum_partials {row['sum_partials_ms']*1e3:.2f} us "
              f"(rel err {row['rel_err']:.1e}, torch's {row['rel_err_torch']:.1e})", flush=True)
    return res


# Tile configurations (R, CHUNK, num_warps) of embedding_grad_into_ timed beside its default.
EMBEDDING_CONFIGS = [(64, 64, 8), (16, 64, 4), (32, 128, 4), (64, 128, 8), (32, 32, 2)]


def bench_embedding_grad(M=12288, V=50304, C=768, dtype=torch.bfloat16):
    """Part 9: dW = dW_head + the token embedding's gradient, for uniform and Zipf-distributed tokens.
    Inductor's code for the unfused sum (``dw + embedding_dense_backward(d, idx)``, what the compiled
    model's autograd adds) against embedding_grad_into_ (in place: each replay adds once more, which
    changes no timing), as replayed CUDA graphs. The floor of the in-place sum: read d and the
    touched rows of dW, write those rows."""
    res = {"M": M, "V": V, "C": C}
    d = torch.randn(M, C, device="cuda").to(dtype)
    ranks = torch.arange(1, V + 1, dtype=torch.float64)
    for name, idx in (("uniform", torch.randint(0, V, (M,), device="cuda")),
                      ("zipf", torch.multinomial(1.0 / ranks, M, replacement=True).to("cuda"))):
        dw = torch.randn(V, C, device="cuda").to(dtype)
        ref = dw.double().index_add(0, idx, d.double())
        row = {"distinct_tokens": int(idx.unique().numel()), "largest_run": int(torch.bincount(idx).max())}
        torch._dynamo.reset()
        unfused = torch.compile(lambda dw, idx, d: dw + torch.ops.aten.embedding_dense_backward(d, idx, V, -1, False))
        out = unfused(dw, idx, d)
        row["inductor_ms"] = _graph_ms(lambda: unfused(dw, idx, d))
        row["inductor_rel_err"] = ((out.double() - ref).norm() / ref.norm()).item()
        got = embedding.embedding_grad_into_(dw.clone(), idx, d)
        row["rel_err"] = ((got.double() - ref).norm() / ref.norm()).item()
        row["configs"] = {}
        for config in [None] + EMBEDDING_CONFIGS:
            key = "default " + str(embedding._CONFIG) if config is None else str(config)
            target = dw.clone()
            row["configs"][key] = _graph_ms(lambda: embedding.embedding_grad_into_(target, idx, d, config))
        row["fused_ms"] = row["configs"]["default " + str(embedding._CONFIG)]
        res[name] = row
        best = min(row["configs"].items(), key=lambda kv: kv[1])
        print(f"embedding gradient into the head's, {name} tokens ({row['distinct_tokens']} distinct, largest run "
              f"{row['largest_run']}), graph replay: Inductor {row['inductor_ms']*1e3:.1f} us, in place "
              f"{row['fused_ms']*1e3:.1f} us (fastest {best[0]} {best[1]*1e3:.1f} us); rel err {row['rel_err']:.1e} "
              f"(Inductor's {row['inductor_rel_err']:.1e})", flush=True)
    torch._dynamo.reset()
    return res


def bench_dgelu_epilogue(M=12288, C=768):
    """Part 10 (sm_90): dZ = (dOut W_proj) * gelu'(Z) and c_fc's bias gradient at GPT-2's shape, as the
    fused MLP's backward computes them: cuBLAS's product followed by gelu_backward_bias (gelu_backward=
    "pass") against ws.gelu_backward_fused (the product's epilogue, gelu_backward="epilogue"), and
    cuBLAS's product alone, the floor the epilogue should hide behind. Each as a replayed CUDA graph;
    dZ and db of the two forms compared with each other (bf16 dZ: the two may round a few elements to
    neighbouring values)."""
    g = torch.randn(M, C, device="cuda").bfloat16()
    w = (torch.randn(C, 4 * C, device="cuda") / C**0.5).bfloat16()
    z = (1.5 * torch.randn(M, 4 * C, device="cuda")).bfloat16()

    def separate():
        return gelu.gelu_backward_bias(g @ w, z, db_dtype=torch.bfloat16)

    def fused():
        return ws.gelu_backward_fused(g, w, z, True, torch.bfloat16)

    (dz_s, db_s), (dz_f, db_f) = separate(), fused()
    res = {"M": M, "K": C, "N": 4 * C, "cublas_product_ms": _graph_ms(lambda: g @ w),
           "separate_ms": _graph_ms(separate), "fused_ms": _graph_ms(fused),
           "dz_elements_differing": (dz_s != dz_f).float().mean().item(),
           "dz_max_abs_diff": (dz_s.float() - dz_f.float()).abs().max().item(),
           "db_rel_diff": ((db_s.float() - db_f.float()).norm() / db_s.float().norm()).item()}
    print(f"GELU backward in the epilogue of dOut W_proj {M}x{C}->{4 * C}, graph replay: cuBLAS product "
          f"{res['cublas_product_ms']*1e3:.1f} us, product + gelu_backward_bias {res['separate_ms']*1e3:.1f} us, "
          f"fused {res['fused_ms']*1e3:.1f} us ({res['separate_ms'] / res['fused_ms']:.2f}x); dZ differs in "
          f"{res['dz_elements_differing']:.1e} of its elements, db by {res['db_rel_diff']:.1e}", flush=True)
    return res


# Tile configurations (ROWS, BLOCK_M, num_warps[, method[, stages]]) of layer_norm_backward timed
# beside its default, (64, 4, 4) with the loads pipelined three iterations ahead. At GPT-2's 12288
# rows (64, 4, 4) makes 192 programs, (32, 4, 4) 384. Without the pipeline, compiled ahead of time for
# sm_90 with a launch's specialisations (Triton 3.6), 16, 32 or 64 rows a program take 168 registers a
# thread (three 4-warp programs per multiprocessor) and 24, 40, 48 or 56 rows 190 (two); with it,
# 207 (two). The
# "two-pass" kernel holds (BLOCK_M, 256) tiles instead of whole rows: 72 registers a thread, so up to
# seven programs share a multiprocessor.
LAYER_NORM_CONFIGS = [(32, 4, 4), (64, 4, 4), (48, 4, 4, "whole-rows", 2), (64, 4, 4, "whole-rows", 2),
                      (96, 4, 4, "whole-rows", 3), (64, 4, 4, "whole-rows", 4), (48, 4, 4), (16, 4, 4), (32, 4, 8),
                      (16, 4, 4, "two-pass"), (32, 4, 4, "two-pass"), (8, 4, 4, "two-pass"), (64, 4, 4, "two-pass"),
                      (16, 8, 8, "two-pass"), (16, 2, 2, "two-pass"), (32, 8, 4, "two-pass")]


def bench_layer_norm_backward(M=12288, C=768):
    """LayerNorm's backward as the fused residual add + LayerNorm needs it (layernorm.py), at GPT-2's
    (tokens, C) in bf16: dx' = dx'_res + LayerNorm's input gradient, and the weight and bias
    gradients. Inductor compiles torch's formulas for it (with and without its mix-order reduction)
    against layer_norm_backward at its default and other tile configurations, each timed as a
    replayed CUDA graph (and by do_bench as `call_ms`). Bytes: read dy, x', dx'_res and write dx',
    4 * M * C * 2 B, the floor at the copy bandwidth."""
    import torch._inductor.config as inductor_config

    x = torch.randn(M, C, device="cuda").bfloat16()
    dy, dres = torch.randn(M, C, device="cuda").bfloat16(), torch.randn(M, C, device="cuda").bfloat16()
    w, b = (1 + 0.1 * torch.randn(C, device="cuda")).bfloat16(), (0.1 * torch.randn(C, device="cuda")).bfloat16()
    var, mean = torch.var_mean(x.float(), dim=1, correction=0)
    rstd = torch.rsqrt(var + 1e-5)
    ref = [t.double() for t in layernorm.layer_norm_backward_reference(dy, x, mean, rstd, w, dres)]

    def errs(out):
        return [((o.double() - r).norm() / r.norm()).item() for o, r in zip(out, ref)]

    def torch_ln_backward(dy, x, mean, rstd, w, b, dres):  # what the unfused model's backward computes
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(dy.float(), x.float(), [C], mean[:, None], rstd[:, None],
                                                               w.float(), b.float(), [True, True, True])
        return dx.to(x.dtype) + dres, dw, db

    args = (dy, x, mean, rstd, w, b, dres)
    res = {"M": M, "C": C, "bytes": 4 * M * C * 2}
    for name, patch in (("torch_compiled_ms", {}), ("torch_compiled_no_mix_order_ms", {"triton.mix_order_reduction": False})):
        torch._dynamo.reset()
        with inductor_config.patch(patch):
            fn = torch.compile(torch_ln_backward)
            out = fn(*args)
            res[name] = _graph_ms(lambda: fn(*args))
            res[name.replace("_ms", "_rel_err")] = errs(out)
    torch._dynamo.reset()
    res["configs"] = {}
    for config in [None] + LAYER_NORM_CONFIGS:
        out = layernorm.layer_norm_backward(dy, x, mean, rstd, w, dres, config=config)
        key = "default " + str(layernorm._CONFIG) if config is None else str(config)
        res["configs"][key] = {"ms": _graph_ms(lambda: layernorm.layer_norm_backward(dy, x, mean, rstd, w, dres, config=config)),
                               "call_ms": _median_ms(lambda: layernorm.layer_norm_backward(dy, x, mean, rstd, w, dres,
                                                                                           config=config)),
                               "rel_err_dx_dw_db": errs(out)}
    res["fused_ms"] = res["configs"]["default " + str(layernorm._CONFIG)]["ms"]
    best = min(res["configs"].items(), key=lambda kv: kv[1]["ms"])
    print(f"LayerNorm backward + residual {M}x{C}, graph replay: compiled {res['torch_compiled_ms']*1e3:.1f} us "
          f"(no mix-order {res['torch_compiled_no_mix_order_ms']*1e3:.1f}) | fused {res['fused_ms']*1e3:.1f} us "
          f"({res['bytes'] / res['fused_ms'] * 1e-9:.2f} TB/s); fastest config {best[0]} {best[1]['ms']*1e3:.1f} us",
          flush=True)
    for key, row in res["configs"].items():
        print(f"    {key:>26}: {row['ms']*1e3:6.1f} us (do_bench {row['call_ms']*1e3:6.1f} us)  errors "
              + " ".join(f"{e:.1e}" for e in row["rel_err_dx_dw_db"]))
    return res


def linear_case(M, fin, fout, act):
    """One layer comparison: (nn.Linear, + nn.GELU if act), a TritonLinear sharing its parameters,
    fp32 input x (M, fin) that needs a gradient, bf16 output gradient g (M, fout), and
    step(layer) -> a function running one forward + backward under bf16 autocast."""
    lin = nn.Linear(fin, fout, device="cuda")
    ref_layer = nn.Sequential(lin, nn.GELU(approximate="tanh")) if act else lin
    tri_layer = TritonLinear.from_linear(lin, activation=act)
    x = torch.randn(M, fin, device="cuda", requires_grad=True)
    g = torch.randn(M, fout, device="cuda", dtype=torch.bfloat16)

    def step(layer):
        def fn():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = layer(x)
            y.backward(g)
        return fn
    return lin, ref_layer, tri_layer, x, g, step


def _grads(fn, params):
    """The gradients of ``params`` after one call of ``fn`` (a forward + backward), as fp32 copies."""
    for p in params:
        p.grad = None
    fn()
    return [p.grad.detach().float().clone() for p in params]


def bench_linear(M=12288):
    rows = []
    for label, fin, fout, act in LINEAR_SHAPES:
        lin, ref_layer, tri_layer, x, g, step = linear_case(M, fin, fout, act)

        params = [x, lin.weight, lin.bias]
        ms_ref = _median_ms(step(ref_layer), grad_to_none=params)
        ms_tri = _median_ms(step(tri_layer), grad_to_none=params)
        graph_ref = _graph_ms(step(ref_layer), params)
        graph_tri = _graph_ms(step(tri_layer), params)
        # The same layer with its gradient products on other kernels, where they can run (sm_90):
        # dW on the TMA kernel unsplit, then dX on the warp-specialised kernel as well. `auto`
        # elsewhere.
        # Each setting's gradients are first compared with the default path's, so a wrong kernel
        # cannot pass as a fast one.
        grad_kernels = {}
        if kenv.capability(x.device) == (9, 0):
            reference_grads = _grads(step(tri_layer), params)
            for name, dx_kernel, dw_kernel in (("dw_tma", "auto", "tma"), ("dx_ws_dw_tma", "ws", "tma")):
                linear.INPUT_GRAD_KERNEL, linear.WEIGHT_GRAD_KERNEL = dx_kernel, dw_kernel
                try:
                    diffs = [((g - r).norm() / r.norm()).item()
                             for g, r in zip(_grads(step(tri_layer), params), reference_grads)]
                    ms_k = _graph_ms(step(tri_layer), params)
                finally:
                    linear.INPUT_GRAD_KERNEL = linear.WEIGHT_GRAD_KERNEL = "auto"
                grad_kernels[name] = {"graph_ms": ms_k, "graph_speedup": graph_ref / ms_k,
                                      "grad_rel_diff_vs_default": dict(zip(("x", "weight", "bias"), diffs))}
        flops = 3 * 2.0 * M * fin * fout  # forward + two backward GEMMs
        row = {"layer": label, "M": M, "in": fin, "out": fout, "activation": act,
               "nn_linear_ms": ms_ref, "triton_linear_ms": ms_tri, "speedup": ms_ref / ms_tri,
               "nn_linear_tflops": flops / ms_ref * 1e-9, "triton_linear_tflops": flops / ms_tri * 1e-9,
               "graph": {"nn_linear_ms": graph_ref, "triton_linear_ms": graph_tri,
                         "speedup": graph_ref / graph_tri},
               "grad_kernels": grad_kernels}
        rows.append(row)
        sk = "".join(f"; {k} {v['graph_ms']*1e3:.0f} us ({v['graph_speedup']:.2f}x, gradients within "
                     f"{max(v['grad_rel_diff_vs_default'].values()):.1e} of the default's)" for k, v in grad_kernels.items())
        print(f"fwd+bwd {label:>12} ({M}x{fin}->{fout}): nn.Linear {ms_ref*1e3:7.0f} us | "
              f"TritonLinear {ms_tri*1e3:7.0f} us ({row['speedup']:.2f}x) | recorded as a graph: "
              f"{graph_ref*1e3:.0f} vs {graph_tri*1e3:.0f} us ({row['graph']['speedup']:.2f}x){sk}", flush=True)
    return rows


def bench_gradients(tokens=12288):
    """The two gradient products of GPT-2 small's four layers, each timed as a replayed CUDA graph,
    each result checked against float64 before it is timed, and whether it repeats bit for bit:

    dX = dY @ W   (tokens, out) @ (out, in), W row-major: cuBLAS against `auto` (the TMA kernel)
                  and the warp-specialised kernel reading W row-major (`ws`), all into bf16;
    dW = dY.t() @ X  (out, tokens) @ (tokens, in): cuBLAS into bf16 (nn.Linear under autocast)
                  against the package's kernels into fp32 (TritonLinear with fp32 master weights):
                  `auto`'s choice, the TMA kernel unsplit, and the warp-specialised kernel with K
                  in slices (`ws`)."""
    rows = []
    for label, fout, fin in GRAD_SHAPES:
        g = torch.randn(tokens, fout, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(tokens, fin, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(fout, fin, device="cuda", dtype=torch.bfloat16)
        flops = 2.0 * fout * fin * tokens
        for product, a, b, out_dtype, kerns in (("dX", g, w, torch.bfloat16, ("auto", "ws")),
                                                ("dW", g.t(), x, torch.float32, ("auto", "tma", "ws"))):
            ref = a.double() @ b.double()
            ms = _graph_ms(lambda: torch.mm(a, b))
            row = {"layer": label, "product": product, "out": fout, "in": fin, "tokens": tokens,
                   "cublas_ms": ms, "cublas_tflops": flops / ms * 1e-9}
            for kern in kerns:
                # NaN-filled outputs: a tile a kernel leaves unwritten shows as NaN, not as the
                # previous kernel's answer left in a reused block of memory
                out = torch.full(ref.shape, float("nan"), device="cuda", dtype=out_dtype)
                matmul(a, b, out=out, kernel=kern)
                err = ((out.double() - ref).norm() / ref.norm()).item()
                again = matmul(a, b, out=torch.full_like(out, float("nan")), kernel=kern)
                ms_k = _graph_ms(lambda: matmul(a, b, out=out, kernel=kern))
                p = plan(a, b, out=out, kernel=kern)
                row[kern] = {"graph_ms": ms_k, "vs_cublas": ms / ms_k, "tflops": flops / ms_k * 1e-9,
                             "rel_err_vs_float64": err, "repeats_bit_for_bit": bool(torch.equal(out, again)),
                             "kernel": p.kernel, "split_k": p.split_k, "plan": p.reason}
            rows.append(row)
            print(f"{product} {label:>12} ({tuple(a.shape)} @ {tuple(b.shape)}), graph replay: cuBLAS {ms*1e3:.1f} us | "
                  + " | ".join(f"{k} ({row[k]['kernel']}{'/' + str(row[k]['split_k']) if row[k]['split_k'] > 1 else ''}) "
                               f"{row[k]['graph_ms']*1e3:.1f} us ({row[k]['vs_cublas']:.2f}x, "
                               f"error {row[k]['rel_err_vs_float64']:.1e})" for k in kerns), flush=True)
        del g, x, w
    return rows


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m mpgpt.bench kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default=".", help="where the JSON result goes (default: the current folder)")
    parser.add_argument("--kernels", default="grouped,tma,ws,auto",
                        help="comma-separated: grouped, tma (Hopper only), ws (sm_90 only), auto")
    parser.add_argument("--tag", default=None, type=check_tag,
                        help="appended to the file name, so two runs on one day both stay")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: matmul, fused, triton (TritonLinear fwd+bwd), gelu (GELU's backward), "
                        "merge (the attention gradients' head merge), layer (LayerNorm's backward), "
                        "grads (the gradient products on cuBLAS and each kernel; sm_90), partials (the last "
                        "sums of the one-pass kernels' tables), embedding (the tied embedding's gradient), "
                        "dgelu (GELU's backward in the product's epilogue; sm_90)")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("The kernel benchmark needs a CUDA GPU (compute capability >= 8.0); the recorded results are "
              "mpgpt.results.load_record('kernels-h200').")
        return 1
    cc = kenv.capability(torch.device("cuda", torch.cuda.current_device()))
    if cc < (8, 0):
        print(f"{kenv.device_name()} is below compute capability 8.0: bf16 Triton does not compile there.")
        return 1
    kernels = [k for k in args.kernels.split(",") if k]
    if cc < (9, 0):
        kernels = [k for k in kernels if k != "tma"]
    if cc != (9, 0):
        kernels = [k for k in kernels if k != "ws"]
    skip = set(filter(None, args.skip.split(",")))

    env = environment(argv)
    print(f"{env['gpu']} | driver {env['driver']} | CUDA {env['cuda']} | torch {env['torch']} | "
          f"triton {env['triton']}", flush=True)
    result = {"kernels": kernels, "compute_capability": list(cc)}
    path = None
    parts = [("matmul", lambda: bench_matmul(kernels, GPT2_SHAPES + SQUARE_SHAPES)),
             # ws runs GELU only through ws.gelu_forward, which bench_fused adds where it can run
             ("fused_bias_gelu", lambda: bench_fused([k for k in kernels if k != "ws"])),
             ("triton_linear_fwd_bwd", bench_linear),
             ("gelu_backward", bench_gelu_backward),
             ("merge_heads", bench_merge_heads),
             ("layer_norm_backward", bench_layer_norm_backward),
             ("partials", bench_partials),
             ("embedding", bench_embedding_grad)]
    if cc == (9, 0):  # the TMA and ws kernels the gradient products are compared on are Hopper's
        parts.append(("grads", bench_gradients))
        if ws.WS_IMPORT_ERROR is None:
            parts.append(("dgelu_epilogue", bench_dgelu_epilogue))
    for name, run in parts:
        if name.split("_")[0] in skip or name in skip:
            continue
        t0 = time.perf_counter()
        result[name] = run()
        result.setdefault("wall_s", {})[name] = round(time.perf_counter() - t0, 1)
        # after each part: a run cut short by a time limit keeps what it measured
        path = write_result("kernels", result, args.out_dir, tag=args.tag, command=env["command"],
                            environment_extra={"multiprocessors": env["multiprocessors"]})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
