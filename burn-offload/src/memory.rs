//! Host buffers for partitions streamed through every step: large, zeroed, and (on Linux)
//! advised for transparent huge pages before their first touch, so CPU-Adam's passes over
//! gigabytes take far fewer TLB misses. Where the kernel has huge pages off, the advice is a
//! no-op and the buffer is an ordinary zeroed vector.

/// Bytes of a huge page on x86-64 and aarch64 with 4 KiB base pages.
const HUGE_PAGE: usize = 2 << 20;

/// `n` zeroed f32s, advised for huge pages when `huge` (see [`advise_huge_pages`]).
pub fn zeroed_f32(n: usize, huge: bool) -> Vec<f32> {
    let mut v = vec![0.0f32; n];
    if huge {
        advise_huge_pages(&mut v);
    }
    v
}

/// `n` zeroed bf16s, mapped lazily as a large `vec![0u16; n]` is (a `vec![bf16::ZERO; n]`
/// would write every element).
pub fn zeroed_bf16(n: usize) -> Vec<half::bf16> {
    // SAFETY: bf16 is a transparent u16 whose zero bits are +0.
    unsafe { zeroed_halfwords(n) }
}

/// `n` zeroed f16s, as [`zeroed_bf16`].
pub fn zeroed_f16(n: usize) -> Vec<half::f16> {
    // SAFETY: f16 is a transparent u16 whose zero bits are +0.
    unsafe { zeroed_halfwords(n) }
}

/// # Safety
/// `T` must be a transparent `u16` (same size and alignment, every bit pattern valid).
unsafe fn zeroed_halfwords<T>(n: usize) -> Vec<T> {
    let mut v = std::mem::ManuallyDrop::new(vec![0u16; n]);
    let (ptr, len, cap) = (v.as_mut_ptr(), v.len(), v.capacity());
    // SAFETY: the caller's layout guarantee; the vector's allocation is handed over whole.
    unsafe { Vec::from_raw_parts(ptr.cast::<T>(), len, cap) }
}

/// Asks the kernel to back the huge-page-aligned interior of `buf` with transparent huge
/// pages; effective for pages not yet touched (a fresh `vec![0; n]` of a large `n` is
/// untouched: the allocator maps zero pages lazily). Returns whether the kernel accepted.
pub fn advise_huge_pages<T>(buf: &mut [T]) -> bool {
    #[cfg(target_os = "linux")]
    {
        let start = buf.as_mut_ptr() as usize;
        let end = start + std::mem::size_of_val(buf);
        let first = start.next_multiple_of(HUGE_PAGE);
        let last = end / HUGE_PAGE * HUGE_PAGE;
        if last <= first {
            return false;
        }
        // SAFETY: the range lies inside `buf`'s allocation; MADV_HUGEPAGE changes how pages
        // are backed, never their contents.
        unsafe {
            libc::madvise(
                first as *mut libc::c_void,
                last - first,
                libc::MADV_HUGEPAGE,
            ) == 0
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (buf, HUGE_PAGE);
        false
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn advised_buffers_are_zeroed_and_small_ones_are_left_alone() {
        let v = super::zeroed_f32(3 << 20, true);
        assert!(v.iter().all(|x| *x == 0.0));
        assert!(!super::advise_huge_pages(&mut [0u8; 100]));
    }
}
