//! Messages for the user: through `tracing` when the program installed a subscriber, else on
//! stderr, so that a warning is never lost because nobody set up logging.

/// A warning (unknown config keys, deprecated forms, ...).
pub(crate) fn warn(message: &str) {
    if tracing::dispatcher::has_been_set() {
        tracing::warn!("{message}");
    } else {
        eprintln!("burn-zero warning: {message}");
    }
}

/// Information worth seeing once (the resolved config, progress).
pub(crate) fn info(message: &str) {
    if tracing::dispatcher::has_been_set() {
        tracing::info!("{message}");
    } else {
        eprintln!("burn-zero: {message}");
    }
}

/// Whether the stream-ordering trace is on (`BURN_ZERO_TRACE_ORDER=1`): a debugging aid for a
/// hung device step, read once and announced on stderr when set.
#[cfg(feature = "cuda")]
pub(crate) fn tracing_order() -> bool {
    static ON: std::sync::LazyLock<bool> = std::sync::LazyLock::new(|| {
        let on = std::env::var("BURN_ZERO_TRACE_ORDER").is_ok_and(|v| v == "1");
        if on {
            eprintln!("burn-zero: BURN_ZERO_TRACE_ORDER=1: tracing every flag handshake");
        }
        on
    });
    *ON
}

/// One line of the stream-ordering trace, on stderr and flushed: the thread, a clock in
/// milliseconds since the first line, and `message` (built only when tracing is on).
#[cfg(feature = "cuda")]
pub(crate) fn trace_order(message: impl FnOnce() -> String) {
    if !tracing_order() {
        return;
    }
    static START: std::sync::LazyLock<std::time::Instant> =
        std::sync::LazyLock::new(std::time::Instant::now);
    let thread = std::thread::current();
    let line = format!(
        "[order {:>9.3} {}] {}\n",
        START.elapsed().as_secs_f64() * 1e3,
        thread.name().unwrap_or("?"),
        message()
    );
    use std::io::Write;
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(line.as_bytes());
    let _ = err.flush();
}
