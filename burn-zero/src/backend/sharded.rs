//! ZeRO-3's sharded parameter: a float primitive that holds only this rank's partition and is
//! gathered in full by whatever op reads it.
//!
//! The gather itself belongs to the engine (it knows the partition plan, the communicator and
//! the prefetch trace): it installs a [`ParamGatherer`] on the rank's thread, and
//! [`ZeroTensor::into_inner`](super::ZeroTensor::into_inner) calls it. Shape-only ops
//! (reshape, transpose, swap_dims, permute) on a sharded handle stay lazy: they are recorded
//! and replayed on the gathered tensor, so e.g. a tied embedding's transpose saved by autodiff
//! for backward is a handle, not a full copy kept alive from forward to backward.

use std::sync::Arc;

use burn_backend::{Backend, Shape, TensorData};

use super::hooks::registry;
use super::view::ViewOp;

/// This rank's part of one parameter under ZeRO-3.
#[derive(Debug)]
pub struct ShardedParam<B: Backend> {
    /// Index of the parameter in the engine's layout; gathers are labeled with it.
    pub slot: usize,
    /// The engine's parameter version (its optimizer steps) when the handle was made: a
    /// handle kept from an older step is gathered from its own partition, outside the trace.
    pub version: u64,
    /// The full shape.
    pub shape: Shape,
    /// The dtype of the gathered parameter. The partition may be held wider: the engine's
    /// ZeRO-3 partitions are chunks of the fp32 master, narrowed to the compute dtype at
    /// each gather, so no second (bf16) copy of the partition stays on the device.
    pub dtype: burn_backend::DType,
    /// This rank's partition: a 1-D tensor of the plan's chunk for this parameter, zero
    /// padded past the end of the parameter. With `offloaded`, a one-element tensor of the
    /// same device and dtype that answers metadata queries only.
    pub partition: B::FloatTensorPrimitive,
    /// Where the partition waits off the device (`offload_param`: host memory or swap
    /// files), fetched and uploaded when the parameter is gathered.
    pub offloaded: Option<Arc<dyn PartitionSource>>,
}

/// Where an offloaded partition waits between gathers.
pub trait PartitionSource: Send + Sync + std::fmt::Debug {
    /// The partition's values, in their dtype; an error names what could not be read.
    fn fetch(&self) -> Result<TensorData, String>;
}

/// A partition in host memory (`offload_param {"device": "cpu"}`).
impl PartitionSource for TensorData {
    fn fetch(&self) -> Result<TensorData, String> {
        Ok(self.clone())
    }
}

impl<B: Backend> ShardedParam<B> {
    /// The partition on the device: itself, or fetched and uploaded.
    ///
    /// # Panics
    /// If an offloaded partition cannot be read (a damaged swap file): a backend op has no
    /// error channel, and training on wrong values would be worse.
    pub fn partition_on_device(&self) -> B::FloatTensorPrimitive {
        match &self.offloaded {
            None => self.partition.clone(),
            Some(source) => {
                let data = source.fetch().unwrap_or_else(|e| {
                    panic!("parameter {}: its offloaded partition: {e}", self.slot)
                });
                let device = B::float_device(&self.partition);
                B::float_from_data(data, &device)
            }
        }
    }
}

/// Gathers sharded parameters for the ops of one thread (the engine of that rank).
pub trait ParamGatherer<B: Backend> {
    /// The full tensor of `param`, in its full shape: gathered now, or already live.
    fn gather(&mut self, param: &ShardedParam<B>) -> B::FloatTensorPrimitive;
}

/// Keeps a gatherer installed on this thread; dropping it uninstalls the gatherer.
pub type GathererGuard<B> = registry::Guard<dyn ParamGatherer<B>>;

/// Installs `gatherer` for `ZeroBackend<B>` on this thread, replacing an earlier one.
pub fn install_gatherer<B: Backend>(gatherer: Box<dyn ParamGatherer<B>>) -> GathererGuard<B> {
    registry::install(gatherer)
}

/// The full tensor of `param`, from this thread's gatherer.
pub(crate) fn gather<B: Backend>(param: &ShardedParam<B>) -> B::FloatTensorPrimitive {
    registry::with::<dyn ParamGatherer<B>, _>(|g| g.gather(param)).unwrap_or_else(|| {
        panic!(
            "parameter #{} of shape {:?} is a ZeRO-3 shard, and no engine on this thread can \
             gather it: use the model while its engine is alive, or take the full model from \
             the engine (`Engine::full_model`)",
            param.slot, param.shape
        )
    })
}

/// A sharded handle, with the views recorded on it.
#[derive(Clone, Debug)]
pub(crate) struct ShardedView<B: Backend> {
    pub(crate) param: Arc<ShardedParam<B>>,
    pub(crate) views: Vec<ViewOp>,
    pub(crate) shape: Shape,
}

impl<B: Backend> ShardedView<B> {
    /// Gathers the parameter and replays the views.
    pub(crate) fn materialize(&self) -> B::FloatTensorPrimitive {
        let full = gather(&self.param);
        self.views.iter().fold(full, |t, op| op.apply::<B>(t))
    }
}
