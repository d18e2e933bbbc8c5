//! A watchdog for collectives that complete asynchronously (NCCL's, on a CUDA stream): each
//! enqueued call is watched until its completion probe says it is done; one that stays pending
//! longer than the timeout fires the watchdog's handler once, with the flight record of the
//! rank's last calls (what NCCL's own watchdog in torch does before it tears the process down).
//!
//! Free of CUDA: a call is watched through a [`Probe`] (a CUDA event on GPUs, a flag in tests).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::base::{OpSignature, TimeoutCell};
use super::flight::{FlightRecord, FlightRecorder};

/// Whether an enqueued call has completed.
pub trait Probe: Send {
    /// `Ok(true)` once the call completed; an error when the device reports one.
    fn done(&self) -> Result<bool, String>;
}

/// What the handler is told when a call stays pending past the timeout (or its probe fails).
#[derive(Clone, Debug)]
pub struct Expired {
    /// This rank.
    pub rank: usize,
    /// Number of the call that did not complete.
    pub seq: u64,
    /// The call.
    pub call: OpSignature,
    /// How long it has been pending.
    pub pending: Duration,
    /// The timeout it exceeded.
    pub timeout: Duration,
    /// The device's error, when the probe failed instead of timing out.
    pub error: Option<String>,
    /// The rank's last calls, oldest first.
    pub recent: FlightRecord,
}

impl std::fmt::Display for Expired {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.error {
            Some(error) => write!(
                f,
                "rank {}: {} (#{}) failed on the device after {:.1} s: {error}",
                self.rank,
                self.call,
                self.seq,
                self.pending.as_secs_f64()
            )?,
            None => write!(
                f,
                "rank {}: {} (#{}) did not complete within {:.1} s (comm_timeout_s); a rank \
                 that never issued it, or a device or link that stopped, holds it",
                self.rank,
                self.call,
                self.seq,
                self.timeout.as_secs_f64()
            )?,
        }
        write!(f, "{}", self.recent)
    }
}

/// What the watchdog does with an expired call (on its own thread, once).
pub type Handler = Box<dyn FnOnce(Expired) + Send>;

struct Watched {
    seq: u64,
    call: OpSignature,
    issued: Instant,
    probe: Box<dyn Probe>,
}

struct State {
    rank: usize,
    queue: Mutex<VecDeque<Watched>>,
    timeout: TimeoutCell,
    flight: FlightRecorder,
    handler: Mutex<Option<Handler>>,
}

/// Watches one communicator's calls; a thread polls them while the watchdog lives.
pub struct Watchdog {
    state: Arc<State>,
}

impl Watchdog {
    /// A watchdog for `rank`'s calls that fires `handler` when one stays pending longer than
    /// `timeout`, polling every `poll`.
    pub fn new(rank: usize, timeout: Duration, poll: Duration, handler: Handler) -> Self {
        let state = Arc::new(State {
            rank,
            queue: Mutex::new(VecDeque::new()),
            timeout: TimeoutCell::new(timeout),
            flight: FlightRecorder::default(),
            handler: Mutex::new(Some(handler)),
        });
        let weak = Arc::downgrade(&state);
        std::thread::Builder::new()
            .name(format!("burn-zero watchdog (rank {rank})"))
            .spawn(move || watch(weak, poll))
            .expect("spawning the collective watchdog's thread");
        Self { state }
    }

    /// Watches `call`, just enqueued, until `probe` says it completed; returns its number.
    pub fn watch(&self, call: OpSignature, probe: Box<dyn Probe>) -> u64 {
        let seq = self.state.flight.start(call);
        let mut queue = self.state.queue.lock().unwrap_or_else(|e| e.into_inner());
        queue.push_back(Watched {
            seq,
            call,
            issued: Instant::now(),
            probe,
        });
        seq
    }

    /// Changes the timeout (`burn_zero.comm_timeout_s`).
    pub fn set_timeout(&self, timeout: Duration) {
        self.state.timeout.set(timeout);
    }

    /// The timeout calls are held to.
    pub fn timeout(&self) -> Duration {
        self.state.timeout.get()
    }

    /// The last calls watched, oldest first (completed ones with the time the watchdog saw
    /// them done, within one poll).
    pub fn record(&self) -> FlightRecord {
        self.state.flight.record()
    }

    /// Calls not yet seen completed.
    pub fn pending(&self) -> usize {
        self.state
            .queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }
}

