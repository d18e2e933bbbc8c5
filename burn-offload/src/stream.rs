//! The offloaded step as a three-stage pipeline over sub-groups: while CPU-Adam steps
//! sub-group k, the gradient of k+1 comes down and the new weights of k-1 go up. Each stage
//! runs on its own thread and hands reusable buffers (pinned, where the caller has them) to
//! the next through channels, so a step allocates nothing and touches no fresh page.
//!
//! The caller says how bytes move (`Download`, `Upload`): CUDA copies on side streams in
//! burn-zero, slices of a host vector in tests. Nothing here knows about devices.

use core::ops::Range;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::{Duration, Instant};

use half::{bf16, f16};

use crate::cpu_adam::{Grad, Out};
use crate::host::OutDtype;

/// A buffer for one sub-group's gradient: fp32 (filled from the device, or an fp32 host
/// partition's own chunk) or bf16 / f16 (a 16-bit host partition's own chunk).
#[derive(Debug)]
pub enum GradBuf<'a> {
    /// fp32.
    F32(&'a mut [f32]),
    /// bf16.
    Bf16(&'a mut [bf16]),
    /// f16.
    F16(&'a mut [f16]),
}

impl GradBuf<'_> {
    /// Elements it holds.
    pub fn len(&self) -> usize {
        match self {
            GradBuf::F32(g) => g.len(),
            GradBuf::Bf16(g) => g.len(),
            GradBuf::F16(g) => g.len(),
        }
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Its first `n` elements, to be filled.
    pub fn prefix(&mut self, n: usize) -> GradBuf<'_> {
        match self {
            GradBuf::F32(g) => GradBuf::F32(&mut g[..n]),
            GradBuf::Bf16(g) => GradBuf::Bf16(&mut g[..n]),
            GradBuf::F16(g) => GradBuf::F16(&mut g[..n]),
        }
    }

    /// Its first `n` elements, as CPU-Adam reads a gradient.
    pub fn grad(&self, n: usize) -> Grad<'_> {
        match self {
            GradBuf::F32(g) => Grad::F32(&g[..n]),
            GradBuf::Bf16(g) => Grad::Bf16(&g[..n]),
            GradBuf::F16(g) => Grad::F16(&g[..n]),
        }
    }

    /// Where its first element lies (to check a buffer is the one expected).
    pub fn addr(&self) -> usize {
        match self {
            GradBuf::F32(g) => g.as_ptr() as usize,
            GradBuf::Bf16(g) => g.as_ptr() as usize,
            GradBuf::F16(g) => g.as_ptr() as usize,
        }
    }

    /// The values widened to f32.
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            GradBuf::F32(g) => g.to_vec(),
            GradBuf::Bf16(g) => g.iter().map(|x| x.to_f32()).collect(),
            GradBuf::F16(g) => g.iter().map(|x| x.to_f32()).collect(),
        }
    }

    /// The fp32 buffer, or an error naming what it is instead (for a fill from the device).
    pub fn f32_mut(&mut self) -> Result<&mut [f32], String> {
        match self {
            GradBuf::F32(g) => Ok(g),
            GradBuf::Bf16(_) | GradBuf::F16(_) => {
                Err("a 16-bit gradient buffer cannot be filled with fp32".into())
            }
        }
    }
}

/// A buffer for one sub-group's new weights, in the dtype the device stores them.
#[derive(Debug)]
pub enum OutSlot<'a> {
    /// fp32 (a copy of the master).
    F32(&'a mut [f32]),
    /// bf16.
    Bf16(&'a mut [bf16]),
    /// f16.
    F16(&'a mut [f16]),
}

/// One sub-group's new weights, as handed to [`Upload`].
#[derive(Clone, Copy, Debug)]
pub enum Weights<'a> {
    /// fp32.
    F32(&'a [f32]),
    /// bf16.
    Bf16(&'a [bf16]),
    /// f16.
    F16(&'a [f16]),
}

impl Weights<'_> {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            Weights::F32(w) => w.len(),
            Weights::Bf16(w) => w.len(),
            Weights::F16(w) => w.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values widened to f32.
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            Weights::F32(w) => w.to_vec(),
            Weights::Bf16(w) => w.iter().map(|x| x.to_f32()).collect(),
            Weights::F16(w) => w.iter().map(|x| x.to_f32()).collect(),
        }
    }
}

impl<'a> OutSlot<'a> {
    /// Elements the slot holds.
    pub fn len(&self) -> usize {
        match self {
            OutSlot::F32(o) => o.len(),
            OutSlot::Bf16(o) => o.len(),
            OutSlot::F16(o) => o.len(),
        }
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The dtype it holds.
    pub fn dtype(&self) -> OutDtype {
        match self {
            OutSlot::F32(_) => OutDtype::F32,
            OutSlot::Bf16(_) => OutDtype::Bf16,
            OutSlot::F16(_) => OutDtype::F16,
        }
    }

    /// The first `n` elements as CPU-Adam's output (fp32 is copied from the master after).
    pub(crate) fn target(&mut self, n: usize) -> Out<'_> {
        match self {
            OutSlot::F32(_) => Out::None,
            OutSlot::Bf16(o) => Out::Bf16(&mut o[..n]),
            OutSlot::F16(o) => Out::F16(&mut o[..n]),
        }
    }

    /// Copies the master into an fp32 slot (the others were written by the step).
    pub(crate) fn finish(&mut self, master: &[f32]) {
        if let OutSlot::F32(o) = self {
            o[..master.len()].copy_from_slice(master);
        }
    }

    /// The first `n` elements, read-only.
    pub fn weights(&self, n: usize) -> Weights<'_> {
        match self {
            OutSlot::F32(o) => Weights::F32(&o[..n]),
            OutSlot::Bf16(o) => Weights::Bf16(&o[..n]),
            OutSlot::F16(o) => Weights::F16(&o[..n]),
        }
    }
}

