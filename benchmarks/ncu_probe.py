"""Where does the time go at N = 768? One launch each of cuBLAS and of a few variants of our TMA
kernel, for Nsight Compute (ncu) to profile. Session 5 (issue 3).

Run on the GPU machine under ncu (see benchmarks/h200_s5_ncu.sh):
    ncu --clock-control none --section SpeedOfLight ... python3 benchmarks/ncu_probe.py
Launch order is fixed (cuBLAS, then OURS in order), so the report says which is which;
the kernel names also say which cuBLAS kernel (tile, cluster, schedule) torch picked.
"""
import sys

import torch

sys.path.insert(0, "benchmarks")
from tma_variants import _launch, _tensors  # noqa: E402

SHAPES = {"attn.c_proj": (12288, 768, 768), "mlp.c_proj": (12288, 3072, 768)}
OURS = {  # name: variant (tile = BLOCK_M, BLOCK_N, BLOCK_K, stages, warps)
    "tma128x128": dict(tile=(128, 128, 64, 4, 8), TMA_STORE=True, EPILOGUE_SUBTILE=False, WARP_SPECIALIZE=False,
                       PPS=1),
    "tma128x128pps2": dict(tile=(128, 128, 64, 3, 4), TMA_STORE=False, EPILOGUE_SUBTILE=True,
                           WARP_SPECIALIZE=False, PPS=2),
    "tma128x256ws": dict(tile=(128, 256, 64, 3, 8), TMA_STORE=True, EPILOGUE_SUBTILE=False, WARP_SPECIALIZE=True,
                         PPS=1),
}


def main():
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for shape, (M, K, N) in SHAPES.items():
        a, w, bias, c, z = _tensors(M, K, N, "plain")
        for _ in range(3):  # warm-up: compile, and cuBLAS's heuristics
            torch.matmul(a, w.t())
            for v in OURS.values():
                _launch(v, a, w, bias, c, z, "plain", num_sms)
        torch.cuda.synchronize()
        for rep in range(2):
            torch.cuda.nvtx.range_push(f"{shape}/cublas")
            torch.matmul(a, w.t())
            torch.cuda.nvtx.range_pop()
            for name, v in OURS.items():
                torch.cuda.nvtx.range_push(f"{shape}/{name}")
                _launch(v, a, w, bias, c, z, "plain", num_sms)
                torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
    print("done")


if __name__ == "__main__":
    main()
