//! Float tensors sent to and received from another rank: a pipeline's activations and their
//! gradients.
//!
//! Where the communicator has a one-way link to the peer ([`DeviceCollectives::link`], NCCL's
//! `NcclComm::open_links`) and the tensor is a CUDA tensor, the message stays in device memory
//! and the host never waits for the GPU:
//! - a send copies the tensor into memory of its own (`staged_copy`: sending the tensor's own
//!   memory gave wrong updates, see there) and records a CUDA event on burn's stream after the
//!   copy; the link's stream waits for it, sends, and records an event of its own. The copy is
//!   held until [`TensorLinks::finish`] has made burn's stream wait for the link's last event,
//!   so its memory is not reused while NCCL reads it; burn's stream does not wait for a send
//!   before then (a send completes only when the peer receives, and a pipeline's peer receives
//!   later in its own order);
//! - a receive allocates its tensor on burn's stream from cubecl's thread and registers it with
//!   fusion (as the engine's collectives do: a receive into a tensor made by fusion's `empty`
//!   did not land in the memory later reads used), records an event after it for the link's
//!   stream, and makes burn's stream wait for the link's event after the receive: what reads
//!   the tensor comes after.
//!
//! Events, not the flag kernels the engine's collectives use (`stream_order.rs`): a kernel
//! spinning on burn's stream for a receive deadlocked against CUDA loading a module
//! (`backend/stream_event.rs` says how).
//!
//! Behind fusion, the events and the waits are taken on fusion's thread after its queue has
//! run, so they land on burn's stream after every operation registered before them.
//!
//! Without a link, the message goes through host memory over the communicator's `send`/`recv`,
//! as f32. Both ends decide the same way: links are opened in pairs.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};

#[cfg(feature = "cuda")]
use crate::comm::Way;
use crate::comm::{CommError, Communicator};
#[cfg(feature = "cuda")]
use crate::comm::{OpKind, OpSignature};

/// The messages of one rank over `comm`, for one span of work (a pipeline's step).
pub struct TensorLinks<'a> {
    comm: &'a dyn Communicator,
    /// Per link, sends on device memory not yet ordered before burn's later work.
    #[cfg(feature = "cuda")]
    sent: Vec<SentOn>,
    device_messages: usize,
}

impl<'a> TensorLinks<'a> {
    /// Messages over `comm`'s links where it has them, its host `send`/`recv` otherwise.
    pub fn new(comm: &'a dyn Communicator) -> Self {
        Self {
            comm,
            #[cfg(feature = "cuda")]
            sent: Vec::new(),
            device_messages: 0,
        }
    }

    /// Messages that travelled in device memory so far.
    pub fn device_messages(&self) -> usize {
        self.device_messages
    }

    /// Sends `tensor` to `peer`, which receives it with [`TensorLinks::recv`] of the same shape
    /// and `tensor`'s dtype.
    pub fn send<I: Backend, const D: usize>(
        &mut self,
        tensor: Tensor<I, D>,
        peer: usize,
    ) -> Result<(), CommError> {
        #[cfg(feature = "cuda")]
        if let Some((link, to)) = self.comm.device().and_then(|d| d.link(peer, Way::To)) {
            return self.send_on_device(link, to, tensor, peer);
        }
        let values = tensor
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .expect("f32 values");
        self.comm.send(values.as_slice().into(), peer)
    }

    /// Receives from `peer` a tensor of `dims` and `dtype` on `device`.
    pub fn recv<I: Backend, const D: usize>(
        &mut self,
        dims: [usize; D],
        dtype: DType,
        device: &I::Device,
        peer: usize,
    ) -> Result<Tensor<I, D>, CommError> {
        #[cfg(feature = "cuda")]
        if let Some((link, from)) = self.comm.device().and_then(|d| d.link(peer, Way::From)) {
            return self.recv_on_device(link, from, dims, dtype, device, peer);
        }
        let mut values = vec![0.0f32; dims.iter().product()];
        self.comm.recv(values.as_mut_slice().into(), peer)?;
        let data = TensorData::new(values, dims).convert_dtype(dtype);
        Ok(Tensor::from_data(data, (device, dtype)))
    }

