//! Real processes for the multi-process tests: the launcher starting dist-workers on a free
//! port. The binaries' paths come from the test (`env!("CARGO_BIN_EXE_…")` exists there only).

use std::process::Command;

pub use burn_zero::dist::free_port;

/// `launcher` starting `nproc` copies of `worker` with `worker_args`, each rank giving up on
/// the others after 60 s.
pub fn launcher(launcher: &str, worker: &str, nproc: usize, worker_args: &[&str]) -> Command {
    let mut command = Command::new(launcher);
    command
        .args([
            "--nproc-per-node",
            &nproc.to_string(),
            "--master-port",
            &free_port().to_string(),
            "--grace",
            "2",
            "--",
        ])
        .arg(worker)
        .args(worker_args)
        .env("BURN_ZERO_TIMEOUT", "60");
    command
}
