//! Owned copies of buffers and the reduction arithmetic shared by in-process communicators.

use core::ops::Range;

use half::{bf16, f16};

use super::base::{Buf, BufMut, CommElement, ReduceOp};

/// An owned copy of a [`Buf`].
#[derive(Clone, Debug)]
pub(crate) enum Payload {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
}

impl Payload {
    pub(crate) fn copy_of(buf: Buf<'_>) -> Self {
        match buf {
            Buf::F32(v) => Payload::F32(v.to_vec()),
            Buf::Bf16(v) => Payload::Bf16(v.to_vec()),
            Buf::F16(v) => Payload::F16(v.to_vec()),
        }
    }

    /// A view of the values.
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    pub(crate) fn as_buf(&self) -> Buf<'_> {
        match self {
            Payload::F32(v) => Buf::F32(v),
            Payload::Bf16(v) => Buf::Bf16(v),
            Payload::F16(v) => Buf::F16(v),
        }
    }

    /// Appends the values as little-endian bytes.
    pub(crate) fn write_le(&self, out: &mut Vec<u8>) {
        match self {
            Payload::F32(v) => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            Payload::Bf16(v) => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_bits().to_le_bytes())),
            Payload::F16(v) => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_bits().to_le_bytes())),
        }
    }

    /// Reads values of `dtype` from little-endian bytes.
    pub(crate) fn read_le(dtype: super::base::DType, bytes: &[u8]) -> Self {
        use super::base::DType;
        let u16s = || {
            bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
        };
        match dtype {
            DType::F32 => Payload::F32(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            ),
            DType::Bf16 => Payload::Bf16(u16s().map(bf16::from_bits).collect()),
            DType::F16 => Payload::F16(u16s().map(f16::from_bits).collect()),
        }
    }

    fn values<T: CommElement>(&self) -> &[T] {
        let any: &dyn core::any::Any = match self {
            Payload::F32(v) => v,
            Payload::Bf16(v) => v,
            Payload::F16(v) => v,
        };
        any.downcast_ref::<Vec<T>>()
            .expect("ranks agreed on the dtype before their payloads are combined")
    }

    /// Copies `range` of this payload to `out[at..]` (dtypes were checked to agree).
    pub(crate) fn copy_range_into(&self, range: Range<usize>, out: &mut BufMut<'_>, at: usize) {
        let len = range.len();
        match out {
            BufMut::F32(o) => o[at..at + len].copy_from_slice(&self.values::<f32>()[range]),
            BufMut::Bf16(o) => o[at..at + len].copy_from_slice(&self.values::<bf16>()[range]),
            BufMut::F16(o) => o[at..at + len].copy_from_slice(&self.values::<f16>()[range]),
        }
    }
}

/// Writes into `out` the reduction over ranks of `inputs[r][offset..offset + out.len()]`,
/// accumulating in f32 in rank order (the same order, hence the same bits, on every rank).
pub(crate) fn reduce_chunk(
    inputs: &[std::sync::Arc<Payload>],
    offset: usize,
    op: ReduceOp,
    out: BufMut<'_>,
) {
    match out {
        BufMut::F32(o) => reduce_typed::<f32>(inputs, offset, op, o),
        BufMut::Bf16(o) => reduce_typed::<bf16>(inputs, offset, op, o),
        BufMut::F16(o) => reduce_typed::<f16>(inputs, offset, op, o),
    }
}

fn reduce_typed<T: CommElement>(
    inputs: &[std::sync::Arc<Payload>],
    offset: usize,
    op: ReduceOp,
    out: &mut [T],
) {
    let parts: Vec<&[T]> = inputs
        .iter()
        .map(|p| &p.values::<T>()[offset..offset + out.len()])
        .collect();
    let world = parts.len() as f32;
    for (i, o) in out.iter_mut().enumerate() {
        let mut acc = parts[0][i].to_f32();
        for part in &parts[1..] {
            let v = part[i].to_f32();
            acc = match op {
                ReduceOp::Sum | ReduceOp::Avg => acc + v,
                // NaN wins, as in NCCL: a NaN anywhere must not be hidden by the reduction.
                ReduceOp::Max if acc.is_nan() || v.is_nan() => f32::NAN,
                ReduceOp::Max => acc.max(v),
            };
        }
        if op == ReduceOp::Avg {
            acc /= world;
        }
        *o = T::from_f32(acc);
    }
}
