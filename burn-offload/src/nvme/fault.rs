//! A disk that fills up, for tests: swap files are sparse (`set_len` at creation), so a disk
//! another process fills later refuses a step's writes with `ENOSPC`. Scoped by a marker in
//! the file's path (each engine swaps in a directory of its own), so tests running side by
//! side in one process do not see each other's.

use std::path::Path;
use std::sync::Mutex;

/// Markers and the bytes still writable under each.
static FULL: Mutex<Vec<(String, u64)>> = Mutex::new(Vec::new());

/// From now on, writes to swap files whose path contains `marker` fail as on a full disk once
/// `after` more bytes were written to them.
#[doc(hidden)]
pub fn inject_full_disk(marker: &str, after: u64) {
    let mut full = FULL.lock().unwrap_or_else(|e| e.into_inner());
    full.retain(|(m, _)| m != marker);
    full.push((marker.to_string(), after));
}

/// Whether a write of `len` bytes to `path` finds the disk full (spending what is left).
pub(super) fn disk_full(path: &Path, len: u64) -> bool {
    let mut full = FULL.lock().unwrap_or_else(|e| e.into_inner());
    if full.is_empty() {
        return false;
    }
    let path = path.to_string_lossy();
    match full.iter_mut().find(|(m, _)| path.contains(m.as_str())) {
        Some((_, left)) if *left >= len => {
            *left -= len;
            false
        }
        Some(_) => true,
        None => false,
    }
}
