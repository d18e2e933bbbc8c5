//! A rank's fp32 gradient partition in host memory (ZeRO-Offload at stages 2 and 3): reduced
//! gradient buckets are written into it while backward still runs, so the device never holds
//! the fp32 partition, and the CPU optimizer reads it where it lies at the step.
//!
//! No zeroing pass: after [`HostGrads::clear`], the next backward's writes copy instead of add,
//! and only the elements it never wrote are zeroed when it ends. The sum of squares the
//! gradient norm needs is taken in the same passes, in f64, at the accumulation boundary.

use std::collections::BTreeMap;
use std::ops::Range;

/// Below this many elements a write runs on the calling thread.
const PARALLEL_FROM: usize = 1 << 20;

/// Why a write was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum HostGradsError {
    /// The range is not inside the partition.
    #[error("gradient elements {range:?} lie outside the {len}-element host partition")]
    OutOfRange {
        /// The range written.
        range: Range<usize>,
        /// The partition's length.
        len: usize,
    },
    /// Two writes of one backward overlap (each element belongs to one parameter, whose
    /// gradient is final once per backward).
    #[error("gradient elements {range:?} were written twice in one backward")]
    Twice {
        /// The second write's range.
        range: Range<usize>,
    },
}

/// The partition, what the running backward has written, and the sum of squares.
#[derive(Debug)]
pub struct HostGrads {
    values: Vec<f32>,
    threads: usize,
    /// No backward has ended since the last clear: writes copy.
    fresh: bool,
    /// Start → end of the ranges written by the running backward.
    written: BTreeMap<usize, usize>,
    /// Σ g² of the values as they stand after the boundary backward.
    squares: f64,
}

impl HostGrads {
    /// `len` elements (zero until written), writes spread over up to `threads` threads.
    pub fn new(len: usize, threads: usize) -> Self {
        Self {
            values: crate::memory::zeroed_f32(len, false),
            threads: threads.max(1),
            fresh: true,
            written: BTreeMap::new(),
            squares: 0.0,
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether the partition is empty.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        4 * self.values.len()
    }

    /// Adds `src` into elements `range` (copies it, in the first backward after a clear),
    /// taking the sum of squares of the results when `boundary` (the backward that ends the
    /// accumulation window).
    pub fn write(
        &mut self,
        range: Range<usize>,
        src: &[f32],
        boundary: bool,
    ) -> Result<(), HostGradsError> {
        assert_eq!(range.len(), src.len(), "a write's source is its range long");
        if range.end > self.values.len() {
            return Err(HostGradsError::OutOfRange {
                range,
                len: self.values.len(),
            });
        }
        if range.is_empty() {
            return Ok(());
        }
        let before = self.written.range(..range.end).next_back();
        if before.is_some_and(|(_, &end)| end > range.start) {
            return Err(HostGradsError::Twice { range });
        }
        self.written.insert(range.start, range.end);
        let copy = self.fresh;
        let squares = in_parallel(
            &mut self.values[range],
            src,
            self.threads,
            |dst, src| match (copy, boundary) {
                (true, false) => {
                    dst.copy_from_slice(src);
                    0.0
                }
                (true, true) => {
                    dst.copy_from_slice(src);
                    sum_squares(dst)
                }
                (false, false) => {
                    dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
                    0.0
                }
                (false, true) => {
                    dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
                    sum_squares(dst)
                }
            },
        );
        self.squares += squares;
        Ok(())
    }

    /// Ends a backward: zeroes what the first backward after a clear did not write, and at the
    /// `boundary` adds the squares of everything it did not write to the sum.
    pub fn end_pass(&mut self, boundary: bool) {
        let mut gaps = Vec::new();
        let mut at = 0;
        for (&start, &end) in &self.written {
            if start > at {
                gaps.push(at..start);
            }
            at = end;
        }
        if at < self.values.len() {
            gaps.push(at..self.values.len());
        }
        for gap in gaps {
            let values = &mut self.values[gap];
            if self.fresh {
                values.fill(0.0);
            } else if boundary {
                self.squares += sum_squares(values);
            }
        }
        self.written.clear();
        self.fresh = false;
    }

    /// Σ g² over the partition after the boundary backward (0 before it).
    pub fn sum_of_squares(&self) -> f64 {
        self.squares
    }

    /// Starts a new accumulation window (after a step).
    pub fn clear(&mut self) {
        self.fresh = true;
        self.written.clear();
        self.squares = 0.0;
    }

    /// The partition as it stands.
    pub fn values(&self) -> &[f32] {
        &self.values
    }

    /// The partition, for a step that reads it in place; [`Self::clear`] follows.
    pub fn values_mut(&mut self) -> &mut [f32] {
        &mut self.values
    }
}

fn sum_squares(values: &[f32]) -> f64 {
    // Eight f64 lanes: vectorizes, and rounds less than one running sum.
    let mut lanes = [0.0f64; 8];
    let chunks = values.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l += f64::from(*v) * f64::from(*v);
        }
    }
    let tail: f64 = tail.iter().map(|v| f64::from(*v) * f64::from(*v)).sum();
    lanes.iter().sum::<f64>() + tail
}

