//! Mixed precision in the engine (`bf16` / `fp16` / `data_types.grad_accum_dtype`): the model
//! computes in bf16 or fp16 while the optimizer keeps fp32 master weights and state;
//! gradients are accumulated and reduced in fp32 unless `grad_accum_dtype` says otherwise;
//! fp16 multiplies the loss by the scaler's scale, unscales the gradients before clipping and
//! skips a step whose gradients overflowed on any rank.
//!
//! A backend without the dtype (NdArray has f32/f64 only) gets it emulated: values are
//! rounded to it (parameters when written, gradients when they arrive, accumulators after
//! each sum) and stored in f32; activations then compute in f32.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor, TensorData};
use half::{bf16, f16};

use crate::config::DeepSpeedConfig;
use crate::precision::LossScaler;

/// A floating-point format, held natively or emulated by rounding f32 values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Format {
    pub(crate) dtype: FloatDType,
    pub(crate) emulated: bool,
}

impl Format {
    fn of<I: Backend>(dtype: FloatDType, device: &I::Device) -> Self {
        let emulated = dtype != FloatDType::F32 && !I::supports_dtype(device, DType::from(dtype));
        Self { dtype, emulated }
    }

    pub(crate) const F32: Format = Format {
        dtype: FloatDType::F32,
        emulated: false,
    };

    /// `t` in this format (its storage dtype is f32 when emulated).
    pub(crate) fn convert<I: Backend>(&self, t: Tensor<I, 1>) -> Tensor<I, 1> {
        if self.emulated {
            round::<I>(t.cast(FloatDType::F32), self.dtype)
        } else if DType::from(self.dtype) != t.dtype() {
            t.cast(self.dtype)
        } else {
            t
        }
    }

    /// Rounds the result of an arithmetic op to this format when it is emulated.
    pub(crate) fn settle<I: Backend>(&self, t: Tensor<I, 1>) -> Tensor<I, 1> {
        if self.emulated {
            round::<I>(t, self.dtype)
        } else {
            t
        }
    }

    /// The dtype when it is held natively and is not f32 (a kernel may write it directly).
    pub(crate) fn native_dtype(&self) -> Option<DType> {
        (!self.emulated && self.dtype != FloatDType::F32).then(|| self.dtype.into())
    }

    /// The storage dtype.
    pub(crate) fn storage(&self) -> DType {
        if self.emulated {
            DType::F32
        } else {
            self.dtype.into()
        }
    }
}

/// f32 values rounded to the nearest `dtype` value (round-to-nearest-even; overflow to ±inf).
fn round<I: Backend>(t: Tensor<I, 1>, dtype: FloatDType) -> Tensor<I, 1> {
    let device = t.device();
    let values: Vec<f32> = t
        .into_data()
        .convert::<f32>()
        .into_vec()
        .expect("f32 values");
    let rounded: Vec<f32> = match dtype {
        FloatDType::BF16 => values.iter().map(|v| bf16::from_f32(*v).to_f32()).collect(),
        FloatDType::F16 => values.iter().map(|v| f16::from_f32(*v).to_f32()).collect(),
        _ => values,
    };
    let n = rounded.len();
    Tensor::from_data(TensorData::new(rounded, [n]), &device)
}

/// The engine's precision settings and loss-scaling state.
pub(crate) struct Precision {
    /// What the model computes in (its parameters' working copy).
    pub(crate) compute: Format,
    /// What gradients accumulate and reduce in.
    pub(crate) accum: Format,
    pub(crate) scaler: LossScaler,
    /// Optimizer steps skipped because of overflow.
    pub(crate) skipped: usize,
}

impl Precision {
    pub(crate) fn new<I: Backend>(config: &DeepSpeedConfig, device: &I::Device) -> Self {
        let compute = if config.bf16.enabled {
            FloatDType::BF16
        } else if config.fp16.enabled {
            FloatDType::F16
        } else {
            FloatDType::F32
        };
        let accum = match config.data_types.grad_accum_dtype.as_deref() {
            Some("bf16") => FloatDType::BF16,
            Some("fp16") => FloatDType::F16,
            _ => FloatDType::F32,
        };
        let scaler = if config.fp16.enabled {
            LossScaler::from_config(&config.fp16)
        } else {
            LossScaler::fixed(1.0)
        };
        Self {
            compute: Format::of::<I>(compute, device),
            accum: if accum == FloatDType::F32 {
                Format::F32
            } else {
                Format::of::<I>(accum, device)
            },
            scaler,
            skipped: 0,
        }
    }

    /// Whether the loss is scaled (fp16).
    pub(crate) fn scales(&self) -> bool {
        self.compute.dtype == FloatDType::F16
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;

    #[test]
    fn emulated_formats_round_like_the_real_ones() {
        let device = Default::default();
        let bf = Format::of::<NdArray>(FloatDType::BF16, &device);
        let half = Format::of::<NdArray>(FloatDType::F16, &device);
        assert!(bf.emulated && half.emulated, "NdArray has no bf16/f16");
        let t = Tensor::<NdArray, 1>::from_floats([1.0 + 1.0 / 256.0, 70000.0, 1e-3], &device);
        let b: Vec<f32> = bf.convert(t.clone()).into_data().to_vec().unwrap();
        // bf16 keeps 8 bits of mantissa: 1 + 2^-8 is a tie that rounds to even (1.0).
        assert_eq!(b[0], 1.0);
        assert_eq!(b[1], bf16::from_f32(70000.0).to_f32());
        let h: Vec<f32> = half.convert(t).into_data().to_vec().unwrap();
        assert_eq!(h[0], 1.0 + 1.0 / 256.0, "f16 has 10 mantissa bits");
        assert!(h[1].is_infinite(), "70000 overflows f16");
        assert_eq!(Format::F32.storage(), DType::F32);
    }
}
