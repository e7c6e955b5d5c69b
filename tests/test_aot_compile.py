"""The fp16 kernels compile for the GPUs learners rent (T4 sm_75, A100 sm_80, L4 sm_89) — checked
ahead of time on a machine with no GPU, through Triton's own compile API (tests/aot_driver.py).

What each check guards against:
- a kernel that does not compile for a target fails a learner's first cell on that runtime;
- a fixed configuration that needs more shared memory than the GPU has per block fails at launch
  (T4: 64 KB; A100: 163 KB; L4: 99 KB, from NVIDIA's CUDA C programming guide, compute
  capabilities table);
- on sm_80/89 tl.dot must use tensor-core mma instructions; on sm_75, Triton 3.2+ uses FMA
  (pull request 5066 in triton-lang/triton) — recorded, and the chapter says so.
What bf16 does on sm_75 depends on the Triton version (3.9 compiles it, older versions fail in
ptxas); the package refuses bf16 there in either case, which the last test checks.
"""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import mpgpt  # noqa: F401  (before triton: it sets TRITON_INTERPRET for this process; see conftest.py)

triton = pytest.importorskip("triton")
GPUTarget = pytest.importorskip("triton.backends.compiler").GPUTarget

ROOT = Path(__file__).resolve().parents[1]
SHARED_PER_BLOCK = {75: 64 * 1024, 80: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}


@pytest.fixture(scope="module")
def compiled():
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "aot_driver.py"), "75", "80", "89"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))  # shown with -s: the record of what this Triton does
    return {(r["cc"], r["kernel"], r["dtype"]): r for r in report["results"]}


@pytest.mark.parametrize("cc", [75, 80, 89])
def test_fp16_kernels_compile_and_fit(compiled, cc):
    matmul, gelu = compiled[cc, "matmul", "fp16"], compiled[cc, "gelu_backward", "fp16"]
    assert matmul["ok"], matmul.get("error")
    assert gelu["ok"], gelu.get("error")
    assert 0 < matmul["shared"] <= SHARED_PER_BLOCK[cc], f"sm_{cc}: {matmul['shared']} bytes of shared memory"
    if cc >= 80:
        assert matmul["mma"] > 0, f"sm_{cc}: tl.dot did not use tensor cores"
    else:
        assert matmul["mma"] + matmul["fma"] > 0


@pytest.mark.parametrize("cc,dtype", [(75, "fp16"), (80, "fp16"), (80, "bf16"), (89, "fp16"), (89, "bf16")])
def test_the_fused_cross_entropy_kernel_compiles(compiled, cc, dtype):
    record = compiled[cc, "cross_entropy", dtype]
    assert record["ok"], record.get("error")
    assert record["shared"] <= SHARED_PER_BLOCK[cc]  # the row reductions' scratch space


@pytest.mark.parametrize("cc,dtype", [(75, "fp16"), (90, "bf16")])
@pytest.mark.parametrize("kernel", ["gelu_backward_bias", "merge_heads", "layer_norm", "layer_norm_sum_dx",
                                    "layer_norm_two_pass", "sum_partials"])
def test_the_one_pass_backward_kernels_compile(compiled, cc, dtype, kernel):
    """GELU's backward with the bias sums, the head merge and LayerNorm's two backward kernels (the
    whole-rows one with and without the third sum), at their GPU tiles and pipeline stages, and the
    last sum of their tables: they run in the interpreter on a CPU, which
    never compiles them, so a construct only the compiler rejects would otherwise first fail on
    the learner's GPU. The two-pass kernel
    must keep its barrier between the row sums and the columns (other threads read what it wrote);
    the others need none of their own."""
    record = compiled[cc, kernel, dtype]
    assert record["ok"], record.get("error")
    assert record["shared"] <= SHARED_PER_BLOCK[cc]
    assert (record["barriers"] > 0) == (kernel == "layer_norm_two_pass"), record


@pytest.mark.parametrize("cc", [75, 90])
def test_the_one_launch_adamw16_compiles_and_vectorises_when_aligned(compiled, cc):
    """The optimizer's one-launch kernel reads each parameter through an address loaded from a
    table, which tells the compiler nothing of its alignment. Promised alignment (every address,
    count and state index a multiple of 16) must bring back the 16-byte vector accesses the
    per-tensor kernel gets from Triton's launcher; without the promise, 2-byte accesses remain.
    The same for the gradients' norm, which reads through the same tables."""
    aligned, ragged = compiled[cc, "adamw16_many_aligned", "bf16"], compiled[cc, "adamw16_many", "bf16"]
    assert aligned["ok"], aligned.get("error")
    assert ragged["ok"], ragged.get("error")
    assert aligned["vector_loads"] > 0 and aligned["vector_stores"] > 0 and aligned["scalar_16bit"] == 0, aligned
    assert ragged["vector_loads"] == 0 and ragged["scalar_16bit"] > 0, ragged
    # the gradients' norm over the same tables: loads only
    aligned, ragged = compiled[cc, "grad_sq_sum_many_aligned", "bf16"], compiled[cc, "grad_sq_sum_many", "bf16"]
    assert aligned["ok"], aligned.get("error")
    assert ragged["ok"], ragged.get("error")
    assert aligned["vector_loads"] > 0 and aligned["scalar_16bit"] == 0, aligned
    assert ragged["vector_loads"] == 0 and ragged["scalar_16bit"] > 0, ragged


