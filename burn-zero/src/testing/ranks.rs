//! Ranks as threads over in-process communicators, and a communicator that records calls.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;
use std::time::Duration;

use crate::comm::{
    Buf, BufMut, CommError, Communicator, DEFAULT_TIMEOUT, LocalComm, LocalGroup, OpKind,
    OpSignature, ReduceOp,
};

/// What a rank's closure receives.
pub struct RankCtx {
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// This rank's communicator.
    pub comm: LocalComm,
}

/// A rank that panicked, with its message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankFailure {
    /// The rank.
    pub rank: usize,
    /// Its panic message.
    pub message: String,
}

impl core::fmt::Display for RankFailure {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "rank {} panicked: {}", self.rank, self.message)
    }
}

/// Runs `f` on `world_size` thread ranks and returns their results in rank order.
///
/// # Panics
/// If any rank panics, with the message of the rank that failed first.
pub fn run_ranks<T: Send>(world_size: usize, f: impl Fn(RankCtx) -> T + Sync) -> Vec<T> {
    run_ranks_with_timeout(world_size, DEFAULT_TIMEOUT, f)
}

/// [`run_ranks`] with a communicator timeout.
pub fn run_ranks_with_timeout<T: Send>(
    world_size: usize,
    timeout: Duration,
    f: impl Fn(RankCtx) -> T + Sync,
) -> Vec<T> {
    match try_run_ranks(world_size, timeout, f) {
        Ok(results) => results,
        Err(failures) => {
            let first = &failures[0];
            let others: Vec<String> = failures[1..].iter().map(|f| f.to_string()).collect();
            if others.is_empty() {
                panic!("{first}")
            }
            panic!("{first}\n(then: {})", others.join("; "))
        }
    }
}

/// Runs `f` on `world_size` thread ranks; on failure returns every rank that panicked, the
/// first to fail first.
pub fn try_run_ranks<T: Send>(
    world_size: usize,
    timeout: Duration,
    f: impl Fn(RankCtx) -> T + Sync,
) -> Result<Vec<T>, Vec<RankFailure>> {
    let group = LocalGroup::with_timeout(world_size, timeout);
    let failures = Mutex::new(Vec::new());
    let results: Vec<Option<T>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                let (group, f, failures) = (&group, &f, &failures);
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        let ctx = RankCtx {
                            rank,
                            world_size,
                            comm: group.comm(rank),
                        };
                        match catch_unwind(AssertUnwindSafe(|| f(ctx))) {
                            Ok(value) => Some(value),
                            Err(payload) => {
                                let message = panic_message(payload.as_ref());
                                let reason = format!("rank {rank} panicked: {message}");
                                // Record before releasing the others, so the root cause is
                                // listed ahead of the ranks that fail because of it.
                                failures
                                    .lock()
                                    .unwrap_or_else(|e| e.into_inner())
                                    .push(RankFailure { rank, message });
                                group.abort(reason);
                                None
                            }
                        }
                    })
                    .expect("spawn a rank thread")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().ok().flatten())
            .collect()
    });
    let failures = failures.into_inner().unwrap_or_else(|e| e.into_inner());
    if failures.is_empty() {
        Ok(results
            .into_iter()
            .map(|r| r.expect("no rank failed"))
            .collect())
    } else {
        Err(failures)
    }
}

/// Runs `f` once per world size, naming the world size if it panics.
pub fn for_world_sizes(world_sizes: &[usize], f: impl Fn(usize)) {
    for &world_size in world_sizes {
        if let Err(payload) = catch_unwind(AssertUnwindSafe(|| f(world_size))) {
            panic!(
                "world size {world_size}: {}",
                panic_message(payload.as_ref())
            );
        }
    }
}

fn panic_message(payload: &(dyn core::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

/// A communicator that records the signature of every call it forwards to `inner`, labels
/// included (for tests that count and order collectives).
pub struct RecordingComm<C> {
    inner: C,
    calls: Mutex<Vec<OpSignature>>,
}

impl<C: Communicator> RecordingComm<C> {
    /// Records the calls made on `inner`.
    pub fn new(inner: C) -> Self {
        Self {
            inner,
            calls: Mutex::new(Vec::new()),
        }
    }

    /// The calls recorded since the last `take`, in order.
    pub fn take(&self) -> Vec<OpSignature> {
        std::mem::take(&mut *self.calls.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn record(&self, kind: OpKind, buf: Buf<'_>) {
        self.calls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(OpSignature::new(kind, buf.dtype(), buf.len()));
    }
}

impl<C: Communicator> Communicator for RecordingComm<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn set_timeout(&self, timeout: Duration) {
        self.inner.set_timeout(timeout)
    }
    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<(), CommError> {
        self.record(OpKind::AllReduce(op), buf.as_buf());
        self.inner.all_reduce(buf, op)
    }
    fn reduce_scatter(
        &self,
        input: Buf<'_>,
        output: BufMut<'_>,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.record(OpKind::ReduceScatter(op), input);
        self.inner.reduce_scatter(input, output, op)
    }
    fn all_gather(&self, input: Buf<'_>, output: BufMut<'_>) -> Result<(), CommError> {
        self.record(OpKind::AllGather, input);
        self.inner.all_gather(input, output)
    }
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<(), CommError> {
        self.record(OpKind::Broadcast { root }, buf.as_buf());
        self.inner.broadcast(buf, root)
    }
    fn barrier(&self) -> Result<(), CommError> {
        self.record(OpKind::Barrier, Buf::F32(&[]));
        self.inner.barrier()
    }
    fn send(&self, buf: Buf<'_>, peer: usize) -> Result<(), CommError> {
        self.record(OpKind::PointToPoint, buf);
        self.inner.send(buf, peer)
    }
    fn recv(&self, buf: BufMut<'_>, peer: usize) -> Result<(), CommError> {
        self.record(OpKind::PointToPoint, buf.as_buf());
        self.inner.recv(buf, peer)
    }
}
