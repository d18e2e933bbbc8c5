//! The [`Strategy`] trait every ZeRO stage implements, and what it trades with the engine.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use burn::module::Module;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use super::setup::Setup;

use super::gathers::GatherStats;
use crate::ZeroTensor;
#[cfg(feature = "zero3")]
use crate::backend::GathererGuard;
use crate::checkpoint::{Partitioning, Span};
use crate::comm::{CommError, Communicator};
use crate::config::ZeroStage;
use crate::engine::grads::GradCore;
use crate::engine::host_grads::HostGradLayout;
use crate::engine::params::{FlatLayout, ParamSlot};
use crate::engine::{EngineError, ZeroAutodiff};
use crate::optim::TensorBounds;

/// Where this rank's fp32 master partition was made.
pub(crate) enum Master<I: Backend> {
    /// On the device.
    Device(Tensor<I, 1>),
    /// In host memory (ZeRO-Offload below stage 3).
    Host(Vec<f32>),
}

/// How a stage lays its partitions out in a checkpoint.
pub(crate) struct CheckpointLayout {
    /// How the partitions are cut from the parameters.
    pub(crate) partitioning: Partitioning,
    /// Each parameter's chunk, where partitions are per parameter.
    pub(crate) chunks: Vec<Option<usize>>,
    /// Ranks `0..writers` write a partition file.
    pub(crate) writers: usize,
    /// The length each written tensor is zero-padded to (the chunk of a flat partition).
    pub(crate) pad_to: Option<usize>,
}

/// What a partition-shaped tensor holds, for [`Strategy::for_each_full`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Held {
    /// This rank's fp32 master partition.
    Master,
    /// This rank's gradients, as the strategy accumulates them.
    Gradients,
}

/// The new value (and gradient flag) of each trainable parameter, by layout slot, for the
/// model's rebuild.
pub(crate) trait ParamSource<I: Backend> {
    fn param(&mut self, p: usize) -> ZeroTensor<I>;

    /// Whether the rebuilt leaf requires a gradient, given the old leaf's flag.
    fn require_grad(&mut self, _p: usize, was: bool) -> bool {
        was
    }
}

/// What a ZeRO stage does. The hook, the gatherer and the engine's fixed loop (backward →
/// precision → reduce → optimizer → publish) call it; each stage's choices live in its own.
pub(crate) trait Strategy<I: Backend>: Send {
    fn stage(&self) -> ZeroStage;

    fn grads(&self) -> &GradCore<I>;

    fn grads_mut(&mut self) -> &mut GradCore<I>;

    /// Builds the model's parameters and this rank's master partition for the stage, from the
    /// user's model (rank 0's values) or one built sharded.
    fn setup<M: Module<ZeroAutodiff<I>>>(
        &mut self,
        model: M,
        setup: &Setup<'_>,
    ) -> Result<(M, Master<I>), EngineError>
    where
        Self: Sized;

    /// Allocates the gradients (after the optimizer's state, see `initialize`); in host memory
    /// laid out as `host` says where the stage's partition may live there.
    fn allocate(&mut self, host: Option<HostGradLayout>);

    /// Installs the stage's gatherer of sharded parameters on this thread, if it has one
    /// (kept while the guard lives).
    #[cfg(feature = "zero3")]
    fn install_gatherer(_this: &Arc<Mutex<Self>>) -> Option<GathererGuard<I>>
    where
        Self: Sized,
    {
        None
    }

    /// Takes parameter `slot`'s final gradient (flattened, in the accumulation format).
    /// Returns whether the full gradient may be freed (its partition is being reduced).
    fn accept(&mut self, slot: usize, grad: Tensor<I, 1>) -> bool;

    /// Backward ended: reduce or settle what is left.
    fn end_backward(&mut self);

    /// The part of the gradient buffer this rank's optimizer steps with.
    fn step_range(&self) -> Range<usize>;

