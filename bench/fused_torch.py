"""The peer of bench-fused (issue 35) on the same GPU: the torch eager equivalents of the fused
ops at the same shapes and dtype (bf16, 8,192 tokens of the 8B Llama), forward and forward +
backward of `(out * probe).sum()`, median of ITERATIONS after a warm-up (each call synced, and per
call in queues of ten between syncs), as one JSON line.
    python3 bench/fused_torch.py ITERATIONS
RMSNorm is timed as torch.nn.RMSNorm (what bench/llama_torch.py's FSDP2 peer runs) and as
Hugging Face's LlamaRMSNorm formula; RoPE interleaved as Meta's Llama (complex multiply) and
half-split as Hugging Face's rotate_half with materialized cos/sin; SwiGLU as F.silu(g) * u.
"""
import json
import sys
import time

import torch
import torch.nn.functional as F


def queued_time(fn, iterations, queue=10):
    """Seconds per call when `queue` calls go between syncs (median of `iterations` queues,
    after one warm-up call); `queue=1` times each call from a sync to a sync."""
    fn()
    times = []
    for _ in range(iterations):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(queue):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / queue)
    return sorted(times)[len(times) // 2]


def median_time(fn, iterations):
    return queued_time(fn, iterations, queue=1)


def row(name, make_inputs, op, iterations):
    inputs = make_inputs()
    with torch.no_grad():
        out = op(*inputs)
    probe = torch.randn_like(out)

    def forward():
        with torch.no_grad():
            return op(*inputs)

    def both():
        leaves = [t.detach().requires_grad_(True) for t in inputs]
        (op(*leaves) * probe).sum().backward()

    return {"op": name, "shape": list(inputs[0].shape), "dtype": "bf16",
            "forward_ms": median_time(forward, iterations) * 1e3,
            "forward_backward_ms": median_time(both, iterations) * 1e3,
            "forward_queued_ms": queued_time(forward, iterations) * 1e3,
            "forward_backward_queued_ms": queued_time(both, iterations) * 1e3}


def hf_rms_norm(x, w, eps=1e-5):
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(dtype)


def freqs(seq, head_dim, theta=500000.0):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim)
    return torch.outer(torch.arange(seq, device="cuda").float(), inv)


def rope_interleaved(x, freqs_cis):
    # Meta's Llama: pairs (2i, 2i+1) as complex numbers; x [b, s, h, d].
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3)
    return out.type_as(x)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_half(x, cos, sin):
    # Hugging Face's apply_rotary_pos_emb on [b, s, h, d] with cos/sin [s, d] broadcast.
    return (x * cos[None, :, None, :]) + (rotate_half(x) * sin[None, :, None, :])


def loss_rows(iterations, tokens=8192, hidden=4096, vocab=128256):
    """The output projection and the mean cross-entropy at the 8B Llama's output layer (tied
    `[vocab, hidden]` layout, bf16), forward + backward of both inputs, as torch eager computes
    it: the logits materialized, then `F.cross_entropy` on their f32 copy (what Hugging Face's
    `ForCausalLMLoss` and torchtitan do) and, second, on the bf16 logits themselves. Peak memory
    is the allocator's peak over one call above what was allocated before it (the two gradients
    included, as in bench-fused's pool growth)."""
    dev, bf16 = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(13)
    x = torch.randn(tokens, hidden, device=dev, dtype=bf16, generator=gen)
    w = torch.randn(vocab, hidden, device=dev, dtype=bf16, generator=gen) * 0.02
    t = torch.randint(0, vocab, (tokens,), device=dev, generator=gen)
    gradient_bytes = (tokens * hidden + vocab * hidden) * 2
    rows = []
    for name, upcast in [("f32 logits (F.cross_entropy(logits.float()))", True),
                         ("bf16 logits (F.cross_entropy(logits))", False)]:
        def step():
            xg, wg = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
            logits = xg @ wg.t()
            loss = F.cross_entropy(logits.float() if upcast else logits, t)
            loss.backward()
            return loss.detach()
        step()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        value = step().item()
        peak = torch.cuda.max_memory_allocated() - before
        rows.append({"op": "linear_cross_entropy", "peer": name, "tokens": tokens,
                     "hidden": hidden, "vocab": vocab, "dtype": "bf16", "loss": value,
                     "ms": median_time(step, min(iterations, 5)) * 1e3,
                     "peak_growth_bytes": peak,
                     "beyond_gradients_bytes": peak - gradient_bytes})
    return rows


def main():
    iterations = int(sys.argv[1])
    tokens, bf16 = 8192, torch.bfloat16
    dev = "cuda"
    rows = []
    norm = torch.nn.RMSNorm(4096, eps=1e-5, device=dev, dtype=bf16)
    x_w = lambda: [torch.randn(tokens, 4096, device=dev, dtype=bf16),
                   torch.ones(4096, device=dev, dtype=bf16)]
    rows.append(row("rms_norm (torch.nn.RMSNorm)", x_w,
                    lambda x, w: F.rms_norm(x, (4096,), w, 1e-5), iterations))
    rows.append(row("rms_norm (HF LlamaRMSNorm)", x_w, hf_rms_norm, iterations))
    # A block's residual add and the norm after it (ours: one kernel, burn_zero::nn::add_rms_norm).
    x_r_w = lambda: [torch.randn(tokens, 4096, device=dev, dtype=bf16),
                     torch.randn(tokens, 4096, device=dev, dtype=bf16),
                     torch.ones(4096, device=dev, dtype=bf16)]
    rows.append(row("add_rms_norm (x + r, then torch.nn.RMSNorm)", x_r_w,
                    lambda x, r, w: F.rms_norm(x + r, (4096,), w, 1e-5), iterations))
    del norm
    rows.append(row("swiglu", lambda: [torch.randn(tokens, 14336, device=dev, dtype=bf16) * 6,
                                       torch.randn(tokens, 14336, device=dev, dtype=bf16)],
                    lambda g, u: F.silu(g) * u, iterations))
    angles = freqs(tokens, 128)
    freqs_cis = torch.polar(torch.ones_like(angles), angles)
    for heads in (32, 8):
        rows.append(row(f"rope Interleaved ({heads} heads)",
                        lambda: [torch.randn(1, tokens, heads, 128, device=dev, dtype=bf16)],
                        lambda x: rope_interleaved(x, freqs_cis), iterations))
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(bf16), emb.sin().to(bf16)
    rows.append(row("rope HalfSplit (32 heads)",
                    lambda: [torch.randn(1, tokens, 32, 128, device=dev, dtype=bf16)],
                    lambda x: rope_half(x, cos, sin), iterations))
    print(json.dumps({"torch": torch.__version__, "time": rows, "loss": loss_rows(iterations),
                      "iterations": iterations}))


if __name__ == "__main__":
    main()
