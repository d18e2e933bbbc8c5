//! The swap's disk side: O_DIRECT-aligned buffers, the regions' checksum, opening swap files
//! and checking the room for them.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use super::{SwapError, io_err};

/// Alignment of O_DIRECT buffers, offsets and lengths.
pub(super) const ALIGN: usize = 4096;

/// A zeroed, 4 KiB-aligned buffer of f32 (what O_DIRECT needs).
pub struct AlignedBuf {
    pub(super) ptr: *mut f32,
    len: usize,
    pub(super) bytes: usize,
}

// SAFETY: the buffer owns its allocation; moving it between threads moves the ownership.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    pub(super) fn new(len: usize) -> Self {
        let bytes = (len * 4).next_multiple_of(ALIGN).max(ALIGN);
        let layout = std::alloc::Layout::from_size_align(bytes, ALIGN).expect("layout");
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) } as *mut f32;
        assert!(
            !ptr.is_null(),
            "out of host memory for a {bytes}-byte swap buffer"
        );
        Self { ptr, len, bytes }
    }

    /// The values.
    pub fn as_slice(&self) -> &[f32] {
        // SAFETY: `ptr` holds `len` initialized f32 (zeroed at allocation).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The values, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        // SAFETY: as above, and `&mut self` is unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    pub(super) fn region(&self) -> &[u8] {
        // SAFETY: `bytes` bytes are allocated and initialized.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.bytes) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = std::alloc::Layout::from_size_align(self.bytes, ALIGN).expect("layout");
        // SAFETY: allocated with this layout in `new`.
        unsafe { std::alloc::dealloc(self.ptr as *mut u8, layout) }
    }
}

/// A 64-bit checksum of a region (multiply-rotate over 8-byte words in four independent lanes,
/// so the multiplies overlap; not cryptographic, fast).
pub(super) fn checksum(bytes: &[u8]) -> u64 {
    const K: u64 = 0xff51_afd7_ed55_8ccd;
    let mix = |h: u64, word: u64| (h ^ word).wrapping_mul(K).rotate_left(29);
    let seed = 0x9e37_79b9_7f4a_7c15u64 ^ bytes.len() as u64;
    let mut lanes = [seed, seed ^ 1, seed ^ 2, seed ^ 3];
    let mut blocks = bytes.chunks_exact(32);
    for block in &mut blocks {
        for (lane, word) in lanes.iter_mut().zip(block.chunks_exact(8)) {
            *lane = mix(*lane, u64::from_le_bytes(word.try_into().expect("8 bytes")));
        }
    }
    let mut h = lanes.iter().fold(seed, |h, lane| mix(h, *lane));
    for chunk in blocks.remainder().chunks(8) {
        let mut word = [0u8; 8];
        word[..chunk.len()].copy_from_slice(chunk);
        h = mix(h, u64::from_le_bytes(word));
    }
    h
}

/// Opens (creates) a swap file, with O_DIRECT where the file system supports it.
pub(super) fn open_swap(path: &Path) -> Result<(File, bool), SwapError> {
    let open = |flags| {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(flags)
            .open(path)
    };
    match open(libc::O_DIRECT) {
        Ok(f) => Ok((f, true)),
        // tmpfs and some overlays refuse O_DIRECT: the page cache then sits in between.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            open(0).map(|f| (f, false)).map_err(|e| io_err(path, e))
        }
        Err(e) => Err(io_err(path, e)),
    }
}

/// Checks `root` exists, creates `dir` in it and checks it can hold `needed` bytes more.
pub(super) fn check_room(root: &Path, dir: &Path, needed: u64) -> Result<(), SwapError> {
    if !root.is_dir() {
        return Err(io_err(
            root,
            "`nvme_path` does not exist (or is not a directory)",
        ));
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| io_err(dir, format!("cannot create the swap directory: {e}")))?;
    let probe = dir.join(".burn-zero-write-test");
    std::fs::write(&probe, b"ok").map_err(|e| io_err(dir, format!("not writable: {e}")))?;
    let _ = std::fs::remove_file(&probe);
    let c =
        std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).map_err(|e| io_err(dir, e))?;
    // SAFETY: a zeroed statvfs is a valid out-parameter; `c` is NUL-terminated.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } == 0 {
        let free = st.f_bavail as u64 * st.f_frsize as u64;
        if free < needed {
            return Err(io_err(
                dir,
                format!(
                    "too small: the optimizer swap needs {:.2} GB, {:.2} GB are free",
                    needed as f64 / 1e9,
                    free as f64 / 1e9
                ),
            ));
        }
    }
    Ok(())
}