/// The buffers a step cycles through: each at least a sub-group long. One of each runs the
/// stages in turn; two or more let them overlap. Buffers are taken in the order given, so one
/// gradient buffer per sub-group, in order, can be the gradient itself (already in host
/// memory: `download` then has nothing to move), and one output per sub-group, in order, the
/// weights' own place (`upload` then has nothing to move).
#[derive(Debug)]
pub struct StepBuffers<'a> {
    /// For gradients coming down.
    pub grads: Vec<GradBuf<'a>>,
    /// For new weights going up, all of one dtype.
    pub outs: Vec<OutSlot<'a>>,
}

/// Buffers in ordinary host memory, for when nothing better is at hand (tests, CPU backends).
#[derive(Debug)]
pub struct OwnedBuffers {
    grads: Vec<Vec<f32>>,
    outs: OwnedOuts,
}

#[derive(Debug)]
enum OwnedOuts {
    F32(Vec<Vec<f32>>),
    Bf16(Vec<Vec<bf16>>),
    F16(Vec<Vec<f16>>),
}

impl OwnedBuffers {
    /// `count` buffers of each kind, `len` elements long, new weights in `out`.
    pub fn new(count: usize, len: usize, out: OutDtype) -> Self {
        let count = count.max(1);
        let outs = match out {
            OutDtype::F32 => OwnedOuts::F32(vec![vec![0.0; len]; count]),
            OutDtype::Bf16 => OwnedOuts::Bf16(vec![vec![bf16::ZERO; len]; count]),
            OutDtype::F16 => OwnedOuts::F16(vec![vec![f16::ZERO; len]; count]),
        };
        Self {
            grads: vec![vec![0.0; len]; count],
            outs,
        }
    }

    /// The buffers, lent to one step.
    pub fn lend(&mut self) -> StepBuffers<'_> {
        let outs = match &mut self.outs {
            OwnedOuts::F32(o) => o.iter_mut().map(|b| OutSlot::F32(b)).collect(),
            OwnedOuts::Bf16(o) => o.iter_mut().map(|b| OutSlot::Bf16(b)).collect(),
            OwnedOuts::F16(o) => o.iter_mut().map(|b| OutSlot::F16(b)).collect(),
        };
        StepBuffers {
            grads: self.grads.iter_mut().map(|b| GradBuf::F32(b)).collect(),
            outs,
        }
    }
}

/// Fills the buffer with the gradient of a range of the partition (or checks that it is that
/// gradient's own place); runs on the pipeline's download thread.
pub type Download<'f> = dyn Fn(Range<usize>, GradBuf<'_>) -> Result<(), String> + Sync + 'f;

/// Takes the new weights of a range of the partition; runs on the calling thread.
pub type Upload<'f> = dyn FnMut(Range<usize>, Weights<'_>) -> Result<(), String> + 'f;

/// Where a step's time went: each stage's busy time on its own thread, and the whole.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StreamTimings {
    /// Gradients device → host.
    pub download: Duration,
    /// CPU-Adam.
    pub compute: Duration,
    /// New weights host → device.
    pub upload: Duration,
    /// First byte down to last byte up.
    pub total: Duration,
}

