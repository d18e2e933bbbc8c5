//! CPU-Adam against scalar references: the same order of operations in plain f32 (bit for
//! bit, every SIMD level and thread count), and Adam's formula in f64 (within f32 rounding).

use half::{bf16, f16};

use crate::cpu_adam::{AdamStep, CpuAdam, Decay, Grad, Out, SgdStep, SimdLevel};

/// Deterministic values in [-1, 1) (an LCG; no RNG dependency).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

#[derive(Clone, Copy, Debug)]
enum GradType {
    F32,
    Bf16,
    F16,
}

/// The gradient of step `t` as stored in `ty`, and its exact f32 values.
fn gradient(n: usize, t: u64, ty: GradType) -> (Vec<f32>, Vec<bf16>, Vec<f16>) {
    let g: Vec<f32> = values(n, 100 + t).iter().map(|x| x * 0.3).collect();
    let b: Vec<bf16> = g.iter().map(|x| bf16::from_f32(*x)).collect();
    let h: Vec<f16> = g.iter().map(|x| f16::from_f32(*x)).collect();
    let exact = match ty {
        GradType::F32 => g,
        GradType::Bf16 => b.iter().map(|x| x.to_f32()).collect(),
        GradType::F16 => h.iter().map(|x| x.to_f32()).collect(),
    };
    (exact, b, h)
}

fn grad_of<'a>(ty: GradType, exact: &'a [f32], b: &'a [bf16], h: &'a [f16]) -> Grad<'a> {
    match ty {
        GradType::F32 => Grad::F32(exact),
        GradType::Bf16 => Grad::Bf16(b),
        GradType::F16 => Grad::F16(h),
    }
}

/// The engine's order of operations, one element at a time.
fn scalar_adam(k: &AdamStep, w: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    let bc2_sqrt = k.bias_correction2.sqrt();
    let step_size = k.lr / k.bias_correction1;
    for i in 0..w.len() {
        let mut gi = g[i];
        if k.decay == Decay::L2 {
            gi += w[i] * k.weight_decay;
        }
        m[i] = m[i] * k.beta1 + gi * (1.0 - k.beta1);
        v[i] = v[i] * k.beta2 + gi * (1.0 - k.beta2) * gi;
        if k.decay == Decay::Decoupled {
            w[i] *= 1.0 - k.lr * k.weight_decay;
        }
        w[i] -= m[i] / (v[i].sqrt() / bc2_sqrt + k.eps) * step_size;
    }
}

/// Adam as its paper and PyTorch write it, in f64.
#[allow(clippy::too_many_arguments)]
fn f64_adam(
    t: u64,
    lr: f64,
    wd: f64,
    decay: Decay,
    bias: bool,
    w: &mut f64,
    g: f64,
    mv: &mut (f64, f64),
) {
    // The hyperparameters as the f32 step receives them (0.999 is not exact in f32).
    let (b1, b2, eps) = (0.9f32 as f64, 0.999f32 as f64, 1e-8f32 as f64);
    let g = if decay == Decay::L2 { g + wd * *w } else { g };
    mv.0 = b1 * mv.0 + (1.0 - b1) * g;
    mv.1 = b2 * mv.1 + (1.0 - b2) * g * g;
    if decay == Decay::Decoupled {
        *w *= 1.0 - lr * wd;
    }
    let (c1, c2) = if bias {
        (1.0 - b1.powi(t as i32), 1.0 - b2.powi(t as i32))
    } else {
        (1.0, 1.0)
    };
    *w -= lr / c1 * mv.0 / (mv.1.sqrt() / c2.sqrt() + eps);
}

/// Ten steps of every combination against both references, at every SIMD level.
#[test]
fn adam_equals_the_scalar_references() {
    let lengths = [1usize, 7, 64, 1000, 1_000_003];
    for &n in &lengths {
        for (decay, wd, decoupled) in [
            (Decay::Decoupled, 0.01f32, true),
            (Decay::L2, 0.05, false),
            (Decay::None, 0.0, false),
        ] {
            for bias in [true, false] {
                for ty in [GradType::F32, GradType::Bf16, GradType::F16] {
                    // The longest length for one combination per decay mode only (time).
                    if n > 1000 && (!bias || !matches!(ty, GradType::Bf16)) {
                        continue;
                    }
                    check_adam(n, decay, wd, decoupled, bias, ty);
                }
            }
        }
    }
}

