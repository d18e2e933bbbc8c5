//! Float tensors sent to and received from another rank: a pipeline's activations and their
//! gradients.
//!
//! Where the communicator has a one-way link to the peer ([`DeviceCollectives::link`], NCCL's
//! `NcclComm::open_links`) and the tensor is a CUDA tensor, the message stays in device memory
//! and the host never waits for the GPU:
//! - a send copies the tensor into memory of its own (`staged_copy`: sending the tensor's own
//!   memory gave wrong updates, see there) and raises a flag on burn's stream after the copy;
//!   the link's stream waits for it, sends, and signals back. The copy is held until
//!   [`TensorLinks::finish`] has made burn's stream wait for every send, so its memory is not
//!   reused while NCCL reads it; burn's
//!   stream does not wait for a send before then (a send completes only when the peer receives,
//!   and a pipeline's peer receives later in its own order);
//! - a receive allocates its tensor on burn's stream from cubecl's thread and registers it with
//!   fusion (as the engine's collectives do: a receive into a tensor made by fusion's `empty`
//!   did not land in the memory later reads used), raises a flag after it, and makes burn's
//!   stream wait for the link's stream to have received: what reads the tensor comes after.
//!
//! Behind fusion, the handshakes and the waits are taken on fusion's thread after its queue has
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
    /// Sends on device memory not yet ordered before burn's later work, with their tensors.
    #[cfg(feature = "cuda")]
    sent: Vec<(
        crate::backend::cuda::Fence,
        crate::backend::cuda::CudaBuffer,
    )>,
    device_messages: usize,
    /// Whether the flag kernels were launched from cubecl's thread yet (see `warm`).
    #[cfg(feature = "cuda")]
    warm: bool,
}

impl<'a> TensorLinks<'a> {
    /// Messages over `comm`'s links where it has them, its host `send`/`recv` otherwise.
    pub fn new(comm: &'a dyn Communicator) -> Self {
        Self {
            comm,
            #[cfg(feature = "cuda")]
            sent: Vec::new(),
            device_messages: 0,
            #[cfg(feature = "cuda")]
            warm: false,
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
        {
            let (fences, buffers): (Vec<_>, Vec<_>) =
                std::mem::take(&mut self.sent).into_iter().unzip();
            crate::log::trace_order(|| format!("finish: {} sends", fences.len()));
            crate::backend::cuda::await_fences(fences).map_err(|e| {
                CommError::Aborted(format!("ordering burn's stream after a send: {e}"))
            })?;
            // Released only now that burn's stream waits for the sends: the pool hands their
            // memory to burn's stream again at once, and the wait above first runs whatever
            // fusion had queued (a step's optimizer, which allocates). Released before it, a
            // large message still on its way to the peer could be overwritten by that step.
            drop(buffers);
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
        use crate::backend::cuda::{fence_in_order, staged_copy};
        let rank = self.comm.rank();
        let call = OpSignature::new(OpKind::PointToPoint, wire_dtype(tensor.dtype()), 0);
        let invalid = |reason: String| CommError::Invalid { rank, call, reason };
        if !link.orders_by_flags() {
            return Err(invalid("the link's stream cannot wait for flags".into()));
        }
        crate::log::trace_order(|| format!("send to {peer}: {:?}", tensor.dims()));
        let primitive = tensor.into_primitive().tensor();
        let src = staged_copy(&primitive as &dyn core::any::Any).ok_or_else(|| {
            invalid(format!(
                "the link to rank {peer} is on a GPU, the tensor is not a CUDA tensor"
            ))
        })?;
        crate::log::trace_order(|| format!("send to {peer}: staged"));
        self.warm(&src, link);
        let fence = fence_in_order(
            &primitive as &dyn core::any::Any,
            &src,
            crate::backend::cuda::channel_of(link),
        )
        .ok_or_else(|| invalid("burn's stream could not raise a flag for the send".into()))?;
        // SAFETY: `src` is complete once `ready` is raised and is held in `sent` until burn's
        // stream waits for `done`.
        unsafe { between_flags(link, &fence, "send", || link.send(src.buf, to))? };
        self.sent.push((fence, src));
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
        if !link.orders_by_flags() {
            return Err(invalid("the link's stream cannot wait for flags".into()));
        }
        crate::log::trace_order(|| format!("receive from {peer}: {dims:?}"));
        let (dst, fence, primitive) = crate::backend::cuda::ordered_empty::<I>(
            device,
            &dims,
            dtype,
            crate::backend::cuda::channel_of(link),
        )
        .ok_or_else(|| {
            invalid(format!(
                "the link from rank {peer} is on a GPU, the device is not a CUDA device"
            ))
        })?;
        let tensor =
            Tensor::<I, D>::from_primitive(burn::tensor::TensorPrimitive::Float(primitive));
        // SAFETY: `dst` is allocated before `ready` is raised and lives in `tensor`; burn's
        // stream waits for `done` below, before anything it runs later reads or frees it.
        unsafe { between_flags(link, &fence, "receive", || link.recv(dst.buf, from))? };
        fence.await_on_compute_stream().map_err(|e| {
            CommError::Aborted(format!("ordering burn's stream after a receive: {e}"))
        })?;
        self.device_messages += 1;
        Ok(tensor)
    }
}

#[cfg(feature = "cuda")]
impl TensorLinks<'_> {
    /// Before the first message: burn's flag kernels launched once from cubecl's own thread,
    /// which loads them now. A handshake taken in fusion's order launches them later, from
    /// fusion's thread, while the link's stream may already spin for the flag; under CUDA's
    /// lazy loading, loading a kernel can wait for the spinning one, which waits for it. The
    /// flag this raises early is below every number a link waits for afterwards.
    fn warm(
        &mut self,
        buffer: &crate::backend::cuda::CudaBuffer,
        link: &dyn crate::comm::DeviceCollectives,
    ) {
        if !std::mem::replace(&mut self.warm, true) {
            let _ =
                crate::backend::cuda::fence_after(buffer, crate::backend::cuda::channel_of(link));
        }
    }
}

/// `message` on the link's stream between `fence`'s flags: after burn's stream raised `ready`,
/// and `done` raised after it, even when it failed (burn's stream may be told to wait for it).
///
/// # Safety
/// The buffers `message` reads or writes are live and complete when `ready` is raised, and stay
/// so until burn's stream has waited for `done`.
#[cfg(feature = "cuda")]
unsafe fn between_flags(
    link: &dyn crate::comm::DeviceCollectives,
    fence: &crate::backend::cuda::Fence,
    what: &str,
    message: impl FnOnce() -> Result<(), CommError>,
) -> Result<(), CommError> {
    let (flag, seq) = fence.ready();
    // SAFETY: the flags live as long as cubecl's flags.
    unsafe { link.wait_for_flag(flag, seq)? };
    let outcome = message();
    crate::log::trace_order(|| {
        format!("{what} issued on the link after ready {flag:#x} seq {seq}: {outcome:?}")
    });
    let (flag, seq) = fence.done();
    // SAFETY: as for `ready`.
    if let Err(e) = unsafe { link.raise_flag(flag, seq) } {
        panic!("after a {what}, the link's stream could not signal burn's: {e}");
    }
    outcome
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
