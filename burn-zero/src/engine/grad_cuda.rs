//! A gradient's first write into the f32 gradient buffer on burn-cuda: cubecl-kernels'
//! `cast_into` as an operation of burn's fusion stream, writing the bf16/f16/f32 values into
//! the buffer's piece in place. burn ops take a cast into a new tensor and a `slice_assign`
//! copy (and fusion sometimes folds the cast into a slower kernel): at 1B on one H200 these
//! were about 6 ms of each step.

use core::any::TypeId;
use core::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape, Tensor, TensorPrimitive};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_fusion::FusionRuntime;
use burn_fusion::stream::{Operation, OperationStreams};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};
use cubecl::cuda::CudaRuntime;
use cubecl_kernels::cast::cast_into;

use crate::backend::fused_op::{Fused, FusedCuda};
use crate::nn::downcast::float_as;

type Cuda = burn::backend::Cuda;
type Cube = CubeBackend<CudaRuntime, f32, i32, u8>;

/// Writes the values (second input) into `range` of the piece (first input), converted to
/// f32: in the piece's own buffer when fusion hands it over as its last use, else into a copy.
#[derive(Debug)]
struct CastIntoOp {
    desc: CustomOpIr,
    range: Range<usize>,
}

impl Operation<FusedCuda> for CastIntoOp {
    fn execute(&self, handles: &mut HandleContainer<<FusedCuda as FusionRuntime>::FusionHandle>) {
        let ([piece, values], [out]) = self.desc.as_fixed::<2, 1>();
        let piece = handles.get_float_tensor::<Cube>(piece);
        let values = into_contiguous(handles.get_float_tensor::<Cube>(values));
        let piece = match piece.can_mut() && piece.is_contiguous() {
            true => piece,
            false => piece.copy(),
        };
        let at = piece
            .handle
            .clone()
            .offset_start((self.range.start * DType::F32.size()) as u64);
        cast_into::<CudaRuntime>(
            &piece.client,
            values.dtype.into(),
            self.range.len(),
            &values.handle,
            &at,
        );
        handles.register_float_tensor::<Cube>(&out.id, piece);
    }
}

/// `piece` (f32) with `values` (f32, bf16 or f16; `range.len()` elements) written into
/// `range`, converted to f32, as one kernel of burn-cuda's fusion stream, in place where
/// `piece` is its buffer's only reference. Both back where they are not burn-cuda tensors of
/// those dtypes.
#[allow(clippy::type_complexity)]
pub(crate) fn cast_into_piece<I: Backend>(
    piece: Tensor<I, 1>,
    range: Range<usize>,
    values: Tensor<I, 1>,
) -> Result<Tensor<I, 1>, (Tensor<I, 1>, Tensor<I, 1>)> {
    let takes = TypeId::of::<I>() == TypeId::of::<Cuda>()
        && piece.dtype() == DType::F32
        && matches!(values.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && values.dims()[0] == range.len()
        && range.end <= piece.dims()[0];
    if !takes {
        return Err((piece, values));
    }
    let len = piece.dims()[0];
    let fused = |t: Tensor<I, 1>| -> Fused {
        let t = float_as::<I, Cuda, 1>(t).expect("I is burn-cuda's backend");
        t.into_primitive().tensor()
    };
    let (piece, values) = (fused(piece), fused(values));
    let client = piece.client.clone();
    let streams = OperationStreams::with_inputs([&piece, &values]);
    let output = TensorIr::uninit(client.create_empty_handle(), Shape::new([len]), DType::F32);
    // The piece goes in by value: its last reference, so fusion may hand its buffer over.
    let inputs = [piece.into_ir(), values.into_ir()];
    let desc = CustomOpIr::new("burn_zero_cast_into", &inputs, &[output]);
    let op = CastIntoOp {
        desc: desc.clone(),
        range,
    };
    let [out]: [Fused; 1] = client
        .register(streams, OperationIr::Custom(desc), op)
        .try_into()
        .expect("one output");
    let out = Tensor::<Cuda, 1>::from_primitive(TensorPrimitive::Float(out));
    Ok(float_as::<Cuda, I, 1>(out).expect("I is burn-cuda's backend"))
}
