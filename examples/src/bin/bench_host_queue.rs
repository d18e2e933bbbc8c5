//! The runner-thread queue between a producer thread and a device thread (cubecl-common's
//! channel, patched in `patches/cubecl-common`), with no GPU: a producer spends `client` µs
//! before queuing each task, the runner spends `server` µs running it, and the run's time is
//! compared with the larger of the two sums (the time if neither side ever waited for the
//! other). Each regime runs under both runner policies (`eager`: an idle runner takes what is
//! queued and is woken by the next enqueue; `batched`: upstream's, a runner waits for 32 tasks
//! or a flush and sleeps in 150 µs steps), interleaved `--repeats` times.
//!
//! `bench-host-queue [--tasks N] [--repeats R]` prints one JSON line per regime and policy
//! (median and range of time ÷ that bound) and a summary line.

use std::sync::Arc;
use std::time::{Duration, Instant};

use burn_zero_examples::cli::arg;
use cubecl::device::{DeviceId, DeviceService, ServerUtilitiesHandle};
use cubecl::device_handle::{DeviceHandle, set_eager_fetch};

/// The runner's state: the tasks it ran.
struct Counter(u64);

impl DeviceService for Counter {
    fn init(_: DeviceId) -> Self {
        Self(0)
    }
    fn utilities(&self) -> ServerUtilitiesHandle {
        Arc::new(())
    }
}

/// Busy for `d` (a sleep would hand the core away, which the threads being measured do not).
fn busy(d: Duration) {
    let start = Instant::now();
    while start.elapsed() < d {
        std::hint::spin_loop();
    }
}

/// Seconds for `tasks` tasks through a fresh runner, the producer queuing `burst` at a time.
fn run(device: u16, tasks: usize, client: Duration, server: Duration, burst: usize) -> f64 {
    let handle = DeviceHandle::<Counter>::new(DeviceId {
        type_id: 9_302,
        index_id: device,
    });
    handle.submit_blocking(|c| c.0 += 1).unwrap();
    let start = Instant::now();
    for i in 0..tasks {
        if i % burst == 0 {
            busy(client * burst as u32);
        }
        handle.submit(move |c| {
            busy(server);
            c.0 += 1;
        });
    }
    // The first blocking task, then the timed ones; this last one reads the count.
    let ran = handle.submit_blocking(|c| c.0).unwrap();
    assert_eq!(ran, tasks as u64 + 1);
    start.elapsed().as_secs_f64()
}

/// The number after `flag`, or `default`.
fn count(args: &[String], flag: &str, default: usize) -> usize {
    arg(args, flag).map_or(default, |v| {
        v.parse()
            .unwrap_or_else(|_| panic!("{flag} takes a number, not {v}"))
    })
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let tasks = count(&args, "--tasks", 20_000);
    let repeats = count(&args, "--repeats", 5);
    // (client µs, server µs, burst): producer-bound, runner-bound, even, and bursts.
    let regimes = [
        (3.0, 1.0, 1),
        (10.0, 2.0, 1),
        (1.0, 3.0, 1),
        (4.0, 4.0, 1),
        (3.0, 2.0, 64),
        (2.0, 3.0, 64),
    ];
    let mut device = 0u16;
    let mut summary = Vec::new();
    for (client_us, server_us, burst) in regimes {
        let client = Duration::from_secs_f64(client_us * 1e-6);
        let server = Duration::from_secs_f64(server_us * 1e-6);
        let bound = tasks as f64 * f64::max(client_us, server_us) * 1e-6;
        let mut ratios = [Vec::new(), Vec::new()];
        for _ in 0..repeats {
            for (p, eager) in [true, false].into_iter().enumerate() {
                set_eager_fetch(eager);
                device += 1;
                ratios[p].push(run(device, tasks, client, server, burst) / bound);
            }
        }
        for (p, policy) in ["eager", "batched"].into_iter().enumerate() {
            let r = &mut ratios[p];
            r.sort_by(f64::total_cmp);
            let median = r[r.len() / 2];
            println!(
                "{{\"client_us\": {client_us}, \"server_us\": {server_us}, \"burst\": {burst}, \
                 \"policy\": \"{policy}\", \"tasks\": {tasks}, \"over_bound_median\": {median:.4}, \
                 \"min\": {:.4}, \"max\": {:.4}}}",
                r[0],
                r[r.len() - 1]
            );
            summary.push(format!(
                "\"{client_us}/{server_us}/{burst}/{policy}\": {median:.4}"
            ));
        }
    }
    println!("{{\"summary\": {{{}}}}}", summary.join(", "));
}
