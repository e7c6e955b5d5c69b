"""Compile the package's Triton kernels ahead of time for GPUs this machine does not have.

Run by tests/test_aot_compile.py in a child process with TRITON_INTERPRET=0 (the kernels must be
real JITFunctions, not the interpreter's wrappers). Triton's own compile API needs no GPU:

    triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 75, 32))

Prints one JSON object: for each (target, kernel, dtype) whether it compiled, the shared memory
the compiled kernel needs, and which multiply instructions its PTX uses.

A launch on a GPU compiles with specialisations this API leaves out unless given as `attrs`:
Triton's launcher marks 16-byte aligned pointers and integer arguments divisible by 16, and turns
an integer argument of 1 into a constant. Without them the 16-bit loads are 2-byte scalars and
register counts come out far higher (LayerNorm's backward: 255 and spills, against 168 with them). So a
register count read from a compile here describes a launch only where the compile passes the
launch's `attrs` (as compile_adamw16_many does).
"""
import json
import os
import re
import sys

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from mpgpt.fast import cross_entropy, embedding, heads, layernorm  # noqa: E402
from mpgpt.kernels import adamw16, fp8_matmul, gelu, grouped, partials  # noqa: E402

POINTERS = ["a_ptr", "b_ptr", "c_ptr", "bias_ptr", "z_ptr"]
INTS = ["M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cm", "stride_cn",
        "stride_zm", "stride_zn", "stride_cs"]


def instructions(ptx: str) -> dict:
    found = re.findall(r"^\s*((?:mma|wgmma|fma)\.[\w.]*)", ptx, re.MULTILINE)
    return {"mma": sum(f.startswith(("mma", "wgmma")) for f in found), "fma": sum(f.startswith("fma") for f in found)}


