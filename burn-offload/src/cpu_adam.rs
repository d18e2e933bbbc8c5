//! CPU-Adam: one fused pass over a partition's fp32 master weights, gradient (f32, bf16 or
//! f16), Adam moments, and the compute-dtype copy of the weights it writes back, split across
//! threads. The loop is plain scalar Rust compiled three times (AVX-512, AVX2, portable) and
//! picked at run time: Rust never contracts `a * b + c` into an FMA, and division and square
//! root are exact in SIMD, so every path gives the same bits as the scalar order of operations,
//! which is the engine's device optimizer's order (so offloading changes no result).

use half::{bf16, f16};

/// Vector instruction sets a step can run with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimdLevel {
    /// x86-64 AVX-512F.
    Avx512,
    /// x86-64 AVX2 + FMA (FMA is never used for the update itself: see the module docs).
    Avx2,
    /// Whatever the target's baseline vectorizes (SSE2 on x86-64, NEON on aarch64).
    Portable,
}

impl SimdLevel {
    /// The best level this CPU supports.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return SimdLevel::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return SimdLevel::Avx2;
            }
        }
        SimdLevel::Portable
    }

    /// Every level this CPU can run, best first.
    pub fn available() -> Vec<Self> {
        let best = Self::detect();
        [SimdLevel::Avx512, SimdLevel::Avx2, SimdLevel::Portable]
            .into_iter()
            .skip_while(|l| *l != best)
            .collect()
    }
}

/// A gradient partition in the dtype it was reduced in.
#[derive(Clone, Copy, Debug)]
pub enum Grad<'a> {
    /// fp32.
    F32(&'a [f32]),
    /// bfloat16.
    Bf16(&'a [bf16]),
    /// IEEE half.
    F16(&'a [f16]),
}

impl Grad<'_> {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            Grad::F32(g) => g.len(),
            Grad::Bf16(g) => g.len(),
            Grad::F16(g) => g.len(),
        }
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where the updated weights go in the compute dtype, besides the fp32 master.
#[derive(Debug)]
pub enum Out<'a> {
    /// Only the fp32 master (an fp32 run: the master is the weights).
    None,
    /// A bf16 copy, rounded to nearest even.
    Bf16(&'a mut [bf16]),
    /// An f16 copy, rounded to nearest even.
    F16(&'a mut [f16]),
}

/// How weight decay enters the update.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decay {
    /// None (`weight_decay` 0 with L2).
    None,
    /// L2: `weight_decay · w` added to the gradient (Adam).
    L2,
    /// Decoupled: `w ← w·(1 − lr·weight_decay)` before the update (AdamW).
    Decoupled,
}

/// Adam's constants for one step (β's, bias corrections and learning rate of that step).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamStep {
    /// Learning rate.
    pub lr: f32,
    /// β1.
    pub beta1: f32,
    /// β2.
    pub beta2: f32,
    /// ε.
    pub eps: f32,
    /// Weight decay coefficient.
    pub weight_decay: f32,
    /// How it applies.
    pub decay: Decay,
    /// `1 − β1ᵗ` (1 without bias correction).
    pub bias_correction1: f32,
    /// `1 − β2ᵗ` (1 without bias correction).
    pub bias_correction2: f32,
}

impl AdamStep {
    /// The constants of step `t` (1-based).
    pub fn at(
        t: u64,
        lr: f32,
        (beta1, beta2): (f32, f32),
        eps: f32,
        weight_decay: f32,
        decoupled: bool,
        bias_correction: bool,
    ) -> Self {
        let (bias_correction1, bias_correction2) = if bias_correction {
            (1.0 - beta1.powi(t as i32), 1.0 - beta2.powi(t as i32))
        } else {
            (1.0, 1.0)
        };
        let decay = match (decoupled, weight_decay == 0.0) {
            (true, _) => Decay::Decoupled,
            (false, true) => Decay::None,
            (false, false) => Decay::L2,
        };
        Self {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            decay,
            bias_correction1,
            bias_correction2,
        }
    }
}

