//! Sharded construction (DeepSpeed's `zero.Init`): build a model whose full parameters never
//! exist on one rank at once.
//!
//! burn initializes parameters lazily: `config.init(device)` records how to make each one
//! and materializes it on first use. [`construct_sharded`] walks the parameters in module
//! order, materializes one, keeps this rank's chunk of it as a ZeRO-3 handle and drops the
//! rest before the next, so the peak is one parameter plus the partitions. Every parameter
//! is drawn from its own seed (derived from `seed` and its position), under a process-wide
//! lock: the values do not depend on the rank, on other threads drawing random numbers (thread
//! ranks share NdArray's generator), or on the order of materialization.
//! [`construct_full`] draws the same values into full parameters: partitioning its result
//! gives exactly the partitions of [`construct_sharded`].

#[cfg(feature = "zero3")]
use std::sync::Arc;
use std::sync::Mutex;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};

use super::ZeroAutodiff;
#[cfg(feature = "zero3")]
use super::{PARTITION_ALIGN, zero_padded};
#[cfg(feature = "zero3")]
use crate::backend::ShardedParam;
#[cfg(feature = "zero3")]
use crate::partition::ShardPlan;
#[cfg(feature = "zero3")]
use crate::{ZeroBackend, ZeroTensor};

/// Serializes seeding and drawing, so each parameter's values come from its own seed.
static DRAW: Mutex<()> = Mutex::new(());

/// The seed of the parameter at `position` in module order.
fn param_seed(seed: u64, position: usize) -> u64 {
    // SplitMix64's finalizer: neighboring positions get unrelated seeds.
    let mut z = seed ^ (position as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Builds `model` (fresh from `config.init`, parameters not yet materialized) with each float
/// parameter as rank `rank`'s ZeRO-3 partition of `world_size`; pass it to
/// [`initialize`](super::initialize) with stage 3 and the same world size.
#[cfg(feature = "zero3")]
pub fn construct_sharded<I: Backend, M: Module<ZeroAutodiff<I>>>(
    model: M,
    seed: u64,
    rank: usize,
    world_size: usize,
) -> M {
    assert!(rank < world_size, "rank {rank} outside {world_size} ranks");
    model.map(&mut Draw {
        seed,
        position: 0,
        shard: Some((rank, world_size)),
    })
}

/// Builds `model` with full parameters drawn exactly as [`construct_sharded`] draws them.
pub fn construct_full<I: Backend, M: Module<ZeroAutodiff<I>>>(model: M, seed: u64) -> M {
    model.map(&mut Draw {
        seed,
        position: 0,
        shard: None,
    })
}

/// Values of a model's parameters computed from their place alone, so another program (a
/// PyTorch peer) can compute the same ones: a benchmark's shared starting point.
pub trait ParamValues {
    /// The row-major elements `range` of the float parameter at `position` in module order,
    /// whose shape is `shape`.
    fn values(&self, position: usize, shape: &[usize], range: core::ops::Range<usize>) -> Vec<f32>;
}

/// [`construct_sharded`] with each parameter's values from `values` instead of burn's
/// initializers: only this rank's chunk of each is computed and uploaded, so an 8B model is
/// built without any full parameter on the device. Every parameter is made trainable.
#[cfg(feature = "zero3")]
pub fn construct_sharded_from<I: Backend, M: Module<ZeroAutodiff<I>>>(
    model: M,
    values: &dyn ParamValues,
    rank: usize,
    world_size: usize,
) -> M {
    assert!(rank < world_size, "rank {rank} outside {world_size} ranks");
    model.map(&mut FromValues {
        values,
        position: 0,
        shard: Some((rank, world_size)),
    })
}

/// Builds `model` with full parameters from `values`, as [`construct_sharded_from`] would shard
/// them.
pub fn construct_full_from<I: Backend, M: Module<ZeroAutodiff<I>>>(
    model: M,
    values: &dyn ParamValues,
) -> M {
    model.map(&mut FromValues {
        values,
        position: 0,
        shard: None,
    })
}

struct FromValues<'a> {
    values: &'a dyn ParamValues,
    position: usize,
    shard: Option<(usize, usize)>,
}

impl<I: Backend> ModuleMapper<ZeroAutodiff<I>> for FromValues<'_> {
    fn map_float<const D: usize>(
        &mut self,
        param: Param<Tensor<ZeroAutodiff<I>, D>>,
    ) -> Param<Tensor<ZeroAutodiff<I>, D>> {
        let position = self.position;
        self.position += 1;
        let (id, shape, device) = (param.id, param.lazy_shape(), param.lazy_device());
        let n = shape.num_elements();
        let Some((rank, world)) = self.shard else {
            let data = TensorData::new(self.values.values(position, shape.as_slice(), 0..n), shape);
            let tensor = Tensor::from_data(data, &device).require_grad();
            return Param::initialized(id, tensor);
        };
        #[cfg(not(feature = "zero3"))]
        unreachable!("sharded construction needs the zero3 feature ({rank} of {world})");
        #[cfg(feature = "zero3")]
        {
            let plan = ShardPlan::new(&[n], world, PARTITION_ALIGN);
            let owned = plan.owned(0, rank);
            let mut chunk = self.values.values(position, shape.as_slice(), owned);
            chunk.resize(plan.chunk(0), 0.0);
            let len = chunk.len();
            let partition = Tensor::<I, 1>::from_data(TensorData::new(chunk, [len]), &device);
            let sharded = sharded_tensor(position, shape, partition.into_primitive().tensor());
            Param::initialized(id, sharded.require_grad())
        }
    }
}