def compile_matmul(cc: int, dtype: str, config: dict) -> dict:
    signature = {name: f"*{dtype}" for name in POINTERS} | {name: "i32" for name in INTS}
    constexprs = dict(HAS_BIAS=True, ACTIVATION="gelu", STORE_Z=True, UPCAST=False, SPLIT_K=1,
                      **{k: config[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")})
    signature |= {name: "constexpr" for name in constexprs}
    source = triton.compiler.ASTSource(fn=grouped.matmul_kernel, signature=signature, constexprs=constexprs)
    kernel = triton.compile(source, target=GPUTarget("cuda", cc, 32),
                            options=dict(num_warps=config["num_warps"], num_stages=config["num_stages"]))
    return {"shared": kernel.metadata.shared, **instructions(kernel.asm["ptx"])}


def compile_gelu_backward(cc: int, dtype: str) -> dict:
    signature = {"g_ptr": f"*{dtype}", "z_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "n": "i32", "BLOCK": "constexpr"}
    source = triton.compiler.ASTSource(fn=gelu._gelu_backward_kernel, signature=signature, constexprs={"BLOCK": 1024})
    kernel = triton.compile(source, target=GPUTarget("cuda", cc, 32))
    return {"shared": kernel.metadata.shared}


def compile_cross_entropy(cc: int, dtype: str) -> dict:
    """The fused classifier's kernel, writing the gradient of the sum (fp16), or of the mean (bf16: the
    scale a model held in bf16 gets)."""
    signature = {"logits_ptr": f"*{dtype}", "grad_ptr": f"*{dtype}", "targets_ptr": "*i64", "loss_ptr": "*fp32",
                 "V": "i32", "stride_l": "i32", "stride_g": "i32", "scale_ptr": "*fp32", "BLOCK_V": "constexpr",
                 "WRITE_GRAD": "constexpr", "SCALED": "constexpr"}
    constexprs = {"BLOCK_V": cross_entropy._BLOCK_V, "WRITE_GRAD": True, "SCALED": dtype == "bf16"}
    source = triton.compiler.ASTSource(fn=cross_entropy._cross_entropy_kernel, signature=signature,
                                       constexprs=constexprs)
    kernel = triton.compile(source, target=GPUTarget("cuda", cc, 32), options=dict(num_warps=cross_entropy._NUM_WARPS))
    return {"shared": kernel.metadata.shared}


def compile_column_sums(cc: int, dtype: str, kernel: str) -> dict:
    """The one-pass backward kernels that sum columns beside their main output, at their GPU
    tiles for GPT-2 small (C = 768, 12 heads of 64): GELU's backward with the bias sums, the
    attention's head merge, and LayerNorm's backward (whole rows, and the two-pass kernel behind a
    barrier), and the last sum of their partial-sum tables, rounded into the parameters' dtype."""
    t, f32 = f"*{dtype}", "*fp32"
    if kernel == "sum_partials":
        warps = 4
        fn, constexprs = partials._sum_partials_kernel, dict(BLOCK_N=partials._BLOCK_N, BLOCK_R=partials._BLOCK_R)
        signature = dict(part_ptr=f32, out_ptr=t, N="i32", R="i32")
    elif kernel == "gelu_backward_bias":
        rows, block_m, block_n, warps = gelu._BIAS_CONFIG
        fn, constexprs = gelu._gelu_backward_bias_kernel, dict(ROWS=rows, BLOCK_M=block_m, BLOCK_N=block_n)
        signature = dict(g_ptr=t, z_ptr=t, out_ptr=t, part_ptr=f32, M="i32", N="i32", R="i32")
    elif kernel == "merge_heads":
        rows, block_m, warps = heads._CONFIG
        fn, constexprs = heads._merge_heads_sum_kernel, dict(HS=64, NH=12, ROWS=rows, BLOCK_M=block_m, BLOCK_D=64)
        signature = dict(q_ptr=t, k_ptr=t, v_ptr=t, out_ptr=t, part_ptr=f32,
                         **{n: "i32" for n in ("M", "T", "R", "s_b", "s_h", "s_t", "s_d")})
    else:
        two_pass = kernel == "layer_norm_two_pass"
        rows, block_m, warps, _, stages = (16, 4, 4, "two-pass", 1) if two_pass else layernorm._CONFIG
        fn = layernorm._layer_norm_backward_two_pass_kernel if two_pass else layernorm._layer_norm_backward_kernel
        constexprs = dict(HAS_RES=True, SUM_DX=kernel == "layer_norm_sum_dx", ROWS=rows, BLOCK_M=block_m,
                          CHUNK=layernorm._CHUNK)
        if not two_pass:  # at the default tiles, loads pipelined as they run; C = 768 in chunks of 256, padded to 4
            constexprs |= dict(NCHUNK=4, STAGES=stages)
        signature = dict(dy_ptr=t, x_ptr=t, mean_ptr=f32, rstd_ptr=f32, w_ptr=f32, res_ptr=t, dx_ptr=t,
                         part_ptr=f32, **(dict(stat_ptr=f32) if two_pass else {}), M="i32", C="i32", R="i32")
    names = list(signature)
    # the launcher's specialisations at GPT-2's shapes: 16-byte aligned pointers, sizes multiples of 16
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n.endswith("_ptr") or n in ("M", "C", "R")}
    signature |= {name: "constexpr" for name in constexprs}
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", cc, 32), options=dict(num_warps=warps))
    # Barriers the kernel itself asks for (tl.debug_barrier: `gpu.barrier`, or `ttg.barrier` in newer
    # Triton), before the compiler adds its own for reductions through shared memory.
    return {"shared": compiled.metadata.shared,
            "barriers": sum("barrier" in line for line in compiled.asm["ttir"].splitlines())}


def compile_adamw16_many(cc: int, aligned: bool) -> dict:
    """The one-launch 16-bit AdamW (bf16-mantissa storage, bf16 gradients), with and without the
    alignment it may promise: which global loads and stores its PTX uses (16-byte vectors, the
    single-tensor kernel's, when every tensor is aligned)."""
    signature = dict(meta_ptr="*i64", block_ptr="*i32", S="i32", m_ptr="*fp32", v_ptr="*fp32", x_ptr="*i16",
                     coef_ptr="*fp32", div_ptr="*fp32", key="i64")
    constexprs = dict(WEIGHTS=adamw16.WEIGHT_CODES["mantissa"], MOMENTS=0, GRAD_BF16=True, BLOCK=1024, ALIGNED=aligned)
    names = list(signature)
    # the launcher's specialisation of 16-byte aligned pointer arguments
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n.endswith("_ptr")}
    signature |= {name: "constexpr" for name in constexprs}
    source = triton.compiler.ASTSource(fn=adamw16._adamw16_many_kernel, signature=signature, constexprs=constexprs,
                                       attrs=attrs)
    ptx = triton.compile(source, target=GPUTarget("cuda", cc, 32),
                         options=dict(num_warps=4, enable_fp_fusion=False)).asm["ptx"]
    return {"vector_loads": ptx.count("ld.global.v4"), "vector_stores": ptx.count("st.global.v4"),
            "scalar_16bit": ptx.count("ld.global.b16") + ptx.count("st.global.b16")}


def compile_grad_sq_sum_many(cc: int, aligned: bool) -> dict:
    """The gradients' norm over the same tables (bf16 gradients), with and without the promise."""
    signature = dict(meta_ptr="*i64", block_ptr="*i32", S="i32", blocks="i32", out_ptr="*fp32")
    constexprs = dict(GRAD_BF16=True, BLOCK=1024, ALIGNED=aligned, PER_PROGRAM=adamw16._NORM_BLOCKS)
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n.endswith("_ptr")}
    signature |= {name: "constexpr" for name in constexprs}
    source = triton.compiler.ASTSource(fn=adamw16._grad_sq_sum_many_kernel, signature=signature,
                                       constexprs=constexprs, attrs=attrs)
    ptx = triton.compile(source, target=GPUTarget("cuda", cc, 32), options=dict(num_warps=4)).asm["ptx"]
    return {"vector_loads": ptx.count("ld.global.v4"), "vector_stores": ptx.count("st.global.v4"),
            "scalar_16bit": ptx.count("ld.global.b16") + ptx.count("st.global.b16")}


def compile_embedding(cc: int, dtype: str, kernel: str) -> dict:
    """The tied embedding's two kernels at their GPU tiles: the tails, and the addition into dW's rows
    (d and dW in ``dtype``)."""
    R, chunk, warps = embedding._CONFIG
    signature = dict(d_ptr=f"*{dtype}", order_ptr="*i64", tok_ptr="*i32", tail_ptr="*fp32")
    if kernel == "embedding_tails":
        fn = embedding._run_tails_kernel
        signature |= dict(M="i32", C="i32")
    else:
        fn = embedding._add_runs_kernel
        signature |= dict(first_ptr="*i64", dw_ptr=f"*{dtype}", M="i32", C="i32", stride_dw="i32")
    constexprs = dict(R=R, CHUNK=chunk)
    signature |= {name: "constexpr" for name in constexprs}
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", cc, 32), options=dict(num_warps=warps))
    return {"shared": compiled.metadata.shared}


COLUMN_SUM_KERNELS = ("gelu_backward_bias", "merge_heads", "layer_norm", "layer_norm_sum_dx", "layer_norm_two_pass",
                      "sum_partials")


FP8_POINTERS = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "scale_a_ptr": "*fp32", "scale_b_ptr": "*fp32",
                "out_scale_ptr": "*fp32", "amax_ptr": "*fp32"}


