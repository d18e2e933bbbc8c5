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
