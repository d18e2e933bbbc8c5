//! Stepping ahead: CPU-Adam of each sub-group starts as soon as the boundary backward has
//! finished that sub-group's gradient in host memory, on a thread of its own, while backward
//! goes on writing the others (ZeRO-Offload's optimizer overlapped with backward); given an
//! [`AheadSink`], each one's new weights are sent there at once. The step that follows
//! backward then only steps what never finished early and hands the other weights out.
//!
//! Only a step that depends on nothing but each sub-group's own gradient may start early: no
//! clipping by the global norm and no loss scale to unscale (the caller decides). A
//! non-finite gradient stops stepping ahead at that sub-group; whether the step is then
//! skipped is the caller's decision ([`HostOptimizer::abandon_ahead`]).

use std::sync::mpsc::channel;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::cpu_adam::{Grad, GradScale};
use crate::grads::HostGrads;
use crate::host::{AheadError, HostOptimizer};
use crate::stream::OutSlot;

/// What stepping ahead did in one backward.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AheadReport {
    /// Sub-groups stepped ahead.
    pub stepped: usize,
    /// Time spent stepping them (overlapped with backward).
    pub busy: Duration,
    /// The first sub-group whose gradient was not finite (none was stepped after it).
    pub non_finite: Option<usize>,
    /// Why stepping ahead stopped, if it failed.
    pub failure: Option<String>,
}

/// Where each sub-group stepped ahead sends its new weights at once (the device, on CUDA),
/// so the step after backward hands out only the others and reads no master twice.
pub trait AheadSink: Send {
    /// A free buffer of at least `n` elements in the weights' dtype (nothing sent earlier
    /// still reads it).
    fn slot(&mut self, n: usize) -> Result<OutSlot<'_>, String>;
    /// Sends sub-group `index`'s `n` new weights, written into the slot last given.
    fn send(&mut self, index: usize, n: usize) -> Result<(), String>;
    /// Waits until everything sent has arrived.
    fn flush(&mut self) -> Result<(), String>;
}

/// A sink shared between the engine, which aims it, and the thread stepping ahead.
pub type SharedSink = Arc<Mutex<dyn AheadSink>>;

/// The thread stepping one backward's finished sub-groups.
pub struct StepAhead {
    thread: Option<JoinHandle<AheadReport>>,
    /// The partition watched (told to stop watching if this is dropped before its backward
    /// ended, so the thread ends).
    grads: Arc<Mutex<HostGrads>>,
    /// The optimizer stepped (told to forget what was sent if the thread panicked).
    opt: Arc<Mutex<HostOptimizer>>,
}

impl std::fmt::Debug for StepAhead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepAhead")
            .field("running", &self.thread.is_some())
            .finish()
    }
}

/// Waits for everything sent to a sink when dropped, even by a panic: nothing may still be
/// copying into outputs that the caller frees once this thread has ended.
struct FlushOnDrop(Option<SharedSink>);

impl Drop for FlushOnDrop {
    fn drop(&mut self) {
        if let Some(sink) = &self.0 {
            let _ = lock(sink).flush();
        }
    }
}

fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Steps sub-group `c` of `opt` with `grad` and, given a sink, sends its new weights there.
fn step_one(
    opt: &Mutex<HostOptimizer>,
    sink: Option<&SharedSink>,
    c: usize,
    grad: Grad<'_>,
) -> Result<(), String> {
    let Some(sink) = sink else {
        return lock(opt)
            .step_ahead(c, grad, None)
            .map_err(|e| e.to_string());
    };
    let mut sink = lock(sink);
    {
        let mut slot = sink.slot(grad.len())?;
        lock(opt)
            .step_ahead(c, grad, Some(&mut slot))
            .map_err(|e| e.to_string())?;
    }
    sink.send(c, grad.len())?;
    lock(opt).sent_ahead(c);
    Ok(())
}

impl StepAhead {
    /// Begins `opt`'s step with `lr`, `betas` and `grad_scale` ahead of its gradient and
    /// steps each sub-group the next boundary backward finishes in `grads`, whose chunks must
    /// be `opt`'s sub-groups; each one's new weights go to `sink` when given. [`Self::finish`]
    /// once that backward has ended, then [`HostOptimizer::step`] with the same values.
    pub fn start(
        grads: Arc<Mutex<HostGrads>>,
        opt: Arc<Mutex<HostOptimizer>>,
        (lr, betas, grad_scale): (f32, (f32, f32), GradScale),
        sink: Option<SharedSink>,
    ) -> Result<Self, AheadError> {
        let (sub_groups, chunk) = {
            let o = lock(&opt);
            (o.sub_groups(), o.sub_group_len().max(1))
        };
        let g_chunk = lock(&grads).chunk_len();
        if g_chunk != chunk && sub_groups.len() > 1 {
            return Err(AheadError::Chunks {
                chunk: g_chunk,
                sub_group: chunk,
            });
        }
        lock(&opt).begin_ahead(lr, betas, grad_scale)?;
        let (tx, finished) = channel::<usize>();
        lock(&grads).watch(tx);
        let (watched, stepped) = (grads.clone(), opt.clone());
        let thread = std::thread::Builder::new()
            .name("burn-offload-step-ahead".into())
            .spawn(move || {
                let _flush = FlushOnDrop(sink.clone());
                let mut report = AheadReport::default();
                // Ends when the backward ends (`end_pass` drops the watcher's sender).
                for c in finished {
                    let Some(range) = sub_groups.get(c) else {
                        continue; // padding past the optimizer's partition
                    };
                    if report.non_finite.is_some() || report.failure.is_some() {
                        continue;
                    }
                    let values = {
                        let mut g = lock(&grads);
                        if !g.chunk_sum_of_squares(c).is_finite() {
                            report.non_finite = Some(c);
                            continue;
                        }
                        match g.lend(c) {
                            Ok(v) => v,
                            Err(e) => {
                                report.failure = Some(e.to_string());
                                continue;
                            }
                        }
                    };
                    let start = Instant::now();
                    let stepped = step_one(&opt, sink.as_ref(), c, values.grad(range.len()));
                    report.busy += start.elapsed();
                    lock(&grads).give_back(c, values);
                    match stepped {
                        Ok(()) => report.stepped += 1,
                        Err(e) => report.failure = Some(e),
                    }
                }
                if let Some(Err(e)) = sink.as_ref().map(|s| lock(s).flush()) {
                    report.failure.get_or_insert(e);
                }
                if report.failure.is_some() {
                    // What reached the outputs is not known: the step hands them all out.
                    lock(&opt).unsend_ahead();
                }
                report
            })
            .expect("spawning the step-ahead thread");
        Ok(Self {
            thread: Some(thread),
            grads: watched,
            opt: stepped,
        })
    }

    /// Waits for every sub-group the backward finished (call after it ended).
    pub fn finish(mut self) -> AheadReport {
        self.join()
    }

    fn join(&mut self) -> AheadReport {
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(report)) => report,
            Some(Err(_)) => {
                lock(&self.opt).unsend_ahead();
                AheadReport {
                    failure: Some("the step-ahead thread panicked".into()),
                    ..AheadReport::default()
                }
            }
            None => AheadReport::default(),
        }
    }
}

impl Drop for StepAhead {
    /// Not finished (its backward failed or never ended): the watcher goes, so the thread
    /// ends once it has stepped what it was told of.
    fn drop(&mut self) {
        if self.thread.is_some() {
            lock(&self.grads).unwatch();
            self.join();
        }
    }
}