def compile_fp8(cc: int, kernel: str) -> dict:
    """The fp8 GEMM with an fp8 output, rowwise scales and promotion (every epilogue branch that
    runs on a GPU): the pointer kernel with its smallest configuration (it must fit an L4), or the
    TMA kernel (sm_90) with its first."""
    tma = kernel == "fp8_matmul_tma"
    config = fp8_matmul.TMA_CONFIGS[0] if tma else fp8_matmul.CONFIGS[-1]
    constexprs = dict(OUT_MAX=448.0, ROWWISE=True, OUT_FP8=True, PROMOTE=True, **config.kwargs)
    strides = ["stride_am", "stride_bn", "stride_cm", "stride_cn"] if tma else \
        ["stride_am", "stride_ak", "stride_bn", "stride_bk", "stride_cm", "stride_cn"]
    constexprs |= dict(NUM_SMS=132) if tma else dict(UPCAST=False)
    signature = FP8_POINTERS | {"c_ptr": "*fp8e4nv"} | {n: "i32" for n in ["M", "N", "K", *strides]}
    signature |= {name: "constexpr" for name in constexprs}
    fn = fp8_matmul.fp8_matmul_tma_kernel if tma else fp8_matmul.fp8_matmul_kernel
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", cc, 32),
                              options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    return {"shared": compiled.metadata.shared, **instructions(compiled.asm["ptx"])}


