//! The kernels on a real runtime: wgpu on lavapipe (a Vulkan driver running on the CPU) in CI.
//! No adapter is a failure, never a skip.

use cubecl::prelude::*;
use cubecl::wgpu::{WgpuDevice, WgpuRuntime};

use burn_offload::AdamStep;

use crate::adam::{AdamConstants, adamw_into};

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 2000) as f32 / 1000.0 - 1.0)
        .collect()
}

/// The engine's order of operations on the host.
fn reference(k: &AdamConstants, w: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    for i in 0..w.len() {
        let gi = g[i] + w[i] * k.l2;
        m[i] = m[i] * k.beta1 + gi * (1.0 - k.beta1);
        v[i] = v[i] * k.beta2 + gi * (1.0 - k.beta2) * gi;
        let denom = v[i].sqrt() / k.bias_correction2_sqrt + k.eps;
        w[i] = w[i] * k.shrink - m[i] / denom * k.step_size;
    }
}

/// The out-of-place kernel over 10 steps, odd and even lengths: the same values as the host
/// update, and the inputs of each step untouched.
#[test]
fn fused_adamw_into_new_buffers_matches_the_host_update() {
    let client = WgpuRuntime::client(&WgpuDevice::default());
    for n in [1usize, 7, 64, 1_000_003] {
        for decoupled in [true, false] {
            let mut w = values(n, 3);
            let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
            let mut h = [&w, &m, &v].map(|x| client.create_from_slice(f32::as_bytes(x)));
            for t in 1..=10u64 {
                let g: Vec<f32> = values(n, 20 + t as u32).iter().map(|x| x * 0.1).collect();
                let step = AdamStep::at(t, 1e-2, (0.9, 0.999), 1e-8, 0.05, decoupled, true);
                let k = AdamConstants::from(&step);
                reference(&k, &mut w, &g, &mut m, &mut v);
                let hg = client.create_from_slice(f32::as_bytes(&g));
                let out = [0; 3].map(|_| client.empty(4 * n));
                adamw_into(
                    &client,
                    &k,
                    n,
                    [&h[0], &hg, &h[1], &h[2]],
                    [&out[0], &out[1], &out[2]],
                );
                let kept = client.read_one(hg).expect("the gradient comes back");
                assert_eq!(f32::from_bytes(&kept), &g[..], "the input is only read");
                h = out;
            }
            for (name, handle, want) in [("master", &h[0], &w), ("m", &h[1], &m), ("v", &h[2], &v)]
            {
                let bytes = client
                    .read_one(handle.clone())
                    .expect("the result comes back");
                for (i, (a, b)) in f32::from_bytes(&bytes).iter().zip(want.iter()).enumerate() {
                    assert!(
                        (a - b).abs() <= 1e-6 * (1.0 + b.abs()),
                        "n {n}, decoupled {decoupled}, {name}[{i}]: {a} vs {b}"
                    );
                }
            }
        }
    }
}
