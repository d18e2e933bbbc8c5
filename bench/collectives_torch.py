"""Collective bus bandwidth through torch.distributed (NCCL): the peer of
examples/src/bin/bench_collectives.rs, same sizes, same formulas, same JSON lines.

Run: torchrun --nproc-per-node N bench/collectives_torch.py
"""
import json
import os
import time

import torch
import torch.distributed as dist

SIZES_MIB = [1, 4, 16, 64, 256, 1024]


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    for op in ["all_gather", "reduce_scatter", "all_reduce"]:
        for mib in SIZES_MIB:
            nbytes = mib << 20
            elements = nbytes // 4
            big = torch.ones(elements, device="cuda")
            small = torch.ones(elements // world, device="cuda")

            def once():
                if op == "all_gather":
                    dist.all_gather_into_tensor(big, small)
                elif op == "reduce_scatter":
                    dist.reduce_scatter_tensor(small, big)
                else:
                    dist.all_reduce(big)

            for _ in range(3):
                once()
            torch.cuda.synchronize()
            iters = 20 if mib <= 64 else 10
            start = time.perf_counter()
            for _ in range(iters):
                once()
            torch.cuda.synchronize()
            seconds = (time.perf_counter() - start) / iters
            algbw = nbytes / seconds / 1e9
            factor = (2.0 if op == "all_reduce" else 1.0) * (world - 1) / world
            if rank == 0:
                print(json.dumps({"system": "torch", "op": op, "bytes": nbytes, "time_us": round(seconds * 1e6, 2),
                                  "algbw_GBps": round(algbw, 2), "busbw_GBps": round(algbw * factor, 2)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
