//! Stages 1 and 2: the flat parameters are cut into one aligned chunk per rank
//! ([`PartitionPlan`]); each rank's optimizer updates its chunk and the new chunks are
//! all-gathered into every rank's full parameters. Stage 1 all-reduces the whole gradient at
//! the window's end and steps with its chunk of it; stage 2 reduce-scatters buckets into the
//! chunk as backward goes.

use std::ops::Range;
use std::sync::Arc;

use burn::module::Module;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use super::super::collective::FlatComm;
use super::super::flat_pieces::Gathered;
use super::super::grads::GradCore;
use super::super::host_grads::HostGradLayout;
use super::super::params::ParamSlot;
use super::super::{EngineError, PARTITION_ALIGN, ZeroAutodiff};
use super::intake::Accumulated;
#[cfg(feature = "zero2")]
use super::intake::{ScatterPlan, Scattered};
use super::setup::{FullValues, Setup, each_slot, full_params};
use super::{CheckpointLayout, Held, Master, ParamSource, Strategy, owned_segments};
use crate::checkpoint::{Partitioning, Span};
use crate::comm::{CommError, Communicator, ReduceOp};
use crate::config::ZeroStage;
use crate::optim::TensorBounds;
use crate::partition::PartitionPlan;

/// How a partitioned stage takes gradients in.
enum Intake<I: Backend> {
    /// Stage 1: whole, all-reduced at the window's end.
    Accumulated(core::marker::PhantomData<I>),
    /// Stage 2: reduce-scattered into this rank's chunk.
    #[cfg(feature = "zero2")]
    Scattered(Scattered<I>),
}

pub(crate) struct Partitioned<I: Backend> {
    grads: GradCore<I>,
    plan: PartitionPlan,
    intake: Intake<I>,
    rank: usize,
    /// Elements each rank contributes to one all-gather of new parameters
    /// (`allgather_bucket_size` / world size).
    gather_piece: usize,
}

impl<I: Backend> Partitioned<I> {
    /// Stage 1 or 2 (`gradients`: whether gradients are partitioned too).
    pub(crate) fn new(grads: GradCore<I>, gradients: bool, allgather_bucket_size: usize) -> Self {
        let comm = grads.flat.comm();
        let (rank, world) = (comm.rank(), comm.world_size());
        let plan = PartitionPlan::aligned(grads.layout().numel(), world, PARTITION_ALIGN);
        let intake = match gradients {
            #[cfg(feature = "zero2")]
            true => Intake::Scattered(Scattered::new()),
            #[cfg(not(feature = "zero2"))]
            true => unreachable!("the config refuses stage 2 without the zero2 feature"),
            false => Intake::Accumulated(core::marker::PhantomData),
        };
        Self {
            grads,
            plan,
            intake,
            rank,
            gather_piece: allgather_bucket_size / world,
        }
    }

    /// The whole model (the gathered parameters; stage 1's gradients), rank `rank`'s
    /// partition and a chunk: the largest flat buffers.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn buffer_lens(plan: &PartitionPlan, rank: usize) -> Vec<usize> {
        let whole = [plan.numel(), plan.padded_numel()];
        whole
            .into_iter()
            .chain([plan.owned(rank).len(), plan.chunk()])
            .collect()
    }

    fn owned(&self) -> Range<usize> {
        self.plan.owned(self.rank)
    }

    /// Every rank's `owned` part of the flat buffer (padded here to the plan's chunk),
    /// gathered into the flat buffer in `allgather_bucket_size` pieces.
    fn gather(
        flat: &mut FlatComm<I>,
        plan: &PartitionPlan,
        piece: usize,
        owned: &[Tensor<I, 1>],
    ) -> Result<Gathered<I>, CommError> {
        Gathered::gather(flat, owned, plan.chunk(), piece)
    }
}

impl<I: Backend> Strategy<I> for Partitioned<I> {
    fn stage(&self) -> ZeroStage {
        match self.intake {
            Intake::Accumulated(_) => ZeroStage::OptimizerStates,
            #[cfg(feature = "zero2")]
            Intake::Scattered(_) => ZeroStage::Gradients,
        }
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
        let owned = self.owned();
        full_params(model, &mut self.grads, setup, owned)
    }

    fn allocate(&mut self, host: Option<HostGradLayout>) {
        match self.intake {
            Intake::Accumulated(_) => self.grads.allocate(self.plan.numel(), None),
            #[cfg(feature = "zero2")]
            Intake::Scattered(_) => self.grads.allocate(self.plan.chunk(), host),
        }
    }

