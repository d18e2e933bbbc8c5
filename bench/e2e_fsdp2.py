"""Peer of examples/src/bin/bench_e2e.rs: the same Llama (bench/llama_torch.py) trained with
PyTorch FSDP2 (`fully_shard` per block and at the root, bf16 parameters, fp32 gradient reduction
and master weights), fused AdamW (betas 0.9/0.95, weight decay 0.1), clipping at 1.0, the same
sizes, sequence length, micro-batch, token stream and starting weights (bench/shared_init.py).
Pure torch, no downloads. One process per GPU:
    torchrun --nproc-per-node N bench/e2e_fsdp2.py SIZE STAGE [STEPS] [MICRO] [SEQ] [--ac 0|1]
STAGE 3 reshards parameters after forward (ZeRO-3); 2 keeps them gathered until backward is done
(reshard_after_forward=False, ZeRO-2's memory profile). `--ac 1` checkpoints every block. The
model is built on the meta device and each parameter's shard filled from the shared values, so
no rank holds the full model. Rank 0 prints one JSON line with bench-e2e's keys."""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_torch as lt  # noqa: E402
import shared_init  # noqa: E402


@torch.no_grad()
def fill_shards(model, device):
    """Each sharded parameter's local shard from the shared values (one full parameter at a
    time on the device)."""
    for position, (name, module, param) in enumerate(shared_init.parameters_in_order(model)):
        full = shared_init.torch_values(lt.SEED, position, module, param.shape, device)
        local = distribute_tensor(full.contiguous(), param.device_mesh, param.placements)
        param.to_local().copy_(local.to_local())
        del full, local


def main():
    size, stage, steps, micro, seq, ac = lt.parse(sys.argv[1:])
    vocab, hidden, inter, layers, heads, kv, tied = lt.preset(size)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    with torch.device("meta"):
        model = lt.Llama(vocab, hidden, inter, layers, heads, kv, tied, checkpointing=ac)
    params = sum(p.numel() for p in model.parameters())
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy, reshard_after_forward=(stage == 3))
    fully_shard(model, mp_policy=policy, reshard_after_forward=(stage == 3))
    model.to_empty(device=device)
    fill_shards(model, device)
    torch.cuda.empty_cache()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)

    def step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    run = lt.train(model, step, lambda loss: loss.backward(), size, micro, seq, steps, rank,
                   device)
    if rank == 0:
        print(json.dumps(lt.result("torch-fsdp2", {"activation_checkpointing": ac}, size, stage,
                                   world, micro, seq, steps, params, *run)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