/// The ZeRO-3 handle of the parameter at `position` in module order, of `shape`, holding
/// this rank's `partition`.
#[cfg(feature = "zero3")]
fn sharded_tensor<I: Backend, const D: usize>(
    position: usize,
    shape: burn::tensor::Shape,
    partition: I::FloatTensorPrimitive,
) -> Tensor<ZeroAutodiff<I>, D> {
    let handle = ZeroTensor::sharded(Arc::new(ShardedParam {
        slot: position,
        version: 0,
        shape,
        dtype: burn_backend::TensorMetadata::dtype(&partition),
        partition,
        offloaded: None,
    }));
    Tensor::from_inner(Tensor::<ZeroBackend<I>, D>::from_primitive(
        TensorPrimitive::Float(handle),
    ))
}

struct Draw {
    seed: u64,
    position: usize,
    /// (rank, world size), or `None` for full parameters.
    shard: Option<(usize, usize)>,
}

impl<I: Backend> ModuleMapper<ZeroAutodiff<I>> for Draw {
    fn map_float<const D: usize>(
        &mut self,
        param: Param<Tensor<ZeroAutodiff<I>, D>>,
    ) -> Param<Tensor<ZeroAutodiff<I>, D>> {
        let position = self.position;
        self.position += 1;
        let (id, tensor, mapper) = {
            let _draw = DRAW.lock().unwrap_or_else(|e| e.into_inner());
            let device = param.lazy_device();
            <ZeroAutodiff<I> as Backend>::seed(&device, param_seed(self.seed, position));
            param.consume()
        };
        let Some((rank, world)) = self.shard else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        #[cfg(not(feature = "zero3"))]
        unreachable!("sharded construction needs the zero3 feature ({rank} of {world})");
        #[cfg(feature = "zero3")]
        {
            let require_grad = tensor.is_require_grad();
            let shape = tensor.shape();
            let n = shape.num_elements();
            let full = Tensor::<I, D>::from_primitive(TensorPrimitive::Float(
                tensor.inner().into_primitive().tensor().into_inner(),
            ))
            .reshape([n]);
            let plan = ShardPlan::new(&[n], world, PARTITION_ALIGN);
            let partition = chunk_of(&plan, 0, rank, &full, 0).into_primitive().tensor();
            drop(full);
            let sharded = sharded_tensor(position, shape, partition).set_require_grad(require_grad);
            Param::from_mapped_value(id, sharded, mapper)
        }
    }
}

/// Rank `rank`'s chunk of parameter `p`, whose flat values start at `base` in `values`: its
/// owned elements, zero-padded to the plan's chunk.
#[cfg(feature = "zero3")]
pub(crate) fn chunk_of<I: Backend>(
    plan: &ShardPlan,
    p: usize,
    rank: usize,
    values: &Tensor<I, 1>,
    base: usize,
) -> Tensor<I, 1> {
    let owned = plan.owned(p, rank);
    if owned.is_empty() {
        return Tensor::zeros([plan.chunk(p)], (&values.device(), values.dtype()));
    }
    let mine = values.clone().slice(base + owned.start..base + owned.end);
    zero_padded(mine, plan.chunk(p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_seeds_differ_and_repeat() {
        let seeds: Vec<u64> = (0..100).map(|p| param_seed(7, p)).collect();
        let mut unique = seeds.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), seeds.len());
        assert_eq!(seeds[3], param_seed(7, 3));
        assert_ne!(param_seed(7, 3), param_seed(8, 3));
    }
}
