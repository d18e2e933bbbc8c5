//! Choosing a rendezvous port for jobs started side by side on one host.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};

/// A TCP port free at the time of asking, below the kernel's ephemeral range and never given
/// twice by one process. A port from `bind(":0")` is ephemeral: between this call and rank 0's
/// bind, the kernel may hand it to another job's data socket or connection (tests start jobs
/// in parallel), which once made rank 0 fail with "address in use" and that job's ranks reach
/// the other's data port.
pub fn free_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let (low, span) = (10_000u16, ephemeral_low.saturating_sub(10_000).max(1_000));
    // Test processes that run at once (other checkouts, other binaries) start apart.
    let start = std::process::id() % u32::from(span);
    for _ in 0..span {
        let offset = (start + NEXT.fetch_add(1, Ordering::Relaxed)) % u32::from(span);
        let port = low + offset as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free TCP port in {low}..{}", low + span)
}
