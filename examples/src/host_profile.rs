//! Where the host's CPU time goes (feature `host-profile`): a sampling profile of every thread
//! of the process, written as a readable summary and as collapsed stacks.
//!
//! Training on the GPU is host-bound when the training thread cannot issue operations as fast as
//! the device runs them; this profile names the functions that thread spends its time in. It
//! samples CPU time (`SIGPROF`), so a thread blocked in a wait does not appear at all, while a
//! thread spinning on the GPU does. Symbols come from the binary's symbol table: stage the
//! binary unstripped.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::path::Path;

/// A running profile; [`HostProfile::write`] stops it and writes the results.
pub struct HostProfile {
    guard: pprof::ProfilerGuard<'static>,
}

/// One thread's samples: per function, the samples it was the innermost frame of (self) and
/// the samples it was anywhere on the stack of (total).
#[derive(Default)]
struct ThreadCounts {
    samples: isize,
    self_by_function: HashMap<String, isize>,
    total_by_function: HashMap<String, isize>,
    self_by_crate: HashMap<String, isize>,
}

impl HostProfile {
    /// Starts sampling every thread at `hertz` samples per second of CPU time.
    pub fn start(hertz: i32) -> Self {
        let guard = pprof::ProfilerGuardBuilder::default()
            .frequency(hertz)
            // Unwinding from inside the unwinder itself can deadlock; libc (malloc, memcpy) is
            // kept, as its time is part of what the host spends.
            .blocklist(&["libgcc", "libunwind", "vdso"])
            .build()
            .unwrap_or_else(|e| panic!("cannot start the host profiler: {e}"));
        Self { guard }
    }

    /// Writes `path` (per thread: samples, the top functions by self and by total samples, self
    /// samples per crate) and `path.collapsed` (`thread;root;…;leaf count`, the input of any
    /// flame-graph tool).
    pub fn write(self, path: &Path, top: usize) -> std::io::Result<()> {
        let report = self
            .guard
            .report()
            .build()
            .map_err(|e| std::io::Error::other(format!("host profile report: {e}")))?;
        let mut threads: BTreeMap<String, ThreadCounts> = BTreeMap::new();
        let mut collapsed = String::new();
        for (frames, &count) in &report.data {
            let thread = frames.thread_name_or_id();
            // Innermost first, as sampled; one name per frame (the symbol table has no inlines).
            let names: Vec<String> = frames
                .frames
                .iter()
                .filter_map(|symbols| symbols.last().map(|s| short_name(&s.name())))
                .collect();
            let counts = threads.entry(thread.clone()).or_default();
            counts.samples += count;
            if let Some(leaf) = names.first() {
                *counts.self_by_function.entry(leaf.clone()).or_default() += count;
                *counts.self_by_crate.entry(crate_of(leaf)).or_default() += count;
            }
            let mut seen = HashSet::new();
            for name in &names {
                if seen.insert(name) {
                    *counts.total_by_function.entry(name.clone()).or_default() += count;
                }
            }
            let stack: Vec<&str> = names.iter().rev().map(String::as_str).collect();
            let _ = writeln!(collapsed, "{thread};{} {count}", stack.join(";"));
        }
        let mut text = String::new();
        let mut by_size: Vec<(&String, &ThreadCounts)> = threads.iter().collect();
        by_size.sort_by_key(|(_, c)| std::cmp::Reverse(c.samples));
        let all: isize = by_size.iter().map(|(_, c)| c.samples).sum();
        let _ = writeln!(text, "{all} samples in {} threads", by_size.len());
        for (thread, counts) in by_size {
            let share = |n: isize| 100.0 * n as f64 / counts.samples.max(1) as f64;
            let _ = writeln!(text, "\n=== thread {thread}: {} samples", counts.samples);
            for (title, table, rows) in [
                ("self, by crate", &counts.self_by_crate, top),
                ("self, by function", &counts.self_by_function, top),
                ("total, by function", &counts.total_by_function, 2 * top),
            ] {
                let _ = writeln!(text, "--- {title}");
                for (name, n) in largest(table, rows) {
                    let _ = writeln!(text, "{:6.2}% {n:7} {name}", share(n));
                }
            }
        }
        std::fs::write(path, text)?;
        std::fs::write(path.with_extension("collapsed"), collapsed)
    }
}

/// The `rows` largest entries of `table`, largest first.
fn largest(table: &HashMap<String, isize>, rows: usize) -> Vec<(String, isize)> {
    let mut entries: Vec<(String, isize)> = table.iter().map(|(k, &v)| (k.clone(), v)).collect();
    entries.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    entries.truncate(rows);
    entries
}

/// A demangled name without its trailing `::h0123…` hash.
fn short_name(name: &str) -> String {
    match name.rfind("::h") {
        Some(i) if name[i + 3..].chars().all(|c| c.is_ascii_hexdigit()) => name[..i].to_string(),
        _ => name.to_string(),
    }
}

/// The crate a demangled Rust name belongs to (`<burn_fusion::X as T>::f` → `burn_fusion`), or
/// `other` for C symbols.
fn crate_of(name: &str) -> String {
    let path = name
        .trim_start_matches(['<', '_', '&'])
        .trim_start_matches("mut ");
    match path.find("::") {
        Some(i) if path[..i].chars().all(|c| c.is_alphanumeric() || c == '_') => {
            path[..i].to_string()
        }
        _ => "other".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_lose_their_hash_and_know_their_crate() {
        assert_eq!(
            short_name("burn_fusion::stream::execute::h0123abcd"),
            "burn_fusion::stream::execute"
        );
        assert_eq!(short_name("memcpy"), "memcpy");
        assert_eq!(
            crate_of("<burn_fusion::Fusion<B> as burn_backend::Backend>::sync"),
            "burn_fusion"
        );
        assert_eq!(crate_of("alloc::vec::Vec<T>::push"), "alloc");
        assert_eq!(crate_of("__memmove_avx_unaligned_erms"), "other");
    }

    #[test]
    fn largest_entries_come_first() {
        let table = HashMap::from([
            ("a".to_string(), 1),
            ("b".to_string(), 5),
            ("c".to_string(), 3),
        ]);
        let names: Vec<String> = largest(&table, 2).into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["b", "c"]);
    }
}
