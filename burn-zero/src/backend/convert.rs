//! Conversions between burn's float-carrying types of `ZeroBackend` and of its inner backend.
//!
//! The forwarding macro calls these for the few argument and return types that hold float
//! primitives inside another type; every other type is identical for both backends.

use burn_backend::{
    Backend, TensorPrimitive,
    ops::{
        DeformConv2dBackward, MaxPool1dBackward, MaxPool1dWithIndices, MaxPool2dBackward,
        MaxPool2dWithIndices, TransactionPrimitive,
    },
    quantization::QuantizationParametersPrimitive,
};

use super::{ZeroBackend, ZeroTensor};

type Zero<B> = ZeroBackend<B>;

pub(crate) fn primitive_in<B: Backend>(p: TensorPrimitive<Zero<B>>) -> TensorPrimitive<B> {
    match p {
        TensorPrimitive::Float(t) => TensorPrimitive::Float(t.into_inner()),
        TensorPrimitive::QFloat(q) => TensorPrimitive::QFloat(q),
    }
}

pub(crate) fn primitive_out<B: Backend>(p: TensorPrimitive<B>) -> TensorPrimitive<Zero<B>> {
    match p {
        TensorPrimitive::Float(t) => TensorPrimitive::Float(ZeroTensor::local(t)),
        TensorPrimitive::QFloat(q) => TensorPrimitive::QFloat(q),
    }
}

pub(crate) fn qparams_in<B: Backend>(
    p: QuantizationParametersPrimitive<Zero<B>>,
) -> QuantizationParametersPrimitive<B> {
    QuantizationParametersPrimitive {
        scales: p.scales.into_inner(),
    }
}

pub(crate) fn transaction_in<B: Backend>(
    t: TransactionPrimitive<Zero<B>>,
) -> TransactionPrimitive<B> {
    TransactionPrimitive::new(
        t.read_floats
            .into_iter()
            .map(ZeroTensor::into_inner)
            .collect(),
        t.read_qfloats,
        t.read_ints,
        t.read_bools,
    )
}

pub(crate) fn max_pool1d_out<B: Backend>(
    r: MaxPool1dWithIndices<B>,
) -> MaxPool1dWithIndices<Zero<B>> {
    MaxPool1dWithIndices::new(ZeroTensor::local(r.output), r.indices)
}

pub(crate) fn max_pool2d_out<B: Backend>(
    r: MaxPool2dWithIndices<B>,
) -> MaxPool2dWithIndices<Zero<B>> {
    MaxPool2dWithIndices::new(ZeroTensor::local(r.output), r.indices)
}

pub(crate) fn max_pool1d_backward_out<B: Backend>(
    r: MaxPool1dBackward<B>,
) -> MaxPool1dBackward<Zero<B>> {
    MaxPool1dBackward::new(ZeroTensor::local(r.x_grad))
}

pub(crate) fn max_pool2d_backward_out<B: Backend>(
    r: MaxPool2dBackward<B>,
) -> MaxPool2dBackward<Zero<B>> {
    MaxPool2dBackward::new(ZeroTensor::local(r.x_grad))
}

pub(crate) fn deform_conv2d_backward_out<B: Backend>(
    r: DeformConv2dBackward<B>,
) -> DeformConv2dBackward<Zero<B>> {
    DeformConv2dBackward::new(
        ZeroTensor::local(r.x_grad),
        ZeroTensor::local(r.offset_grad),
        ZeroTensor::local(r.weight_grad),
        r.mask_grad.map(ZeroTensor::local),
        r.bias_grad.map(ZeroTensor::local),
    )
}