class _Sm90Driver:
    """Stands in for Triton's CUDA driver so that a Gluon kernel's ``warmup`` (which specialises on
    real descriptor arguments, unlike ASTSource) compiles for an H100/H200 on a machine with no GPU."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch
        return torch.device("cpu")


def compile_gluon(kernel: str, epilogue: int = 0, row_major_b: bool = False, narrow: bool = False,
                  n_out: int = 4096) -> dict:
    """The two warp-specialised Gluon kernels (sm_90): ws.matmul_ws_kernel in bf16 with the given
    epilogue (0: a bias; 1: a bias, then Z and gelu(Z) stored; 2: GELU's backward with the column
    sums; 3: attn.c_proj's weight gradient, A transposed, K in 5 fp32 slices, or with `narrow` the
    MLP's, unsplit on 128 x 160 tiles), B read as w.t() or row-major, an output n_out wide (768:
    the sliced store of ws.sliced_store, with its fifth stage), and
    fp8_ws.fp8_ws_kernel promoting, with rowwise scales, for a 4096^3 product (descriptors of CPU
    tensors: only their shapes, strides and alignment matter here)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime import driver

    from mpgpt.kernels.hopper import fp8_ws, ws
    driver.set_active(_Sm90Driver())   # left active: this child process compiles, it never launches
    n = 4096
    if kernel == "fp8_ws":
        a = torch.empty(n, n, dtype=torch.float8_e4m3fn)
        c = torch.empty(n, n, dtype=torch.bfloat16)
        descs = [TensorDescriptor.from_tensor(t, box, layout)
                 for t, (box, layout) in zip((a, a, c), fp8_ws._layouts(torch.bfloat16))]
        s = torch.empty(n, dtype=torch.float32)
        compiled = fp8_ws.fp8_ws_kernel.warmup(*descs, s, s, n, n, n, SPLIT=fp8_ws.SPLIT, ROWWISE=True, PROMOTE=True,
                                               GROUP_M=fp8_ws.GROUP_M, STAGES=fp8_ws.default_stages(torch.bfloat16),
                                               num_warps=4, grid=(132,))
    elif epilogue == 3:
        # attn.c_proj's dW (768 x 768, sliced, wide tiles), or with `narrow` the MLP's (768 x 3072,
        # unsplit, 128 x 160 tiles), both with DEEP_STAGES stages
        m, n, k = (768, 3072 if narrow else 768, 12288)
        g = torch.empty(k, m, dtype=torch.bfloat16)  # dY (tokens, out): the product reads dY.t()
        x = torch.empty(k, n, dtype=torch.bfloat16)
        split = ws.split_for(m, n, k, 132)
        extra_n = ws.split_tile(m, n, k, split, 132)
        assert (extra_n == ws.NARROW_EXTRA_N) == narrow, (split, extra_n)
        descs = [TensorDescriptor.from_tensor(t, box, layout) for t, (box, layout) in
                 zip(ws.ws_tensors(g.t(), x, g, None, True, True), ws._layouts7(torch.bfloat16, True, True, extra_n))]
        compiled = ws.matmul_ws_kernel.warmup(*descs, g, g, torch.empty(split, m, n), m, n, k, HAS_BIAS=False,
                                              EPILOGUE=3, A_T=True, B_ROW_MAJOR=True,
                                              GROUP_M=ws.group_rows(n, extra_n), SPLIT_K=split,
                                              STAGES=ws.DEEP_STAGES, ROLES=1, SLICED=False,
                                              num_warps=ws.NUM_WARPS, grid=(120,))
    else:
        a = torch.empty(n, n, dtype=torch.bfloat16)
        w = torch.empty(n_out, n, dtype=torch.bfloat16)
        b = w.t().contiguous() if row_major_b else w.t()  # row-major (K, N), or w.t() as nn.Linear holds w
        c = torch.empty(n, n_out, dtype=torch.bfloat16)
        roles, sliced = ws.mma_roles(epilogue, 1, True, n_out), ws.sliced_store(epilogue, 1, n_out)
        stages = ws.STAGES_GELU_BACKWARD if epilogue == 2 else ws.DEEP_STAGES if sliced else ws.STAGES
        descs = [TensorDescriptor.from_tensor(t, box, layout)
                 for t, (box, layout) in zip(ws.ws_tensors(a, b, c), ws._layouts7(torch.bfloat16, row_major_b))]
        compiled = ws.matmul_ws_kernel.warmup(*descs, c[0], c, torch.empty(n_out, 32), n, n_out, n, HAS_BIAS=True,
                                              EPILOGUE=epilogue, A_T=False, B_ROW_MAJOR=row_major_b,
                                              GROUP_M=ws.group_rows(n_out), SPLIT_K=1, STAGES=stages, ROLES=roles,
                                              SLICED=sliced, num_warps=ws.NUM_WARPS // roles, grid=(132,))
    ptx = compiled.asm["ptx"]
    return {"shared": compiled.metadata.shared, **instructions(ptx), "tanh": ptx.count("tanh.approx.f32"),
            "ex2": ptx.count("ex2.approx"),
            "wgmma_types": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.\w+\.f32\.(\w+)\.", ptx))),
            # wgmma's last two immediates: whether it reads A, and B, transposed from shared memory
            "wgmma_transposed": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned[^;]*, ([01]), ([01]);", ptx)))}


def attempt(fn, *args) -> dict:
    try:
        return {"ok": True, **fn(*args)}
    except Exception as exc:  # what the compiler says is the result being recorded
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}


def main(targets) -> dict:
    out = {"triton": triton.__version__, "results": []}
    for cc in targets:
        arch = grouped.arch_of((cc // 10, cc % 10))
        out["results"].append({"cc": cc, "kernel": "matmul", "dtype": "fp16", "config": "fixed",
                               **attempt(compile_matmul, cc, "fp16", grouped.FIXED[arch])})
        out["results"].append({"cc": cc, "kernel": "gelu_backward", "dtype": "fp16", "config": "-",
                               **attempt(compile_gelu_backward, cc, "fp16")})
        for dtype in ("fp16", "bf16") if cc >= 80 else ("fp16",):
            out["results"].append({"cc": cc, "kernel": "cross_entropy", "dtype": dtype, "config": "-",
                                   **attempt(compile_cross_entropy, cc, dtype)})
    # The one-pass backward kernels of chapter 7's fastest step: fp16 on a T4, bf16 on Hopper.
    for cc, dtype in ((75, "fp16"), (90, "bf16")):
        for kernel in COLUMN_SUM_KERNELS:
            out["results"].append({"cc": cc, "kernel": kernel, "dtype": dtype, "config": "gpu default",
                                   **attempt(compile_column_sums, cc, dtype, kernel)})
    # The fp8 GEMMs on the GPUs that have fp8 tensor cores: the L4 (pointer kernel), Hopper (TMA).
    out["results"].append({"cc": 89, "kernel": "fp8_matmul", "dtype": "fp8", "config": "smallest",
                           **attempt(compile_fp8, 89, "fp8_matmul")})
    out["results"].append({"cc": 90, "kernel": "fp8_matmul_tma", "dtype": "fp8", "config": "first",
                           **attempt(compile_fp8, 90, "fp8_matmul_tma")})
    # The warp-specialised Gluon kernels (Hopper only), where this Triton has Gluon.
    from mpgpt.kernels.hopper import fp8_ws
    if fp8_ws.WS_FP8_IMPORT_ERROR is None:
        for name in ("ws", "fp8_ws"):
            out["results"].append({"cc": 90, "kernel": name, "dtype": "fp8" if name == "fp8_ws" else "bf16",
                                   "config": "fixed", **attempt(compile_gluon, name)})
        out["results"].append({"cc": 90, "kernel": "ws_gelu", "dtype": "bf16", "config": "fixed",
                               **attempt(compile_gluon, "ws", 1)})
        out["results"].append({"cc": 90, "kernel": "ws_row_major_b", "dtype": "bf16", "config": "fixed",
                               **attempt(compile_gluon, "ws", 0, True)})
        out["results"].append({"cc": 90, "kernel": "ws_gelu_backward", "dtype": "bf16", "config": "fixed",
                               **attempt(compile_gluon, "ws", 2, True)})
        out["results"].append({"cc": 90, "kernel": "ws_split_weight_grad", "dtype": "bf16", "config": "fixed",
                               **attempt(compile_gluon, "ws", 3, True)})
        out["results"].append({"cc": 90, "kernel": "ws_split_weight_grad_narrow", "dtype": "bf16", "config": "fixed",
                               **attempt(compile_gluon, "ws", 3, True, True)})
        out["results"].append({"cc": 90, "kernel": "ws_sliced_store", "dtype": "bf16", "config": "fixed",
                               **attempt(compile_gluon, "ws", 0, False, False, 768)})
    # The one-launch 16-bit AdamW, on a T4 and on Hopper.
    for cc in (75, 90):
        for aligned in (True, False):
            out["results"].append({"cc": cc, "kernel": "adamw16_many" + ("_aligned" if aligned else ""),
                                   "dtype": "bf16", "config": "-", **attempt(compile_adamw16_many, cc, aligned)})
            out["results"].append({"cc": cc, "kernel": "grad_sq_sum_many" + ("_aligned" if aligned else ""),
                                   "dtype": "bf16", "config": "-", **attempt(compile_grad_sq_sum_many, cc, aligned)})
    # The tied embedding's kernels: fp16 on a T4, bf16 on Hopper.
    for cc, dtype in ((75, "fp16"), (90, "bf16")):
        for name in ("embedding_tails", "embedding_add"):
            out["results"].append({"cc": cc, "kernel": name, "dtype": dtype, "config": "gpu default",
                                   **attempt(compile_embedding, cc, dtype, name)})
    # What bf16 does below sm_80 depends on the Triton version: recorded, not assumed.
    out["results"].append({"cc": 75, "kernel": "matmul", "dtype": "bf16", "config": "fixed",
                           **attempt(compile_matmul, 75, "bf16", grouped.FIXED["sm75"])})
    return out


if __name__ == "__main__":
    print(json.dumps(main([int(t) for t in sys.argv[1:]] or [75, 80, 89])))
