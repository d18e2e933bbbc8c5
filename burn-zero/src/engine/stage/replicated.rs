//! Stage 0: plain data parallelism. Every rank holds the whole model, its gradients and the
//! optimizer state; gradients are all-reduced once per accumulation window.

use std::ops::Range;
use std::sync::Arc;

use burn::module::Module;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use super::super::flat_pieces::slice_pieces;
use super::super::grads::GradCore;
use super::super::host_grads::HostGradLayout;
use super::super::params::ParamSlot;
use super::super::{EngineError, ZeroAutodiff};
use super::intake::Accumulated;
use super::setup::{FullValues, Setup, each_slot, full_params};
use super::{CheckpointLayout, Held, Master, ParamSource, Strategy, owned_segments};
use crate::checkpoint::{Partitioning, Span};
use crate::comm::{CommError, Communicator};
use crate::config::ZeroStage;
use crate::optim::TensorBounds;

pub(crate) struct Replicated<I: Backend> {
    grads: GradCore<I>,
}

impl<I: Backend> Replicated<I> {
    pub(crate) fn new(grads: GradCore<I>) -> Self {
        Self { grads }
    }

    fn numel(&self) -> usize {
        self.grads.layout().numel()
    }
}

impl<I: Backend> Strategy<I> for Replicated<I> {
    fn stage(&self) -> ZeroStage {
        ZeroStage::Disabled
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
        let all = 0..self.numel();
        full_params(model, &mut self.grads, setup, all)
    }

    fn allocate(&mut self, _host: Option<HostGradLayout>) {
        // The full gradient stays on the device: ZeRO-Offload streams partitions only.
        let len = self.numel();
        self.grads.allocate(len, None);
    }

    fn accept(&mut self, slot: usize, grad: Tensor<I, 1>) -> bool {
        Accumulated::accept(&mut self.grads, slot, grad);
        false
    }

    fn end_backward(&mut self) {
        Accumulated::end_backward(&mut self.grads);
    }

    fn step_range(&self) -> Range<usize> {
        0..self.numel()
    }

    fn total_squares(&mut self, squares: Tensor<I, 1>) -> Result<Tensor<I, 1>, CommError> {
        // Every rank holds the whole (all-reduced) gradient.
        Ok(squares)
    }

    fn publish(
        &mut self,
        working: Vec<Tensor<I, 1>>,
    ) -> Result<Box<dyn ParamSource<I> + '_>, EngineError> {
        Ok(Box::new(FullValues {
            layout: self.grads.layout(),
            values: move |range| slice_pieces(&working, range),
        }))
    }

    fn for_each_full(
        &mut self,
        partition: Tensor<I, 1>,
        _held: Held,
        f: &mut dyn FnMut(&ParamSlot, Tensor<I, 1>),
    ) -> Result<(), EngineError> {
        each_slot(self.grads.layout(), &partition, f);
        Ok(())
    }

    fn checkpoint_layout(&self) -> CheckpointLayout {
        // Replicated: rank 0's file holds it all (and rank 0 writes the manifest).
        CheckpointLayout {
            partitioning: Partitioning::Flat {
                chunk: self.numel(),
            },
            chunks: vec![None; self.grads.layout().slots().len()],
            writers: 1,
            pad_to: None,
        }
    }

    fn load_spans(&self, index: &[usize]) -> (Vec<Span>, usize) {
        let slots = self.grads.layout().slots();
        let spans = slots
            .iter()
            .zip(index)
            .map(|(slot, &param)| Span {
                param,
                elements: 0..slot.numel(),
                at: slot.offset,
            })
            .collect();
        (spans, self.numel())
    }

    fn tensor_bounds(&self, _comm: &Arc<dyn Communicator>) -> TensorBounds {
        let layout = self.grads.layout();
        TensorBounds {
            segments: owned_segments(layout, &(0..layout.numel())),
            params: layout.slots().len(),
            comm: None,
        }
    }

    fn param_numel(&self) -> (usize, usize) {
        (self.numel(), 0)
    }

    fn comm_buffer_bytes(&self) -> usize {
        Accumulated::comm_buffer_bytes(&self.grads)
    }

    fn big_buffer_lens(&self) -> Vec<usize> {
        vec![self.numel()]
    }
}
