"""Scenario fp32_gemm (GPU): a large FP32 matmul on SIMT cores.

Problem: default FP32 matmul precision ("highest"): cuBLAS runs sgemm kernels without tensor
cores. Fix: `torch.set_float32_matmul_precision("high")` lets it use TF32 tensor cores.
"""

import torch

from scenario_recorder import main


def make(fixed: bool):
    torch.set_float32_matmul_precision("high" if fixed else "highest")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(4096, 4096, device=device)
    b = torch.randn(4096, 4096, device=device)

    def step():
        return torch.addmm(a, a, b)

    return step


if __name__ == "__main__":
    main("fp32_gemm", make)
