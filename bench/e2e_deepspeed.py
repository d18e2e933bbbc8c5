"""DeepSpeed itself as the third system of bench/run_e2e_zero3.sh: the same Llama
(bench/llama_torch.py), sizes, token stream and starting weights (bench/shared_init.py) as
bench-e2e and e2e_fsdp2.py, through `deepspeed.initialize` with ZeRO-3 (or STAGE), bf16 with
fp32 master weights, clipping at 1.0, and torch's fused AdamW (betas 0.9/0.95, weight decay 0.1)
as the client optimizer (DeepSpeed's own FusedAdam would need a JIT build; the step is the same
arithmetic). Parameters are partitioned at construction (`zero.Init`) and each filled from the
shared values while gathered. `--offload cpu` (stage 3) offloads the optimizer and the parameters
to page-locked host memory (ZeRO-Infinity's `offload_optimizer` / `offload_param`), with
DeepSpeedCPUAdam from the config's AdamW (built just in time on first use) as the optimizer;
`--offload nvme:DIR` puts the optimizer state in swap files under DIR (`offload_optimizer`
on nvme, DeepSpeed's async-I/O op built just in time; the parameters stay on the GPUs). Offloaded
runs construct the parameters in bf16 (`zero.Init(dtype=bfloat16)`, as Hugging Face's
integration does): fp32 construction held 4 more bytes a parameter of host memory at init.
Installed as ../shared/GPU.md describes. One process per GPU:
    torchrun --nproc-per-node N bench/e2e_deepspeed.py SIZE STAGE [STEPS] [MICRO] [SEQ] [--ac 0|1]
        [--offload cpu|nvme:DIR] [--sub-group N]
Rank 0 prints one JSON line with bench-e2e's keys."""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_torch as lt  # noqa: E402
import shared_init  # noqa: E402

import deepspeed  # noqa: E402


def config(stage, micro, world, offload, sub_group=None):
    ds = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro * world,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "overlap_comm": True,
                              "contiguous_gradients": True,
                              # bench-e2e's value (2e8 until 1f8d105)
                              "reduce_bucket_size": 50000000,
                              "allgather_bucket_size": 50000000},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000000,
        "wall_clock_breakdown": False,
    }
    if offload:
        # bench-e2e's AdamW, stepped by DeepSpeedCPUAdam on the host.
        ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95],
                                                      "weight_decay": 0.1, "eps": 1e-8}}
    if offload == "cpu":
        for key in ("offload_optimizer", "offload_param"):
            ds["zero_optimization"][key] = {"device": "cpu", "pin_memory": True}
    elif offload:
        # nvme:DIR, with bench-e2e's `aio` defaults (1 MiB requests, 8 in flight).
        ds["zero_optimization"]["offload_optimizer"] = {
            "device": "nvme", "nvme_path": offload[len("nvme:"):], "pin_memory": True}
        ds["aio"] = {"block_size": 1048576, "queue_depth": 8, "single_submit": False,
                     "overlap_events": True, "thread_count": 1}
    if sub_group:
        ds["zero_optimization"]["sub_group_size"] = sub_group
    return ds


@torch.no_grad()
def fill(model, stage, device):
    """Every parameter from the shared values, gathered one at a time at stage 3."""
    for position, (name, module, param) in enumerate(shared_init.parameters_in_order(model)):
        shape = tuple(param.ds_shape) if hasattr(param, "ds_shape") else tuple(param.shape)
        full = shared_init.torch_values(lt.SEED, position, module, shape, device)
        if stage == 3:
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                param.copy_(full.to(param.dtype))
        else:
            param.copy_(full.to(param.dtype))
        del full


def main():
    size, stage, steps, micro, seq, ac = lt.parse(sys.argv[1:])
    offload = sys.argv[sys.argv.index("--offload") + 1] if "--offload" in sys.argv else None
    assert offload in (None, "cpu") or offload.startswith("nvme:"), \
        f"--offload is cpu or nvme:DIR, not {offload}"
    if offload:
        assert stage == 3, "--offload: stage 3"
        from deepspeed.ops.op_builder import CPUAdamBuilder
        CPUAdamBuilder().load()  # built once, before the model takes the GPU's time
    if offload and offload != "cpu":
        from deepspeed.ops.op_builder import AsyncIOBuilder
        AsyncIOBuilder().load()
    vocab, hidden, inter, layers, heads, kv, tied = lt.preset(size)
    deepspeed.init_distributed("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    sub_group = int(float(sys.argv[sys.argv.index("--sub-group") + 1])) \
        if "--sub-group" in sys.argv else None
    ds = config(stage, micro, world, offload, sub_group)
    if stage == 3:
        dtype = torch.bfloat16 if offload else torch.float32
        with deepspeed.zero.Init(config_dict_or_path=ds, dtype=dtype):
            model = lt.Llama(vocab, hidden, inter, layers, heads, kv, tied, checkpointing=ac)
        params = sum(p.ds_numel for p in model.parameters())
    else:
        model = lt.Llama(vocab, hidden, inter, layers, heads, kv, tied, checkpointing=ac)
        params = sum(p.numel() for p in model.parameters())
    fill(model, stage, device)
    if offload:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=ds)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95),
                                weight_decay=0.1, fused=True)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    torch.cuda.empty_cache()
    run = lt.train(engine, engine.step, engine.backward, size, micro, seq, steps, rank, device)
    if rank == 0:
        print(json.dumps(lt.result("deepspeed", {"deepspeed": deepspeed.__version__,
                                                 "activation_checkpointing": ac,
                                                 "offload": offload},
                                   size, stage, world, micro, seq, steps, params, *run)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