/// SGD's constants for one step (PyTorch semantics).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdStep {
    /// Learning rate.
    pub lr: f32,
    /// Momentum (0: none, no buffer).
    pub momentum: f32,
    /// Dampening.
    pub dampening: f32,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// L2 weight decay.
    pub weight_decay: f32,
    /// Whether the momentum buffer holds a value (false on the first step: it takes `g`).
    pub started: bool,
}

trait GradElem: Copy + Send + Sync {
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

trait OutElem: Copy + Send + Sync {
    fn put(v: f32) -> Self;
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
    let update = |i: usize, w: &mut [f32], m: &mut [f32], v: &mut [f32]| {
        let mut gi = g[i].get();
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
    let mut update = |i: usize, w: &mut [f32]| {
        let mut gi = g[i].get();
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

/// The multithreaded, vectorized optimizer step of offloaded partitions.
#[derive(Clone, Debug)]
pub struct CpuAdam {
    threads: usize,
    pin_cores: bool,
    level: SimdLevel,
}

/// Elements per thread below which a step stays on the calling thread.
const MIN_PER_THREAD: usize = 1 << 15;

impl CpuAdam {
    /// A step over `threads` threads (`None`: every available core), at the best SIMD level.
    pub fn new(threads: Option<usize>) -> Self {
        let threads = threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
            .max(1);
        Self {
            threads,
            pin_cores: false,
            level: SimdLevel::detect(),
        }
    }

    /// Pins worker `i` to core `i` (Linux; ignored elsewhere).
    pub fn with_pinned_cores(mut self, pin: bool) -> Self {
        self.pin_cores = pin;
        self
    }

    /// Runs at `level` instead of the detected one (tests compare the levels).
    ///
    /// # Panics
    /// If this CPU cannot run `level`.
    pub fn with_level(mut self, level: SimdLevel) -> Self {
        assert!(
            SimdLevel::available().contains(&level),
            "this CPU cannot run {level:?}"
        );
        self.level = level;
        self
    }

    /// Threads a step uses.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The SIMD level a step runs at.
    pub fn level(&self) -> SimdLevel {
        self.level
    }

    /// Adam/AdamW over one partition: updates `master`, `m`, `v` in place from `grad` and
    /// writes the new weights to `out` in its dtype. All slices have `master`'s length.
    ///
    /// # Panics
    /// If the lengths differ.
    pub fn adam(
        &self,
        k: &AdamStep,
        master: &mut [f32],
        grad: Grad<'_>,
        m: &mut [f32],
        v: &mut [f32],
        out: Out<'_>,
    ) {
        let n = master.len();
        assert!(
            grad.len() == n && m.len() == n && v.len() == n && out_len(&out).is_none_or(|l| l == n),
            "CPU-Adam: master ({n}), gradient ({}), moments ({}, {}) and output differ in length",
            grad.len(),
            m.len(),
            v.len()
        );
        let (level, k) = (self.level, *k);
        let chunks = self.chunks(n);
        let ws = split_mut(master, &chunks);
        let ms = split_mut(m, &chunks);
        let vs = split_mut(v, &chunks);
        let outs = split_out(out, &chunks);
        let grads = split_grad(grad, &chunks);
        let jobs: Vec<_> = ws
            .into_iter()
            .zip(ms)
            .zip(vs)
            .zip(outs)
            .zip(grads)
            .map(|((((w, m), v), o), g)| move || adam_dispatch(level, &k, w, g, m, v, o))
            .collect();
        self.run(jobs);
    }

    /// SGD over one partition (`momentum_buffer` empty when momentum is 0).
    ///
    /// # Panics
    /// If the lengths differ.
    pub fn sgd(
        &self,
        k: &SgdStep,
        master: &mut [f32],
        grad: Grad<'_>,
        momentum_buffer: &mut [f32],
        out: Out<'_>,
    ) {
        let n = master.len();
        let buffered = k.momentum > 0.0;
        assert!(
            grad.len() == n && (!buffered || momentum_buffer.len() == n),
            "CPU-SGD: master ({n}), gradient ({}) and momentum buffer ({}) differ in length",
            grad.len(),
            momentum_buffer.len()
        );
        let (level, k) = (self.level, *k);
        let chunks = self.chunks(n);
        let ws = split_mut(master, &chunks);
        let bufs = if buffered {
            split_mut(momentum_buffer, &chunks)
        } else {
            chunks.iter().map(|_| &mut [][..]).collect()
        };
        let outs = split_out(out, &chunks);
        let grads = split_grad(grad, &chunks);
        let jobs: Vec<_> = ws
            .into_iter()
            .zip(bufs)
            .zip(outs)
            .zip(grads)
            .map(|(((w, b), o), g)| move || sgd_dispatch(level, &k, w, g, b, o))
            .collect();
        self.run(jobs);
    }

    /// Chunk lengths: one per thread, multiples of 64 elements (cache lines of every slice).
    fn chunks(&self, n: usize) -> Vec<usize> {
        let threads = self.threads.min(n / MIN_PER_THREAD).max(1);
        let per = n.div_ceil(threads).next_multiple_of(64);
        let mut left = n;
        let mut out = Vec::new();
        while left > 0 {
            let c = per.min(left);
            out.push(c);
            left -= c;
        }
        out
    }

    fn run<F: FnOnce() + Send>(&self, jobs: Vec<F>) {
        if jobs.len() <= 1 {
            jobs.into_iter().for_each(|j| j());
            return;
        }
        let pin = self.pin_cores;
        std::thread::scope(|s| {
            for (i, job) in jobs.into_iter().enumerate() {
                s.spawn(move || {
                    if pin {
                        pin_to_core(i);
                    }
                    job()
                });
            }
        });
    }
}

fn out_len(out: &Out<'_>) -> Option<usize> {
    match out {
        Out::None => None,
        Out::Bf16(o) => Some(o.len()),
        Out::F16(o) => Some(o.len()),
    }
}

fn split_mut<'a, T>(mut s: &'a mut [T], chunks: &[usize]) -> Vec<&'a mut [T]> {
    let mut parts = Vec::with_capacity(chunks.len());
    for &c in chunks {
        let (a, b) = s.split_at_mut(c);
        parts.push(a);
        s = b;
    }
    parts
}

fn split_ref<'a, T>(mut s: &'a [T], chunks: &[usize]) -> Vec<&'a [T]> {
    let mut parts = Vec::with_capacity(chunks.len());
    for &c in chunks {
        let (a, b) = s.split_at(c);
        parts.push(a);
        s = b;
    }
    parts
}

