"""The peer of bench-kernels (issue 10) on the same GPU: torch.optim.AdamW(fused=True) over N
fp32 parameters (median step time of STEPS after a warm-up) and the GPU's copy bandwidth (a
device-to-device copy of 4 GiB, read + write counted), as one JSON line.
    python3 bench/kernels_torch.py N STEPS
"""
import json
import sys
import time

import torch


def median_time(fn, steps):
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main():
    n, steps = int(float(sys.argv[1])), int(sys.argv[2])
    device = "cuda"
    param = torch.nn.Parameter(torch.randn(n, device=device))
    param.grad = torch.randn(n, device=device)
    opt = torch.optim.AdamW([param], lr=1e-4, weight_decay=0.01, fused=True)
    opt.step()  # creates the state
    adamw = median_time(opt.step, steps)
    del opt, param
    torch.cuda.empty_cache()
    x = torch.randn(1 << 30, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    copy = median_time(lambda: y.copy_(x), steps)
    print(json.dumps({
        "system": "torch", "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
        "params": n, "steps": steps, "adamw_fused_s": adamw,
        "adamw_fused_s_per_1e9": adamw * 1e9 / n,
        "adamw_fused_gb_per_s": 7 * 4 * n / adamw / 1e9,
        "copy_gb_per_s": 2 * 4 * (1 << 30) / copy / 1e9,
    }))


if __name__ == "__main__":
    main()
