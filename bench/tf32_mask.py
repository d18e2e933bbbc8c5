"""The TF32 explanation of matmul-check's "inner" training step (issue 41 item 4), on the host.

The two-layer MLP of matmul-check and burn-linear-repro (Linear 257->129, relu, Linear
129->65, MSE, fixed data) in f64, once exactly and once with relu's mask taken from the first
layer's product of TF32-rounded operands (round to nearest, 10 mantissa bits: what tensor
cores multiply for f32). Prints how many mask elements flip and the first layer's gradient
errors that alone causes: burn-cuda's measured 1.18e-1 (w1) and 5.38e-2 (b1).
    python3 bench/tf32_mask.py
"""
import struct
def f32(v): return struct.unpack('f', struct.pack('f', v))[0]
def vals(n, seed):
    return [f32(f32(f32(((i*7919 + seed*104729) % 2003) / 1001.5) - 1.0) * 0.2) for i in range(n)]
def tf32(v):
    b = struct.unpack('I', struct.pack('f', v))[0]
    # round to nearest, ties away from zero, keeping 10 mantissa bits (cvt.rna.tf32.f32)
    b = (b + 0x1000) & 0xffffe000
    return struct.unpack('f', struct.pack('I', b))[0]
R, I, H, O = 33, 257, 129, 65
x, w1, w2 = vals(R*I, 3), vals(I*H, 1), vals(H*O, 2)
b1, b2, y = vals(H, 6), vals(O, 7), vals(R*O, 4)
def mm(a, b, r, k, n):
    c = [0.0]*(r*n)
    for i in range(r):
        for p in range(k):
            av = a[i*k+p]
            if av == 0.0: continue
            row = p*n
            for j in range(n):
                c[i*n+j] += av*b[row+j]
    return c
def t(a, r, c): return [a[(i % r)*c + i//r] for i in range(r*c)]
def grads(mask_from_tf32):
    pre = mm(x, w1, R, I, H)
    pre = [v + b1[i % H] for i, v in enumerate(pre)]
    if mask_from_tf32:
        pre_t = mm([tf32(v) for v in x], [tf32(v) for v in w1], R, I, H)
        pre_t = [v + b1[i % H] for i, v in enumerate(pre_t)]
        mask = [v > 0 for v in pre_t]
        flips = sum((a > 0) != (b > 0) for a, b in zip(pre, pre_t))
    else:
        mask = [v > 0 for v in pre]; flips = 0
    h = [v if m else 0.0 for v, m in zip(pre, mask)]
    out = mm(h, w2, R, H, O); out = [v + b2[i % O] for i, v in enumerate(out)]
    d_o = [2*(o - yy)/(R*O) for o, yy in zip(out, y)]
    d_h = mm(d_o, t(w2, H, O), R, O, H)
    d_pre = [g if m else 0.0 for g, m in zip(d_h, mask)]
    gw1 = mm(t(x, R, I), d_pre, I, R, H)
    gb1 = [sum(d_pre[r*H + j] for r in range(R)) for j in range(H)]
    return gw1, gb1, flips, pre
ref_w1, ref_b1, _, pre = grads(False)
tw1, tb1, flips, _ = grads(True)
err = lambda g, w: max(abs(a-b) for a, b in zip(g, w)) / max(abs(b) for b in w)
print("relu mask flips under TF32 inputs:", flips, "of", R*H)
print("w1 error %.3e, b1 error %.3e" % (err(tw1, ref_w1), err(tb1, ref_b1)))
near = sorted(abs(v) for v in pre)[:5]
print("smallest |pre|:", near)
