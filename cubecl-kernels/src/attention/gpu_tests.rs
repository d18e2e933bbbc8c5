//! Flash attention on wgpu/lavapipe against an f64 host reference of the materialized
//! softmax: outputs, log-sum-exp and all three gradients, causal and not, grouped-query,
//! odd sequence lengths and head widths, a query length unlike the key length.

use core::marker::PhantomData;

use cubecl::ir::{ElemType, FloatKind};
use cubecl::prelude::*;
use cubecl::wgpu::{WgpuDevice, WgpuRuntime};
use cubecl::zspace::{Shape, Strides};

use super::{
    AttentionDims, BlockSparsity, FlashOptions, flash_backward, flash_forward, layout_binding,
};
use crate::sparse::{
    BigBirdConfig, Direction, FixedConfig, SparseLayout, SparsityConfig, SparsityMode,
    VariableConfig,
};

#[derive(Clone, Copy, Debug)]
struct Case {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    seq_q: usize,
    seq_k: usize,
    head_dim: usize,
    causal: bool,
}

/// Never-zero values in (−1, 1).
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = ((i as u32).wrapping_mul(2654435761) ^ seed.wrapping_mul(40503)) % 1999;
            (x as f32 + 1.0) / 1000.0 - 1.0
        })
        .collect()
}

struct Grads {
    out: Vec<f64>,
    lse: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
}

/// Materialized attention and its gradients in f64, contiguous layouts; a row that sees no key
/// (block-sparse only) has zero output and a log-sum-exp of 0, as the kernel defines it.
fn reference(
    c: &Case,
    scale: f64,
    [q, k, v, g]: [&[f32]; 4],
    layout: Option<&SparseLayout>,
) -> Grads {
    let (hd, group) = (c.head_dim, c.heads / c.kv_heads);
    let at_q = |b: usize, h: usize, i: usize| ((b * c.heads + h) * c.seq_q + i) * hd;
    let at_k = |b: usize, h: usize, j: usize| ((b * c.kv_heads + h) * c.seq_k + j) * hd;
    let mut r = Grads {
        out: vec![0.0; q.len()],
        lse: vec![0.0; c.batch * c.heads * c.seq_q],
        dq: vec![0.0; q.len()],
        dk: vec![0.0; k.len()],
        dv: vec![0.0; k.len()],
    };
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    for b in 0..c.batch {
        for h in 0..c.heads {
            let hk = h / group;
            for i in 0..c.seq_q {
                let (qi, gi) = (&q[at_q(b, h, i)..][..hd], &g[at_q(b, h, i)..][..hd]);
                let seen: Vec<usize> = (0..c.seq_k)
                    .filter(|j| !c.causal || *j <= i)
                    .filter(|j| layout.is_none_or(|l| l.keeps(h, i, *j)))
                    .collect();
                if seen.is_empty() {
                    continue;
                }
                let s: Vec<f64> = seen
                    .iter()
                    .map(|j| scale * dot(qi, &k[at_k(b, hk, *j)..][..hd]))
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = s.iter().map(|x| (x - m).exp()).sum();
                let p: Vec<f64> = s.iter().map(|x| (x - m).exp() / sum).collect();
                r.lse[(b * c.heads + h) * c.seq_q + i] = m + sum.ln();
                let dp: Vec<f64> = seen
                    .iter()
                    .map(|j| dot(gi, &v[at_k(b, hk, *j)..][..hd]))
                    .collect();
                let delta: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for (n, &j) in seen.iter().enumerate() {
                    let ds = p[n] * (dp[n] - delta);
                    for d in 0..hd {
                        r.out[at_q(b, h, i) + d] += p[n] * v[at_k(b, hk, j) + d] as f64;
                        r.dq[at_q(b, h, i) + d] += scale * ds * k[at_k(b, hk, j) + d] as f64;
                        r.dk[at_k(b, hk, j) + d] += scale * ds * qi[d] as f64;
                        r.dv[at_k(b, hk, j) + d] += p[n] * gi[d] as f64;
                    }
                }
            }
        }
    }
    r
}

/// A tensor's memory (kept to read it back) and its binding for a launch.
struct Buf(cubecl::server::Handle, TensorBinding<WgpuRuntime>);

fn binding(client: &ComputeClient<WgpuRuntime>, data: &[f32], shape: [usize; 4]) -> Buf {
    let handle = if data.is_empty() {
        client.empty(4 * shape.iter().product::<usize>())
    } else {
        client.create_from_slice(f32::as_bytes(data))
    };
    let strides = [
        shape[1] * shape[2] * shape[3],
        shape[2] * shape[3],
        shape[3],
        1,
    ];
    let binding = TensorBinding {
        handle: handle.clone().binding(),
        strides: Strides::new(&strides),
        shape: Shape::new(shape),
        runtime: PhantomData,
    };
    Buf(handle, binding)
}

