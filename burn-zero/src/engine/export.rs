//! Full parameters out of a training engine: streamed one at a time (to save a consolidated
//! model without holding it), or as a whole model (DeepSpeed's
//! `stage3_gather_16bit_weights_on_model_save`). Every rank must make the same calls: under
//! ZeRO-3 each parameter is all-gathered.

use std::collections::HashMap;

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};

use super::params::rebuild_params;
use super::stage::Held;
use super::{Engine, EngineError, ParamSlot, ZeroAutodiff};
use crate::ZeroTensor;

impl<I: Backend, M: Module<ZeroAutodiff<I>>> Engine<I, M> {
    /// Calls `f` with each trainable parameter's full fp32 value (flattened; from the fp32
    /// master weights, whatever the compute dtype), one at a time in module order; under ZeRO-3
    /// each is gathered from the partitions and dropped after `f`, so at most one full
    /// parameter is alive at once.
    pub fn for_each_full_param(
        &self,
        f: impl FnMut(&ParamSlot, Tensor<I, 1>),
    ) -> Result<(), EngineError> {
        self.refuse_while_ahead("for_each_full_param")?;
        self.for_each_full(self.master_partition()?, Held::Master, f)
    }

    /// Calls `f` with each trainable parameter's accumulated, averaged gradient (flattened,
    /// fp32, unscaled), one at a time in module order, like DeepSpeed's `safe_get_full_grad`:
    /// call it after the `backward` that ends an accumulation window and before `step`.
    pub fn for_each_full_grad(
        &self,
        f: impl FnMut(&ParamSlot, Tensor<I, 1>),
    ) -> Result<(), EngineError> {
        self.settle_step_ahead();
        let buffer = self.strategy().grads().partition().cast(FloatDType::F32);
        let buffer = if self.precision.scales() {
            buffer.div_scalar(self.precision.scaler.scale())
        } else {
            buffer
        };
        self.for_each_full(buffer, Held::Gradients, f)
    }

    /// A copy of the model with every parameter full, local and fp32 (the master weights),
    /// usable without the engine.
    /// Under ZeRO-3 this holds the whole model on every rank, so it requires
    /// `stage3_gather_16bit_weights_on_model_save` (else [`Engine::for_each_full_param`]
    /// streams the parameters without holding them all).
    pub fn full_model(&self) -> Result<M, EngineError> {
        self.refuse_while_ahead("full_model")?;
        let gather = self
            .resolved
            .config
            .zero_optimization
            .gather_16bit_weights_on_model_save;
        if let Some(why) = self.strategy().full_model_refused(gather) {
            return Err(EngineError::Usage(why));
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
