//! Choosing a rendezvous port for jobs started side by side on one host.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};

/// A TCP port free at the time of asking, outside the kernel's ephemeral range and never given
/// twice by one process. A port from `bind(":0")` is ephemeral: between this call and rank 0's
/// bind, the kernel may hand it to another job's data socket or connection (tests start jobs
/// in parallel), which once made rank 0 fail with "address in use" and that job's ranks reach
/// the other's data port.
pub fn free_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let (ephemeral_low, ephemeral_high) =
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|r| {
                let mut ends = r.split_whitespace().map(|v| v.parse::<u32>().ok());
                Some((ends.next()??, ends.next()??))
            })
            .unwrap_or((32768, 60999));
    // Below the ephemeral range when it leaves room there, else above it.
    let (low, span) = if ephemeral_low >= 11_000 {
        (10_000, ephemeral_low - 10_000)
    } else {
        (
            ephemeral_high + 1,
            65_535u32.saturating_sub(ephemeral_high).max(1),
        )
    };
    // Processes that start at once (other checkouts, other test binaries) start apart and
    // walk with different strides.
    let start = std::process::id() % span;
    // A prime stride visits every port of the span once, unless it divides the span.
    let stride = [7919, 7907, 7901, 7883][std::process::id() as usize % 4];
    let stride = if span % stride == 0 { 1 } else { stride };
    for _ in 0..span {
        let k = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = low + (start + k.wrapping_mul(stride)) % span;
        if let Ok(port) = u16::try_from(port)
            && TcpListener::bind(("127.0.0.1", port)).is_ok()
        {
            return port;
        }
    }
    panic!("no free TCP port in {low}..{}", low + span)
}
