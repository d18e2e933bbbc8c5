//! The stage-3 strategy: sharded handles, gathers on use, reduce-scatter into each
//! parameter's chunk, new partitions as the new handles.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor, TensorPrimitive};

use super::params::{ParamPlace, ShardedParams, sharded_handles};
use crate::ZeroTensor;
use crate::backend::hooks;
use crate::backend::{GathererGuard, ParamGatherer, ShardedParam, install_gatherer};
use crate::checkpoint::{Partitioning, Span};
use crate::comm::{CommError, Communicator, ReduceOp, with_label};
use crate::config::{OffloadDevice, ResolvedConfig, ZeroStage};
use crate::engine::grads::GradCore;
use crate::engine::host_grads::HostGradLayout;
use crate::engine::optim_state::swap_config;
use crate::engine::params::{FlatLayout, ParamSlot, flatten_params, rebuild_params};
use crate::engine::precision::Format;
use crate::engine::stage::intake::{ScatterPlan, Scattered};
use crate::engine::stage::setup::Setup;
use crate::engine::stage::{CheckpointLayout, Held, Master, ParamSource, Strategy};
use crate::engine::{EngineError, PARTITION_ALIGN, ZeroAutodiff};
use crate::optim::TensorBounds;
use crate::partition::PartitionPlan;
use crate::trace::TraceConfig;

pub(crate) struct Sharded<I: Backend> {
    grads: GradCore<I>,
    params: ShardedParams<I>,
    scattered: Scattered<I>,
    /// The format the model computes in (what gathers narrow the partitions to).
    compute: Format,
    rank: usize,
    /// While the partitions are released for a step: the parameters' `require_grad` flags.
    released: Option<Vec<bool>>,
}

impl<I: Backend> Sharded<I> {
    pub(crate) fn new(grads: GradCore<I>, setup: &Setup<'_>) -> Result<Self, EngineError> {
        let zero = &setup.resolved.config.zero_optimization;
        let trace = TraceConfig {
            prefetch_bucket_size: zero.prefetch_bucket_size.get(),
            max_live_parameters: zero.max_live_parameters.get(),
            max_reuse_distance: zero.max_reuse_distance.get(),
        };
        let params = ShardedParams::new(
            grads.layout(),
            setup.comm.world_size(),
            PARTITION_ALIGN,
            zero.param_persistence_threshold.get(),
            trace,
            param_place(setup.resolved, setup.comm.rank()),
            !setup.optimizer_offloaded(),
        )?;
        Ok(Self {
            grads,
            params,
            scattered: Scattered::new(),
            compute: setup.compute,
            rank: setup.comm.rank(),
            released: None,
        })
    }

    /// The largest flat buffers of `numel` parameters: never the whole model in one buffer
    /// (at 8B on 4 GPUs its 32 GB was one allocation too many), the partition and a chunk of
    /// the flat plan.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn buffer_lens(numel: usize, world: usize, rank: usize) -> Vec<usize> {
        let flat = PartitionPlan::aligned(numel, world, PARTITION_ALIGN);
        vec![flat.owned(rank).len(), flat.chunk()]
    }

    /// The new partitions from `source` (the master, or its copy in the compute format) and
    /// the full values of the persistent parameters.
    fn set(
        &mut self,
        source: &[Tensor<I, 1>],
    ) -> Result<std::collections::HashMap<usize, Tensor<I, 1>>, EngineError> {
        let flat = &mut self.grads.flat;
        self.params.set_partitions(flat, source, self.compute)?;
        Ok(self.params.gather_persistent(flat, source)?)
    }
}

/// The [`ParamGatherer`] the engine installs on its thread.
struct EngineGatherer<I: Backend> {
    strategy: Arc<Mutex<Sharded<I>>>,
}

impl<I: Backend> ParamGatherer<I> for EngineGatherer<I> {
    fn gather(&mut self, param: &ShardedParam<I>) -> I::FloatTensorPrimitive {
        let result = {
            let mut strategy = self.strategy.lock().expect("engine state");
            let s = &mut *strategy;
            s.params
                .gather(&mut s.grads.flat, param)
                .map_err(|e| s.params.explain(param.slot, &e))
        };
        // Panic only once the lock is released: the failure is the user's to see, and the
        // communicator has already stopped the other ranks (no one waits on this one).
        result.unwrap_or_else(|message| panic!("{message}"))
    }
}

/// The handles after a step or a load.
struct Handles<'a, I: Backend> {
    params: &'a ShardedParams<I>,
    full: std::collections::HashMap<usize, Tensor<I, 1>>,
    released: Option<Vec<bool>>,
}

impl<I: Backend> ParamSource<I> for Handles<'_, I> {
    fn param(&mut self, p: usize) -> ZeroTensor<I> {
        self.params.handle(p, self.full.get(&p))
    }

    fn require_grad(&mut self, p: usize, was: bool) -> bool {
        self.released.as_ref().map_or(was, |flags| flags[p])
    }
}