@pytest.mark.parametrize("cc,dtype", [(75, "fp16"), (90, "bf16")])
@pytest.mark.parametrize("kernel", ["embedding_tails", "embedding_add"])
def test_the_tied_embeddings_kernels_compile(compiled, cc, dtype, kernel):
    """The segmented scan (tl.associative_scan over a pair) and the walk back through the tiles'
    tails (a while loop on loaded values) run in the interpreter on a CPU, which never compiles
    them."""
    record = compiled[cc, kernel, dtype]
    assert record["ok"], record.get("error")
    assert record["shared"] <= SHARED_PER_BLOCK[cc]


@pytest.mark.parametrize("cc,kernel", [(89, "fp8_matmul"), (90, "fp8_matmul_tma")])
def test_the_fp8_gemms_compile_for_fp8_tensor_cores(compiled, cc, kernel):
    """fp8 output, rowwise scales and promotion: the epilogue both kernels share, compiled for the L4
    (pointer loads) and Hopper (TMA loads, wgmma), within the GPU's shared memory."""
    record = compiled[cc, kernel, "fp8"]
    assert record["ok"], record.get("error")
    assert 0 < record["shared"] <= SHARED_PER_BLOCK[cc]
    assert record["mma"] > 0, f"sm_{cc}: tl.dot on fp8 did not use tensor cores"


@pytest.mark.parametrize("kernel,dtype,operands", [("ws", "bf16", "bf16"), ("ws_gelu", "bf16", "bf16"),
                                                    ("ws_row_major_b", "bf16", "bf16"),
                                                    ("ws_gelu_backward", "bf16", "bf16"),
                                                    ("ws_split_weight_grad", "bf16", "bf16"),
                                                    ("ws_split_weight_grad_narrow", "bf16", "bf16"),
                                                    ("ws_sliced_store", "bf16", "bf16"),
                                                    ("fp8_ws", "fp8", "e4m3")])
def test_the_gluon_kernels_compile_for_hopper(compiled, kernel, dtype, operands):
    """The warp-specialised kernels are written in Gluon, whose API moved between Triton releases
    (3.9 renamed the TMA copies): each, the bf16 kernel with its GELU epilogue (Z and gelu(Z)
    stored), with a row-major B (dX = dY @ W), with GELU's backward in the epilogue of
    dOut W_proj, and reading A transposed with K split into fp32 planes (dW = dY.t() @ X; unsplit
    on 128 x 160 tiles; both with five stages, the deepest ring in shared memory), and an N = 768
    output stored in slices through one staging buffer, beside five stages, must
    compile with the Triton installed here, fit an H100's shared memory, and multiply on wgmma
    with the operand type it was written for."""
    if (90, kernel, dtype) not in compiled:
        pytest.skip("this Triton has no Gluon")
    record = compiled[90, kernel, dtype]
    assert record["ok"], record.get("error")
    assert 0 < record["shared"] <= SHARED_PER_BLOCK[90]
    assert record["mma"] > 0 and record["wgmma_types"] == [operands], record
    if kernel.startswith("ws"):  # A is read transposed (its (K, M) stages) only by the weight-gradient kernel
        assert {a for a, _ in record["wgmma_transposed"]} == {"1" if kernel.startswith("ws_split_weight_grad") else "0"}, record
    # The GELU epilogue is compiled in (one tanh instruction per element), and only where asked for.
    assert (record["tanh"] > 0) == (kernel == "ws_gelu"), record
    # GELU's backward evaluates gelu' with exp (ex2), as gelu.py does, not the tanh instruction.
    assert (record["ex2"] > 0) == (kernel == "ws_gelu_backward"), record


def test_bf16_on_sm75_is_refused_whatever_triton_does(compiled):
    record = compiled[75, "matmul", "bf16"]
    assert isinstance(record["ok"], bool)  # compiled (Triton 3.9) or a ptxas error (older): both recorded
    from unittest import mock

    from mpgpt import runtime
    from mpgpt.kernels import env
    t4_tensor = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16)
    with mock.patch.object(env, "interpreting", lambda: False), \
         mock.patch.object(runtime, "capability", lambda device=None: (7, 5)), \
         mock.patch.object(runtime, "device_name", lambda device=None: "Tesla T4"):
        with pytest.raises(RuntimeError, match="Tesla T4 is sm_75.*fp16"):
            env.check_device(t4_tensor)
        env.check_device(SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.float16))  # fp16 is fine
