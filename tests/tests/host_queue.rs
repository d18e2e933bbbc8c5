//! The runner-thread queue of the patched cubecl-common (`patches/cubecl-common`): with the
//! eager policy an idle runner runs a task as soon as it is queued; with upstream's batched
//! policy the same task waits for a full buffer of 32 or a flush. Both policies run every task
//! once, in order. One test: the policy is process-wide.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cubecl_common::device::{DeviceId, DeviceService, ServerUtilitiesHandle};
use cubecl_common::device_handle::{DeviceHandle, eager_fetch, set_eager_fetch};

/// A service that records the order its tasks ran in.
struct Log {
    seen: Vec<usize>,
}

impl DeviceService for Log {
    fn init(_: DeviceId) -> Self {
        Self { seen: Vec::new() }
    }
    fn utilities(&self) -> ServerUtilitiesHandle {
        Arc::new(())
    }
}

/// Waits up to `limit` for `count` to reach `want`; whether it did.
fn reaches(count: &AtomicUsize, want: usize, limit: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if count.load(Ordering::SeqCst) >= want {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    count.load(Ordering::SeqCst) >= want
}

/// Queues tasks `first..first + n`, each bumping `ran`.
fn queue(handle: &DeviceHandle<Log>, ran: &Arc<AtomicUsize>, first: usize, n: usize) {
    for i in first..first + n {
        let ran = ran.clone();
        handle.submit(move |log| {
            log.seen.push(i);
            ran.fetch_add(1, Ordering::SeqCst);
        });
    }
}

#[test]
fn eager_runner_takes_queued_tasks_and_batched_waits_for_a_flush() {
    assert!(eager_fetch(), "the patched default is the eager policy");
    // A device id no backend uses.
    let handle = DeviceHandle::<Log>::new(DeviceId {
        type_id: 9_301,
        index_id: 0,
    });
    let ran = Arc::new(AtomicUsize::new(0));

    // Eager: 5 tasks (fewer than a buffer) run without a flush, also after the runner has
    // gone idle long enough to park (its spin and yield budgets are far below 200 ms).
    queue(&handle, &ran, 0, 5);
    assert!(
        reaches(&ran, 5, Duration::from_secs(5)),
        "eager: queued tasks did not run"
    );
    std::thread::sleep(Duration::from_millis(200));
    queue(&handle, &ran, 5, 3);
    assert!(
        reaches(&ran, 8, Duration::from_secs(5)),
        "eager: a parked runner was not woken"
    );

    // Batched (upstream's policy): 7 tasks wait for a full buffer or a flush.
    set_eager_fetch(false);
    std::thread::sleep(Duration::from_millis(50));
    queue(&handle, &ran, 8, 7);
    assert!(
        !reaches(&ran, 15, Duration::from_millis(300)),
        "batched: tasks ran before the buffer was full or flushed"
    );
    handle.flush_queue();
    assert!(
        reaches(&ran, 15, Duration::from_secs(5)),
        "batched: the flush ran nothing"
    );

    // Eager again, with several producers: every task runs once; each producer's in order.
    set_eager_fetch(true);
    let producers: Vec<_> = (0..4)
        .map(|p| {
            let handle = handle.clone();
            let ran = ran.clone();
            std::thread::spawn(move || queue(&handle, &ran, 1_000 * (p + 1), 500))
        })
        .collect();
    producers.into_iter().for_each(|p| p.join().unwrap());
    assert!(
        reaches(&ran, 2_015, Duration::from_secs(10)),
        "eager: producers' tasks lost"
    );
    let seen = handle.submit_blocking(|log| log.seen.clone()).unwrap();
    assert_eq!(seen[..15], (0..15).collect::<Vec<_>>()[..]);
    assert_eq!(seen.len(), 2_015);
    for p in 1..=4 {
        let own: Vec<usize> = seen.iter().copied().filter(|i| i / 1_000 == p).collect();
        assert_eq!(
            own,
            (1_000 * p..1_000 * p + 500).collect::<Vec<_>>(),
            "producer {p}"
        );
    }
}