    /// Orders burn's stream after every send so far and lets their tensors go. Call it before
    /// the sent tensors' memory may be reused for long (a step's end); dropping the links does
    /// it too.
    pub fn finish(&mut self) -> Result<(), CommError> {
        #[cfg(feature = "cuda")]
        for sent in std::mem::take(&mut self.sent) {
            crate::log::trace_order(|| format!("finish: {} sends", sent.buffers.len()));
            crate::backend::stream_event::wait_in_order(sent.fusion, &sent.device, sent.done)
                .map_err(|e| {
                    CommError::Aborted(format!("ordering burn's stream after a send: {e}"))
                })?;
            // Released only now that burn's stream waits for the sends: the pool hands their
            // memory to burn's stream again at once, and the wait above first runs whatever
            // fusion had queued (a step's optimizer, which allocates). Released before it, a
            // large message still on its way to the peer could be overwritten by that step.
            drop(sent.buffers);
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn send_on_device<I: Backend, const D: usize>(
        &mut self,
        link: &dyn crate::comm::DeviceCollectives,
        to: usize,
        tensor: Tensor<I, D>,
        peer: usize,
    ) -> Result<(), CommError> {
        use crate::backend::cuda::staged_copy;
        use crate::backend::stream_event::{between_events, record_in_order};
        let rank = self.comm.rank();
        let call = OpSignature::new(OpKind::PointToPoint, wire_dtype(tensor.dtype()), 0);
        let invalid = |reason: String| CommError::Invalid { rank, call, reason };
        crate::log::trace_order(|| format!("send to {peer}: {:?}", tensor.dims()));
        let primitive = tensor.into_primitive().tensor();
        let src = staged_copy(&primitive as &dyn core::any::Any).ok_or_else(|| {
            invalid(format!(
                "the link to rank {peer} is on a GPU, the tensor is not a CUDA tensor"
            ))
        })?;
        let device = src._keep.device.clone();
        let fusion = crate::backend::cuda::fusion_client_of(&primitive as &dyn core::any::Any);
        let ready = record_in_order(fusion.clone(), &device)
            .map_err(|e| invalid(format!("an event on burn's stream before a send: {e}")))?;
        // SAFETY: `src` is complete once `ready` is reached and is held in `sent` until burn's
        // stream waits for `done`.
        let done = unsafe { between_events(link, ready, "send", || link.send(src.buf, to))? };
        // A link's stream runs in order: its last event covers the sends before.
        let channel = crate::backend::cuda::channel_of(link);
        if let Some(i) = self.sent.iter().position(|s| s.channel == channel) {
            let earlier = std::mem::replace(&mut self.sent[i].done, done);
            crate::backend::stream_event::drop_event(earlier);
            self.sent[i].buffers.push(src);
        } else {
            self.sent.push(SentOn {
                channel,
                done,
                fusion,
                device,
                buffers: vec![src],
            });
        }
        self.device_messages += 1;
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn recv_on_device<I: Backend, const D: usize>(
        &mut self,
        link: &dyn crate::comm::DeviceCollectives,
        from: usize,
        dims: [usize; D],
        dtype: DType,
        device: &I::Device,
        peer: usize,
    ) -> Result<Tensor<I, D>, CommError> {
        let rank = self.comm.rank();
        let call = OpSignature::new(
            OpKind::PointToPoint,
            wire_dtype(dtype),
            dims.iter().product(),
        );
        let invalid = |reason: String| CommError::Invalid { rank, call, reason };
        crate::log::trace_order(|| format!("receive from {peer}: {dims:?}"));
        let (dst, ready, primitive, fusion) =
            crate::backend::cuda::empty_with_event::<I>(device, &dims, dtype).ok_or_else(|| {
                invalid(format!(
                    "the link from rank {peer} is on a GPU, the device is not a CUDA device"
                ))
            })?;
        let tensor =
            Tensor::<I, D>::from_primitive(burn::tensor::TensorPrimitive::Float(primitive));
        // SAFETY: `dst` is allocated before `ready` and lives in `tensor`; burn's stream waits
        // for `done` below, before anything it runs later reads or frees it.
        let done = unsafe {
            crate::backend::stream_event::between_events(link, ready, "receive", || {
                link.recv(dst.buf, from)
            })?
        };
        crate::backend::stream_event::wait_in_order(fusion, &dst._keep.device, done).map_err(
            |e| CommError::Aborted(format!("ordering burn's stream after a receive: {e}")),
        )?;
        self.device_messages += 1;
        Ok(tensor)
    }
}

/// The sends on one link's stream not yet ordered before burn's later work.
#[cfg(feature = "cuda")]
struct SentOn {
    channel: u64,
    /// Recorded on the link's stream after its last send.
    done: crate::backend::stream_event::RawEvent,
    /// The fusion client burn's wait goes through (the sent tensors').
    fusion: Option<crate::backend::cuda::FusionClient>,
    device: cubecl::cuda::CudaDevice,
    /// The staged copies the sends read, held until burn's stream waits for `done`.
    buffers: Vec<crate::backend::cuda::CudaBuffer>,
}

impl Drop for TensorLinks<'_> {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

/// A message's element type in its signature (f32 for dtypes NCCL does not move: the call
/// fails on them before the signature matters).
#[cfg(feature = "cuda")]
fn wire_dtype(dtype: DType) -> crate::comm::DType {
    crate::backend::cuda::comm_dtype(dtype).unwrap_or(crate::comm::DType::F32)
}