/// What the model holds while the partitions are released for the step: never gathered,
/// outside burn's graph; their flags are kept for [`Handles`].
struct Placeholders<'a, I: Backend> {
    params: &'a ShardedParams<I>,
    stub: Tensor<I, 1>,
    flags: &'a mut Vec<bool>,
    /// The model holds placeholders already: `flags` keep the parameters' own.
    again: bool,
}

impl<I: Backend> ParamSource<I> for Placeholders<'_, I> {
    fn param(&mut self, p: usize) -> ZeroTensor<I> {
        self.params.placeholder(p, &self.stub)
    }

    fn require_grad(&mut self, p: usize, was: bool) -> bool {
        if !self.again {
            self.flags[p] = was;
        }
        false
    }
}

impl<I: Backend> Strategy<I> for Sharded<I> {
    fn stage(&self) -> ZeroStage {
        ZeroStage::Parameters
    }

    fn grads(&self) -> &GradCore<I> {
        &self.grads
    }

    fn grads_mut(&mut self) -> &mut GradCore<I> {
        &mut self.grads
    }

    fn setup<M: Module<ZeroAutodiff<I>>>(
        &mut self,
        model: M,
        setup: &Setup<'_>,
    ) -> Result<(M, Master<I>), EngineError> {
        let layout = self.grads.layout().clone();
        let master = match sharded_master(&model, &layout, &self.params)? {
            // Built sharded (every rank its own partitions, from the same seed).
            Some(master) => master,
            None => {
                let flat = &mut self.grads.flat;
                let params = flat.broadcast(flatten_params(&model, &layout), 0)?;
                flat.wait()?;
                self.params.partition_of(&params, self.rank)
            }
        };
        let master = master.cast(FloatDType::F32);
        // With the optimizer and the parameters on the device, the partitions are chunks of
        // the fp32 master itself (each gather narrows its chunk to the compute format); else
        // a copy in the compute format.
        let source = match self.params.master_backed() {
            true => [master.clone()],
            false => [setup.compute.convert(master.clone())],
        };
        let full = self.set(&source)?;
        let model = rebuild_params(model, &layout, |p| self.params.handle(p, full.get(&p)));
        Ok((hooks::mark_distributed(model), Master::Device(master)))
    }

    fn allocate(&mut self, host: Option<HostGradLayout>) {
        let len = self.params.plan().len();
        self.grads.allocate(len, host);
    }

    fn install_gatherer(this: &Arc<Mutex<Self>>) -> Option<GathererGuard<I>> {
        Some(install_gatherer::<I>(Box::new(EngineGatherer {
            strategy: this.clone(),
        })))
    }

    fn accept(&mut self, slot: usize, grad: Tensor<I, 1>) -> bool {
        let plan = ScatterPlan::Sharded(self.params.plan());
        self.scattered.accept(&mut self.grads, slot, grad, plan);
        true
    }

    fn end_backward(&mut self) {
        let plan = ScatterPlan::Sharded(self.params.plan());
        self.scattered.end_backward(&mut self.grads, plan);
        self.params.end_pass();
    }

    fn step_range(&self) -> Range<usize> {
        0..self.grads.buffer.len()
    }

    fn total_squares(&mut self, squares: Tensor<I, 1>) -> Result<Tensor<I, 1>, CommError> {
        let total = self.grads.flat.all_reduce(squares, ReduceOp::Sum)?;
        self.grads.flat.wait()?;
        Ok(total)
    }

    fn master_backed(&self) -> bool {
        self.params.master_backed()
    }

