//! `offload_param {"device": "cpu"}`: the partitions in host memory, in one buffer per rank laid
//! out as the optimizer's partition, in the compute format. On CUDA the buffer is page-locked:
//! a gather uploads its partitions on the communication stream right before the all-gather that
//! reads them (`FlatComm::all_gather_group_from_host`), at PCIe speed and without stopping
//! burn's stream. After each step an offloaded optimizer writes the new parameters into it
//! (`ShardedParams::direct_outs`), or they come down into it by DMA.
//!
//! One buffer, rewritten at each step (and checkpoint load), where the device keeps each
//! step's values in new tensors: while it is rewritten the engine's model holds placeholders
//! (`ShardedParams::release_partitions`), and a partition that something else still holds (a
//! model the user kept from an earlier step) is copied out first, so it keeps its values.

use std::ops::Range;
use std::sync::{Arc, OnceLock, RwLock, Weak};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};

use crate::backend::PartitionSource;

/// The buffer's memory.
enum HostBytes {
    /// Ordinary memory, in words so that it is aligned for any element (`usize`: its bytes).
    Plain(Vec<u64>, usize),
    /// Page-locked, with the copy stream that fills it.
    #[cfg(feature = "cuda")]
    Pinned(super::param_host_cuda::Pinned),
}

impl HostBytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            // SAFETY: `n` of the vector's bytes, initialized (zeroed words).
            HostBytes::Plain(v, n) => unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), *n) },
            #[cfg(feature = "cuda")]
            HostBytes::Pinned(p) => p.as_slice(),
        }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            // SAFETY: as in `as_slice`, borrowed mutably.
            HostBytes::Plain(v, n) => unsafe {
                std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), *n)
            },
            #[cfg(feature = "cuda")]
            HostBytes::Pinned(p) => p.as_mut_slice(),
        }
    }
}

/// One rank's partitions, end to end.
struct HostStore {
    bytes: RwLock<HostBytes>,
    dtype: DType,
}

impl HostStore {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, HostBytes> {
        self.bytes.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Elements `range`, copied.
    fn copy(&self, range: Range<usize>) -> TensorData {
        let size = self.dtype.size();
        let bytes = self.read().as_slice()[range.start * size..range.end * size].to_vec();
        TensorData::from_bytes_vec(bytes, [range.len()], self.dtype)
    }

    /// Whether it holds `len` elements of `dtype`.
    fn fits(&self, len: usize, dtype: DType) -> bool {
        self.dtype == dtype && self.read().as_slice().len() == len * dtype.size()
    }
}

/// One parameter's partition in the rank's buffer (`range`: its elements there), or, once
/// the buffer was rewritten while this was still held, its values copied out.
pub(crate) struct HostPartition {
    store: Arc<HostStore>,
    range: Range<usize>,
    kept: OnceLock<TensorData>,
}

impl std::fmt::Debug for HostPartition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostPartition({:?}, {:?})", self.range, self.store.dtype)
    }
}

impl HostPartition {
    fn copy_out(&self) -> TensorData {
        self.store.copy(self.range.clone())
    }

    /// The partition's page-locked bytes, for an upload on the communication stream; `None`
    /// when the buffer is not page-locked or the values were copied out.
    ///
    /// The bytes stay valid until the buffer is next written (after each step, by
    /// `ShardedParams::set_host_partitions`, which first waits for every collective and for
    /// burn's stream): the caller uploads them before a collective whose ticket it waits for.
    #[cfg(feature = "cuda")]
    pub(crate) fn pinned(&self) -> Option<&[u8]> {
        if self.kept.get().is_some() {
            return None;
        }
        let bytes = self.store.read();
        match &*bytes {
            HostBytes::Plain(..) => None,
            HostBytes::Pinned(p) => {
                let size = self.store.dtype.size();
                let slice = &p.as_slice()[self.range.start * size..self.range.end * size];
                // SAFETY: the page-locked allocation lives as long as `self.store` (held by
                // `self`) and is only written after every upload from it is done (see above):
                // the lock guards the enum, not the bytes.
                Some(unsafe { std::slice::from_raw_parts(slice.as_ptr(), slice.len()) })
            }
        }
    }
}

impl PartitionSource for HostPartition {
    fn fetch(&self) -> Result<TensorData, String> {
        Ok(match self.kept.get() {
            Some(data) => data.clone(),
            None => self.copy_out(),
        })
    }
}

/// The rank's partition buffer and the partitions last written to it.
#[derive(Default)]
pub(super) struct HostParams {
    store: Option<Arc<HostStore>>,
    written: Vec<Weak<HostPartition>>,
    /// Bytes written since [`HostParams::begin`].
    at: usize,
    /// Partitions copied out before a rewrite, in all.
    copied_out: usize,
}

