//! What a strategy's [`Strategy::setup`](super::Strategy::setup) needs from `initialize`, and
//! the set-up of the stages whose parameters stay full (0–2): rank 0's values on every rank,
//! this rank's owned range of them as the fp32 master.

use std::ops::Range;
use std::sync::Arc;

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Shape, Tensor, TensorData};

use super::super::grads::GradCore;
use super::super::params::{
    FlatLayout, ParamSlot, flatten_params, params_to_host, rebuild_params, unflatten_params,
};
use super::super::precision::Format;
use super::super::{EngineError, ZeroAutodiff};
use super::{Master, ParamSource};
use crate::ZeroTensor;
use crate::backend::hooks;
use crate::comm::{BufMut, Communicator};
use crate::config::{OffloadDevice, ResolvedConfig};

/// The run's facts a strategy's set-up reads.
pub(crate) struct Setup<'a> {
    pub(crate) resolved: &'a ResolvedConfig,
    /// The format the model computes in.
    pub(crate) compute: Format,
    pub(crate) comm: &'a Arc<dyn Communicator>,
}

impl Setup<'_> {
    /// Whether the optimizer state lives off the device (`offload_optimizer`).
    pub(crate) fn optimizer_offloaded(&self) -> bool {
        self.resolved.config.zero_optimization.optimizer_offload() != OffloadDevice::None
    }
}

/// Stages 0–2: the model's parameters in the compute format with rank 0's values, and the
/// `owned` elements of the flat buffer as this rank's master.
pub(crate) fn full_params<I: Backend, M: Module<ZeroAutodiff<I>>>(
    model: M,
    core: &mut GradCore<I>,
    setup: &Setup<'_>,
    owned: Range<usize>,
) -> Result<(M, Master<I>), EngineError> {
    let layout = core.layout().clone();
    let layout = layout.as_ref();
    let compute = setup.compute;
    if setup.optimizer_offloaded() {
        // ZeRO-Offload: the values go to the host one parameter at a time and come back in
        // the compute format, so the device never holds a second fp32 copy.
        let mut values = params_to_host(&model, layout);
        broadcast_on_host(setup.comm.as_ref(), &mut values)?;
        let device = core.flat.device().clone();
        let model = rebuild_params(model, layout, |p| {
            let slot = &layout.slots()[p];
            let part = values[slot.offset..slot.offset + slot.numel()].to_vec();
            let t = Tensor::<I, 1>::from_data(TensorData::new(part, [slot.numel()]), &device);
            let shape = Shape::from(slot.shape.clone());
            ZeroTensor::local(I::float_reshape(
                compute.convert(t).into_primitive().tensor(),
                shape,
            ))
        });
        let master = if owned == (0..values.len()) {
            values
        } else {
            values[owned].to_vec()
        };
        return Ok((hooks::mark_distributed(model), Master::Host(master)));
    }
    let flat = flatten_params(&model, layout);
    let params = core.flat.broadcast(flat, 0)?;
    core.flat.wait()?;
    let params = params.cast(FloatDType::F32);
    let master = params.clone().slice(owned);
    let model = unflatten_params(model, layout, compute.convert(params));
    Ok((hooks::mark_distributed(model), Master::Device(master)))
}

/// Rank 0's `values` on every rank, through host buffers in pieces (so a device path holds
/// one piece at a time).
fn broadcast_on_host(comm: &dyn Communicator, values: &mut [f32]) -> Result<(), EngineError> {
    const PIECE: usize = 1 << 26;
    if comm.world_size() > 1 {
        for piece in values.chunks_mut(PIECE) {
            comm.broadcast(BufMut::from(piece), 0)?;
        }
    }
    Ok(())
}

/// Each parameter cut from the full flat values, `values(its range)`, in its shape (stages
/// 0–2 after a step: the new values are whole on every rank).
pub(crate) struct FullValues<'a, F> {
    pub(crate) layout: &'a FlatLayout,
    pub(crate) values: F,
}

impl<I: Backend, F: FnMut(Range<usize>) -> Tensor<I, 1>> ParamSource<I> for FullValues<'_, F> {
    fn param(&mut self, p: usize) -> ZeroTensor<I> {
        let slot = &self.layout.slots()[p];
        let values = (self.values)(slot.offset..slot.offset + slot.numel());
        let shape = Shape::from(slot.shape.clone());
        ZeroTensor::local(I::float_reshape(values.into_primitive().tensor(), shape))
    }
}

/// Calls `f` with each parameter's part of the full flat `values`, in layout order.
pub(crate) fn each_slot<I: Backend>(
    layout: &FlatLayout,
    values: &Tensor<I, 1>,
    f: &mut dyn FnMut(&ParamSlot, Tensor<I, 1>),
) {
    for slot in layout.slots() {
        f(
            slot,
            values
                .clone()
                .slice(slot.offset..slot.offset + slot.numel()),
        );
    }
}