fn check_adam(n: usize, decay: Decay, wd: f32, decoupled: bool, bias: bool, ty: GradType) {
    let what = format!("n {n}, {decay:?}, bias correction {bias}, grad {ty:?}");
    let w0 = values(n, 1);
    let mut reference = (w0.clone(), vec![0.0f32; n], vec![0.0f32; n]);
    let mut wide: Vec<(f64, (f64, f64))> = w0.iter().map(|w| (*w as f64, (0.0, 0.0))).collect();
    let configs: Vec<CpuAdam> = SimdLevel::available()
        .into_iter()
        .flat_map(|l| [1, 3].map(|t| CpuAdam::new(Some(t)).with_level(l)))
        .collect();
    let mut states: Vec<_> = configs
        .iter()
        .map(|_| {
            (
                w0.clone(),
                vec![0.0f32; n],
                vec![0.0f32; n],
                vec![bf16::ZERO; n],
            )
        })
        .collect();
    for t in 1..=10u64 {
        let lr = 1e-3 * t as f32;
        let k = AdamStep::at(t, lr, (0.9, 0.999), 1e-8, wd, decoupled, bias);
        assert_eq!(k.decay, decay);
        let (exact, b, h) = gradient(n, t, ty);
        scalar_adam(
            &k,
            &mut reference.0,
            &exact,
            &mut reference.1,
            &mut reference.2,
        );
        for (i, (w, mv)) in wide.iter_mut().enumerate() {
            f64_adam(t, lr as f64, wd as f64, decay, bias, w, exact[i] as f64, mv);
        }
        for (adam, (w, m, v, out)) in configs.iter().zip(states.iter_mut()) {
            let g = grad_of(ty, &exact, &b, &h);
            adam.adam(&k, w, g, m, v, Out::Bf16(out));
        }
    }
    for (adam, (w, m, v, out)) in configs.iter().zip(&states) {
        let at = format!("{what}, {:?} × {} threads", adam.level(), adam.threads());
        assert!(
            *w == reference.0 && *m == reference.1 && *v == reference.2,
            "{at}: not bitwise"
        );
        assert!(
            out.iter().zip(w).all(|(o, w)| *o == bf16::from_f32(*w)),
            "{at}: the bf16 copy is not the rounded master"
        );
    }
    for (i, (w, _)) in wide.iter().enumerate() {
        let got = reference.0[i] as f64;
        assert!(
            (got - w).abs() <= 1e-6 * (1.0 + w.abs()),
            "{what}: element {i}: {got} vs {w} (f64)"
        );
    }
}

#[test]
#[allow(clippy::needless_range_loop)] // the reference indexes like the formula
fn sgd_equals_the_scalar_reference() {
    let n = 4099;
    for (momentum, dampening, nesterov, wd) in [
        (0.0f32, 0.0f32, false, 0.0f32),
        (0.9, 0.0, false, 0.01),
        (0.9, 0.1, true, 0.0),
    ] {
        let mut reference = (values(n, 7), vec![0.0f32; n]);
        let adam = CpuAdam::new(Some(2));
        let (mut w, mut buf, mut out) = (values(n, 7), vec![0.0f32; n], vec![f16::ZERO; n]);
        for t in 0..5u64 {
            let k = SgdStep {
                lr: 0.01,
                momentum,
                dampening,
                nesterov,
                weight_decay: wd,
                started: t > 0,
                grad_scale: [1.0, 1.0],
            };
            let (g, _, h) = gradient(n, t, GradType::F16);
            for i in 0..n {
                let mut gi = g[i];
                if wd != 0.0 {
                    gi += reference.0[i] * wd;
                }
                if momentum > 0.0 {
                    let next = if t > 0 {
                        reference.1[i] * momentum + gi * (1.0 - dampening)
                    } else {
                        gi
                    };
                    reference.1[i] = next;
                    gi = if nesterov { gi + next * momentum } else { next };
                }
                reference.0[i] -= gi * 0.01;
            }
            adam.sgd(&k, &mut w, Grad::F16(&h), &mut buf, Out::F16(&mut out));
        }
        assert!(w == reference.0, "momentum {momentum}, nesterov {nesterov}");
        assert!(out.iter().zip(&w).all(|(o, w)| *o == f16::from_f32(*w)));
    }
}