fn read(client: &ComputeClient<WgpuRuntime>, t: &Buf) -> Vec<f32> {
    f32::from_bytes(&client.read_one(t.0.clone()).expect("the result comes back")).to_vec()
}

fn assert_close(name: &str, c: &Case, got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{name} length");
    let norm = want.iter().fold(0.0f64, |a, x| a.max(x.abs())).max(1e-3);
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (*a as f64 - b).abs() <= 2e-4 * norm + 1e-5 * b.abs() && a.is_finite(),
            "{c:?}: {name}[{i}] = {a}, reference {b} (largest |reference| {norm})"
        );
    }
}

/// Forward and backward of case `c` on the device: out, lse, dq, dk, dv.
fn launch(
    client: &ComputeClient<WgpuRuntime>,
    c: &Case,
    [q, k, v, g]: [&[f32]; 4],
    layout: Option<&SparseLayout>,
) -> [Vec<f32>; 5] {
    let q_shape = [c.batch, c.heads, c.seq_q, c.head_dim];
    let k_shape = [c.batch, c.kv_heads, c.seq_k, c.head_dim];
    let dims = AttentionDims::of(&q_shape, &k_shape, &k_shape).unwrap();
    let options = FlashOptions {
        register_scores: true,
        causal: c.causal,
        scale: 1.0 / (c.head_dim as f32).sqrt(),
        tensor_cores: true,
    };
    let f32_type = StorageType::Scalar(ElemType::Float(FloatKind::F32));
    let [bq, bk, bv, bg] = [(q, q_shape), (k, k_shape), (v, k_shape), (g, q_shape)]
        .map(|(x, s)| binding(client, x, s));
    let out = binding(client, &[], q_shape);
    // lse and delta are [b, h, s]: a 4-d binding whose last dim is 1.
    let row_shape = [c.batch, c.heads, c.seq_q, 1];
    let [lse, delta] = [row_shape; 2].map(|s| binding(client, &[], s));
    let [dq, dk, dv] = [q_shape, k_shape, k_shape].map(|s| binding(client, &[], s));
    let layout_binding = layout.map(|l| {
        dims.check_layout(&[l.heads, l.blocks, l.blocks], l.block)
            .unwrap();
        layout_binding(client, l)
    });
    let sparsity = || {
        layout
            .zip(layout_binding.as_ref())
            .map(|(l, b)| BlockSparsity {
                layout: b,
                block: l.block,
            })
    };
    flash_forward(
        client,
        &dims,
        f32_type,
        options,
        sparsity(),
        [&bq.1, &bk.1, &bv.1],
        &out.1,
        &lse.1,
    );
    flash_backward(
        client,
        &dims,
        f32_type,
        options,
        sparsity(),
        [&bq.1, &bk.1, &bv.1],
        [&out.1, &bg.1, &lse.1, &delta.1],
        [&dq.1, &dk.1, &dv.1],
    );
    [&out, &lse, &dq, &dk, &dv].map(|b| read(client, b))
}

fn inputs(c: &Case) -> [Vec<f32>; 4] {
    let n_q = c.batch * c.heads * c.seq_q * c.head_dim;
    let n_k = c.batch * c.kv_heads * c.seq_k * c.head_dim;
    [
        values(n_q, 1),
        values(n_k, 2),
        values(n_k, 3),
        values(n_q, 4),
    ]
}

fn run(client: &ComputeClient<WgpuRuntime>, c: Case, layout: Option<&SparseLayout>) {
    let [q, k, v, g] = inputs(&c);
    let scale = 1.0 / (c.head_dim as f32).sqrt();
    let want = reference(&c, scale as f64, [&q, &k, &v, &g], layout);
    let got = launch(client, &c, [&q, &k, &v, &g], layout);
    let wanted = [&want.out, &want.lse, &want.dq, &want.dk, &want.dv];
    for ((name, got), want) in ["out", "lse", "dq", "dk", "dv"]
        .iter()
        .zip(&got)
        .zip(wanted)
    {
        assert_close(name, &c, got, want);
    }
}