impl HostParams {
    /// Readies the buffer for `len` elements of `dtype`: the partitions written before and
    /// still held elsewhere are copied out, and the buffer is made (page-locked when `probe`
    /// is a CUDA tensor) or reused. The caller has waited for every upload from it.
    pub(super) fn begin<I: Backend>(
        &mut self,
        len: usize,
        dtype: DType,
        probe: Option<&Tensor<I, 1>>,
    ) -> Result<(), String> {
        for partition in self.written.drain(..).filter_map(|w| w.upgrade()) {
            let _ = partition.kept.set(partition.copy_out());
            self.copied_out += 1;
        }
        self.at = 0;
        if self.fits(len, dtype) {
            return Ok(());
        }
        let bytes = len * dtype.size();
        // Ours goes before the new one is taken (a partition copied out holds it until dropped).
        self.store = None;
        #[cfg(feature = "cuda")]
        match probe.and_then(|t| super::param_host_cuda::Pinned::new_for(t, bytes)) {
            Some(Ok(pinned)) => {
                self.store = Some(Arc::new(HostStore {
                    bytes: RwLock::new(HostBytes::Pinned(pinned)),
                    dtype,
                }));
                return Ok(());
            }
            // Gathers then upload through burn, on its stream: slower, still correct.
            Some(Err(e)) => crate::log::warn(&format!(
                "offload_param: the parameters' host buffer is not page-locked ({e})"
            )),
            None => {}
        }
        let _ = probe;
        self.store = Some(Arc::new(HostStore {
            bytes: RwLock::new(HostBytes::Plain(vec![0; bytes.div_ceil(8)], bytes)),
            dtype,
        }));
        Ok(())
    }

    /// Writes `parts` (1-D tensors in the buffer's dtype) one after another from where the
    /// last write ended: by DMA into page-locked memory, or read through burn.
    pub(super) fn write<I: Backend>(
        &mut self,
        parts: Vec<Tensor<I, 1>>,
        device: &I::Device,
    ) -> Result<(), String> {
        let store = self.store.as_ref().expect("begin made the buffer");
        let size = store.dtype.size();
        let mut bytes = store.bytes.write().unwrap_or_else(|e| e.into_inner());
        let len: usize = parts.iter().map(|p| p.dims()[0] * size).sum();
        let span = self.at..self.at + len;
        if span.end > bytes.as_slice().len() {
            return Err(format!(
                "{} bytes of parameter partitions past the {}-byte host buffer",
                span.end,
                bytes.as_slice().len()
            ));
        }
        self.at = span.end;
        #[cfg(feature = "cuda")]
        let parts = match &mut *bytes {
            HostBytes::Pinned(pinned) => match pinned.download::<I>(parts, span.start, device)? {
                None => return Ok(()),
                Some(parts) => parts,
            },
            HostBytes::Plain(..) => parts,
        };
        let _ = device;
        let mut at = span.start;
        for part in parts {
            let data = part.into_data();
            let values = data.as_bytes();
            bytes.as_mut_slice()[at..at + values.len()].copy_from_slice(values);
            at += values.len();
        }
        Ok(())
    }

    /// Elements `range` of the buffer (its dtype), copied.
    pub(super) fn read(&self, range: Range<usize>) -> TensorData {
        self.store
            .as_ref()
            .expect("begin made the buffer")
            .copy(range)
    }

    /// Whether the buffer holds `len` elements of `dtype`.
    pub(super) fn fits(&self, len: usize, dtype: DType) -> bool {
        self.store.as_ref().is_some_and(|s| s.fits(len, dtype))
    }

    /// The buffer's first byte, when it holds `len` elements of `dtype`: for a step that
    /// writes the new parameters into it directly. The caller has waited for every upload
    /// from it and lets nothing read it until it is done.
    pub(super) fn raw(&mut self, len: usize, dtype: DType) -> Option<*mut u8> {
        let store = self.store.as_ref().filter(|s| s.fits(len, dtype))?;
        let mut bytes = store.bytes.write().unwrap_or_else(|e| e.into_inner());
        Some(bytes.as_mut_slice().as_mut_ptr())
    }

    /// Partitions copied out before a rewrite so far.
    pub(super) fn copied_out(&self) -> usize {
        self.copied_out
    }

    /// The sources of the partitions written since [`HostParams::begin`], at `ranges`
    /// (elements of the buffer).
    pub(super) fn partitions(&mut self, ranges: &[Range<usize>]) -> Vec<Arc<HostPartition>> {
        let store = self.store.as_ref().expect("begin made the buffer");
        let partitions: Vec<Arc<HostPartition>> = ranges
            .iter()
            .map(|range| {
                Arc::new(HostPartition {
                    store: store.clone(),
                    range: range.clone(),
                    kept: OnceLock::new(),
                })
            })
            .collect();
        self.written = partitions.iter().map(Arc::downgrade).collect();
        partitions
    }
}
