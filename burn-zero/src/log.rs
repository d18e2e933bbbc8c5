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

/// A switch that is on unless the environment variable `$var` is `0`, read once per use site
/// (for comparisons on the device: `BURN_ZERO_CUBLASLT_IN_STREAM=0` and the like).
macro_rules! env_switch_on {
    ($var:literal) => {{
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| std::env::var($var).map_or(true, |v| v != "0"))
    }};
}
pub(crate) use env_switch_on;
