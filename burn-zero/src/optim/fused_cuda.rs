//! The device optimizer's Adam/AdamW step as one CubeCL kernel on CUDA tensors
//! (cubecl-kernels' fused AdamW): one read of master, gradient and moments and one write of
//! the new ones, where burn's tensor ops would make several passes. The new values go to new
//! buffers: burn tensors are values that other tensors may share.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorPrimitive};
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cubecl_kernels::adam::{AdamConstants, adamw_into};

use crate::backend::cuda::{cube_tensor, from_cube};

/// `(master, m, v)` after one step from `grad`, or `None` when these are not contiguous f32
/// CUDA tensors of one device (the tensor ops take them then).
pub(crate) fn adamw<B: Backend>(
    master: &Tensor<B, 1>,
    grad: &Tensor<B, 1>,
    m: &Tensor<B, 1>,
    v: &Tensor<B, 1>,
    k: &AdamConstants,
) -> Option<[Tensor<B, 1>; 3]> {
    let primitive = |t: &Tensor<B, 1>| t.clone().into_primitive().tensor();
    let like = primitive(master);
    let inputs = [master, grad, m, v].map(|t| cube_tensor::<B>(&primitive(t)));
    let inputs: Vec<CubeTensor<CudaRuntime>> = inputs.into_iter().collect::<Option<_>>()?;
    let len = master.dims()[0];
    let usable = |c: &CubeTensor<CudaRuntime>| {
        c.dtype == DType::F32 && c.is_contiguous() && c.meta.shape().num_elements() == len
    };
    if !inputs.iter().all(usable) || inputs.iter().any(|c| c.device != inputs[0].device) {
        return None;
    }
    let (client, device) = (inputs[0].client.clone(), inputs[0].device.clone());
    let outputs = [0; 3].map(|_| {
        let handle = client.empty(4 * len);
        CubeTensor::new_contiguous(
            client.clone(),
            device.clone(),
            [len].into(),
            handle,
            DType::F32,
        )
    });
    let [a, b, c, d] = [0, 1, 2, 3].map(|i| &inputs[i].handle);
    let [e, f, g] = [0, 1, 2].map(|i| &outputs[i].handle);
    adamw_into::<CudaRuntime>(&client, k, len, [a, b, c, d], [e, f, g]);
    let tensor =
        |o| from_cube::<B>(&like, o).map(|p| Tensor::from_primitive(TensorPrimitive::Float(p)));
    let [w, m, v] = outputs.map(tensor);
    Some([w?, m?, v?])
}
