//! The element loop of CPU-Adam and its dispatch: the scalar update for each gradient and
//! output dtype, compiled once per SIMD level (see the parent module for why every level gives
//! the same bits).

use half::{bf16, f16};

use super::{AdamStep, Decay, Grad, Out, SgdStep, SimdLevel};

/// A gradient element, widened to f32 (also how the host partition's norm reads it).
pub(crate) trait GradElem: Copy + Send + Sync {
    fn get(self) -> f32;
}
impl GradElem for f32 {
    #[inline(always)]
    fn get(self) -> f32 {
        self
    }
}
impl GradElem for bf16 {
    // The widening is a shift: written out, it vectorizes (half's call does not).
    #[inline(always)]
    fn get(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
}
impl GradElem for f16 {
    #[inline(always)]
    fn get(self) -> f32 {
        self.to_f32()
    }
}

/// An f32 value rounded to an element (also how the host gradient partition stores sums).
pub(crate) trait OutElem: Copy + Send + Sync {
    fn put(v: f32) -> Self;
}
impl OutElem for f32 {
    #[inline(always)]
    fn put(v: f32) -> Self {
        v
    }
}
impl OutElem for bf16 {
    #[inline(always)]
    fn put(v: f32) -> Self {
        bf16::from_bits(bf16_bits(v))
    }
}

/// `v` rounded to the nearest bf16 (ties to even; NaN stays NaN, quieted), branch-free so the
/// loop vectorizes; the same bits as `half::bf16::from_f32`.
#[inline(always)]
pub fn bf16_bits(v: f32) -> u16 {
    let b = v.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let nan = (b & 0x7fff_ffff) > 0x7f80_0000;
    (if nan { (b >> 16) | 0x40 } else { rounded }) as u16
}
impl OutElem for f16 {
    #[inline(always)]
    fn put(v: f32) -> Self {
        f16::from_f32(v)
    }
}

/// One chunk of the Adam update, in the engine's order of operations.
#[inline(always)]
fn adam_chunk<G: GradElem, O: OutElem, const DECAY: u8>(
    k: &AdamStep,
    w: &mut [f32],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
    out: Option<&mut [O]>,
) {
    let n = w.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    let (b1, b2, wd, eps) = (k.beta1, k.beta2, k.weight_decay, k.eps);
    let (c1, c2) = (1.0 - b1, 1.0 - b2);
    let shrink = 1.0 - k.lr * wd;
    let bc2_sqrt = k.bias_correction2.sqrt();
    let step_size = k.lr / k.bias_correction1;
    let [s0, s1] = k.grad_scale;
    let update = |i: usize, w: &mut [f32], m: &mut [f32], v: &mut [f32]| {
        let mut gi = g[i].get() * s0 * s1;
        if DECAY == 1 {
            gi += w[i] * wd;
        }
        m[i] = m[i] * b1 + gi * c1;
        v[i] = v[i] * b2 + gi * c2 * gi;
        if DECAY == 2 {
            w[i] *= shrink;
        }
        let denom = v[i].sqrt() / bc2_sqrt + eps;
        w[i] -= m[i] / denom * step_size;
    };
    match out {
        None => (0..n).for_each(|i| update(i, w, m, v)),
        Some(out) => {
            let out = &mut out[..n];
            for i in 0..n {
                update(i, w, m, v);
                out[i] = O::put(w[i]);
            }
        }
    }
}

/// One chunk of the SGD update.
#[inline(always)]
fn sgd_chunk<G: GradElem, O: OutElem>(
    k: &SgdStep,
    w: &mut [f32],
    g: &[G],
    buf: &mut [f32],
    out: Option<&mut [O]>,
) {
    let n = w.len();
    let g = &g[..n];
    let (lr, mu, damp, wd) = (k.lr, k.momentum, 1.0 - k.dampening, k.weight_decay);
    let [s0, s1] = k.grad_scale;
    let mut update = |i: usize, w: &mut [f32]| {
        let mut gi = g[i].get() * s0 * s1;
        if wd != 0.0 {
            gi += w[i] * wd;
        }
        if mu > 0.0 {
            let next = if k.started {
                buf[i] * mu + gi * damp
            } else {
                gi
            };
            buf[i] = next;
            gi = if k.nesterov { gi + next * mu } else { next };
        }
        w[i] -= gi * lr;
    };
    match out {
        None => (0..n).for_each(|i| update(i, w)),
        Some(out) => {
            let out = &mut out[..n];
            for i in 0..n {
                update(i, w);
                out[i] = O::put(w[i]);
            }
        }
    }
}

/// Instantiates `$body::<G, O, ...>` for every gradient and output dtype, at a SIMD level.
macro_rules! by_dtypes {
    ($body:ident, $grad:expr, $out:expr, ($($arg:expr),*), [$($cg:tt)*]) => {
        match ($grad, $out) {
            (Grad::F32(g), Out::None) => $body::<f32, bf16 $($cg)*>($($arg,)* g, None),
            (Grad::F32(g), Out::Bf16(o)) => $body::<f32, bf16 $($cg)*>($($arg,)* g, Some(o)),
            (Grad::F32(g), Out::F16(o)) => $body::<f32, f16 $($cg)*>($($arg,)* g, Some(o)),
            (Grad::Bf16(g), Out::None) => $body::<bf16, bf16 $($cg)*>($($arg,)* g, None),
            (Grad::Bf16(g), Out::Bf16(o)) => $body::<bf16, bf16 $($cg)*>($($arg,)* g, Some(o)),
            (Grad::Bf16(g), Out::F16(o)) => $body::<bf16, f16 $($cg)*>($($arg,)* g, Some(o)),
            (Grad::F16(g), Out::None) => $body::<f16, bf16 $($cg)*>($($arg,)* g, None),
            (Grad::F16(g), Out::Bf16(o)) => $body::<f16, bf16 $($cg)*>($($arg,)* g, Some(o)),
            (Grad::F16(g), Out::F16(o)) => $body::<f16, f16 $($cg)*>($($arg,)* g, Some(o)),
        }
    };
}

/// The Adam chunk with its operands in the order the macro passes them.
#[inline(always)]
fn adam_args<G: GradElem, O: OutElem, const DECAY: u8>(
    k: &AdamStep,
    w: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[G],
    out: Option<&mut [O]>,
) {
    adam_chunk::<G, O, DECAY>(k, w, g, m, v, out)
}

#[inline(always)]
fn adam_all(k: &AdamStep, w: &mut [f32], g: Grad<'_>, m: &mut [f32], v: &mut [f32], o: Out<'_>) {
    match k.decay {
        Decay::None => by_dtypes!(adam_args, g, o, (k, w, m, v), [, 0]),
        Decay::L2 => by_dtypes!(adam_args, g, o, (k, w, m, v), [, 1]),
        Decay::Decoupled => by_dtypes!(adam_args, g, o, (k, w, m, v), [, 2]),
    }
}

#[inline(always)]
fn sgd_args<G: GradElem, O: OutElem>(
    k: &SgdStep,
    w: &mut [f32],
    b: &mut [f32],
    g: &[G],
    out: Option<&mut [O]>,
) {
    sgd_chunk::<G, O>(k, w, g, b, out)
}

#[inline(always)]
fn sgd_all(k: &SgdStep, w: &mut [f32], g: Grad<'_>, b: &mut [f32], o: Out<'_>) {
    by_dtypes!(sgd_args, g, o, (k, w, b), [])
}

/// The compute-dtype copy of weights already stepped (a sub-group stepped ahead of the
/// pipeline, whose master alone was written): the bits the step itself would have written.
#[inline(always)]
fn narrow_all(w: &[f32], o: Out<'_>) {
    fn put<O: OutElem>(w: &[f32], o: &mut [O]) {
        o[..w.len()]
            .iter_mut()
            .zip(w)
            .for_each(|(o, w)| *o = O::put(*w));
    }
    match o {
        Out::None => {}
        Out::Bf16(o) => put(w, o),
        Out::F16(o) => put(w, o),
    }
}

/// Compiles `$all` once per SIMD level and calls the one for `level`.
macro_rules! multiversion {
    ($name:ident, $all:ident, ($($arg:ident: $ty:ty),*)) => {
        pub(super) fn $name(level: SimdLevel, $($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                fn avx512($($arg: $ty),*) {
                    $all($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn avx2($($arg: $ty),*) {
                    $all($($arg),*)
                }
                match level {
                    // SAFETY: `level` was detected on (or checked against) this CPU.
                    SimdLevel::Avx512 => return unsafe { avx512($($arg),*) },
                    // SAFETY: as above.
                    SimdLevel::Avx2 => return unsafe { avx2($($arg),*) },
                    SimdLevel::Portable => {}
                }
            }
            let _ = level;
            $all($($arg),*)
        }
    };
}

multiversion!(adam_dispatch, adam_all, (k: &AdamStep, w: &mut [f32], g: Grad<'_>, m: &mut [f32], v: &mut [f32], o: Out<'_>));
multiversion!(sgd_dispatch, sgd_all, (k: &SgdStep, w: &mut [f32], g: Grad<'_>, b: &mut [f32], o: Out<'_>));
multiversion!(narrow_dispatch, narrow_all, (w: &[f32], o: Out<'_>));
