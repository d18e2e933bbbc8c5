"""torch.optim.AdamW(fused=True) on the CPU: median step time over N fp32 parameters with the
given thread count, the peer of bench-cpu-adam (bench/run_cpu_adam.sh runs both)."""
import json
import os
import sys
import time

import torch

n, threads, steps = int(float(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
p = torch.nn.Parameter(torch.empty(n).uniform_(-0.5, 0.5))
p.grad = torch.empty(n).uniform_(-0.05, 0.05)
opt = torch.optim.AdamW([p], lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True)
times = []
for _ in range(steps + 1):
    start = time.perf_counter()
    opt.step()
    times.append(time.perf_counter() - start)
times = sorted(times[1:])  # the first step allocates the moments
median = times[len(times) // 2]
print(json.dumps({"thp_mem_alloc_enable": os.environ.get("THP_MEM_ALLOC_ENABLE", ""),
                  "torch": torch.__version__, "optimizer": "AdamW(fused=True)", "params": n,
                  "threads": torch.get_num_threads(), "median_step_s": median,
                  "s_per_1b_params": median * 1e9 / n, "steps": len(times),
                  "effective_gb_per_s": 28 * n / median / 1e9}))
