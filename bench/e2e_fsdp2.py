"""Peer of examples/src/bin/bench_e2e.rs (issue 12): the same Llama-style model trained with
PyTorch FSDP2 (`fully_shard`, bf16 parameters, fp32 gradient reduction and master weights),
fused AdamW (betas 0.9/0.95, weight decay 0.1), clipping at 1.0, the same sizes, sequence
length, micro-batch and token stream. Pure torch, no downloads. One process per GPU:
    torchrun --nproc-per-node N bench/e2e_fsdp2.py SIZE STAGE [STEPS] [MICRO_BATCH] [SEQ]
STAGE 3 reshards parameters after forward (ZeRO-3); 2 keeps them gathered until backward is done
(FSDP2's reshard_after_forward=False, ZeRO-2's memory profile). Rank 0 prints one JSON line
with the same keys as bench-e2e."""
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

PRESETS = {  # vocab, hidden, intermediate, layers, heads, kv heads (bench-e2e's `preset`)
    "125m": (49152, 768, 2048, 12, 12, 4),
    "1b": (128256, 2048, 8192, 16, 32, 8),
    "3b": (128256, 3072, 8192, 28, 24, 8),
}
ROPE_THETA = 500000.0


class Block(nn.Module):
    def __init__(self, hidden, inter, heads, kv):
        super().__init__()
        hd = hidden // heads
        self.heads, self.kv, self.hd = heads, kv, hd
        self.attn_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.q = nn.Linear(hidden, heads * hd, bias=False)
        self.k = nn.Linear(hidden, kv * hd, bias=False)
        self.v = nn.Linear(hidden, kv * hd, bias=False)
        self.o = nn.Linear(heads * hd, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.gate = nn.Linear(hidden, inter, bias=False)
        self.up = nn.Linear(hidden, inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x, cos, sin):
        b, s, h = x.shape
        y = self.attn_norm(x)
        q = self.q(y).view(b, s, self.heads, self.hd).transpose(1, 2)
        k = self.k(y).view(b, s, self.kv, self.hd).transpose(1, 2)
        v = self.v(y).view(b, s, self.kv, self.hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, h))
        y = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


def rope(x, cos, sin):
    """Interleaved pairs, as bench-e2e's model rotates them."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


class Llama(nn.Module):
    def __init__(self, vocab, hidden, inter, layers, heads, kv):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, inter, heads, kv) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.hd = hidden // heads

    def forward(self, ids):
        s = ids.shape[1]
        pos = torch.arange(s, device=ids.device, dtype=torch.float32)
        freq = ROPE_THETA ** (-torch.arange(0, self.hd, 2, device=ids.device) / self.hd)
        angles = pos[:, None] * freq[None, :]
        x = self.embed(ids)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x) @ self.embed.weight.t()  # tied output projection


def tokens(step, rank, micro, seq, vocab, device):
    """bench-e2e's LCG, so both systems see the same ids."""
    mask = (1 << 64) - 1
    s = ((step * 1000 + rank + 1) * 0x9E3779B97F4A7C15) & mask
    ids = []
    for _ in range(micro * (seq + 1)):
        s = (s * 6364136223846793005 + 1442695040888963407) & mask
        ids.append((s >> 33) % vocab)
    return torch.tensor(ids, device=device).view(micro, seq + 1)


def flops_per_token(params, layers, hidden, seq):
    return 6 * params + 12 * layers * hidden * seq


def main():
    size, stage = sys.argv[1], int(sys.argv[2])
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    micro = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    seq = int(sys.argv[5]) if len(sys.argv) > 5 else 1024
    vocab, hidden, inter, layers, heads, kv = PRESETS[size]
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    torch.manual_seed(42)
    model = Llama(vocab, hidden, inter, layers, heads, kv).to(device)
    params = sum(p.numel() for p in model.parameters())
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy, reshard_after_forward=(stage == 3))
    fully_shard(model, mp_policy=policy, reshard_after_forward=(stage == 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    times, forward, backward, stepping, losses = [], [], [], [], []
    torch.cuda.reset_peak_memory_stats(device)
    for step in range(steps):
        batch = tokens(step, rank, micro, seq, vocab, device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), batch[:, 1:].reshape(-1))
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        loss.backward()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.4f}, {t3 - t0:.3f} s", file=sys.stderr)
        if step >= 2:
            times.append(t3 - t0)
            forward.append(t1 - t0)
            backward.append(t2 - t1)
            stepping.append(t3 - t2)
    median = sorted(times)[len(times) // 2]
    per_token = flops_per_token(params, layers, hidden, seq)
    peak = float(os.environ.get("BURN_ZERO_PEAK_TFLOPS", "989.4")) * 1e12
    tps = micro * seq / median
    mean = lambda xs: sum(xs) / max(len(xs), 1)
    if rank == 0:
        print(json.dumps({
            "system": "torch-fsdp2", "torch": torch.__version__, "size": size, "params": params,
            "stage": stage, "world": world, "micro_batch": micro, "seq": seq,
            "global_batch_tokens": micro * seq * world, "steps": steps,
            "median_step_s": median, "step_times_s": times, "tokens_per_s_per_gpu": tps,
            "flops_per_token": per_token, "peak_flops": peak, "mfu": tps * per_token / peak,
            "breakdown_s": {"forward": mean(forward), "backward": mean(backward),
                            "step": mean(stepping)},
            "losses": losses,
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