#[test]
fn bf16_rounding_matches_half_on_every_class_of_value() {
    let mut specials = vec![
        0.0f32,
        -0.0,
        1.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001), // signalling NaN
        f32::MAX,
        f32::MIN_POSITIVE,
        f32::from_bits(1),           // smallest subnormal
        f32::from_bits(0x3f80_8000), // a tie: 1 + 2^-8
        f32::from_bits(0x3f81_8000), // a tie rounding up to even
        f32::from_bits(0x7f7f_ffff), // rounds to infinity
    ];
    specials.extend(values(100_000, 3).iter().map(|x| x * 1e3));
    for v in specials {
        let ours = crate::cpu_adam::bf16_bits(v);
        let theirs = bf16::from_f32(v).to_bits();
        assert_eq!(ours, theirs, "{v:e} ({:#x})", v.to_bits());
    }
}

/// The gradient scale (inverse loss scale, clipping factor) applied inside the step equals
/// scaling the gradient first, `g · s0 · s1` in that order, for Adam and SGD, and factors of 1
/// leave the step bit for bit as without them.
#[test]
fn a_gradient_scale_equals_scaling_the_gradient_first() {
    let n = 1003;
    let adam = CpuAdam::new(Some(2));
    let (s0, s1) = (1.0 / 1024.0, 0.37f32);
    let g = gradient(n, 3, GradType::F32).0;
    let scaled: Vec<f32> = g.iter().map(|x| x * s0 * s1).collect();
    for decoupled in [true, false] {
        let k = AdamStep::at(2, 1e-3, (0.9, 0.999), 1e-8, 0.01, decoupled, true);
        let run = |k: &AdamStep, g: &[f32]| {
            let (mut w, mut m, mut v) = (values(n, 1), values(n, 2), vec![0.01f32; n]);
            adam.adam(k, &mut w, Grad::F32(g), &mut m, &mut v, Out::None);
            (w, m, v)
        };
        assert!(run(&k.with_grad_scale([s0, s1]), &g) == run(&k, &scaled));
        assert!(run(&k.with_grad_scale([1.0, 1.0]), &g) == run(&k, &g));
    }
    let sgd = |scale: [f32; 2], g: &[f32]| {
        let k = SgdStep {
            lr: 0.01,
            momentum: 0.9,
            dampening: 0.0,
            nesterov: true,
            weight_decay: 0.01,
            started: true,
            grad_scale: scale,
        };
        let (mut w, mut buf) = (values(n, 1), values(n, 2));
        adam.sgd(&k, &mut w, Grad::F32(g), &mut buf, Out::None);
        (w, buf)
    };
    assert!(sgd([s0, s1], &g) == sgd([1.0, 1.0], &scaled));
}

#[test]
fn mismatched_lengths_are_refused() {
    let adam = CpuAdam::new(Some(1));
    let k = AdamStep::at(1, 1e-3, (0.9, 0.999), 1e-8, 0.0, true, true);
    let result = std::panic::catch_unwind(|| {
        let (mut w, mut m, mut v) = (vec![0.0f32; 5], vec![0.0f32; 5], vec![0.0f32; 4]);
        adam.adam(&k, &mut w, Grad::F32(&[0.0; 5]), &mut m, &mut v, Out::None);
    });
    let message = *result.unwrap_err().downcast::<String>().unwrap();
    assert!(message.contains("differ in length"), "{message}");
}

mod swap {
    use std::path::PathBuf;

    use crate::cpu_adam::CpuAdam;
    use crate::host::{HostOptimizer, HostSettings, OutDtype};
    use crate::nvme::{NvmeStore, SwapConfig};
    use crate::stream::{OwnedBuffers, StreamError, Weights};

