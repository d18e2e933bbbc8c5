"""DeepSpeed itself as the peer of bench-offload's `formula` runs (bench/run_offload.sh, spec
`ds:LAYERS:WIDTH`): one GPU training the same deep residual MLP (LAYERS bias-free Linear layers of
WIDTH x WIDTH, `h = h + relu(layer(h)) * 0.5`, loss = mean(h^2), batch 16, bf16) at ZeRO-2 with
the optimizer offloaded to the CPU (`offload_optimizer {"device": "cpu", "pin_memory": true}`).
The optimizer is named in the config (AdamW, lr 1e-4, weight decay 0.01), so DeepSpeed uses its
own DeepSpeedCPUAdam, built just in time with the machine's nvcc and ninja on first use (loaded
before the model is built and timed apart: "op_load_s"). No gradient clipping.
Weights and inputs come from bench-offload's formula, computed in float32 on the GPU, then bf16:
    layer l, W[o][i] (torch's [out, in]) = ((o*i + 7*o + 13*i + 101*l) mod 8191 / 8191 - 0.5)
                                           / (sqrt(WIDTH) / 2)
    step s (0 = the warm-up), x[b][j]   = cos(0.11*(b + 16*s) + 0.23*j)
Installed as ../shared/GPU.md describes; one process:
    torchrun --nproc-per-node 1 bench/offload_deepspeed.py LAYERS WIDTH [STEPS]
Prints one JSON line on stdout (everything else, DeepSpeed's own logs included, goes to stderr)."""
import json
import math
import os
import statistics
import sys
import time

# DeepSpeed logs to stdout, and the JIT build prints there too: keep the real stdout for the
# result alone and send everything else (Python and C level) to stderr.
_result_out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

import deepspeed  # noqa: E402

BATCH = 16


def config():
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "train_batch_size": BATCH,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW",
                      "params": {"lr": 1e-4, "weight_decay": 0.01, "betas": [0.9, 0.999],
                                 "eps": 1e-8}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": 500000000,
                              "allgather_bucket_size": 500000000,
                              "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              # bench-offload's value; used by ZeRO-3 only
                              "sub_group_size": 100000000},
        "steps_per_print": 1000000,
        "wall_clock_breakdown": False,
    }


class DeepMlp(nn.Module):
    def __init__(self, layers, width, device):
        super().__init__()
        # No initializer run: every weight is written from the formula right after.
        self.layers = nn.ModuleList(
            torch.nn.utils.skip_init(nn.Linear, width, width, bias=False, device=device,
                                     dtype=torch.bfloat16)
            for _ in range(layers))

    def forward(self, x):
        h = x
        for layer in self.layers:
            h = h + torch.relu(layer(h)) * 0.5
        return h


def f32(v):
    """The float32 value nearest v, as a Python float (exact): a scalar that torch's float32
    kernels take without a further rounding."""
    return torch.tensor(v, dtype=torch.float32).item()


@torch.no_grad()
def formula_weight(l, width, device):
    """((o*i + 7*o + 13*i + 101*l) mod 8191 / 8191 - 0.5) / (sqrt(width) / 2) in float32,
    [out, in]: exact integers first (a full-rank pattern: a smooth formula would be low-rank
    and blow activations up), then a uniform-like weight of kaiming-uniform's range."""
    o = torch.arange(width, dtype=torch.int64, device=device)[:, None]
    i = torch.arange(width, dtype=torch.int64, device=device)[None, :]
    v = (o * i + 7 * o + 13 * i + 101 * l) % 8191
    # True divisions: torch turns division by a CPU scalar into a multiplication by its
    # reciprocal, so divide by 0-dim device tensors.
    w = v.to(torch.float32).div_(torch.tensor(8191.0, dtype=torch.float32, device=device))
    w.sub_(0.5)
    w.div_(torch.tensor(f32(math.sqrt(width)) / 2, dtype=torch.float32, device=device))
    return w


@torch.no_grad()
def formula_input(step, width, device):
    """cos(0.11*(b + 16*step) + 0.23*j) in float32, then bf16, [BATCH, width]."""
    b = torch.arange(BATCH, dtype=torch.float32, device=device) + float(BATCH * step)
    j = torch.arange(width, dtype=torch.float32, device=device)
    x = (b * f32(0.11))[:, None] + (j * f32(0.23))[None, :]
    return x.cos_().to(torch.bfloat16)


