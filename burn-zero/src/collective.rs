//! Collectives on whole tensors over a borrowed communicator, for parallelism built outside
//! the engine: a pipeline stage's gradients over the data axis, a tensor-parallel layer's sums
//! over the model axis. On a communicator with device memory (NCCL) and CUDA tensors they run
//! in device memory, ordered against burn's stream by flags as the engine's own collectives
//! are (`engine::collective`): what reads the output runs after the collective, and the host
//! does not wait. Otherwise the values go through host memory as f32 and the plain
//! [`Communicator`].

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use crate::comm::{CommError, Communicator, ReduceOp};
use crate::engine::collective::FlatComm;

/// `tensor` reduced element-wise over `comm`'s ranks with `op`, in its shape and dtype. Every
/// rank calls it with the same shape.
pub fn all_reduce<I: Backend, const D: usize>(
    comm: &dyn Communicator,
    tensor: Tensor<I, D>,
    op: ReduceOp,
) -> Result<Tensor<I, D>, CommError> {
    let shape = tensor.shape();
    let flat = tensor.reshape([shape.num_elements()]);
    let mut calls = FlatComm::<I, &dyn Communicator>::new(comm, flat.device(), false, false);
    #[cfg(feature = "cuda")]
    if let Some(device) = comm.device() {
        calls = calls.on_channel(crate::backend::cuda::channel_of(device));
    }
    Ok(calls.all_reduce(flat, op)?.reshape(shape))
}
