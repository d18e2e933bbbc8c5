//! The page-locked partition buffer of [`super::param_host`] on CUDA: allocated once, filled
//! after each step by DMA from the new partitions on a copy stream of its own.

use std::sync::Arc;

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use cudarc::driver::{CudaContext, CudaStream, PinnedHostSlice, result};

use crate::backend::cuda::{CudaBuffer, cuda_buffer};
use crate::engine::offload_cuda::copy_streams;

/// Page-locked bytes and the stream that copies into them.
pub(super) struct Pinned {
    /// The allocation `ptr` points into (freed when dropped).
    _memory: PinnedHostSlice<u8>,
    ptr: *mut u8,
    len: usize,
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
}

// SAFETY: `ptr` is `_memory`'s allocation (Send and Sync itself), reached only through `&self`
// for reads and `&mut self` for writes.
unsafe impl Send for Pinned {}
unsafe impl Sync for Pinned {}

impl Pinned {
    /// `bytes` of page-locked memory for the GPU of `probe`; `None` when `probe` is not a
    /// CUDA tensor.
    pub(super) fn new_for<I: Backend>(
        probe: &Tensor<I, 1>,
        bytes: usize,
    ) -> Option<Result<Self, String>> {
        let buffer = cuda_buffer::<I>(&probe.clone().into_primitive().tensor())?;
        let ordinal = buffer._keep.device.index;
        Some((|| {
            let (context, [stream]) = copy_streams::<1>(ordinal)?;
            // Flags 0: cached memory, as the CPU reads it when a partition is copied out.
            // SAFETY: every byte is written by `download` before a gather reads it.
            let mut memory = unsafe { context.alloc_pinned_with_flags::<u8>(bytes.max(1), 0) }
                .map_err(|e| format!("{bytes} bytes of page-locked host memory: {e:?}"))?;
            let ptr = memory
                .as_mut_ptr()
                .map_err(|e| format!("page-locked host memory: {e:?}"))?;
            Ok(Self {
                _memory: memory,
                ptr,
                len: bytes,
                context,
                stream,
            })
        })())
    }

    pub(super) fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` bytes of `_memory`, alive as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub(super) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as for `as_slice`, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Copies `parts` end to end into the buffer from byte `at` by DMA, once burn's stream has
    /// finished them; the parts back when any is not a contiguous CUDA tensor (the caller
    /// reads them through burn instead).
    pub(super) fn download<I: Backend>(
        &mut self,
        parts: Vec<Tensor<I, 1>>,
        at: usize,
        device: &I::Device,
    ) -> Result<Option<Vec<Tensor<I, 1>>>, String> {
        let buffers: Option<Vec<CudaBuffer>> = parts
            .iter()
            .map(|p| cuda_buffer::<I>(&p.clone().into_primitive().tensor()))
            .collect();
        let Some(buffers) = buffers else {
            return Ok(Some(parts));
        };
        I::sync(device).map_err(|e| format!("the compute stream failed: {e:?}"))?;
        self.context
            .bind_to_thread()
            .map_err(|e| format!("{e:?}"))?;
        let stream = self.stream.cu_stream();
        let mut at = at;
        for b in &buffers {
            let n = b.buf.len * b.buf.dtype.size();
            let dst = &mut self.as_mut_slice()[at..at + n];
            // SAFETY: the source is a complete (synchronized above) CUDA buffer of `n` bytes,
            // held in `buffers` until the stream is synchronized below; the destination is
            // page-locked and not read before then.
            unsafe { result::memcpy_dtoh_async(dst, b.buf.ptr, stream) }
                .map_err(|e| format!("a parameter partition down to host memory: {e:?}"))?;
            at += n;
        }
        self.stream
            .synchronize()
            .map_err(|e| format!("a parameter partition down to host memory: {e:?}"))?;
        drop(buffers);
        Ok(None)
    }
}

/// Waits for the device before the memory is freed: an upload on NCCL's stream may still read
/// it when the engine is dropped mid-step.
impl Drop for Pinned {
    fn drop(&mut self) {
        let _ = self.context.bind_to_thread();
        let _ = self.context.synchronize();
    }
}