    /// The squared global norm from this rank's Σ g² (summed over the ranks where each holds
    /// a disjoint part).
    fn total_squares(&mut self, squares: Tensor<I, 1>) -> Result<Tensor<I, 1>, CommError>;

    /// Whether the parameters are chunks of the fp32 master: the step then writes no copy in
    /// the compute format, and [`Strategy::release`] comes first.
    fn master_backed(&self) -> bool {
        false
    }

    /// Before a master-backed step, or one that rewrites the parameters' host buffer: drops
    /// every reference to the master (but the optimizer's) or to the buffer, and returns
    /// placeholders for the model's parameters until [`Strategy::publish`].
    fn release(&mut self) -> Result<Option<Box<dyn ParamSource<I> + '_>>, EngineError> {
        Ok(None)
    }

    /// After [`Strategy::release`], for an offloaded step whose gradient lies in host memory:
    /// where it may write the new parameters in `out`'s dtype instead of sending them to the
    /// device (the parameters' own host buffer, ZeRO-3 with `offload_param` on the CPU);
    /// [`Strategy::publish`] then takes an empty source.
    fn direct_outs(
        &mut self,
        out: burn_offload::OutDtype,
    ) -> Result<Option<crate::engine::offload_io::DirectOuts>, EngineError> {
        let _ = out;
        Ok(None)
    }

    /// The parameters after a step or a load, from this rank's new partition (`source`: the
    /// master where [`Strategy::master_backed`], else the working copy in the compute format).
    fn publish(
        &mut self,
        source: Vec<Tensor<I, 1>>,
    ) -> Result<Box<dyn ParamSource<I> + '_>, EngineError>;

    /// Calls `f` with each parameter's full values from this rank's `partition`, one at a
    /// time in layout order (gathering them where they are partitioned).
    fn for_each_full(
        &mut self,
        partition: Tensor<I, 1>,
        held: Held,
        f: &mut dyn FnMut(&ParamSlot, Tensor<I, 1>),
    ) -> Result<(), EngineError>;

    /// Why a full copy of the model may not be made (stage 3 holds it only on request).
    fn full_model_refused(&self, _gather_16bit_weights_on_model_save: bool) -> Option<String> {
        None
    }

    /// How partitions are written.
    fn checkpoint_layout(&self) -> CheckpointLayout;

    /// Where this rank's partition comes from in a checkpoint of `index[slot]` parameters
    /// (the manifest's index of each layout slot), and the partition's length.
    fn load_spans(&self, index: &[usize]) -> (Vec<Span>, usize);

    /// Where each parameter tensor lies in this rank's partition (LAMB's trust ratios).
    fn tensor_bounds(&self, comm: &Arc<dyn Communicator>) -> TensorBounds;

    /// Elements of the parameters' working copy held on the device and in host memory.
    fn param_numel(&self) -> (usize, usize);

    /// Bytes of communication buffers at their peak.
    fn comm_buffer_bytes(&self) -> usize;

    /// The lengths of the stage's largest flat buffers (gradients, gathered parameters, the
    /// partition and a chunk), for the device pool's exact-size allocations.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn big_buffer_lens(&self) -> Vec<usize>;

    /// What the ZeRO-3 gathers did so far.
    fn gather_stats(&self) -> Option<GatherStats> {
        None
    }
}

/// The slots of `layout` cut to `owned` (a range of the flat buffer): each tensor's part, at
/// its place in the owned range.
pub(crate) fn owned_segments(
    layout: &FlatLayout,
    owned: &Range<usize>,
) -> Vec<(usize, Range<usize>)> {
    layout
        .slots()
        .iter()
        .enumerate()
        .filter_map(|(p, s)| {
            let start = s.offset.max(owned.start);
            let end = (s.offset + s.numel()).min(owned.end);
            (start < end).then(|| (p, start - owned.start..end - owned.start))
        })
        .collect()
}