/// A NaN in one value row reaches exactly the outputs that attend to it (causal: rows at and
/// after its key), and nothing else.
#[test]
fn a_nan_reaches_the_rows_that_see_it_and_no_others() {
    let client = WgpuRuntime::client(&WgpuDevice::default());
    let c = Case {
        batch: 1,
        heads: 2,
        kv_heads: 1,
        seq_q: 9,
        seq_k: 9,
        head_dim: 4,
        causal: true,
    };
    let [q, k, mut v, g] = inputs(&c);
    let bad_key = 5;
    v[bad_key * c.head_dim] = f32::NAN;
    let [out, ..] = launch(&client, &c, [&q, &k, &v, &g], None);
    for h in 0..c.heads {
        for i in 0..c.seq_q {
            let o = out[(h * c.seq_q + i) * c.head_dim];
            assert_eq!(o.is_nan(), i >= bad_key, "head {h} row {i}: {o}");
        }
    }
}

#[test]
fn flash_attention_matches_the_materialized_softmax_and_its_gradients() {
    let client = WgpuRuntime::client(&WgpuDevice::default());
    let case = |heads, kv_heads, seq_q, seq_k, head_dim, causal| Case {
        batch: 2,
        heads,
        kv_heads,
        seq_q,
        seq_k,
        head_dim,
        causal,
    };
    for c in [
        case(2, 2, 1, 1, 8, true),
        case(4, 2, 17, 17, 16, true),
        case(4, 2, 17, 17, 16, false),
        case(3, 1, 17, 9, 7, false),
        case(2, 1, 257, 257, 64, true),
        case(2, 2, 70, 131, 24, false),
        // Rows split over 4 and 8 lanes.
        case(4, 2, 37, 37, 128, true),
        case(2, 1, 20, 29, 256, false),
    ] {
        run(&client, c, None);
    }
}

/// The layouts of `config` for `seq` tokens as the kernels read them.
fn layout_of(config: &SparsityConfig, seq: usize) -> SparseLayout {
    SparseLayout::new(config, seq).unwrap()
}

/// Block-sparse attention equals the materialized softmax under the same block mask: DeepSpeed
/// layouts (fixed causal, bigbird with random blocks per head, variable), a block smaller
/// than the kernel's tiles, and a layout leaving whole block rows empty.
#[test]
fn block_sparse_attention_equals_masked_dense_attention() {
    let client = WgpuRuntime::client(&WgpuDevice::default());
    let case = |seq, causal| Case {
        batch: 1,
        heads: 4,
        kv_heads: 2,
        seq_q: seq,
        seq_k: seq,
        head_dim: 16,
        causal,
    };
    let config = |block, per_head, mode| SparsityConfig {
        num_heads: 4,
        block,
        different_layout_per_head: per_head,
        mode,
    };
    let fixed = config(
        16,
        false,
        SparsityMode::Fixed(FixedConfig {
            num_local_blocks: 2,
            attention: Direction::Unidirectional,
            ..FixedConfig::default()
        }),
    );
    run(&client, case(96, true), Some(&layout_of(&fixed, 96)));
    let bird = config(16, true, SparsityMode::BigBird(BigBirdConfig::default()));
    run(&client, case(96, false), Some(&layout_of(&bird, 96)));
    let variable = config(
        8,
        false,
        SparsityMode::Variable(VariableConfig {
            local_window_blocks: vec![1, 3],
            global_block_indices: vec![2],
            ..VariableConfig::default()
        }),
    );
    run(&client, case(72, false), Some(&layout_of(&variable, 72)));
    // Block rows 1 and 3 of every head keep nothing: their rows get zeros.
    let mut holes = layout_of(&config(8, false, SparsityMode::Dense), 40);
    for h in 0..4 {
        for row in [1, 3] {
            for col in 0..5 {
                holes.kept[(h * 5 + row) * 5 + col] = 0;
            }
        }
    }
    run(&client, case(40, false), Some(&holes));
}

#[test]
fn the_tensor_core_kernels_take_only_half_precision_heads_of_sixteens() {
    use crate::attention::tensor_core::tensor_cores_apply;
    let client = WgpuRuntime::client(&WgpuDevice::default());
    let dims = |hd| AttentionDims::of(&[1, 2, 9, hd], &[1, 1, 9, hd], &[1, 1, 9, hd]).unwrap();
    let float = |kind| StorageType::Scalar(ElemType::Float(kind));
    // f32, or a head dim that is not a multiple of 16 or above 128, never takes them; and
    // WGSL has no tensor-core fragments, so on this runtime even f16 at 64 does not (the
    // CUDA-core kernels run, and are what the other tests here check; the tensor-core ones are
    // checked on the device).
    for (head_dim, kind) in [
        (64, FloatKind::F32),
        (72, FloatKind::F16),
        (144, FloatKind::F16),
        (64, FloatKind::F16),
    ] {
        assert!(
            !tensor_cores_apply(&client, &dims(head_dim), float(kind)),
            "head dim {head_dim}, {kind:?}"
        );
    }
}
