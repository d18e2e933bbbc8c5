"""torch.matmul on the shapes of examples/src/bin/bench_matmul.rs, same JSON lines.
f32 runs twice: strict fp32 (torch's default) and with TF32 allowed (what burn's CUDA f32 uses)."""
import json
import time

import torch

LINEARS = [("smollm2.mlp_up", 2048, 576, 1536), ("smollm2.lm_head", 2048, 576, 49152),
           ("llama1b.attn_q", 4096, 2048, 2048), ("llama1b.mlp_up", 4096, 2048, 8192),
           ("llama1b.mlp_down", 4096, 8192, 2048), ("llama8b.attn_o", 4096, 4096, 4096),
           ("llama8b.mlp_up", 4096, 4096, 14336), ("llama8b.mlp_down", 4096, 14336, 4096)]


def case(dtype, label, name, product, m, k, n, transpose):
    lhs = torch.empty((k, m) if transpose[0] else (m, k), device="cuda", dtype=dtype).uniform_(-1, 1)
    rhs = torch.empty((n, k) if transpose[1] else (k, n), device="cuda", dtype=dtype).uniform_(-1, 1)
    lhs = lhs.t() if transpose[0] else lhs
    rhs = rhs.t() if transpose[1] else rhs
    torch.cuda.synchronize()
    start = time.perf_counter()
    lhs @ rhs
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - start) * 1e3
    for _ in range(3):
        lhs @ rhs
    torch.cuda.synchronize()
    iters = 20
    start = time.perf_counter()
    for _ in range(iters):
        lhs @ rhs
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / iters
    print(json.dumps({"system": "torch", "dtype": label, "linear": name, "product": product, "m": m, "k": k, "n": n,
                      "first_call_ms": round(first_ms, 1), "time_us": round(seconds * 1e6, 1),
                      "tflops": round(2 * m * k * n / seconds / 1e12, 2)}), flush=True)


def run(dtype, label, forward_only):
    for name, m, k, n in LINEARS:
        case(dtype, label, name, "forward", m, k, n, (False, False))
        if not forward_only:
            case(dtype, label, name, "grad_input", m, n, k, (False, True))
            case(dtype, label, name, "grad_weight", k, m, n, (True, False))


torch.backends.cuda.matmul.allow_tf32 = False
run(torch.bfloat16, "bf16", False)
run(torch.float32, "f32", True)
torch.backends.cuda.matmul.allow_tf32 = True
run(torch.float32, "f32-tf32", True)
