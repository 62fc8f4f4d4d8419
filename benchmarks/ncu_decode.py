"""Kernels of decode-size calls, for Nsight Compute: FlashNorm fused and two_stream, the cuBLAS
GEMM alone, and F.rms_norm + cuBLAS, on two sites (bf16), for each M given (default 1).

    ncu --clock-control none --launch-count 40 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
        --csv --page details python3 benchmarks/ncu_decode.py [M ...] > ncu.csv

Needs the kernel library (FLASHNORM_LIBRARY or build/) and PYTHONPATH=exporter.
"""

import sys

import torch
import torch.nn.functional as F

from flashnorm import kernels

SITES = [(4096, [4096, 1024, 1024]), (2048, [8192, 8192])]  # Llama-3.1-8B qkv, Llama-3.2-1B gate/up

torch.manual_seed(0)
for m in [int(arg) for arg in sys.argv[1:]] or [1]:
    for k, splits in SITES:
        n = sum(splits)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / 64
        gain = torch.randn(k, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            kernels.flashnorm_matmul(x, w, 1e-5, splits, strategy="fused")
            kernels.flashnorm_matmul(x, w, 1e-5, splits, strategy="two_stream")
            torch.mm(x, w)
            torch.mm(F.rms_norm(x, (k,), gain, 1e-5), w)
torch.cuda.synchronize()
