//! Full parameters out of a training engine: streamed one at a time (to save a consolidated
//! model without holding it), or as a whole model (DeepSpeed's
//! `stage3_gather_16bit_weights_on_model_save`). Every rank must make the same calls: under
//! ZeRO-3 each parameter is all-gathered.

use std::collections::HashMap;

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};

use super::params::rebuild_params;
use super::{Engine, EngineError, ParamSlot, ZeroAutodiff};
use crate::ZeroTensor;
use crate::comm::with_label;

impl<I: Backend, M: Module<ZeroAutodiff<I>>> Engine<I, M> {
    /// Calls `f` with each trainable parameter's full fp32 value (flattened; from the fp32
    /// master weights, whatever the compute dtype), one at a time in module order; under ZeRO-3
    /// each is gathered from the partitions and dropped after `f`, so at most one full
    /// parameter is alive at once.
    pub fn for_each_full_param(
        &self,
        mut f: impl FnMut(&ParamSlot, Tensor<I, 1>),
    ) -> Result<(), EngineError> {
        let full = match self.resolved.config.zero_optimization.stage {
            0 => self.master_partition()?,
            1 | 2 => self.gather_chunks(&mut self.state().flat, self.master_partition()?)?,
            _ => return self.gather_sharded(self.master_partition()?, f),
        };
        for slot in self.layout.slots() {
            f(
                slot,
                full.clone().slice(slot.offset..slot.offset + slot.numel()),
            );
        }
        Ok(())
    }

    /// Calls `f` with each trainable parameter's accumulated, averaged gradient (flattened,
    /// fp32, unscaled), one at a time in module order, like DeepSpeed's `safe_get_full_grad`:
    /// call it after the `backward` that ends an accumulation window and before `step`.
    pub fn for_each_full_grad(
        &self,
        mut f: impl FnMut(&ParamSlot, Tensor<I, 1>),
    ) -> Result<(), EngineError> {
        let stage = self.resolved.config.zero_optimization.stage;
        let buffer = {
            let state = self.state();
            state.partition().cast(FloatDType::F32)
        };
        let buffer = if self.precision.scales() {
            buffer.div_scalar(self.precision.scaler.scale())
        } else {
            buffer
        };
        let full = match stage {
            0 | 1 => buffer,
            2 => self.gather_chunks(&mut self.state().flat, buffer)?,
            _ => return self.gather_sharded(buffer, f),
        };
        for slot in self.layout.slots() {
            f(
                slot,
                full.clone().slice(slot.offset..slot.offset + slot.numel()),
            );
        }
        Ok(())
    }

    /// Gathers each parameter's chunks of a ZeRO-3 partition-shaped `source` in turn.
    fn gather_sharded(
        &self,
        source: Tensor<I, 1>,
        mut f: impl FnMut(&ParamSlot, Tensor<I, 1>),
    ) -> Result<(), EngineError> {
        let mut state = self.state();
        let state = &mut *state;
        let plan = state.stage3.as_ref().expect("stage 3").plan().clone();
        for (p, slot) in self.layout.slots().iter().enumerate() {
            let start = plan.offset(p);
            let partition = source.clone().slice(start..start + plan.chunk(p));
            let gathered = with_label(p as u64 + 1, || state.flat.all_gather(partition))?;
            state.flat.wait()?;
            f(slot, gathered.slice(0..plan.numel(p)));
        }
        Ok(())
    }

    /// A copy of the model with every parameter full, local and fp32 (the master weights),
    /// usable without the engine.
    /// Under ZeRO-3 this holds the whole model on every rank, so it requires
    /// `stage3_gather_16bit_weights_on_model_save` (else [`Engine::for_each_full_param`]
    /// streams the parameters without holding them all).
    pub fn full_model(&self) -> Result<M, EngineError> {
        let zero = &self.resolved.config.zero_optimization;
        if zero.stage == 3 && !zero.gather_16bit_weights_on_model_save {
            return Err(EngineError::Usage(
                "a full model under ZeRO-3 holds every parameter on every rank: set \
                 `zero_optimization.stage3_gather_16bit_weights_on_model_save` to true, or \
                 stream the parameters with `for_each_full_param`"
                    .into(),
            ));
        }
        self.gather_model()
    }

    /// The trained model with full, local fp32 parameters (the master weights; gathered, so
    /// every rank must call it).
    pub fn into_model(self) -> Result<M, EngineError> {
        self.gather_model()
    }

    fn gather_model(&self) -> Result<M, EngineError> {
        let model = self.model().clone();
        let mut full = HashMap::new();
        self.for_each_full_param(|slot, values| {
            full.insert(slot.offset, (values, slot.shape.clone()));
        })?;
        let layout = self.layout.clone();
        Ok(rebuild_params(model, &layout, |p| {
            let (values, shape) = full
                .remove(&layout.slots()[p].offset)
                .expect("every parameter was gathered");
            let values = values.into_primitive().tensor();
            ZeroTensor::local(I::float_reshape(values, shape.into()))
        }))
    }
}
