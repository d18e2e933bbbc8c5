//! What every stage's gradient intake shares: the flat gradient buffer (or its stream to host
//! memory), the communicator, the failures and counters of a backward pass; and the gradient
//! hook, which hands each final gradient to the stage's strategy.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::tensor::{FloatDType, Tensor, TensorPrimitive};
use burn_backend::distributed::DistributedParamId;
use burn_backend::{Backend, TensorMetadata};
use burn_offload::GradDtype;

use super::collective::FlatComm;
use super::grad_buffer::GradBuffer;
use super::host_grads::{HostGradLayout, HostGradStream};
use super::params::FlatLayout;
use super::precision::Format;
use super::stage::Strategy;
use crate::ZeroTensor;
use crate::backend::hooks::GradientHook;
use crate::comm::CommError;

/// With gradients streaming to host memory, buckets hold at most this many elements and each
/// goes down as soon as the next is reduced: a bucket the size of the model would reach the
/// host only after backward, with nothing left to overlap its copy.
const HOST_BUCKET: usize = 1 << 27;

/// The host side of a finished backward pass ([`GradCore::backward_state`]).
#[derive(Clone)]
pub(crate) struct BackwardState<I: Backend> {
    buffer: super::grad_buffer::BufferState<I>,
    seen: usize,
}

impl<I: Backend> BackwardState<I> {
    /// Whether a backward captured from `captured` would read the same here: nothing written
    /// in either, or the same pieces with the same elements written.
    pub(crate) fn matches(&self, captured: &BackwardState<I>) -> bool {
        self.buffer.matches(&captured.buffer)
    }

    /// What a backward from this state reads of it: the pieces only where elements were
    /// written (a first micro-step copies its gradients in and reads nothing, and holding its
    /// zeroed pieces would keep a second gradient buffer alive).
    pub(crate) fn reads(mut self) -> Self {
        self.buffer = self.buffer.reads();
        self
    }
}

/// The gradient state every strategy holds; the strategy decides what goes where.
pub(crate) struct GradCore<I: Backend> {
    layout: Arc<FlatLayout>,
    /// Index in `layout` of each parameter.
    slots: HashMap<DistributedParamId, usize>,
    pub(crate) flat: FlatComm<I>,
    /// The strategy's gradients on the device, in pieces (see [`GradBuffer`]): empty until
    /// [`GradCore::allocate`], and when they stream to host memory instead.
    pub(crate) buffer: GradBuffer<I>,
    /// ZeRO-Offload of a reduce-scattered partition: it lives in host memory, each bucket sent
    /// down as it arrives.
    pub(crate) host: Option<HostGradStream<I>>,
    /// Elements a bucket collects before it is reduced.
    pub(crate) bucket_size: usize,
    /// Whether the running backward ends an accumulation window.
    pub(crate) boundary: bool,
    /// 1-bit Adam past its warm-up: gradients stay local (the momentum is exchanged instead).
    pub(crate) skip_reduce: bool,
    /// The first communication failure; the engine reports it after backward.
    pub(crate) failure: Option<CommError>,
    /// A failure moving gradients to the host; reported likewise.
    pub(crate) host_failure: Option<String>,
    /// Host time in collectives and their waits since the engine last took it.
    pub(crate) comm_time: Duration,
    /// Parameters reported final during the running backward.
    pub(crate) seen: usize,
    /// The format gradients arrive in (emulated bf16/fp16 rounds them).
    compute: Format,
    /// The format they accumulate and travel in.
    accum: Format,
    /// Elements of one device buffer at most.
    max_piece: usize,
}

impl<I: Backend> GradCore<I> {
    pub(crate) fn new(
        layout: Arc<FlatLayout>,
        flat: FlatComm<I>,
        (compute, accum): (Format, Format),
        bucket_size: usize,
        max_piece: usize,
    ) -> Self {
        let slots = layout
            .slots()
            .iter()
            .enumerate()
            .map(|(i, s)| (DistributedParamId::from(s.id.val()), i))
            .collect();
        let buffer = GradBuffer::zeros(0, max_piece, flat.device(), accum.storage());
        Self {
            layout,
            slots,
            flat,
            buffer,
            host: None,
            bucket_size: bucket_size.max(1),
            boundary: true,
            skip_reduce: false,
            failure: None,
            host_failure: None,
            comm_time: Duration::ZERO,
            seen: 0,
            compute,
            accum,
            max_piece,
        }
    }

    /// Allocates `len` elements of gradients: on the device, or in host memory laid out as
    /// `host` says (smaller buckets then, see [`HOST_BUCKET`]).
    pub(crate) fn allocate(&mut self, len: usize, host: Option<HostGradLayout>) {
        // Gradients reduced and accumulated in bf16 or fp16 are values of that dtype: held as
        // such, exactly, in half the host memory (and summed with the device's rounding).
        let dtype = match self.accum.dtype {
            FloatDType::BF16 => GradDtype::Bf16,
            FloatDType::F16 => GradDtype::F16,
            _ => GradDtype::F32,
        };
        self.host = host.map(|layout| HostGradStream::new(len, layout, dtype));
        let device_len = if self.host.is_some() { 0 } else { len };
        if self.host.is_some() {
            self.bucket_size = self.bucket_size.min(HOST_BUCKET);
        }
        let (device, dtype) = (self.flat.device().clone(), self.accum.storage());
        self.buffer = GradBuffer::zeros(device_len, self.max_piece, &device, dtype);
    }