    fn release(&mut self) -> Result<Option<Box<dyn ParamSource<I> + '_>>, EngineError> {
        if !self.params.released_for_step() {
            return Ok(None);
        }
        self.params.release_partitions(&mut self.grads.flat)?;
        let stub = Tensor::<I, 1>::zeros([1], self.grads.flat.device());
        // Released again before publishing (a step failed, then a load): the model holds
        // placeholders, whose flags are not the parameters'; the first release's stay.
        let again = self.released.is_some();
        let n = self.grads.layout().slots().len();
        let flags = self.released.get_or_insert_with(|| vec![false; n]);
        Ok(Some(Box::new(Placeholders {
            params: &self.params,
            stub,
            flags,
            again,
        })))
    }

    fn direct_outs(
        &mut self,
        out: burn_offload::OutDtype,
    ) -> Result<Option<crate::engine::offload_io::DirectOuts>, EngineError> {
        self.params.direct_outs(&mut self.grads.flat, out)
    }

    fn publish(
        &mut self,
        source: Vec<Tensor<I, 1>>,
    ) -> Result<Box<dyn ParamSource<I> + '_>, EngineError> {
        // No all-gather: the new partitions are the new handles, chunks of the master itself
        // where it is on the device.
        let full = self.set(&source)?;
        Ok(Box::new(Handles {
            params: &self.params,
            full,
            released: self.released.take(),
        }))
    }

    fn for_each_full(
        &mut self,
        partition: Tensor<I, 1>,
        _held: Held,
        f: &mut dyn FnMut(&ParamSlot, Tensor<I, 1>),
    ) -> Result<(), EngineError> {
        // Each parameter's chunks gathered in turn: one full parameter alive at a time.
        let plan = self.params.plan();
        let layout = self.grads.layout().clone();
        let flat = &mut self.grads.flat;
        for (p, slot) in layout.slots().iter().enumerate() {
            let chunk = partition.clone().slice(plan.span(p));
            let gathered = with_label(p as u64 + 1, || flat.all_gather(chunk))?;
            flat.wait()?;
            f(slot, gathered.slice(0..plan.numel(p)));
        }
        Ok(())
    }

    fn full_model_refused(&self, gather_16bit_weights_on_model_save: bool) -> Option<String> {
        (!gather_16bit_weights_on_model_save).then(|| {
            "a full model under ZeRO-3 holds every parameter on every rank: set \
             `zero_optimization.stage3_gather_16bit_weights_on_model_save` to true, or stream \
             the parameters with `for_each_full_param`"
                .into()
        })
    }

    fn checkpoint_layout(&self) -> CheckpointLayout {
        let plan = self.params.plan();
        CheckpointLayout {
            partitioning: Partitioning::PerParam,
            chunks: (0..plan.params()).map(|p| Some(plan.chunk(p))).collect(),
            writers: plan.world_size(),
            pad_to: None,
        }
    }

    fn load_spans(&self, index: &[usize]) -> (Vec<Span>, usize) {
        let plan = self.params.plan();
        let spans = index
            .iter()
            .enumerate()
            .map(|(p, &param)| Span {
                param,
                elements: plan.owned(p, self.rank),
                at: plan.offset(p),
            })
            .collect();
        (spans, plan.len())
    }

    fn tensor_bounds(&self, comm: &Arc<dyn Communicator>) -> TensorBounds {
        let plan = self.params.plan();
        TensorBounds {
            segments: (0..plan.params()).map(|p| (p, plan.span(p))).collect(),
            params: self.grads.layout().slots().len(),
            comm: (comm.world_size() > 1).then(|| comm.clone()),
        }
    }

    fn param_numel(&self) -> (usize, usize) {
        match self.params.master_backed() {
            // The partitions are the optimizer's master: only the persistent copies count.
            true => (self.params.persistent_numel(), 0),
            false => self.params.param_numel(),
        }
    }

    fn comm_buffer_bytes(&self) -> usize {
        Scattered::comm_buffer_bytes(&self.grads)
    }

    fn big_buffer_lens(&self) -> Vec<usize> {
        let world = self.params.plan().world_size();
        Self::buffer_lens(self.grads.layout().numel(), world, self.rank)
    }

    fn gather_stats(&self) -> Option<crate::engine::stage::GatherStats> {
        Some(self.params.stats())
    }
}

/// Where `offload_param` keeps the sharded parameters' partitions of rank `rank`.
fn param_place(config: &ResolvedConfig, rank: usize) -> ParamPlace {
    let zero = &config.config.zero_optimization;
    match (zero.param_offload(), &zero.offload_param) {
        (OffloadDevice::Cpu, _) => ParamPlace::Host,
        (OffloadDevice::Nvme, Some(o)) => {
            let root = o.nvme_path.as_deref().expect("validated");
            let buffers = o.buffer_count.get();
            ParamPlace::Nvme(swap_config(config, root, buffers, rank, "params"))
        }
        _ => ParamPlace::Device,
    }
}

/// This rank's partition when `model` was built sharded ([`crate::engine::construct_sharded`]):
/// its handles' partitions in layout order; `None` for a full model.
fn sharded_master<I: Backend, M: Module<ZeroAutodiff<I>>>(
    model: &M,
    layout: &FlatLayout,
    params: &ShardedParams<I>,
) -> Result<Option<Tensor<I, 1>>, EngineError> {
    let handles = sharded_handles(model, layout);
    if handles.iter().all(Option::is_none) {
        return Ok(None);
    }
    let plan = params.plan();
    let mut parts = Vec::new();
    for (p, handle) in handles.into_iter().enumerate() {
        let Some(h) = handle else {
            return Err(EngineError::Usage(format!(
                "parameter `{}` is full while others were built sharded: build the whole \
                 model with `burn_zero::engine::construct_sharded`",
                layout.slots()[p].name
            )));
        };
        let t = Tensor::<I, 1>::from_primitive(TensorPrimitive::Float(h.partition.clone()));
        if t.dims()[0] != plan.chunk(p) {
            return Err(EngineError::Usage(format!(
                "parameter `{}` was built sharded for another world size: its partition holds \
                 {} elements, {} ranks need {}",
                layout.slots()[p].name,
                t.dims()[0],
                plan.world_size(),
                plan.chunk(p)
            )));
        }
        parts.push(t);
    }
    Ok(Some(Tensor::cat(parts, 0)))
}