/// `f` over matching chunks of `dst` and `src` on up to `threads` threads; the sum of its
/// results.
fn in_parallel(
    dst: &mut [f32],
    src: &[f32],
    threads: usize,
    f: impl Fn(&mut [f32], &[f32]) -> f64 + Sync,
) -> f64 {
    let threads = threads.min(dst.len() / PARALLEL_FROM).max(1);
    if threads == 1 {
        return f(dst, src);
    }
    let per = dst.len().div_ceil(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = dst
            .chunks_mut(per)
            .zip(src.chunks(per))
            .map(|(d, s_)| {
                let f = &f;
                s.spawn(move || f(d, s_))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a gradient write thread panicked"))
            .sum()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 2001) as f32 / 1000.0
                    - 1.0
            })
            .collect()
    }

    /// Three micro-steps of writes into an odd partition (a gap never written, pieces in any
    /// order, one part parallel), against a plain vector summed by hand.
    #[test]
    fn accumulates_like_a_zeroed_vector_and_sums_squares_at_the_boundary() {
        let len = PARALLEL_FROM * 2 + 7919;
        let mut grads = HostGrads::new(len, 3);
        // Stale values from an earlier window must not survive the clear.
        grads.write(0..len, &values(len, 99), true).unwrap();
        grads.end_pass(true);
        grads.clear();
        let pieces = [len - 5000..len - 3, 0..17, 17..PARALLEL_FROM * 2];
        let mut expected = vec![0.0f32; len];
        for micro in 0..3u32 {
            let boundary = micro == 2;
            for (k, r) in pieces.iter().enumerate() {
                // The last micro-step leaves the first piece out, as a dropped layer would.
                if boundary && k == 0 {
                    continue;
                }
                let src = values(r.len(), micro * 10 + k as u32);
                for (e, s) in expected[r.clone()].iter_mut().zip(&src) {
                    *e += s;
                }
                grads.write(r.clone(), &src, boundary).unwrap();
            }
            grads.end_pass(boundary);
        }
        assert_eq!(grads.values(), &expected[..]);
        let squares: f64 = expected.iter().map(|v| f64::from(*v).powi(2)).sum();
        assert!((grads.sum_of_squares() - squares).abs() <= 1e-9 * squares);
    }

    #[test]
    fn overlapping_and_outside_writes_are_refused() {
        let mut grads = HostGrads::new(100, 1);
        grads.write(10..20, &[1.0; 10], false).unwrap();
        let twice = grads.write(15..25, &[1.0; 10], false).unwrap_err();
        assert_eq!(twice, HostGradsError::Twice { range: 15..25 });
        let before = grads.write(5..11, &[1.0; 6], false).unwrap_err();
        assert_eq!(before, HostGradsError::Twice { range: 5..11 });
        grads.write(20..30, &[1.0; 10], false).unwrap();
        let outside = grads.write(95..101, &[1.0; 6], false).unwrap_err();
        assert!(outside.to_string().contains("95..101"), "{outside}");
        grads.end_pass(false);
        grads.write(15..25, &[1.0; 10], false).unwrap();
    }
}
