"""The Llama of examples/src/bin/bench_e2e.rs in PyTorch, shared by its peers
(bench/e2e_fsdp2.py, bench/e2e_deepspeed.py): the same presets, parameter order, RoPE
(interleaved pairs), token stream, FLOPs formula and starting weights (bench/shared_init.py)."""
import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import shared_init

PRESETS = {  # vocab, hidden, intermediate, layers, heads, kv heads, tied (bench-e2e's `preset`)
    "125m": (49152, 768, 2048, 12, 12, 4, True),
    "smollm2": (49152, 576, 1536, 30, 9, 3, True),
    "1b": (128256, 2048, 8192, 16, 32, 8, True),
    "3b": (128256, 3072, 8192, 28, 24, 8, True),
    "8b": (128256, 4096, 14336, 32, 32, 8, False),
    "70b": (128256, 8192, 28672, 80, 64, 8, False),
}


def preset(size):
    """PRESETS[size]; `SIZE:LAYERS` keeps a shape's widths with LAYERS decoder layers."""
    base, _, layers = size.partition(":")
    vocab, hidden, inter, n, heads, kv, tied = PRESETS[base]
    if layers:
        n = int(layers)
        assert n > 0, f"SIZE:LAYERS needs a positive layer count, not {layers!r}"
    return vocab, hidden, inter, n, heads, kv, tied
ROPE_THETA = 500000.0
SEED = 42


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
    """Parameters registered in burn's module order: embed, blocks (attn_norm, q, k, v, o,
    mlp_norm, gate, up, down), norm, lm_head when untied."""

    def __init__(self, vocab, hidden, inter, layers, heads, kv, tied, checkpointing=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, inter, heads, kv) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.lm_head = None if tied else nn.Linear(hidden, vocab, bias=False)
        self.hd = hidden // heads
        self.checkpointing = checkpointing

    def forward(self, ids):
        s = ids.shape[1]
        pos = torch.arange(s, device=ids.device, dtype=torch.float32)
        freq = ROPE_THETA ** (-torch.arange(0, self.hd, 2, device=ids.device) / self.hd)
        angles = pos[:, None] * freq[None, :]
        x = self.embed(ids)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for block in self.blocks:
            if self.checkpointing and self.training:
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        x = self.norm(x)
        if self.lm_head is None:
            return x @ self.embed.weight.t()
        return self.lm_head(x)


def tokens(step, rank, micro, seq, vocab, device):
    """bench-e2e's LCG, so every system sees the same ids."""
    mask = (1 << 64) - 1
    s = ((step * 1000 + rank + 1) * 0x9E3779B97F4A7C15) & mask
    ids = []
    for _ in range(micro * (seq + 1)):
        s = (s * 6364136223846793005 + 1442695040888963407) & mask
        ids.append((s >> 33) % vocab)
    return torch.tensor(ids, device=device).view(micro, seq + 1)


def flops_per_token(params, layers, hidden, seq):
    """6 per parameter plus attention's 12·layers·hidden·seq (bench-e2e's formula)."""
    return 6 * params + 12 * layers * hidden * seq


def parse(argv):
    """SIZE STAGE [STEPS] [MICRO] [SEQ] [--ac 0|1]: positional arguments, then options."""
    pos, opts, i = [], {}, 0
    while i < len(argv):
        if argv[i].startswith("--"):
            opts[argv[i][2:]] = argv[i + 1]
            i += 2
        else:
            pos.append(argv[i])
            i += 1
    size, stage = pos[0], int(pos[1])
    steps = int(pos[2]) if len(pos) > 2 else 10
    micro = int(pos[3]) if len(pos) > 3 else 2
    seq = int(pos[4]) if len(pos) > 4 else 1024
    return size, stage, steps, micro, seq, opts.get("ac", "0") == "1"


def result(system, extra, size, stage, world, micro, seq, steps, params, times, forward, backward,
           stepping, losses, train_start):
    """The JSON line bench-e2e prints, for a torch run."""
    vocab, hidden, inter, layers, heads, kv, tied = preset(size)
    median = sorted(times)[len(times) // 2]
    per_token = flops_per_token(params, layers, hidden, seq)
    peak = float(os.environ.get("BURN_ZERO_PEAK_TFLOPS", "989.4")) * 1e12
    tps = micro * seq / median
    mean = lambda xs: sum(xs) / max(len(xs), 1)
    out = {"system": system, "torch": torch.__version__, "size": size, "params": params,
           "stage": stage, "world": world, "micro_batch": micro, "seq": seq,
           "global_batch_tokens": micro * seq * world, "steps": steps, "init": "shared",
           "median_step_s": median, "step_times_s": times, "tokens_per_s_per_gpu": tps,
           "flops_per_token": per_token, "peak_flops": peak, "mfu": tps * per_token / peak,
           "breakdown_s": {"forward": mean(forward), "backward": mean(backward),
                           "step": mean(stepping)},
           "losses": losses, "train_start_unix": train_start,
           "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
           "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
           "phase_sync": os.environ.get("PHASE_SYNC", "1") != "0"}
    out.update(extra)
    return out


def train(model, opt_step, backward, size, micro, seq, steps, rank, device):
    """The timed loop both peers share: forward, loss in fp32, backward, the step. Each phase
    ends with a device sync so it is timed on its own; PHASE_SYNC=0 syncs only around the step
    (as bench-e2e's `--graphs` runs do), so the host may queue backward while forward runs, and
    the breakdown then holds host times."""
    vocab = preset(size)[0]
    phase_sync = os.environ.get("PHASE_SYNC", "1") != "0"
    sync = torch.cuda.synchronize if phase_sync else (lambda: None)
    times, forward, backward_t, stepping, losses = [], [], [], [], []
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    train_start = time.time()
    for step in range(steps):
        batch = tokens(step, rank, micro, seq, vocab, device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), batch[:, 1:].reshape(-1))
        del logits
        sync()
        t1 = time.perf_counter()
        backward(loss)
        sync()
        t2 = time.perf_counter()
        opt_step()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.4f}, {t3 - t0:.3f} s", file=sys.stderr,
                  flush=True)
        if step >= 2:
            times.append(t3 - t0)
            forward.append(t1 - t0)
            backward_t.append(t2 - t1)
            stepping.append(t3 - t2)
    return times, forward, backward_t, stepping, losses, train_start