fn split_grad<'a>(grad: Grad<'a>, chunks: &[usize]) -> Vec<Grad<'a>> {
    match grad {
        Grad::F32(g) => split_ref(g, chunks).into_iter().map(Grad::F32).collect(),
        Grad::Bf16(g) => split_ref(g, chunks).into_iter().map(Grad::Bf16).collect(),
        Grad::F16(g) => split_ref(g, chunks).into_iter().map(Grad::F16).collect(),
    }
}

fn split_out<'a>(out: Out<'a>, chunks: &[usize]) -> Vec<Out<'a>> {
    match out {
        Out::None => chunks.iter().map(|_| Out::None).collect(),
        Out::Bf16(o) => split_mut(o, chunks).into_iter().map(Out::Bf16).collect(),
        Out::F16(o) => split_mut(o, chunks).into_iter().map(Out::F16).collect(),
    }
}

#[cfg(target_os = "linux")]
fn pin_to_core(i: usize) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // SAFETY: a zeroed cpu_set_t is valid; CPU_SET writes inside it; the call reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(i % cores, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

#[cfg(not(target_os = "linux"))]
fn pin_to_core(_: usize) {}

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

/// Compiles `$all` once per SIMD level and calls the one for `level`.
macro_rules! multiversion {
    ($name:ident, $all:ident, ($($arg:ident: $ty:ty),*)) => {
        fn $name(level: SimdLevel, $($arg: $ty),*) {
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