    fn config(name: &str) -> SwapConfig {
        let dir = std::env::temp_dir().join(format!("bz-swap-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        SwapConfig {
            root: std::env::temp_dir(),
            dir,
            block_size: 4096,
            queue_depth: 2,
            buffer_count: 3,
        }
    }

    const ADAMW: HostSettings = HostSettings::Adam {
        eps: 1e-8,
        weight_decay: 0.01,
        decoupled: true,
        bias_correction: true,
    };

    /// Ten steps in swap files (odd sub-groups, several requests each) equal ten in memory.
    #[test]
    fn swapped_steps_equal_steps_in_memory() {
        let n = 10_007;
        let cfg = config("parity");
        let master = super::values(n, 11);
        let mut memory = HostOptimizer::new(master.clone(), ADAMW, CpuAdam::new(Some(2)), 3001);
        let mut swapped =
            HostOptimizer::on_nvme(master, ADAMW, CpuAdam::new(Some(2)), 3001, &cfg).unwrap();
        assert_eq!(swapped.swap_files().len(), 3, "master, exp_avg, exp_avg_sq");
        for t in 1..=10 {
            let g: Vec<f32> = super::values(n, 50 + t).iter().map(|x| x * 0.1).collect();
            let a = stepped(&mut memory, &g, 2).unwrap();
            let b = stepped(&mut swapped, &g, 2).unwrap();
            assert_eq!(a, b, "step {t}: the emitted sub-groups");
            assert_eq!(a.len(), 4, "10007 elements in sub-groups of 3001");
        }
        let (ma, sa, va) = memory.export().unwrap();
        let (mb, sb, vb) = swapped.export().unwrap();
        assert!(ma == mb && sa == sb && va == vb);
        let files = swapped.swap_files();
        drop(swapped);
        assert!(files.iter().all(|f| !f.exists()), "swap files are removed");
        let _ = std::fs::remove_dir_all(&cfg.dir);
    }

    /// A sub-group's range and the bf16 bits of its new weights.
    pub(super) type Uploaded = (std::ops::Range<usize>, Vec<u16>);

    /// One AdamW step streamed through `count` host buffers of each kind: the bf16 bits of
    /// each sub-group's new weights, in the order they were uploaded.
    pub(super) fn stepped(
        opt: &mut HostOptimizer,
        g: &[f32],
        count: usize,
    ) -> Result<Vec<Uploaded>, StreamError> {
        let mut buffers = OwnedBuffers::new(count, opt.sub_group_len(), OutDtype::Bf16);
        let mut got = Vec::new();
        opt.step(
            1e-3,
            (0.9, 0.999),
            [1.0, 1.0],
            buffers.lend(),
            &|r, mut buf| {
                buf.f32_mut()?.copy_from_slice(&g[r]);
                Ok(())
            },
            &mut |r, w| {
                let Weights::Bf16(w) = w else {
                    return Err(format!("{w:?} is not bf16"));
                };
                got.push((r, w.iter().map(|x| x.to_bits()).collect()));
                Ok(())
            },
        )?;
        Ok(got)
    }

    #[test]
    fn a_corrupted_swap_file_is_named() {
        let cfg = config("corrupt");
        let n = 5000;
        let mut store = NvmeStore::create(&cfg, &["master", "exp_avg"], n, 2048, &|t, r| {
            (t == 0).then(|| r.map(|i| i as f32).collect())
        })
        .unwrap();
        let master = store.read_all(0).unwrap();
        assert_eq!(master, (0..n).map(|i| i as f32).collect::<Vec<_>>());
        assert_eq!(store.read_all(1).unwrap(), vec![0.0; n]);
        let victim: PathBuf = store.paths()[1].clone();
        let mut bytes = std::fs::read(&victim).unwrap();
        bytes[8192 + 100] ^= 0x10; // sub-group 1 of exp_avg
        std::fs::write(&victim, &bytes).unwrap();
        let err = store.read_all(1).unwrap_err().to_string();
        assert!(
            err.contains("exp_avg.swp") && err.contains("corrupted") && err.contains("sub-group 1"),
            "{err}"
        );
        // Every tensor of a sub-group travels together, so any read of it fails until a
        // rewrite heals the region; the store stays usable.
        assert!(store.read_all(0).is_err());
        store.write_all(&[master.clone(), vec![1.0; n]]).unwrap();
        assert_eq!(store.read_all(1).unwrap(), vec![1.0; n]);
        drop(store);
        let _ = std::fs::remove_dir_all(&cfg.dir);
    }

    /// A swap file cut short (a disk that filled, a copy that stopped) fails the read of every
    /// sub-group past the cut with the file named, and a rewrite of the whole state heals it.
    #[test]
    fn a_truncated_swap_file_is_named() {
        let cfg = config("truncated");
        let n = 5000;
        let mut store = NvmeStore::create(&cfg, &["master", "exp_avg_sq"], n, 2048, &|_, r| {
            Some(r.map(|i| i as f32).collect())
        })
        .unwrap();
        let victim: PathBuf = store.paths()[1].clone();
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&victim)
            .unwrap();
        file.set_len(8192 + 1000).unwrap(); // inside sub-group 1's region
        drop(file);
        let err = store.read_all(1).unwrap_err().to_string();
        assert!(
            err.contains("exp_avg_sq.swp") && err.contains("short read"),
            "{err}"
        );
        let want: Vec<f32> = (0..n).map(|i| i as f32).collect();
        store.write_all(&[want.clone(), want.clone()]).unwrap();
        assert_eq!(store.read_all(1).unwrap(), want);
        drop(store);
        let _ = std::fs::remove_dir_all(&cfg.dir);
    }

