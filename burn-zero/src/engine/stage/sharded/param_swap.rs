//! `offload_param {"device": "nvme"}`: the sharded partitions in swap files (ZeRO-Infinity).
//!
//! A handle must keep its step's values, as it does on the device and in host memory, while a
//! swap file holds one set of values. So partitions alternate between two files by version:
//! writing version `v` rewrites the file of version `v − 2`, whose handles are normally gone
//! (the model holds version `v − 1`'s until `v`'s replace them); a handle of `v − 2` still
//! alive (a model the user kept) has its partition read into host memory first.

use std::sync::{Arc, Mutex, OnceLock, Weak};

use burn::tensor::{DType, TensorData};
use burn_offload::{NvmeStore, SwapConfig, SwapError};

use crate::backend::PartitionSource;

/// A partition's elements in one of the rank's parameter swap files, or in host memory once
/// its file is to be rewritten while a handle still holds it.
struct SwappedPartition {
    store: Arc<Mutex<NvmeStore>>,
    range: core::ops::Range<usize>,
    dtype: DType,
    kept: OnceLock<TensorData>,
}

impl std::fmt::Debug for SwappedPartition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SwappedPartition({:?}, {:?})", self.range, self.dtype)
    }
}

impl SwappedPartition {
    fn read(&self) -> Result<TensorData, SwapError> {
        let mut store = self.store.lock().unwrap_or_else(|e| e.into_inner());
        let values = store.read_range(0, self.range.clone())?;
        let n = values.len();
        Ok(TensorData::new(values, [n]).convert_dtype(self.dtype))
    }
}

impl PartitionSource for SwappedPartition {
    fn fetch(&self) -> Result<TensorData, String> {
        match self.kept.get() {
            Some(data) => Ok(data.clone()),
            None => self.read().map_err(|e| e.to_string()),
        }
    }
}

/// The two swap files of a rank's partitions and what was last written to each.
pub(super) struct ParamSwap {
    stores: [Arc<Mutex<NvmeStore>>; 2],
    written: [Vec<Weak<SwappedPartition>>; 2],
}

impl ParamSwap {
    /// Two swap files of `len` elements under `config`, in sub-groups of one request each (a
    /// gather reads only its partition's regions).
    pub(super) fn create(config: &SwapConfig, len: usize) -> Result<Self, SwapError> {
        let sub_group = (config.block_size / 4).max(1024);
        let store = |name: &str| -> Result<_, SwapError> {
            let store = NvmeStore::create(config, &[name], len, sub_group, &|_, _| None)?;
            crate::engine::optim_state::warn_if_cached(store.direct, config);
            Ok(Arc::new(Mutex::new(store)))
        };
        Ok(Self {
            stores: [store("params-even")?, store("params-odd")?],
            written: [Vec::new(), Vec::new()],
        })
    }

    /// Writes `version`'s partitions (each partition's values, end to end in `values` at
    /// `ranges`) and returns their sources, read back as `dtype`.
    pub(super) fn write(
        &mut self,
        version: u64,
        values: Vec<f32>,
        ranges: &[core::ops::Range<usize>],
        dtype: DType,
    ) -> Result<Vec<Arc<dyn PartitionSource>>, SwapError> {
        let file = (version % 2) as usize;
        for source in self.written[file].drain(..).filter_map(|w| w.upgrade()) {
            let data = source.read()?;
            let _ = source.kept.set(data);
        }
        let store = &self.stores[file];
        store
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .write_all(&[values])?;
        let sources: Vec<Arc<SwappedPartition>> = ranges
            .iter()
            .map(|range| {
                Arc::new(SwappedPartition {
                    store: store.clone(),
                    range: range.clone(),
                    dtype,
                    kept: OnceLock::new(),
                })
            })
            .collect();
        self.written[file] = sources.iter().map(Arc::downgrade).collect();
        Ok(sources
            .into_iter()
            .map(|s| s as Arc<dyn PartitionSource>)
            .collect())
    }
}
