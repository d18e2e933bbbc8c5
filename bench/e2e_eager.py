"""Eager PyTorch peer of examples/src/bin/bench_e2e.rs without FSDP: the same Llama
(bench/llama_torch.py), starting weights (bench/shared_init.py), token stream, fused AdamW
(betas 0.9/0.95, weight decay 0.1) and clipping at 1.0, trained the way a user fine-tunes on one
GPU: fp32 parameters and master weights, the forward under torch.autocast(bfloat16). `--compile 1`
wraps the model in torch.compile (its compile time falls in the untimed warm-up steps).
    python3 bench/e2e_eager.py SIZE STAGE [STEPS] [MICRO] [SEQ] [--ac 0|1] [--compile 0|1]
    torchrun --nproc-per-node N bench/e2e_eager.py ...   (DistributedDataParallel, N GPUs)
STAGE is accepted for the shared interface and ignored (nothing is sharded). Under torchrun
each rank trains on its own tokens (bench-e2e's stream for that rank) and DDP averages the
gradients, as bench-e2e's ranks do. Rank 0 prints one JSON line with bench-e2e's keys."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_torch as lt  # noqa: E402
import shared_init  # noqa: E402


class Autocast(torch.nn.Module):
    """The model's forward under bf16 autocast (the loss stays outside, in fp32)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return self.model(ids)


def main():
    argv = sys.argv[1:]
    compiled = "--compile" in argv and argv[argv.index("--compile") + 1] == "1"
    if "--compile" in argv:
        i = argv.index("--compile")
        argv = argv[:i] + argv[i + 2:]
    size, stage, steps, micro, seq, ac = lt.parse(argv)
    vocab, hidden, inter, layers, heads, kv, tied = lt.preset(size)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group("nccl")
        rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    model = lt.Llama(vocab, hidden, inter, layers, heads, kv, tied, checkpointing=ac).to(device)
    with torch.no_grad():
        for position, (_, module, param) in enumerate(shared_init.parameters_in_order(model)):
            param.copy_(shared_init.torch_values(lt.SEED, position, module, param.shape, device))
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    run_model = Autocast(model)
    if world > 1:
        run_model = torch.nn.parallel.DistributedDataParallel(
            run_model, device_ids=[device.index], gradient_as_bucket_view=True)
    if compiled:
        run_model = torch.compile(run_model)

    def step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    run = lt.train(run_model, step, lambda loss: loss.backward(), size, micro, seq, steps, rank,
                   device)
    system = "torch-eager-compiled" if compiled else "torch-eager"
    if world > 1:
        system += "-ddp"
    if rank == 0:
        print(json.dumps(lt.result(system, {"activation_checkpointing": ac, "compiled": compiled,
                                            "precision": "fp32 parameters, bf16 autocast"},
                                   size, stage, world, micro, seq, steps, params, *run)))
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
