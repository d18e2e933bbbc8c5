//! The engine's gradient buffer, held in pieces of at most `burn_zero.max_buffer_elements`
//! elements: cubecl-cuda refuses any single buffer larger than a quarter of the device's memory
//! (its `max_page_size`), which the fp32 gradient partition of a large model exceeds. The
//! pieces are contiguous and in order; every update runs piece by piece, in place.
//!
//! The buffer knows which elements it has been given since it was last cleared: the first
//! gradient of an element is copied in, not added to the zeros there (a gradient's first
//! window, and every step without accumulation, then reads each gradient once and writes it
//! once, where an add reads the zeros too and launches a second kernel per write).

use core::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};

use super::precision::Format;

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

/// `range` cut into consecutive spans, each wholly inside `written` (`true`) or wholly outside
/// it (`false`); `written` is sorted and disjoint.
fn split_by(written: &[Range<usize>], range: &Range<usize>) -> Vec<(Range<usize>, bool)> {
    let mut spans = Vec::new();
    if range.is_empty() {
        return spans;
    }
    let mut at = range.start;
    for w in written
        .iter()
        .filter(|w| w.start < range.end && range.start < w.end)
    {
        if at < w.start {
            spans.push((at..w.start, false));
        }
        let end = w.end.min(range.end);
        spans.push((at.max(w.start)..end, true));
        at = end;
    }
    if at < range.end {
        spans.push((at..range.end, false));
    }
    spans
}

/// Adds `range` to the sorted, disjoint ranges `written`, merging it with any it overlaps or
/// touches.
fn mark(written: &mut Vec<Range<usize>>, range: Range<usize>) {
    if range.is_empty() {
        return;
    }
    let first = written.partition_point(|w| w.end < range.start);
    let last = written.partition_point(|w| w.start <= range.end);
    let merged = match written[first..last] {
        [] => range,
        ref touched => {
            let start = touched[0].start.min(range.start);
            start..touched[touched.len() - 1].end.max(range.end)
        }
    };
    written.splice(first..last, [merged]);
}

/// `part` in `dtype`: itself, or an f16/bf16 part widened to an f32 buffer's dtype.
fn widen<I: Backend>(part: Tensor<I, 1>, dtype: DType) -> Tensor<I, 1> {
    match part.dtype() == dtype {
        true => part,
        false => {
            debug_assert_eq!(dtype, DType::F32, "only an f32 buffer takes another dtype");
            part.cast(burn::tensor::FloatDType::F32)
        }
    }
}

/// `piece` with `part` written into `local` (widened to f32 when the buffer is f32), rounded
/// to `accum`: on burn-cuda one kernel for an f32 buffer, burn ops otherwise.
fn write_widened<I: Backend>(
    piece: Tensor<I, 1>,
    local: Range<usize>,
    part: Tensor<I, 1>,
    accum: Format,
) -> Tensor<I, 1> {
    #[cfg(feature = "cuda")]
    let (piece, part) = match accum == Format::F32 {
        true => match super::grad_cuda::cast_into_piece(piece, local.clone(), part) {
            Ok(piece) => return piece,
            Err(back) => back,
        },
        false => (piece, part),
    };
    let dtype = piece.dtype();
    piece.slice_assign(local, accum.settle(widen(part, dtype)))
}

/// A [`GradBuffer`]'s pieces and written elements at one moment.
#[derive(Clone)]
pub(crate) struct BufferState<I: Backend> {
    pieces: Vec<Tensor<I, 1>>,
    written: Vec<Range<usize>>,
}

impl<I: Backend> BufferState<I> {
    /// The state without its pieces when nothing was written ([`BackwardState::reads`]).
    ///
    /// [`BackwardState::reads`]: super::grads::BackwardState::reads
    pub(crate) fn reads(mut self) -> Self {
        if self.written.is_empty() {
            self.pieces.clear();
        }
        self
    }

    /// Nothing written in either, or the same elements written into the same pieces (the same
    /// tensors: `crate::graph::same_tensors`).
    pub(crate) fn matches(&self, other: &BufferState<I>) -> bool {
        if self.written != other.written {
            return false;
        }
        if self.written.is_empty() {
            return true;
        }
        let primitives = |s: &BufferState<I>| -> Vec<_> {
            s.pieces
                .iter()
                .map(|p| p.clone().into_primitive().tensor())
                .collect()
        };
        let (a, b) = (primitives(self), primitives(other));
        fn any<T: 'static>(v: &[T]) -> Vec<&dyn core::any::Any> {
            v.iter().map(|p| p as &dyn core::any::Any).collect()
        }
        crate::graph::same_tensors(&any(&a), &any(&b))
    }
}

/// A flat buffer of `len` elements in pieces of at most `piece` elements.
pub(crate) struct GradBuffer<I: Backend> {
    pieces: Vec<Tensor<I, 1>>,
    piece: usize,
    len: usize,
    dtype: DType,
    device: I::Device,
    /// Elements written since the last clear: sorted, disjoint, neighbours merged.
    written: Vec<Range<usize>>,
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
            written: Vec::new(),
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

    /// What the buffer holds now (its pieces, shared, and which elements were written), for
    /// [`GradBuffer::restore`].
    pub(crate) fn state(&self) -> BufferState<I> {
        BufferState {
            pieces: self.pieces.clone(),
            written: self.written.clone(),
        }
    }

    /// Makes the buffer hold `state` again: after a replayed backward, whose kernels wrote the
    /// pieces the captured one left (`crate::graph`).
    pub(crate) fn restore(&mut self, state: &BufferState<I>) {
        self.pieces = state.pieces.clone();
        self.written = state.written.clone();
    }