    /// Any range of a tensor reads back what was written, across sub-group boundaries.
    #[test]
    fn ranges_read_back_across_sub_groups() {
        let cfg = config("ranges");
        let n = 5000;
        let mut store = NvmeStore::create(&cfg, &["params"], n, 1024, &|_, r| {
            Some(r.map(|i| i as f32 * 0.25).collect())
        })
        .unwrap();
        for range in [
            0..1,
            0..5000,
            1023..1025,
            1000..3100,
            4999..5000,
            2048..3072,
        ] {
            let got = store.read_range(0, range.clone()).unwrap();
            let want: Vec<f32> = range.clone().map(|i| i as f32 * 0.25).collect();
            assert_eq!(got, want, "{range:?}");
        }
        drop(store);
        let _ = std::fs::remove_dir_all(&cfg.dir);
    }

    #[test]
    fn a_missing_path_is_refused_before_training() {
        let mut cfg = config("missing");
        cfg.root = PathBuf::from("/nonexistent-burn-zero");
        cfg.dir = cfg.root.join("swap");
        let err = NvmeStore::create(&cfg, &["master"], 10, 10, &|_, _| None)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("does not exist"), "{err}");
    }
}

/// The streamed step: the pipeline's buffers, counts and failures.
mod streamed {
    use std::sync::{Arc, Mutex};

    use half::bf16;

    use super::swap::stepped;
    use crate::ahead::{AheadSink, SharedSink};
    use crate::cpu_adam::{AdamStep, CpuAdam, Grad, Out};
    use crate::grads::GradDtype;
    use crate::host::{HostOptimizer, HostSettings, OutDtype};
    use crate::stream::{GradBuf, OutSlot, OwnedBuffers, StreamError, Weights};

    const ADAM: HostSettings = HostSettings::Adam {
        eps: 1e-8,
        weight_decay: 0.0,
        decoupled: false,
        bias_correction: true,
    };

    /// Any sub-group size and buffer count gives the bits of one CPU-Adam call over the whole
    /// partition, every sub-group uploaded once, in order.
    #[test]
    fn sub_groups_and_buffer_counts_do_not_change_the_bits() {
        let n = 7919;
        let master = super::values(n, 3);
        let (mut w, mut m, mut v) = (master.clone(), vec![0.0; n], vec![0.0; n]);
        let mut expected = vec![bf16::ZERO; n];
        let cpu = CpuAdam::new(Some(2));
        for t in 1..=3 {
            let g: Vec<f32> = super::values(n, 70 + t).iter().map(|x| x * 0.2).collect();
            let k = AdamStep::at(t, 1e-3, (0.9, 0.999), 1e-8, 0.0, false, true);
            cpu.adam(
                &k,
                &mut w,
                Grad::F32(&g),
                &mut m,
                &mut v,
                Out::Bf16(&mut expected),
            );
        }
        let expected: Vec<u16> = expected.iter().map(|x| x.to_bits()).collect();
        for (sub_group, count) in [(1000, 1), (1000, 3), (7919, 2), (1, 2), (4096, 5)] {
            let mut opt = HostOptimizer::new(master.clone(), ADAM, cpu.clone(), sub_group);
            let mut last = Vec::new();
            for t in 1..=3 {
                let g: Vec<f32> = super::values(n, 70 + t).iter().map(|x| x * 0.2).collect();
                last = stepped(&mut opt, &g, count).unwrap();
            }
            let ranges: Vec<_> = last.iter().map(|(r, _)| r.clone()).collect();
            assert_eq!(ranges, opt.sub_groups(), "({sub_group}, {count})");
            let bits: Vec<u16> = last.into_iter().flat_map(|(_, b)| b).collect();
            assert!(bits == expected, "sub-group {sub_group}, {count} buffers");
            assert_eq!(
                opt.export().unwrap().0,
                w,
                "the master ({sub_group}, {count})"
            );
        }
    }