/// Why a streamed step stopped.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// Moving a gradient down failed.
    #[error("moving the gradient of elements {range:?} to the host: {what}")]
    Download {
        /// The sub-group.
        range: Range<usize>,
        /// What failed.
        what: String,
    },
    /// Moving new weights up failed.
    #[error("moving the new weights of elements {range:?} to the device: {what}")]
    Upload {
        /// The sub-group.
        range: Range<usize>,
        /// What failed.
        what: String,
    },
    /// The swap files failed.
    #[error(transparent)]
    Swap(#[from] crate::nvme::SwapError),
    /// A step begun ahead could not be completed.
    #[error(transparent)]
    Ahead(#[from] crate::host::AheadError),
}

/// The stepping stage's side of the pipeline: gradients arrive in sub-group order, and each
/// stepped sub-group's weights leave.
pub(crate) struct Stepper<'a> {
    grads_in: Receiver<(Range<usize>, GradBuf<'a>)>,
    grads_free: Sender<GradBuf<'a>>,
    outs_free: Receiver<OutSlot<'a>>,
    outs_done: Sender<(Range<usize>, OutSlot<'a>)>,
    busy: Duration,
    since: Instant,
}

impl<'a> Stepper<'a> {
    /// The next sub-group's gradient and a free output slot, or `None` if another stage
    /// stopped (its error is reported by [`run`]).
    pub(crate) fn next(&mut self, range: &Range<usize>) -> Option<(GradBuf<'a>, OutSlot<'a>)> {
        let (got, grad) = self.grads_in.recv().ok()?;
        assert_eq!(&got, range, "sub-groups arrive in order");
        let out = self.outs_free.recv().ok()?;
        self.since = Instant::now();
        Some((grad, out))
    }

    /// Hands a stepped sub-group on and its gradient buffer back.
    pub(crate) fn done(&mut self, range: Range<usize>, grad: GradBuf<'a>, out: OutSlot<'a>) {
        self.busy += self.since.elapsed();
        let _ = self.grads_free.send(grad);
        let _ = self.outs_done.send((range, out));
    }
}

/// Runs `step` (the stepping stage, on a thread of its own) between a download thread and
/// uploads on this thread. `step` returns `Ok(false)` when [`Stepper::next`] gave up.
pub(crate) fn run<'a>(
    ranges: Vec<Range<usize>>,
    buffers: StepBuffers<'a>,
    download: &Download<'_>,
    upload: &mut Upload<'_>,
    step: impl FnOnce(&mut Stepper<'a>) -> Result<bool, crate::nvme::SwapError> + Send,
) -> Result<StreamTimings, StreamError> {
    assert!(
        !buffers.grads.is_empty() && !buffers.outs.is_empty(),
        "a streamed step needs at least one buffer of each kind"
    );
    let longest = ranges.iter().map(Range::len).max().unwrap_or(0);
    // Output buffers cycle like gradient buffers: any holds any sub-group, or there is one per
    // sub-group, in order (the weights' own place in host memory: nothing to upload).
    let each_its_own = buffers.outs.len() >= ranges.len()
        && ranges
            .iter()
            .zip(&buffers.outs)
            .all(|(r, b)| b.len() >= r.len());
    assert!(
        each_its_own || buffers.outs.iter().all(|b| b.len() >= longest),
        "every output buffer must hold a sub-group ({longest} elements), or be its own sub-group's"
    );
    let start = Instant::now();
    let (grads_free, grads_free_rx) = channel();
    let (grads_ready, grads_in) = channel();
    let (outs_free, outs_free_rx) = channel();
    let (outs_done, outs_done_rx) = channel::<(Range<usize>, OutSlot<'a>)>();
    buffers.grads.into_iter().for_each(|b| {
        let _ = grads_free.send(b);
    });
    buffers.outs.into_iter().for_each(|b| {
        let _ = outs_free.send(b);
    });
    let mut stepper = Stepper {
        grads_in,
        grads_free,
        outs_free: outs_free_rx,
        outs_done,
        busy: Duration::ZERO,
        since: start,
    };
    std::thread::scope(|s| {
        let down_ranges = ranges.clone();
        let downloader = s.spawn(move || -> Result<Duration, StreamError> {
            let mut busy = Duration::ZERO;
            for range in down_ranges {
                let Ok(mut buf) = grads_free_rx.recv() else {
                    break;
                };
                if buf.len() < range.len() {
                    return Err(StreamError::Download {
                        what: format!("a gradient buffer of {} elements", buf.len()),
                        range,
                    });
                }
                let t = Instant::now();
                download(range.clone(), buf.prefix(range.len())).map_err(|what| {
                    StreamError::Download {
                        range: range.clone(),
                        what,
                    }
                })?;
                busy += t.elapsed();
                if grads_ready.send((range, buf)).is_err() {
                    break;
                }
            }
            Ok(busy)
        });
        let stepping = s.spawn(move || step(&mut stepper).map(|_| stepper.busy));
        let mut up = Duration::ZERO;
        let mut failed = None;
        for (range, out) in outs_done_rx.iter() {
            let t = Instant::now();
            if let Err(what) = upload(range.clone(), out.weights(range.len())) {
                failed = Some(StreamError::Upload { range, what });
                break;
            }
            up += t.elapsed();
            let _ = outs_free.send(out);
        }
        // Dropping the channels' ends stops the other stages if this one failed.
        drop(outs_done_rx);
        drop(outs_free);
        let stepped = stepping.join().expect("the CPU-Adam stage");
        let downloaded = downloader.join().expect("the download stage");
        let compute = stepped?;
        let download = downloaded?;
        if let Some(e) = failed {
            return Err(e);
        }
        Ok(StreamTimings {
            download,
            compute,
            upload: up,
            total: start.elapsed(),
        })
    })
}
