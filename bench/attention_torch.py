"""The peer of bench-attention (issue 10) on the same GPU: causal bf16
torch.nn.functional.scaled_dot_product_attention on the flash backend, forward + backward,
for the same sizes (seq 1k/4k/8k, head dim 64/128, 16k tokens per call, hidden 2048; then the
1B e2e call with 32/8 heads, on torch's own choice of backend as e2e_fsdp2.py gets it): median
milliseconds and TFLOP/s (FlashAttention's count, as bench-attention's), one JSON line each;
then the peak memory of one training step at seq 8k, head dim 128.
    python3 bench/attention_torch.py [ITERATIONS]
"""
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def step(q, k, v, g):
    gqa = q.shape[1] != k.shape[1]
    if gqa:  # torch's own choice of backend, as e2e_fsdp2.py gets it
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(g)


def forward_seconds(q, k, v, iterations):
    """Median seconds of the forward alone (no graph kept), on the backend `step` uses."""
    times = []
    with torch.no_grad():
        for i in range(iterations + 1):
            torch.cuda.synchronize()
            start = time.perf_counter()
            if q.shape[1] != k.shape[1]:
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.cuda.synchronize()
            if i > 0:
                times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def cases():
    """bench-attention's `time_cases`: 16k tokens at hidden 2048, then the 1B e2e call
    (batch 2 x 1024, 32 query and 8 K/V heads)."""
    for seq in (1024, 4096, 8192):
        for hd in (64, 128):
            yield 16384 // seq, 2048 // hd, 2048 // hd, seq, hd
    yield 2, 32, 8, 1024, 64


def main():
    iterations = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    torch.manual_seed(0)
    for b, h, kv, seq, hd in cases():
        q, k, v = (torch.randn(b, heads, seq, hd, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for heads in (h, kv, kv))
        g = torch.randn(b, h, seq, hd, device="cuda", dtype=torch.bfloat16)
        times = []
        for i in range(iterations + 1):
            q.grad = k.grad = v.grad = None
            torch.cuda.synchronize()
            start = time.perf_counter()
            step(q, k, v, g)
            torch.cuda.synchronize()
            if i > 0:
                times.append(time.perf_counter() - start)
        median = sorted(times)[len(times) // 2]
        forward = forward_seconds(q, k, v, iterations)
        flops = 4.0 * b * h * hd * seq * seq / 2.0 * 3.5
        print(json.dumps({"time": {"seq": seq, "head_dim": hd, "batch": b, "heads": h,
                                   "kv_heads": kv, "causal": True, "dtype": "bf16",
                                   "fwd_bwd_ms": median * 1e3,
                                   "tflops": flops / median / 1e12,
                                   "fwd_ms": forward * 1e3,
                                   "fwd_tflops": flops / 3.5 / forward / 1e12}}), flush=True)
        del q, k, v, g
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    seq, hd = 8192, 128
    b, h = 16384 // seq, 2048 // hd
    q, k, v = (torch.randn(b, h, seq, hd, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    step(q, k, v, torch.ones_like(q))
    torch.cuda.synchronize()
    print(json.dumps({"memory": {"seq": seq, "head_dim": hd, "batch": b, "heads": h,
                                 "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                                 "peak_reserved_bytes": torch.cuda.max_memory_reserved()},
                      "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main()