    /// One output per sub-group, in order, each its own place in a buffer as long as the
    /// partition (the last sub-group shorter than the others): every sub-group's weights land
    /// at their own elements, the bits of slots cycled through a ring.
    #[test]
    fn outputs_in_their_own_place_get_the_ring_s_bits() {
        let (n, sub_group) = (2500, 1000);
        let g = super::values(n, 12);
        let download = |r: std::ops::Range<usize>, mut buf: GradBuf<'_>| {
            buf.f32_mut()?.copy_from_slice(&g[r]);
            Ok(())
        };
        let fresh = || HostOptimizer::new(super::values(n, 11), ADAM, CpuAdam::new(Some(2)), 700);
        let mut ring = fresh();
        let mut own = fresh();
        assert_ne!(ring.sub_groups().len(), 1);
        let mut expected = vec![bf16::ZERO; n];
        let mut buffers = OwnedBuffers::new(2, sub_group, OutDtype::Bf16);
        ring.step(
            1e-3,
            (0.9, 0.999),
            [1.0, 1.0],
            buffers.lend(),
            &download,
            &mut |r, w| {
                let Weights::Bf16(w) = w else { unreachable!() };
                expected[r].copy_from_slice(w);
                Ok(())
            },
        )
        .unwrap();
        let mut place = vec![bf16::ZERO; n];
        let mut grads = vec![0.0f32; sub_group];
        let ranges = own.sub_groups();
        let mut rest = place.as_mut_slice();
        let mut outs = Vec::new();
        for r in &ranges {
            let (slot, tail) = rest.split_at_mut(r.len());
            outs.push(OutSlot::Bf16(slot));
            rest = tail;
        }
        let lent = crate::stream::StepBuffers {
            grads: vec![GradBuf::F32(grads.as_mut_slice())],
            outs,
        };
        let mut uploads = Vec::new();
        own.step(
            1e-3,
            (0.9, 0.999),
            [1.0, 1.0],
            lent,
            &download,
            &mut |r, _| {
                uploads.push(r);
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(uploads, ranges, "every sub-group handed on once, in order");
        let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(
            bits(&place) == bits(&expected),
            "weights in their own place"
        );
        assert_eq!(
            own.export().unwrap().0,
            ring.export().unwrap().0,
            "the master"
        );
    }

    /// fp32 weights go up as a copy of the master.
    #[test]
    fn fp32_weights_are_the_master() {
        let n = 1001;
        let mut opt = HostOptimizer::new(super::values(n, 5), ADAM, CpuAdam::new(Some(1)), 300);
        let g = super::values(n, 6);
        let mut buffers = OwnedBuffers::new(2, 300, OutDtype::F32);
        let mut up = vec![0.0f32; n];
        opt.step(
            1e-2,
            (0.9, 0.99),
            [1.0, 1.0],
            buffers.lend(),
            &|r, mut buf| {
                buf.f32_mut()?.copy_from_slice(&g[r]);
                Ok(())
            },
            &mut |r, w| {
                let Weights::F32(w) = w else { unreachable!() };
                up[r].copy_from_slice(w);
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(up, opt.export().unwrap().0);
    }

    /// A failing transfer stops the step with its sub-group named (no stage is left waiting).
    #[test]
    fn a_failed_transfer_is_named_and_stops_the_step() {
        let n = 5000;
        let g = super::values(n, 9);
        for fail_down in [true, false] {
            let mut opt =
                HostOptimizer::new(super::values(n, 8), ADAM, CpuAdam::new(Some(1)), 1000);
            let mut buffers = OwnedBuffers::new(2, 1000, OutDtype::Bf16);
            let mut uploads = 0;
            let err = opt
                .step(
                    1e-3,
                    (0.9, 0.999),
                    [1.0, 1.0],
                    buffers.lend(),
                    &|r, mut buf| {
                        if fail_down && r.start == 2000 {
                            return Err("device lost".into());
                        }
                        buf.f32_mut()?.copy_from_slice(&g[r]);
                        Ok(())
                    },
                    &mut |r, _| {
                        uploads += 1;
                        if !fail_down && r.start == 3000 {
                            return Err("out of memory".into());
                        }
                        Ok(())
                    },
                )
                .unwrap_err();
            let text = err.to_string();
            match err {
                StreamError::Download { range, .. } if fail_down => assert_eq!(range, 2000..3000),
                StreamError::Upload { range, .. } if !fail_down => assert_eq!(range, 3000..4000),
                other => panic!("{other:?}"),
            }
            assert!(
                text.contains("device lost") || text.contains("out of memory"),
                "{text}"
            );
            assert!(uploads <= 4, "the step stopped early ({uploads} uploads)");
        }
    }

    /// Stepping ahead: sub-groups stepped as a backward finishes their chunks, in whatever
    /// order the writes finish them, give the serial step's master and bf16 weights bit for
    /// bit over three steps, with a chunk left for the step itself (never finished early) and
    /// a last sub-group shorter than the rest; the step refuses other values than those it
    /// began with (and closes), and an abandoned step before any sub-group leaves no trace.
    #[test]
    fn sub_groups_stepped_ahead_give_the_serial_bits() {
        stepped_ahead_against_serial(false);
    }

    /// The same with each sub-group's weights sent to a sink as it is stepped ahead: the
    /// step hands out only the others, and together they are the serial step's.
    #[test]
    fn sub_groups_stepped_ahead_send_the_serial_weights() {
        stepped_ahead_against_serial(true);
    }

    /// Sub-group and weights' bits, as sent.
    type Sent = Arc<Mutex<Vec<(usize, Vec<u16>)>>>;

    /// Collects what is sent to it, as the device would.
    struct VecSink {
        slot: Vec<bf16>,
        sent: Sent,
    }

    impl AheadSink for VecSink {
        fn slot(&mut self, n: usize) -> Result<OutSlot<'_>, String> {
            self.slot.resize(n.max(self.slot.len()), bf16::ZERO);
            // Garbage in the slot: the step must overwrite every element it sends.
            self.slot.fill(bf16::from_f32(-7.0));
            Ok(OutSlot::Bf16(&mut self.slot))
        }

        fn send(&mut self, index: usize, n: usize) -> Result<(), String> {
            let bits = self.slot[..n].iter().map(|x| x.to_bits()).collect();
            self.sent.lock().unwrap().push((index, bits));
            Ok(())
        }

        fn flush(&mut self) -> Result<(), String> {
            Ok(())
        }
    }

    fn stepped_ahead_against_serial(with_sink: bool) {
        for dtype in [GradDtype::F32, GradDtype::Bf16] {
            stepped_ahead_against_serial_in(with_sink, dtype);
        }
    }

    /// With a bf16 partition the gradients are bf16 values (as a bf16 reduction gives), which
    /// it holds exactly: the serial fp32 step's bits.
    fn stepped_ahead_against_serial_in(with_sink: bool, dtype: GradDtype) {
        use crate::ahead::StepAhead;
        use crate::grads::HostGrads;
        use crate::host::AheadError;

        let (n, sub_group) = (1000, 96);
        let cpu = CpuAdam::new(Some(2));
        let mut serial = HostOptimizer::new(super::values(n, 11), ADAM, cpu.clone(), sub_group);
        let opt = Arc::new(Mutex::new(HostOptimizer::new(
            super::values(n, 11),
            ADAM,
            cpu,
            sub_group,
        )));
        let grads = Arc::new(Mutex::new(HostGrads::in_chunks_of(n, 1, sub_group, dtype)));
        for t in 1..=3u64 {
            let mut g: Vec<f32> = super::values(n, 40 + t).iter().map(|x| x * 0.3).collect();
            if dtype == GradDtype::Bf16 {
                g.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32());
            }
            let expected = stepped(&mut serial, &g, 2).unwrap();
            let sent: Sent = Arc::new(Mutex::new(Vec::new()));
            let sink: Option<SharedSink> = with_sink.then(|| {
                Arc::new(Mutex::new(VecSink {
                    slot: Vec::new(),
                    sent: sent.clone(),
                })) as SharedSink
            });
            let hp = (1e-3, (0.9, 0.999), [1.0; 2]);
            let ahead = StepAhead::start(grads.clone(), opt.clone(), hp, sink).unwrap();
            // Writes from the end backwards in pieces of 70, the first 10 elements last, after
            // the pass ends unwritten (zeroed), as a parameter without gradient would be.
            let mut at = n;
            while at > 10 {
                let start = at.saturating_sub(70).max(10);
                grads
                    .lock()
                    .unwrap()
                    .write(start..at, &g[start..at], true)
                    .unwrap();
                at = start;
            }
            grads.lock().unwrap().end_pass(true);
            let report = ahead.finish();
            assert_eq!(report.stepped, 10, "every chunk but the first: {report:?}");
            assert_eq!(report.failure, None);
            {
                let mut g0 = grads.lock().unwrap();
                match g0.chunks_mut().remove(0) {
                    GradBuf::F32(first) => first[..10].copy_from_slice(&g[..10]),
                    GradBuf::Bf16(first) => first[..10]
                        .iter_mut()
                        .zip(&g[..10])
                        .for_each(|(d, s)| *d = bf16::from_f32(*s)),
                    GradBuf::F16(_) => unreachable!("not one of this test's dtypes"),
                }
            }
            let mut opt = opt.lock().unwrap();
            let expect_out: Vec<usize> = match with_sink {
                true => vec![0],
                false => (0..11).collect(),
            };
            assert_eq!(opt.to_hand_out(), expect_out);
            let got = {
                let mut buffers = OwnedBuffers::new(2, sub_group, OutDtype::Bf16);
                let mut g1 = grads.lock().unwrap();
                let chunks = g1.chunks_mut();
                let by_chunk: Vec<Vec<f32>> = chunks.iter().map(GradBuf::to_f32).collect();
                let mut got: Vec<(std::ops::Range<usize>, Vec<u16>)> = sent
                    .lock()
                    .unwrap()
                    .drain(..)
                    .map(|(i, bits)| (i * sub_group..(i * sub_group + bits.len()), bits))
                    .collect();
                opt.step(
                    1e-3,
                    (0.9, 0.999),
                    [1.0, 1.0],
                    buffers.lend(),
                    &|r, mut buf| {
                        buf.f32_mut()?
                            .copy_from_slice(&by_chunk[r.start / sub_group][..r.len()]);
                        Ok(())
                    },
                    &mut |r, w| {
                        let Weights::Bf16(w) = w else { unreachable!() };
                        got.push((r, w.iter().map(|x| x.to_bits()).collect::<Vec<u16>>()));
                        Ok(())
                    },
                )
                .unwrap();
                g1.clear();
                got.sort_by_key(|(r, _)| r.start);
                got
            };
            assert!(got == expected, "step {t}: the weights");
            assert_eq!(opt.export().unwrap(), serial.export().unwrap(), "step {t}");
        }
        let mut opt = opt.lock().unwrap();
        assert_eq!(
            opt.to_hand_out().len(),
            11,
            "nothing is sent outside a step begun ahead"
        );
        // Completed with another learning rate: refused, and the step begun ahead is closed.
        opt.begin_ahead(1e-3, (0.9, 0.999), [1.0; 2]).unwrap();
        let mut buffers = OwnedBuffers::new(1, sub_group, OutDtype::Bf16);
        let wrong = opt.step(
            2e-3,
            (0.9, 0.999),
            [1.0, 1.0],
            buffers.lend(),
            &|_, _| Ok(()),
            &mut |_, _| Ok(()),
        );
        let wrong = wrong.map(|_| ()).unwrap_err();
        assert!(matches!(
            wrong,
            StreamError::Ahead(AheadError::Changed { .. })
        ));
        assert!(!opt.has_ahead());
        let steps = opt.export().unwrap().1;
        opt.begin_ahead(1e-3, (0.9, 0.999), [1.0; 2]).unwrap();
        assert_eq!(
            opt.begin_ahead(1.0, (0.9, 0.9), [1.0; 2]),
            Err(AheadError::Open)
        );
        assert_eq!(opt.abandon_ahead(), 0, "nothing was stepped");
        assert_eq!(opt.export().unwrap().1, steps, "the step count is back");
    }
}