/// The watchdog thread: retires completed calls in order and fires on the first that expires.
fn watch(state: Weak<State>, poll: Duration) {
    loop {
        std::thread::sleep(poll);
        let Some(state) = state.upgrade() else {
            return;
        };
        if let Some(expired) = check(&state) {
            let handler = state
                .handler
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            if let Some(handler) = handler {
                handler(expired);
            }
            return;
        }
    }
}

/// Retires the calls that completed, oldest first; the first that did not and is past the
/// timeout (or whose probe failed) expires.
fn check(state: &State) -> Option<Expired> {
    let timeout = state.timeout.get();
    let mut queue = state.queue.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let front = queue.front()?;
        let (seq, call, pending) = (front.seq, front.call, front.issued.elapsed());
        let expired = |error| Expired {
            rank: state.rank,
            seq,
            call,
            pending,
            timeout,
            error,
            recent: state.flight.record(),
        };
        match front.probe.done() {
            Ok(true) => {
                state.flight.end(seq);
                queue.pop_front();
            }
            Ok(false) if pending > timeout => return Some(expired(None)),
            Ok(false) => return None,
            Err(e) => return Some(expired(Some(e))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{DType, OpKind};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::mpsc;

    struct Flag(Arc<AtomicBool>);

    impl Probe for Flag {
        fn done(&self) -> Result<bool, String> {
            Ok(self.0.load(Ordering::SeqCst))
        }
    }

    fn call(count: usize) -> OpSignature {
        OpSignature::new(OpKind::AllGather, DType::Bf16, count)
    }

    fn dog(timeout_ms: u64) -> (Watchdog, mpsc::Receiver<Expired>) {
        let (tx, rx) = mpsc::channel();
        let handler: Handler = Box::new(move |e| tx.send(e).unwrap());
        let dog = Watchdog::new(
            3,
            Duration::from_millis(timeout_ms),
            Duration::from_millis(5),
            handler,
        );
        (dog, rx)
    }

    #[test]
    fn completed_calls_are_retired_and_nothing_fires() {
        let (dog, rx) = dog(200);
        for i in 0..5 {
            let done = Arc::new(AtomicBool::new(false));
            dog.watch(call(i + 1), Box::new(Flag(done.clone())));
            done.store(true, Ordering::SeqCst);
        }
        std::thread::sleep(Duration::from_millis(400));
        assert!(
            rx.try_recv().is_err(),
            "a completed call fired the watchdog"
        );
        assert_eq!(dog.pending(), 0);
        let record = dog.record();
        assert_eq!(record.0.len(), 5);
        assert!(record.0.iter().all(|e| e.took.is_some()), "{record}");
    }

    #[test]
    fn a_call_pending_past_the_timeout_fires_once_with_the_record() {
        let (dog, rx) = dog(100);
        let done = Arc::new(AtomicBool::new(true));
        dog.watch(call(7), Box::new(Flag(done)));
        let stuck = Arc::new(AtomicBool::new(false));
        let seq = dog.watch(call(9), Box::new(Flag(stuck.clone())));
        let started = Instant::now();
        let expired = rx.recv_timeout(Duration::from_secs(5)).expect("fired");
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(100) && waited < Duration::from_secs(2),
            "{waited:?}"
        );
        assert_eq!((expired.rank, expired.seq, expired.call), (3, seq, call(9)));
        assert!(expired.error.is_none());
        let text = expired.to_string();
        assert!(
            text.contains("(#1) did not complete within 0.1 s"),
            "{text}"
        );
        assert!(text.contains("#0 all_gather"), "{text}");
        assert!(text.contains("did not complete"), "{text}");
        // Once: completing the call later does not fire again.
        stuck.store(true, Ordering::SeqCst);
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
    }

    #[test]
    fn a_longer_timeout_set_later_holds() {
        let (dog, rx) = dog(50);
        dog.set_timeout(Duration::from_secs(30));
        assert_eq!(dog.timeout(), Duration::from_secs(30));
        dog.watch(call(1), Box::new(Flag(Arc::new(AtomicBool::new(false)))));
        assert!(rx.recv_timeout(Duration::from_millis(400)).is_err());
    }

    #[test]
    fn a_device_error_fires_at_once() {
        struct Failing;
        impl Probe for Failing {
            fn done(&self) -> Result<bool, String> {
                Err("CUDA_ERROR_LAUNCH_FAILED".into())
            }
        }
        let (dog, rx) = dog(60_000);
        dog.watch(call(2), Box::new(Failing));
        let expired = rx.recv_timeout(Duration::from_secs(5)).expect("fired");
        assert_eq!(expired.error.as_deref(), Some("CUDA_ERROR_LAUNCH_FAILED"));
        assert!(expired.to_string().contains("failed on the device"));
    }
}
