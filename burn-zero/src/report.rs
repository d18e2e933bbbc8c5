//! `burn-zero report`: what a user needs when something fails (DeepSpeed's `ds_report`):
//! GPUs and driver, whether libnccl and NVRTC load and their versions, io_uring, cores, memory.
//! Libraries are probed with `dlopen`, so the report works in any build, with or without GPUs.

use std::ffi::{CStr, CString, c_char, c_int, c_void};

/// A loaded shared library (closed on drop).
struct Library(*mut c_void);

impl Library {
    fn open(candidates: &[&str]) -> Option<(Self, String)> {
        candidates.iter().find_map(|name| {
            let c = CString::new(*name).ok()?;
            // SAFETY: dlopen with a valid C string; a null result means "not found".
            let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            (!handle.is_null()).then(|| (Library(handle), name.to_string()))
        })
    }

    /// The exported function `symbol` as the function-pointer type `F`.
    ///
    /// # Safety
    /// `F` must be the symbol's true C signature, and the function must not outlive `self`.
    unsafe fn function<F: Copy>(&self, symbol: &str) -> Option<F> {
        assert_eq!(
            size_of::<F>(),
            size_of::<*mut c_void>(),
            "F is a function pointer"
        );
        let c = CString::new(symbol).ok()?;
        // SAFETY: dlsym on a live handle with a valid C string.
        let address = unsafe { libc::dlsym(self.0, c.as_ptr()) };
        // SAFETY: the caller vouches that F is the symbol's signature; sizes checked above.
        (!address.is_null())
            .then(|| unsafe { std::mem::transmute_copy::<*mut c_void, F>(&address) })
    }
}

impl Drop for Library {
    fn drop(&mut self) {
        // SAFETY: closing the handle this value opened.
        unsafe { libc::dlclose(self.0) };
    }
}

fn cuda_report() -> Vec<String> {
    let Some((cuda, name)) = Library::open(&["libcuda.so.1", "libcuda.so"]) else {
        return vec!["CUDA driver: libcuda not found (no NVIDIA driver on this machine)".into()];
    };
    type Init = unsafe extern "C" fn(u32) -> c_int;
    type GetInt = unsafe extern "C" fn(*mut c_int) -> c_int;
    type DeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
    type DeviceName = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;
    type DeviceMem = unsafe extern "C" fn(*mut usize, c_int) -> c_int;
    // SAFETY: the signatures are the CUDA driver API's.
    let symbols = unsafe {
        (
            cuda.function::<Init>("cuInit"),
            cuda.function::<GetInt>("cuDriverGetVersion"),
            cuda.function::<GetInt>("cuDeviceGetCount"),
            cuda.function::<DeviceGet>("cuDeviceGet"),
            cuda.function::<DeviceName>("cuDeviceGetName"),
            cuda.function::<DeviceMem>("cuDeviceTotalMem_v2"),
        )
    };
    let (Some(init), Some(version), Some(count), Some(get), Some(dev_name), Some(mem)) = symbols
    else {
        return vec![format!("CUDA driver: {name} lacks the expected symbols")];
    };
    let mut lines = Vec::new();
    // SAFETY: calls through the driver API's own signatures with valid pointers.
    unsafe {
        let status = init(0);
        if status != 0 {
            return vec![format!(
                "CUDA driver: {name} loaded but cuInit failed with error {status}"
            )];
        }
        let (mut v, mut n) = (0, 0);
        version(&mut v);
        count(&mut n);
        lines.push(format!(
            "CUDA driver: {name}, CUDA {}.{}, {n} GPU(s)",
            v / 1000,
            (v % 1000) / 10
        ));
        for i in 0..n {
            let mut device = 0;
            get(&mut device, i);
            let mut buf = [0 as c_char; 256];
            dev_name(buf.as_mut_ptr(), 256, device);
            let mut bytes = 0usize;
            mem(&mut bytes, device);
            let gpu = CStr::from_ptr(buf.as_ptr()).to_string_lossy();
            lines.push(format!(
                "  GPU {i}: {gpu}, {:.1} GiB",
                bytes as f64 / (1u64 << 30) as f64
            ));
        }
    }
    lines
}

