"""A GPU kept busy for SECONDS by 4096² matmuls: the load beside which benchmarks/gpu_session.sh's
``graph-load`` part runs the captured step's CUDA cases (results/bench/README.md, fifth GPU run).

    python3 benchmarks/gpu_load.py SECONDS
"""

import sys
import time

import torch

a = torch.randn(4096, 4096, device="cuda")
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    for _ in range(20):
        a = torch.tanh(a @ a)
    torch.cuda.synchronize()
