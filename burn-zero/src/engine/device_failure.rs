//! A panic in one of cubecl's device threads (named `DSU-…` or `DSD-…`: a failed allocation,
//! say) never reaches the caller: the operations after it read memory that was never written,
//! and training went on with a NaN loss (seen on an H200: a 37.5 GB page that did not fit, then
//! "Memory page 0 doesn't exist", then NaN at every step, exit code 0). The engine installs a
//! panic hook that records such a panic, and every `backward` and `step` fails with it instead.

use std::sync::{Mutex, Once};

use super::EngineError;

static FAILURE: Mutex<Option<String>> = Mutex::new(None);
static WATCH: Once = Once::new();

/// Whether a thread of this name is one of cubecl's device service threads.
fn is_device_thread(name: Option<&str>) -> bool {
    name.is_some_and(|n| n.starts_with("DSU-") || n.starts_with("DSD-"))
}

/// Installs the hook once per process (after whatever hook was there, which still runs).
pub(crate) fn watch() {
    WATCH.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let thread = std::thread::current();
            if is_device_thread(thread.name()) {
                let mut failure = FAILURE.lock().unwrap_or_else(|e| e.into_inner());
                failure.get_or_insert_with(|| {
                    let name = thread.name().unwrap_or_default();
                    let at = info
                        .location()
                        .map(|l| format!(" at {l}"))
                        .unwrap_or_default();
                    let payload = info.payload();
                    let message = payload
                        .downcast_ref::<&str>()
                        .copied()
                        .or_else(|| payload.downcast_ref::<String>().map(String::as_str));
                    match message {
                        Some(message) => format!("thread {name}{at}: {message}"),
                        None => format!("thread {name}{at}"),
                    }
                });
            }
            previous(info)
        }));
    });
}

/// The first device-thread panic of this process, as an error.
pub(crate) fn check() -> Result<(), EngineError> {
    let failure = FAILURE.lock().unwrap_or_else(|e| e.into_inner());
    match failure.as_ref() {
        Some(failure) => Err(EngineError::Device(format!(
            "the GPU runtime failed ({failure}); nothing computed since is valid, so training \
             stops here (an allocation that failed is usually out of device memory)"
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::is_device_thread;

    #[test]
    fn device_threads_are_known_by_name() {
        assert!(is_device_thread(Some("DSD-1-0")) && is_device_thread(Some("DSU-3-2")));
        assert!(!is_device_thread(Some("main")) && !is_device_thread(None));
        assert!(!is_device_thread(Some("DSDX")));
    }
}