fn nccl_report() -> String {
    let Some((nccl, name)) = Library::open(&["libnccl.so.2", "libnccl.so"]) else {
        return "NCCL: libnccl not found on the loader path (GPU runs need it; CPU runs use TCP)"
            .into();
    };
    // SAFETY: ncclGetVersion(int*) is NCCL's signature.
    let get =
        unsafe { nccl.function::<unsafe extern "C" fn(*mut c_int) -> c_int>("ncclGetVersion") };
    let Some(get) = get else {
        return format!("NCCL: {name} has no ncclGetVersion");
    };
    let mut v: c_int = 0;
    // SAFETY: a valid out-pointer.
    unsafe { get(&mut v) };
    format!(
        "NCCL: {name}, version {}.{}.{}",
        v / 10000,
        (v % 10000) / 100,
        v % 100
    )
}

fn nvrtc_report() -> String {
    let candidates = [
        "libnvrtc.so.13",
        "libnvrtc.so.12",
        "libnvrtc.so",
        "/usr/local/cuda/targets/x86_64-linux/lib/libnvrtc.so.13",
        "/usr/local/cuda/lib64/libnvrtc.so",
    ];
    let Some((nvrtc, name)) = Library::open(&candidates) else {
        return "NVRTC: not found (burn's CUDA backend compiles kernels with it)".into();
    };
    // SAFETY: nvrtcVersion(int*, int*) is NVRTC's signature.
    let get = unsafe {
        nvrtc.function::<unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int>("nvrtcVersion")
    };
    let Some(get) = get else {
        return format!("NVRTC: {name} has no nvrtcVersion");
    };
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: valid out-pointers.
    unsafe { get(&mut major, &mut minor) };
    format!("NVRTC: {name}, version {major}.{minor}")
}

fn io_uring_report() -> String {
    let mut params = [0u8; 120]; // struct io_uring_params
    // SAFETY: io_uring_setup(entries, params*) with a zeroed parameter block of the right size.
    let fd = unsafe { libc::syscall(libc::SYS_io_uring_setup, 1u32, params.as_mut_ptr()) };
    if fd >= 0 {
        // SAFETY: closing the ring this call created.
        unsafe { libc::close(fd as c_int) };
        "io_uring: available".into()
    } else {
        format!(
            "io_uring: unavailable ({}) — NVMe offload needs it",
            std::io::Error::last_os_error()
        )
    }
}

fn memory_report() -> String {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |key: &str| {
        meminfo
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
    };
    match (field("MemTotal:"), field("MemAvailable:")) {
        (Some(total), Some(available)) => format!(
            "memory: {:.1} GiB total, {:.1} GiB available",
            total / 1048576.0,
            available / 1048576.0
        ),
        _ => "memory: unknown".into(),
    }
}

/// The report, one fact per line.
pub fn report() -> String {
    let mut lines = vec![
        format!(
            "burn-zero {} (burn 0.21.0), stages compiled: {:?}",
            env!("CARGO_PKG_VERSION"),
            crate::config::compiled_stages()
        ),
        format!(
            "CPU cores: {}",
            std::thread::available_parallelism().map_or(0, |n| n.get())
        ),
        memory_report(),
        io_uring_report(),
    ];
    lines.extend(cuda_report());
    lines.push(nccl_report());
    lines.push(nvrtc_report());
    let vars: Vec<String> = std::env::vars()
        .filter(|(k, _)| {
            [
                "RANK",
                "LOCAL_RANK",
                "WORLD_SIZE",
                "LOCAL_WORLD_SIZE",
                "MASTER_ADDR",
                "MASTER_PORT",
                "CUDA_VISIBLE_DEVICES",
                "BURN_ZERO_TIMEOUT",
            ]
            .contains(&k.as_str())
                || k.starts_with("NCCL_")
        })
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    lines.push(format!(
        "environment: {}",
        if vars.is_empty() {
            "(none of the launcher/NCCL variables set)".into()
        } else {
            vars.join(" ")
        }
    ));
    lines.join("\n") + "\n"
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_report_answers_every_question_without_a_gpu() {
        let text = super::report();
        for topic in [
            "CPU cores:",
            "memory:",
            "io_uring:",
            "CUDA driver:",
            "NCCL:",
            "NVRTC:",
            "environment:",
        ] {
            assert!(text.contains(topic), "{topic} missing:\n{text}");
        }
    }
}