    fn accept(&mut self, slot: usize, grad: Tensor<I, 1>) -> bool {
        match &mut self.intake {
            Intake::Accumulated(_) => {
                Accumulated::accept(&mut self.grads, slot, grad);
                false
            }
            #[cfg(feature = "zero2")]
            Intake::Scattered(scattered) => {
                let plan = ScatterPlan::Flat(&self.plan);
                scattered.accept(&mut self.grads, slot, grad, plan);
                true
            }
        }
    }

    fn end_backward(&mut self) {
        match &mut self.intake {
            Intake::Accumulated(_) => Accumulated::end_backward(&mut self.grads),
            #[cfg(feature = "zero2")]
            Intake::Scattered(scattered) => {
                scattered.end_backward(&mut self.grads, ScatterPlan::Flat(&self.plan))
            }
        }
    }

    fn step_range(&self) -> Range<usize> {
        match self.intake {
            // This rank's chunk of the whole all-reduced gradient.
            Intake::Accumulated(_) => self.owned(),
            // The partition is the chunk (its padding beyond `owned` stays zero).
            #[cfg(feature = "zero2")]
            Intake::Scattered(_) => 0..self.owned().len(),
        }
    }

    fn total_squares(&mut self, squares: Tensor<I, 1>) -> Result<Tensor<I, 1>, CommError> {
        let total = self.grads.flat.all_reduce(squares, ReduceOp::Sum)?;
        self.grads.flat.wait()?;
        Ok(total)
    }

    fn publish(
        &mut self,
        working: Vec<Tensor<I, 1>>,
    ) -> Result<Box<dyn ParamSource<I> + '_>, EngineError> {
        let full = Self::gather(
            &mut self.grads.flat,
            &self.plan,
            self.gather_piece,
            &working,
        )?;
        Ok(Box::new(FullValues {
            layout: self.grads.layout(),
            values: move |range| full.slice(range),
        }))
    }

    fn for_each_full(
        &mut self,
        partition: Tensor<I, 1>,
        held: Held,
        f: &mut dyn FnMut(&ParamSlot, Tensor<I, 1>),
    ) -> Result<(), EngineError> {
        let full = match (&self.intake, held) {
            // Stage 1's gradients are whole on every rank.
            (Intake::Accumulated(_), Held::Gradients) => partition,
            _ => {
                let (plan, piece) = (&self.plan, self.gather_piece);
                let full = Self::gather(&mut self.grads.flat, plan, piece, &[partition])?;
                full.slice(0..plan.padded_numel())
            }
        };
        each_slot(self.grads.layout(), &full, f);
        Ok(())
    }

    fn checkpoint_layout(&self) -> CheckpointLayout {
        // Every rank's chunk of the padded flat buffer, padding included.
        CheckpointLayout {
            partitioning: Partitioning::Flat {
                chunk: self.plan.chunk(),
            },
            chunks: vec![None; self.grads.layout().slots().len()],
            writers: self.plan.world_size(),
            pad_to: Some(self.plan.chunk()),
        }
    }

    fn load_spans(&self, index: &[usize]) -> (Vec<Span>, usize) {
        let owned = self.owned();
        let mut spans = Vec::new();
        for (slot, &param) in self.grads.layout().slots().iter().zip(index) {
            let (lo, hi) = (
                owned.start.max(slot.offset),
                owned.end.min(slot.offset + slot.numel()),
            );
            if lo < hi {
                spans.push(Span {
                    param,
                    elements: lo - slot.offset..hi - slot.offset,
                    at: lo - owned.start,
                });
            }
        }
        (spans, owned.len())
    }

    fn tensor_bounds(&self, comm: &Arc<dyn Communicator>) -> TensorBounds {
        let layout = self.grads.layout();
        TensorBounds {
            segments: owned_segments(layout, &self.owned()),
            params: layout.slots().len(),
            comm: (comm.world_size() > 1).then(|| comm.clone()),
        }
    }

    fn param_numel(&self) -> (usize, usize) {
        (self.plan.numel(), 0)
    }

    fn comm_buffer_bytes(&self) -> usize {
        match self.intake {
            Intake::Accumulated(_) => Accumulated::comm_buffer_bytes(&self.grads),
            #[cfg(feature = "zero2")]
            Intake::Scattered(_) => Scattered::comm_buffer_bytes(&self.grads),
        }
    }

    fn big_buffer_lens(&self) -> Vec<usize> {
        Self::buffer_lens(&self.plan, self.rank)
    }
}
