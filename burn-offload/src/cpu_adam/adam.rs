//! CPU-Adam and SGD over flat slices: the step parameters, the SIMD level and the threads.

use half::{bf16, f16};

use super::kernel::{adam_dispatch, narrow_dispatch, sgd_dispatch};

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
    /// See [`GradScale`].
    pub grad_scale: GradScale,
}

/// Two factors each gradient element is multiplied by, in order, before the update: the
/// inverse loss scale and the clipping factor, so an offloaded step needs no pass of its own
/// over the gradient. Factors of 1 leave it bit for bit; a power-of-two loss scale's inverse
/// gives the bits of dividing by it.
pub type GradScale = [f32; 2];

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
            grad_scale: [1.0, 1.0],
        }
    }

    /// These constants with gradients multiplied by `scale` first.
    pub fn with_grad_scale(self, grad_scale: GradScale) -> Self {
        Self { grad_scale, ..self }
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
    /// See [`GradScale`].
    pub grad_scale: GradScale,
}

/// The multithreaded, vectorized optimizer step of offloaded partitions.
#[derive(Clone, Debug)]
pub struct CpuAdam {
    threads: usize,
    pin_cores: bool,
    huge_pages: bool,
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
            huge_pages: false,
            level: SimdLevel::detect(),
        }
    }

    /// The same step over `threads` threads (at least one).
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.threads = threads.max(1);
        self
    }

    /// Pins worker `i` to core `i` (Linux; ignored elsewhere).
    pub fn with_pinned_cores(mut self, pin: bool) -> Self {
        self.pin_cores = pin;
        self
    }

    /// Allocates the partitions it steps advised for transparent huge pages (Linux).
    pub fn with_huge_pages(mut self, huge: bool) -> Self {
        self.huge_pages = huge;
        self
    }

    /// Whether partitions are allocated advised for huge pages.
    pub fn huge_pages(&self) -> bool {
        self.huge_pages
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

    /// Writes `master` to `out` in its dtype, rounded as [`Self::adam`] rounds its output
    /// (for a sub-group whose master was stepped ahead, with no output at hand then).
    ///
    /// # Panics
    /// If `out` is shorter than `master`.
    pub fn narrow(&self, master: &[f32], out: Out<'_>) {
        let n = master.len();
        assert!(
            out_len(&out).is_none_or(|l| l >= n),
            "narrowing {n} weights into a shorter output"
        );
        let out = match out {
            Out::None => return,
            Out::Bf16(o) => Out::Bf16(&mut o[..n]),
            Out::F16(o) => Out::F16(&mut o[..n]),
        };
        let level = self.level;
        let chunks = self.chunks(n);
        let jobs: Vec<_> = split_ref(master, &chunks)
            .into_iter()
            .zip(split_out(out, &chunks))
            .map(|(w, o)| move || narrow_dispatch(level, w, o))
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
