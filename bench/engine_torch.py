"""Peer of examples/src/bin/bench_engine.rs: the same deep MLP step in PyTorch, one process per
GPU (torchrun). Stage 0: DDP; 1: DDP + ZeroRedundancyOptimizer; 2: FSDP SHARD_GRAD_OP (ZeRO-2).
fp32 weights with TF32 matmuls (burn's CUDA f32 matmul uses TF32 too). Prints one JSON line."""
import json, os, sys, time
import torch
import torch.distributed as dist
import torch.nn as nn

WIDTH, LAYERS, BATCH, STEPS, WARMUP = 4096, 8, 64, 12, 4

def main():
    stage = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.backends.cuda.matmul.allow_tf32 = True
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    model = nn.Sequential(*layers).cuda()
    params = sum(p.numel() for p in model.parameters())
    if stage == 2:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
        model = FSDP(model, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, use_orig_params=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    else:
        model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=200)
        if stage == 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                          lr=1e-4, weight_decay=0.01)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    times = []
    for step in range(STEPS):
        x = torch.rand(BATCH, WIDTH, device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        last = loss.item()
        torch.cuda.synchronize()
        if step >= WARMUP:
            times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    if rank == 0:
        print(json.dumps({"impl": "torch", "stage": stage, "world": world, "params": params,
                          "batch": BATCH, "torch": torch.__version__,
                          "median_step_ms": round(times[len(times) // 2], 2),
                          "min_step_ms": round(times[0], 2), "last_loss": last}))
    dist.destroy_process_group()

main()
