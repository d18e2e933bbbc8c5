//! The engine's gradient buffer, held in pieces of at most `burn_zero.max_buffer_elements`
//! elements: cubecl-cuda refuses any single buffer larger than a quarter of the device's memory
//! (its `max_page_size`), which the fp32 gradient partition of a large model exceeds. The
//! pieces are contiguous and in order; every update runs piece by piece, in place.

use core::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};

/// Each of the consecutive `pieces` (element ranges) that overlaps `range`: its index, the
/// overlap within the piece, and where the overlap starts in `range`.
pub(crate) fn overlaps(
    pieces: impl IntoIterator<Item = Range<usize>>,
    range: &Range<usize>,
) -> Vec<(usize, Range<usize>, usize)> {
    pieces
        .into_iter()
        .enumerate()
        .filter(|(_, r)| r.start < range.end && range.start < r.end)
        .map(|(i, r)| {
            let (start, end) = (range.start.max(r.start), range.end.min(r.end));
            (i, start - r.start..end - r.start, start - range.start)
        })
        .collect()
}

/// The element ranges of consecutive tensors.
pub(crate) fn piece_ranges<I: Backend>(pieces: &[Tensor<I, 1>]) -> Vec<Range<usize>> {
    let mut at = 0;
    pieces
        .iter()
        .map(|p| {
            let r = at..at + p.dims()[0];
            at = r.end;
            r
        })
        .collect()
}

/// A flat buffer of `len` elements in pieces of at most `piece` elements.
pub(crate) struct GradBuffer<I: Backend> {
    pieces: Vec<Tensor<I, 1>>,
    piece: usize,
    len: usize,
    dtype: DType,
    device: I::Device,
}

impl<I: Backend> GradBuffer<I> {
    /// Zeros, `len` elements of `dtype`.
    pub(crate) fn zeros(len: usize, piece: usize, device: &I::Device, dtype: DType) -> Self {
        let piece = piece.max(1);
        let mut buffer = Self {
            pieces: Vec::new(),
            piece,
            len,
            dtype,
            device: device.clone(),
        };
        buffer.clear();
        buffer
    }

    /// Elements.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The element ranges of the pieces.
    fn ranges(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        (0..self.len)
            .step_by(self.piece)
            .map(|s| s..(s + self.piece).min(self.len))
    }

    fn overlaps(&self, range: &Range<usize>) -> Vec<(usize, Range<usize>, usize)> {
        overlaps(self.ranges(), range)
    }

    /// Zeroes every piece (the old pieces go first, so the new can take their memory).
    pub(crate) fn clear(&mut self) {
        self.pieces.clear();
        let lens: Vec<usize> = self.ranges().map(|r| r.len()).collect();
        self.pieces = lens
            .into_iter()
            .map(|n| Tensor::zeros([n], (&self.device, self.dtype)))
            .collect();
    }

    /// Adds `values` (`range.len()` elements) into `range`, each sum passed through `settle`
    /// (the accumulation format's rounding). Each piece is updated in place: it is taken out
    /// of the buffer first, so no other reference makes the update copy it. (Nothing is left in
    /// its place meanwhile: an empty tensor would be a kernel over no elements, which CUDA
    /// refuses once a sync makes burn's fusion run it.)
    pub(crate) fn add(
        &mut self,
        range: Range<usize>,
        values: Tensor<I, 1>,
        settle: impl Fn(Tensor<I, 1>) -> Tensor<I, 1>,
    ) {
        for (i, local, at) in self.overlaps(&range) {
            let part = values.clone().slice(at..at + local.len());
            let sum = settle(self.pieces[i].clone().slice(local.clone()) + part);
            let piece = self.pieces.remove(i);
            self.pieces.insert(i, piece.slice_assign(local, sum));
        }
    }

    /// The pieces covering `range`, cut to it, in order.
    pub(crate) fn pieces(&self, range: Range<usize>) -> Vec<Tensor<I, 1>> {
        self.overlaps(&range)
            .into_iter()
            .map(|(i, local, _)| {
                let piece = &self.pieces[i];
                match local.len() == piece.dims()[0] {
                    true => piece.clone(),
                    false => piece.clone().slice(local),
                }
            })
            .collect()
    }

    /// `range` as one tensor (the pieces concatenated when it spans several).
    pub(crate) fn slice(&self, range: Range<usize>) -> Tensor<I, 1> {
        if range.is_empty() {
            return Tensor::zeros([0], (&self.device, self.dtype));
        }
        super::flat_pieces::slice_pieces(&self.pieces, range)
    }

    /// Replaces every piece with `f(piece)` (same length), in order; stops at the first error.
    pub(crate) fn try_map<E>(
        &mut self,
        mut f: impl FnMut(Tensor<I, 1>) -> Result<Tensor<I, 1>, E>,
    ) -> Result<(), E> {
        for i in 0..self.pieces.len() {
            let piece = self.pieces.remove(i);
            let n = piece.dims()[0];
            match f(piece) {
                Ok(t) => self.pieces.insert(i, t),
                Err(e) => {
                    // Zeros keep the buffer whole; the caller reports the failure.
                    let zeros = Tensor::zeros([n], (&self.device, self.dtype));
                    self.pieces.insert(i, zeros);
                    return Err(e);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::NdArray;
    use burn::tensor::{DType, Tensor, TensorData};

    use super::GradBuffer;

    fn values(t: Tensor<NdArray, 1>) -> Vec<f32> {
        t.into_data().to_vec::<f32>().unwrap()
    }

    /// Adds across piece boundaries, reads back in pieces and whole, maps and clears: the same
    /// as one flat buffer, for piece sizes that do and do not divide the length.
    #[test]
    fn pieces_behave_as_one_flat_buffer() {
        let device = Default::default();
        for piece in [1, 3, 4, 10, 100] {
            let mut buffer = GradBuffer::<NdArray>::zeros(10, piece, &device, DType::F32);
            let mut flat = vec![0.0f32; 10];
            for (range, base) in [(2..9, 1.0f32), (0..10, 0.5), (7..8, -2.0)] {
                let add: Vec<f32> = range.clone().map(|i| base + i as f32).collect();
                for (i, v) in range.clone().zip(&add) {
                    flat[i] += v;
                }
                let t = Tensor::from_data(TensorData::new(add.clone(), [add.len()]), &device);
                buffer.add(range, t, |t| t);
            }
            assert_eq!(values(buffer.slice(0..10)), flat, "piece {piece}");
            assert_eq!(values(buffer.slice(3..8)), flat[3..8], "piece {piece}");
            let lens: Vec<usize> = buffer.pieces(1..10).iter().map(|p| p.dims()[0]).collect();
            assert_eq!(lens.iter().sum::<usize>(), 9);
            assert!(lens.iter().all(|n| *n <= piece));
            buffer.try_map::<()>(|t| Ok(t.mul_scalar(2.0))).unwrap();
            let doubled: Vec<f32> = flat.iter().map(|v| v * 2.0).collect();
            assert_eq!(values(buffer.slice(0..10)), doubled);
            buffer.clear();
            assert_eq!(values(buffer.slice(0..10)), vec![0.0; 10]);
            assert_eq!(buffer.len(), 10);
        }
    }
}