    /// Zeroes every piece where it lies, no new buffer made: CUDA graphs write into these
    /// pieces, and new ones would be a second gradient buffer until a replay put the captured
    /// ones back. `false`, changing nothing, where the backend cannot (`crate::graph`).
    pub(crate) fn zero_in_place(&mut self) -> bool {
        let primitives: Vec<_> = self
            .pieces
            .iter()
            .map(|p| p.clone().into_primitive().tensor())
            .collect();
        let tensors: Vec<&dyn core::any::Any> = primitives
            .iter()
            .map(|p| p as &dyn core::any::Any)
            .collect();
        let zeroed = crate::graph::zero_values(&tensors);
        if zeroed {
            self.written.clear();
        }
        zeroed
    }

    /// Zeroes every piece (the old pieces go first, so the new can take their memory).
    pub(crate) fn clear(&mut self) {
        self.written.clear();
        self.pieces.clear();
        let lens: Vec<usize> = self.ranges().map(|r| r.len()).collect();
        self.pieces = lens
            .into_iter()
            .map(|n| Tensor::zeros([n], (&self.device, self.dtype)))
            .collect();
    }

    /// Adds `values` (`range.len()` elements) into `range`, each sum rounded to `accum`;
    /// elements not written since the last clear take the value itself (`0 + v` is `v`, but for
    /// the sign of a zero). `values` are of the buffer's dtype, or, in an f32 buffer, of any
    /// float dtype (widened exactly). Each piece is updated in place: it is taken out of the
    /// buffer first, so no other reference makes the update copy it. (Nothing is left in its
    /// place meanwhile: an empty tensor would be a kernel over no elements, which CUDA refuses
    /// once a sync makes burn's fusion run it.)
    pub(crate) fn add(&mut self, range: Range<usize>, values: Tensor<I, 1>, accum: Format) {
        for (span, seen) in split_by(&self.written, &range) {
            let from = span.start - range.start;
            for (i, local, at) in self.overlaps(&span) {
                let part = values.clone().slice(from + at..from + at + local.len());
                let piece = self.pieces.remove(i);
                let piece = match seen {
                    true => {
                        let old = piece.clone().slice(local.clone());
                        let sum = accum.settle(old + widen(part, self.dtype));
                        piece.slice_assign(local, sum)
                    }
                    false => write_widened(piece, local, part, accum),
                };
                self.pieces.insert(i, piece);
            }
        }
        mark(&mut self.written, range);
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
    /// Every element counts as written afterwards: `f` may have put values where none were
    /// added (an all-reduce brings other ranks' gradients).
    pub(crate) fn try_map<E>(
        &mut self,
        mut f: impl FnMut(Tensor<I, 1>) -> Result<Tensor<I, 1>, E>,
    ) -> Result<(), E> {
        mark(&mut self.written, 0..self.len);
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

    use super::{Format, GradBuffer, mark, split_by};

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
                buffer.add(range, t, Format::F32);
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

    /// Spans and marks against a bitmap: random ranges over 40 elements, the spans tile the
    /// range in order with the right flag, and the marks stay sorted, disjoint and merged.
    #[test]
    fn spans_and_marks_follow_a_bitmap() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        for _ in 0..200 {
            let (mut written, mut bits) = (Vec::new(), [false; 40]);
            for _ in 0..8 {
                let a = next(41);
                let range = a..a + next(41 - a + 1).min(40 - a);
                let spans = split_by(&written, &range);
                let mut at = range.start;
                for (span, seen) in &spans {
                    assert_eq!(span.start, at);
                    assert!(!span.is_empty(), "{written:?} {range:?} {spans:?}");
                    assert!(span.clone().all(|i| bits[i] == *seen), "{span:?} {seen}");
                    at = span.end;
                }
                assert_eq!(at, range.end);
                mark(&mut written, range.clone());
                range.for_each(|i| bits[i] = true);
                for w in written.windows(2) {
                    assert!(w[0].end < w[1].start, "{written:?}");
                }
                let marked: Vec<bool> = (0..40)
                    .map(|i| written.iter().any(|w| w.contains(&i)))
                    .collect();
                assert_eq!(marked, bits);
            }
        }
    }

    /// An element's first value is copied in (a negative zero stays one), later ones add;
    /// after a clear, or for elements never written, the buffer reads zero; after a map every
    /// element adds.
    #[test]
    fn first_writes_copy_and_later_writes_add() {
        let device = Default::default();
        let t = |v: Vec<f32>| {
            Tensor::<NdArray, 1>::from_data(TensorData::new(v.clone(), [v.len()]), &device)
        };
        let mut buffer = GradBuffer::<NdArray>::zeros(6, 4, &device, DType::F32);
        buffer.add(1..4, t(vec![-0.0, 2.0, 3.0]), Format::F32);
        buffer.add(2..6, t(vec![1.0, 1.0, -0.0, 5.0]), Format::F32);
        let got = values(buffer.slice(0..6));
        assert_eq!(got, vec![0.0, -0.0, 3.0, 4.0, -0.0, 5.0]);
        assert!(got[1].is_sign_negative() && got[4].is_sign_negative());
        assert!(got[0].is_sign_positive());
        buffer.clear();
        buffer.add(0..2, t(vec![7.0, 8.0]), Format::F32);
        assert_eq!(
            values(buffer.slice(0..6)),
            vec![7.0, 8.0, 0.0, 0.0, 0.0, 0.0]
        );
        buffer.try_map::<()>(|t| Ok(t.add_scalar(1.0))).unwrap();
        buffer.add(2..3, t(vec![1.0]), Format::F32);
        assert_eq!(
            values(buffer.slice(0..6)),
            vec![8.0, 9.0, 2.0, 1.0, 1.0, 1.0]
        );
    }
}