def median(xs):
    return statistics.median(xs) if xs else None


def finite_or_none(v):
    return v if math.isfinite(v) else None


def main():
    usage = "offload_deepspeed.py LAYERS WIDTH [STEPS]"
    if len(sys.argv) < 3:
        sys.exit(usage)
    layers, width = int(sys.argv[1]), int(sys.argv[2])
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    deepspeed.init_distributed("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 1, "one process: torchrun --nproc-per-node 1"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)

    # DeepSpeedCPUAdam's op, built (first time on a machine) and loaded before anything else.
    t = time.perf_counter()
    from deepspeed.ops.op_builder import CPUAdamBuilder
    CPUAdamBuilder().load()
    op_load_s = time.perf_counter() - t
    print(f"CPU-Adam op loaded in {op_load_s:.1f} s", file=sys.stderr)

    t0 = time.perf_counter()
    model = DeepMlp(layers, width, device)
    with torch.no_grad():
        for l, layer in enumerate(model.layers):
            w = formula_weight(l, width, device)
            layer.weight.copy_(w)  # float32 -> bf16, round to nearest even
            del w
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    print(f"{params} parameters built in {build_s:.1f} s; initializing", file=sys.stderr)
    t = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config())
    torch.cuda.synchronize()
    initialize_s = time.perf_counter() - t
    init_s = time.perf_counter() - t0
    print(f"optimizer: {type(engine.optimizer).__name__} over "
          f"{type(getattr(engine.optimizer, 'optimizer', None)).__name__}", file=sys.stderr)
    init_peak_alloc = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()

    times, forward_times, backward_times, step_parts, losses = [], [], [], [], []
    window = [0.0, 0.0]  # unix seconds: the first timed step's start, the last one's end
    for step in range(steps + 1):
        x = formula_input(step, width, device)
        torch.cuda.synchronize()
        start = time.perf_counter()
        if step == 1:
            window[0] = time.time()
        h = engine(x)
        loss = h.pow(2).mean()  # bf16, as bench-offload's
        torch.cuda.synchronize()
        t_fwd = time.perf_counter()
        engine.backward(loss)
        torch.cuda.synchronize()
        t_bwd = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        t_step = time.perf_counter()
        value = loss.float().item()
        torch.cuda.synchronize()
        secs = time.perf_counter() - start
        window[1] = time.time()
        losses.append(value)
        print(f"step {step}: {secs:.3f} s (forward {t_fwd - start:.3f}, backward "
              f"{t_bwd - t_fwd:.3f}, step {t_step - t_bwd:.3f}), loss {value}", file=sys.stderr)
        if step > 0:
            times.append(secs)
            forward_times.append(t_fwd - start)
            backward_times.append(t_bwd - t_fwd)
            step_parts.append(t_step - t_bwd)
        del h, loss, x

    result = {
        "system": "deepspeed", "deepspeed_version": deepspeed.__version__,
        "torch_version": torch.__version__, "params": params, "layers": layers, "width": width,
        "batch": BATCH, "offload": "cpu", "formula": True,
        "init_s": init_s, "build_s": build_s, "initialize_s": initialize_s,
        "op_load_s": op_load_s,
        "median_step_s": median(times), "step_times_s": times,
        "rows_per_s": BATCH / median(times) if times else None, "timed_window_unix_s": window,
        "forward_s": median(forward_times), "backward_s": median(backward_times),
        "step_s": median(step_parts),
        "forward_times_s": forward_times, "backward_times_s": backward_times,
        "step_part_times_s": step_parts,
        "losses": [finite_or_none(v) for v in losses],
        "init_peak_gpu_allocated_mib": init_peak_alloc / 2**20,
        "peak_gpu_allocated_mib": torch.cuda.max_memory_allocated(device) / 2**20,
        "peak_gpu_reserved_mib": torch.cuda.max_memory_reserved(device) / 2**20,
        "config": config(),
    }
    if rank == 0:
        print(json.dumps(result), file=_result_out, flush=True)
    bad = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
    dist.destroy_process_group()
    if bad is not None:
        print(f"loss of step {bad} is not finite: the run is invalid", file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    main()
