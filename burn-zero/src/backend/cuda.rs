//! Device addresses of burn-cuda float tensors, for collectives on their memory.
//!
//! The engine is generic over its inner backend; at run time it asks whether a flat buffer is
//! a CUDA tensor (`CubeBackend<CudaRuntime>`, or the same behind burn's fusion, the default
//! `burn::backend::Cuda`). Anything else answers `None` and takes the host path.

use core::any::Any;

use burn_backend::{Backend, DType as BurnDType};
use burn_cubecl::CubeBackend;
use burn_cubecl::fusion::FusionCubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use burn_fusion::FusionTensor;
use cubecl::cuda::CudaRuntime;

use crate::comm::{DType, DeviceBuf};

/// A contiguous CUDA buffer and what keeps its memory from being freed or reused.
pub(crate) struct CudaBuffer {
    /// Where it is.
    pub(crate) buf: DeviceBuf,
    /// Holds a reference to the memory until NCCL is done with it.
    pub(crate) _keep: CubeTensor<CudaRuntime>,
}

/// The memory of `tensor` if it is a CUDA float tensor of a dtype NCCL moves, materialized
/// (fusion's pending work on it is executed first). `None` for other backends.
pub(crate) fn cuda_buffer<I: Backend>(tensor: &I::FloatTensorPrimitive) -> Option<CudaBuffer> {
    let any = tensor as &dyn Any;
    if let Some(cube) = any.downcast_ref::<CubeTensor<CudaRuntime>>() {
        return cube_buffer(cube.clone());
    }
    let fused = any.downcast_ref::<FusionTensor<FusionCubeRuntime<CudaRuntime>>>()?;
    // Any CubeBackend over CUDA resolves a fused CUDA tensor: their primitives are the same.
    let cube = fused
        .client
        .resolve_tensor_float::<CubeBackend<CudaRuntime, f32, i32, u8>>(fused.clone());
    cube_buffer(cube)
}

fn cube_buffer(tensor: CubeTensor<CudaRuntime>) -> Option<CudaBuffer> {
    let dtype = match tensor.dtype {
        BurnDType::F32 => DType::F32,
        BurnDType::BF16 => DType::Bf16,
        BurnDType::F16 => DType::F16,
        _ => return None,
    };
    if !tensor.is_contiguous() {
        return None;
    }
    let len = tensor.meta.shape().num_elements();
    // Also aligns this thread's stream after the stream that wrote the memory.
    let resource = tensor.client.get_resource(tensor.handle.clone()).ok()?;
    let resource = resource.resource();
    let bytes = len * tensor.dtype.size();
    assert!(
        resource.size as usize >= bytes,
        "a CUDA tensor of {len} elements lies in {} bytes",
        resource.size
    );
    Some(CudaBuffer {
        buf: DeviceBuf {
            ptr: resource.ptr,
            len,
            dtype,
        },
        _keep: tensor,
    })
}
