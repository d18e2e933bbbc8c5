//! Collectives on the engine's flat buffers: 1-D float tensors of the inner backend.
//!
//! With a communicator that has [`DeviceCollectives`] (NCCL) and CUDA tensors, the collective
//! runs on the tensors' device memory. Ordering, made explicit here:
//! 1. the input's and a fresh output's addresses are taken (materializing fusion's pending
//!    work and aligning this thread's compute stream after the stream that wrote them);
//! 2. the compute stream is synchronized (`Backend::sync`), so the input is complete before
//!    NCCL's stream reads it;
//! 3. NCCL enqueues on its own stream; both buffers are held in `in_flight`;
//! 4. before anything reads an output, [`FlatComm::wait`] blocks until NCCL's stream is done
//!    and releases the buffers. Without `overlap_comm` that wait follows every collective;
//!    with it, backward keeps computing while the gradients travel.
//!
//! Every other case copies through the host and the plain [`Communicator`];
//! `BURN_ZERO_HOST_COLLECTIVES=1` forces that path (to compare or to rule the device path out).

use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::comm::{CommError, Communicator, ReduceOp};

/// One collective on a flat buffer.
#[derive(Clone, Copy, Debug)]
enum Op {
    AllReduce(ReduceOp),
    ReduceScatter(ReduceOp),
    AllGather,
    Broadcast(usize),
}

/// The engine's collectives on flat tensors of `I`.
pub(crate) struct FlatComm<I: Backend> {
    comm: Arc<dyn Communicator>,
    device: I::Device,
    /// Whether device collectives return before NCCL finished (`overlap_comm`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    overlap: bool,
    /// Device collectives are switched off (`BURN_ZERO_HOST_COLLECTIVES=1`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    host_only: bool,
    /// Device buffers NCCL may still be reading or writing.
    #[cfg(feature = "cuda")]
    in_flight: Vec<crate::backend::cuda::CudaBuffer>,
    /// Collectives that ran on device memory (for reports and tests).
    pub(crate) device_calls: usize,
}

impl<I: Backend> FlatComm<I> {
    pub(crate) fn new(comm: Arc<dyn Communicator>, device: I::Device, overlap: bool) -> Self {
        Self {
            comm,
            device,
            overlap,
            host_only: std::env::var("BURN_ZERO_HOST_COLLECTIVES").is_ok_and(|v| v == "1"),
            #[cfg(feature = "cuda")]
            in_flight: Vec::new(),
            device_calls: 0,
        }
    }

    pub(crate) fn comm(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }

    pub(crate) fn device(&self) -> &I::Device {
        &self.device
    }

    /// Reduces `t` across ranks.
    pub(crate) fn all_reduce(
        &mut self,
        t: Tensor<I, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<I, 1>, CommError> {
        self.run(Op::AllReduce(op), t)
    }

    /// Reduces `t` (`world_size × k` elements) and returns this rank's `k`.
    pub(crate) fn reduce_scatter(
        &mut self,
        t: Tensor<I, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<I, 1>, CommError> {
        self.run(Op::ReduceScatter(op), t)
    }

    /// Every rank's `t`, concatenated in rank order.
    pub(crate) fn all_gather(&mut self, t: Tensor<I, 1>) -> Result<Tensor<I, 1>, CommError> {
        self.run(Op::AllGather, t)
    }

    /// `root`'s `t` on every rank.
    pub(crate) fn broadcast(
        &mut self,
        t: Tensor<I, 1>,
        root: usize,
    ) -> Result<Tensor<I, 1>, CommError> {
        self.run(Op::Broadcast(root), t)
    }

    /// Blocks until every device collective finished; their outputs may be read after this.
    pub(crate) fn wait(&mut self) -> Result<(), CommError> {
        #[cfg(feature = "cuda")]
        if !self.in_flight.is_empty() {
            if let Some(device) = self.comm.device() {
                device.synchronize()?;
            }
            self.in_flight.clear();
        }
        Ok(())
    }

    fn output_len(&self, op: Op, len: usize) -> usize {
        let world = self.comm.world_size();
        match op {
            Op::AllReduce(_) | Op::Broadcast(_) => len,
            Op::ReduceScatter(_) => len / world,
            Op::AllGather => len * world,
        }
    }

    fn run(&mut self, op: Op, input: Tensor<I, 1>) -> Result<Tensor<I, 1>, CommError> {
        #[cfg(feature = "cuda")]
        if let Some(output) = self.run_on_device(op, &input)? {
            return Ok(output);
        }
        self.run_on_host(op, input)
    }

    fn run_on_host(&self, op: Op, input: Tensor<I, 1>) -> Result<Tensor<I, 1>, CommError> {
        let dtype = input.dtype();
        let mut values = input
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .expect("f32 values");
        let n = self.output_len(op, values.len());
        let comm = self.comm.as_ref();
        let values = match op {
            Op::AllReduce(reduce) => {
                comm.all_reduce(values.as_mut_slice().into(), reduce)?;
                values
            }
            Op::Broadcast(root) => {
                comm.broadcast(values.as_mut_slice().into(), root)?;
                values
            }
            Op::ReduceScatter(reduce) => {
                let mut out = vec![0.0f32; n];
                comm.reduce_scatter(values.as_slice().into(), out.as_mut_slice().into(), reduce)?;
                out
            }
            Op::AllGather => {
                let mut out = vec![0.0f32; n];
                comm.all_gather(values.as_slice().into(), out.as_mut_slice().into())?;
                out
            }
        };
        let data = TensorData::new(values, [n]).convert_dtype(dtype);
        // The input's dtype: `from_data` would otherwise take the device's default.
        Ok(Tensor::from_data(data, (&self.device, dtype)))
    }

    /// Runs `op` on device memory when the communicator and the tensor allow it.
    #[cfg(feature = "cuda")]
    fn run_on_device(
        &mut self,
        op: Op,
        input: &Tensor<I, 1>,
    ) -> Result<Option<Tensor<I, 1>>, CommError> {
        use crate::backend::cuda::cuda_buffer;
        let Some(device) = self.comm.device().filter(|_| !self.host_only) else {
            return Ok(None);
        };
        let Some(src) = cuda_buffer::<I>(&input.clone().into_primitive().tensor()) else {
            return Ok(None);
        };
        let n = self.output_len(op, src.buf.len);
        let output = Tensor::<I, 1>::empty([n], (&self.device, input.dtype()));
        let dst = cuda_buffer::<I>(&output.clone().into_primitive().tensor())
            .expect("a fresh tensor on the same CUDA device has an address");
        I::sync(&self.device)
            .map_err(|e| CommError::Aborted(format!("the compute stream failed: {e:?}")))?;
        // SAFETY: both buffers are live CUDA allocations of this device, complete (synchronized
        // above), and held in `in_flight` until `wait` has seen NCCL's stream finish.
        unsafe {
            match op {
                Op::AllReduce(reduce) => device.all_reduce(src.buf, dst.buf, reduce),
                Op::ReduceScatter(reduce) => device.reduce_scatter(src.buf, dst.buf, reduce),
                Op::AllGather => device.all_gather(src.buf, dst.buf),
                Op::Broadcast(root) => device.broadcast(src.buf, dst.buf, root),
            }?;
        }
        self.in_flight.push(src);
        self.in_flight.push(dst);
        self.device_calls += 1;
        if !self.overlap {
            self.wait()?;
        }
        Ok(Some(output))
    }
}