    pub(crate) fn layout(&self) -> &Arc<FlatLayout> {
        &self.layout
    }

    /// The format gradients accumulate and travel in.
    pub(crate) fn accum(&self) -> Format {
        self.accum
    }

    /// A final gradient as it arrived, counted and in the compute format: it is converted to
    /// the accumulation format where it is sent ([`GradCore::arrived_in_accum`]) or added
    /// ([`GradCore::add_arrived`]).
    fn arrive(&mut self, grad: Tensor<I, 1>) -> Tensor<I, 1> {
        self.seen += 1;
        self.compute.settle(grad)
    }

    /// An arrived gradient in the accumulation format.
    pub(crate) fn arrived_in_accum(&self, grad: Tensor<I, 1>) -> Tensor<I, 1> {
        self.accum.convert(grad)
    }

    /// Adds an arrived gradient into `range` of the buffer. Into f32 it goes as it is (a bf16
    /// gradient's first write converts as it copies: one kernel on CUDA); otherwise it is
    /// converted to the accumulation format first.
    pub(crate) fn add_arrived(&mut self, range: Range<usize>, grad: Tensor<I, 1>) {
        let grad = match self.accum == Format::F32 {
            true => grad,
            false => self.accum.convert(grad),
        };
        self.buffer.add(range, grad, self.accum);
    }

    /// Adds `values` (in the accumulation format: a reduced bucket) into `range`.
    pub(crate) fn add(&mut self, range: Range<usize>, values: Tensor<I, 1>) {
        self.buffer.add(range, values, self.accum);
    }

    /// Bytes of gradient storage held on the device.
    pub(crate) fn gradient_bytes(&self) -> usize {
        self.accum.storage().size() * self.buffer.len()
    }

    /// Bytes of gradient storage in host memory.
    pub(crate) fn host_gradient_bytes(&self) -> usize {
        self.host.as_ref().map_or(0, |h| h.bytes())
    }

    /// This rank's accumulated gradients, as stored, on the device.
    pub(crate) fn partition(&self) -> Tensor<I, 1> {
        match &self.host {
            Some(host) => host.upload(0..host.grads().len(), self.flat.device()),
            None => self.buffer.slice(0..self.buffer.len()),
        }
    }

    /// What a backward pass left here that a replay of its kernels must find again: the
    /// buffer's pieces and written elements, and the parameters seen.
    pub(crate) fn backward_state(&self) -> BackwardState<I> {
        BackwardState {
            buffer: self.buffer.state(),
            seen: self.seen,
        }
    }

    /// Puts back what [`GradCore::backward_state`] took, after its backward was replayed.
    pub(crate) fn restore_backward(&mut self, state: &BackwardState<I>) {
        self.buffer.restore(&state.buffer);
        self.seen = state.seen;
    }

    /// Zeroes the device gradients where they lie ([`GradBuffer::zero_in_place`]); `false`,
    /// changing nothing, where they stream to the host or the backend cannot.
    pub(crate) fn zero_in_place(&mut self) -> bool {
        self.host.is_none() && self.buffer.zero_in_place()
    }

    /// Zeroes the gradients after an optimizer step.
    pub(crate) fn clear(&mut self) {
        self.buffer.clear();
        if let Some(host) = self.host.as_mut() {
            host.clear();
        }
    }
}

/// The `GradientHook` of the engine: hands each final gradient, flattened, to the strategy.
pub(crate) struct EngineHook<I: Backend> {
    pub(crate) strategy: Arc<Mutex<dyn Strategy<I>>>,
}

impl<I: Backend> GradientHook<I> for EngineHook<I> {
    fn on_backward_start(&mut self, _params: &[DistributedParamId]) {
        self.strategy.lock().expect("strategy").grads_mut().seen = 0;
    }

    fn on_gradient_final(&mut self, param: DistributedParamId, grad: &mut ZeroTensor<I>) {
        let mut strategy = self.strategy.lock().expect("strategy");
        let Some(&slot) = strategy.grads().slots.get(&param) else {
            return;
        };
        let n = grad.shape().num_elements();
        let flat = I::float_reshape(grad.inner().clone(), [n].into());
        let flat = Tensor::from_primitive(TensorPrimitive::Float(flat));
        let flat = strategy.grads_mut().arrive(flat);
        if strategy.accept(slot, flat) {
            // The full gradient is not needed any more: its partition is being reduced. One
            // element, not zero: CUDA backends cannot launch kernels over empty tensors.
            let device = I::float_device(grad.inner());
            let dtype = grad.dtype().into();
            *grad.inner_mut() = I::float_zeros([1].into(), &device, dtype);
        }
    }

    fn on_backward_end(&mut self) {
        self.strategy.lock().expect("strategy").end_backward();
    }
}
