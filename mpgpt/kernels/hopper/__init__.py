"""Hopper (sm_90) matrix kernels: the persistent TMA kernel and the warp-specialised Gluon kernels.

    tma.py     a persistent grid with TMA descriptors (sm_90 and later)
    ws.py      warp-specialised, written in Gluon (sm_90 only): the products, with K in slices for
               weight gradients, and the GELU epilogues of the fused MLP
    fp8_ws.py  chapter 9's promoted fp8 GEMM, warp-specialised

`mpgpt.kernels.matmul`'s `plan` chooses among them and the chapter-6 kernel (`grouped.py`); each
refuses, in one line, a GPU or a product it cannot run.
"""
