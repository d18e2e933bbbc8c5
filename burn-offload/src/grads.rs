//! A rank's gradient partition in host memory (ZeRO-Offload at stages 2 and 3): reduced
//! gradient buckets are written into it while backward still runs, so the device never holds
//! the partition, and the CPU optimizer reads it where it lies at the step. It is fp32, or
//! bf16 or fp16 ([`GradDtype`]) where the gradients are reduced and accumulated in that dtype:
//! the same values in half the memory.
//!
//! No zeroing pass: after [`HostGrads::clear`], the next backward's writes copy instead of add,
//! and only the elements it never wrote are zeroed when it ends. The sum of squares the
//! gradient norm needs is taken in the same passes, in f64, at the accumulation boundary.
//!
//! The partition is held in chunks (the optimizer's sub-groups), so that a chunk the boundary
//! backward has finished can be lent to a CPU optimizer step ([`HostGrads::watch`],
//! [`HostGrads::lend`]) while backward goes on writing the others.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::mpsc::Sender;

use half::{bf16, f16};

use crate::cpu_adam::{Grad, GradElem, OutElem};
use crate::stream::GradBuf;

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
    /// The chunk is lent to a step ([`HostGrads::lend`]) and not given back.
    #[error("gradient chunk {chunk} is lent to an optimizer step")]
    Lent {
        /// The chunk.
        chunk: usize,
    },
}

/// How the partition holds its elements.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GradDtype {
    /// fp32.
    #[default]
    F32,
    /// bfloat16, half the bytes: exact for gradients that arrive as bf16 values (reduced in
    /// bf16); a sum of two is rounded to bf16 (nearest even), as accumulating in bf16 on the
    /// device rounds it.
    Bf16,
    /// IEEE half, as bf16 (rounded to nearest even; past its range a sum is infinite, as an
    /// fp16 accumulation on the device is, and the step overflows).
    F16,
}

impl GradDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            GradDtype::F32 => 4,
            GradDtype::Bf16 | GradDtype::F16 => 2,
        }
    }
}

/// One chunk's values, in the partition's dtype (what [`HostGrads::lend`] hands out).
#[derive(Debug)]
pub enum GradChunk {
    /// fp32.
    F32(Vec<f32>),
    /// bf16.
    Bf16(Vec<bf16>),
    /// f16.
    F16(Vec<f16>),
}

impl GradChunk {
    fn zeroed(n: usize, dtype: GradDtype) -> Self {
        match dtype {
            GradDtype::F32 => GradChunk::F32(crate::memory::zeroed_f32(n, false)),
            GradDtype::Bf16 => GradChunk::Bf16(crate::memory::zeroed_bf16(n)),
            GradDtype::F16 => GradChunk::F16(crate::memory::zeroed_f16(n)),
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            GradChunk::F32(v) => v.len(),
            GradChunk::Bf16(v) => v.len(),
            GradChunk::F16(v) => v.len(),
        }
    }

    /// How it holds its elements.
    pub fn dtype(&self) -> GradDtype {
        match self {
            GradChunk::F32(_) => GradDtype::F32,
            GradChunk::Bf16(_) => GradDtype::Bf16,
            GradChunk::F16(_) => GradDtype::F16,
        }
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first `n` values, as CPU-Adam reads a gradient.
    pub fn grad(&self, n: usize) -> Grad<'_> {
        match self {
            GradChunk::F32(v) => Grad::F32(&v[..n]),
            GradChunk::Bf16(v) => Grad::Bf16(&v[..n]),
            GradChunk::F16(v) => Grad::F16(&v[..n]),
        }
    }

    /// The values as a step's gradient buffer.
    pub fn as_buf(&mut self) -> GradBuf<'_> {
        match self {
            GradChunk::F32(v) => GradBuf::F32(v),
            GradChunk::Bf16(v) => GradBuf::Bf16(v),
            GradChunk::F16(v) => GradBuf::F16(v),
        }
    }

    fn ptr(&mut self) -> *mut u8 {
        match self {
            GradChunk::F32(v) => v.as_mut_ptr().cast(),
            GradChunk::Bf16(v) => v.as_mut_ptr().cast(),
            GradChunk::F16(v) => v.as_mut_ptr().cast(),
        }
    }

    /// Copies (or adds, `add`) `src` into elements `local`; their sum of squares afterwards
    /// when `squares`.
    fn put(
        &mut self,
        local: Range<usize>,
        src: &[f32],
        add: bool,
        squares: bool,
        threads: usize,
    ) -> f64 {
        match self {
            GradChunk::F32(v) => put_into(&mut v[local], src, add, squares, threads),
            GradChunk::Bf16(v) => put_into(&mut v[local], src, add, squares, threads),
            GradChunk::F16(v) => put_into(&mut v[local], src, add, squares, threads),
        }
    }

    /// Σ g² over elements `local`.
    fn squares(&self, local: Range<usize>, threads: usize) -> f64 {
        match self {
            GradChunk::F32(v) => sum_squares_parallel(&v[local], threads),
            GradChunk::Bf16(v) => sum_squares_parallel(&v[local], threads),
            GradChunk::F16(v) => sum_squares_parallel(&v[local], threads),
        }
    }

    fn zero(&mut self, local: Range<usize>) {
        match self {
            GradChunk::F32(v) => v[local].fill(0.0),
            GradChunk::Bf16(v) => v[local].fill(bf16::ZERO),
            GradChunk::F16(v) => v[local].fill(f16::ZERO),
        }
    }

    /// The values widened to f32.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.len());
        self.extend_f32(0..self.len(), &mut out);
        out
    }

    fn extend_f32(&self, local: Range<usize>, out: &mut Vec<f32>) {
        match self {
            GradChunk::F32(v) => out.extend_from_slice(&v[local]),
            GradChunk::Bf16(v) => out.extend(v[local].iter().map(|x| x.get())),
            GradChunk::F16(v) => out.extend(v[local].iter().map(|x| x.get())),
        }
    }
}

/// The partition, what the running backward has written, and the sum of squares.
#[derive(Debug)]
pub struct HostGrads {
    len: usize,
    /// Elements per chunk (the last may be shorter).
    chunk: usize,
    dtype: GradDtype,
    /// The chunks; `None` while lent.
    chunks: Vec<Option<GradChunk>>,
    threads: usize,
    /// No backward has ended since the last clear: writes copy.
    fresh: bool,
    /// Start → end of the ranges written by the running backward.
    written: BTreeMap<usize, usize>,
    /// Elements of each chunk the running backward wrote.
    filled: Vec<usize>,
    /// Σ g² of each chunk's values as they stand after the boundary backward.
    squares: Vec<f64>,
    /// Told each chunk the boundary backward finishes, as it finishes (until that backward ends).
    watch: Option<Sender<usize>>,
}

impl HostGrads {
    /// `len` elements (zero until written) in one chunk, writes spread over up to `threads`
    /// threads.
    pub fn new(len: usize, threads: usize) -> Self {
        Self::in_chunks(len, threads, len)
    }

    /// The same in chunks of `chunk` elements (the last may be shorter).
    pub fn in_chunks(len: usize, threads: usize, chunk: usize) -> Self {
        Self::in_chunks_of(len, threads, chunk, GradDtype::F32)
    }

    /// The same held as `dtype`.
    pub fn in_chunks_of(len: usize, threads: usize, chunk: usize, dtype: GradDtype) -> Self {
        let chunk = chunk.max(1);
        let chunks: Vec<Option<GradChunk>> = (0..len)
            .step_by(chunk)
            .map(|start| Some(GradChunk::zeroed(chunk.min(len - start), dtype)))
            .collect();
        let n = chunks.len();
        Self {
            len,
            chunk,
            dtype,
            chunks,
            threads: threads.max(1),
            fresh: true,
            written: BTreeMap::new(),
            filled: vec![0; n],
            squares: vec![0.0; n],
            watch: None,
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the partition is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.dtype.size() * self.len
    }

    /// How the elements are held.
    pub fn dtype(&self) -> GradDtype {
        self.dtype
    }

    /// Elements per chunk.
    pub fn chunk_len(&self) -> usize {
        self.chunk
    }

    /// Chunks.
    pub fn chunk_count(&self) -> usize {
        self.chunks.len()
    }

    /// The elements of chunk `c`.
    pub fn chunk_range(&self, c: usize) -> Range<usize> {
        let start = c * self.chunk;
        start..(start + self.chunk).min(self.len)
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
        if !self.claim(&range, true)? {
            return Ok(());
        }
        let add = !self.fresh;
        for (c, local, part) in self.pieces(&range) {
            let values = self.chunks[c].as_mut().expect("checked above");
            let src = &src[part.start - range.start..part.end - range.start];
            self.squares[c] += values.put(local, src, add, boundary, self.threads);
            self.arrived(c, part.len(), boundary);
        }
        Ok(())
    }

    /// Each chunk `range` touches: its index, the part of it inside the chunk, and that part's
    /// elements in the partition.
    fn pieces(&self, range: &Range<usize>) -> Vec<(usize, Range<usize>, Range<usize>)> {
        if range.is_empty() {
            return Vec::new();
        }
        (range.start / self.chunk..=(range.end - 1) / self.chunk)
            .map(|c| {
                let whole = self.chunk_range(c);
                let part = range.start.max(whole.start)..range.end.min(whole.end);
                (c, part.start - whole.start..part.end - whole.start, part)
            })
            .collect()
    }

    /// `n` more elements of chunk `c` are in for the running backward; told to the watcher
    /// when that finishes the chunk in the boundary backward.
    fn arrived(&mut self, c: usize, n: usize, boundary: bool) {
        self.filled[c] += n;
        if boundary && self.filled[c] == self.chunk_range(c).len() {
            // A closed receiver only means nobody steps ahead any more.
            let _ = self.watch.as_ref().map(|w| w.send(c));
        }
    }

    /// Whether the running backward's writes copy (the first after a clear), so a writer may
    /// place values where they lie itself ([`Self::reserve`], [`Self::commit`]).
    pub fn copies(&self) -> bool {
        self.fresh
    }

    /// Where chunk `c`'s values lie (stable while it is not lent: lending moves the vector, not
    /// its buffer), for a writer that copies into them itself (a DMA), in [`Self::dtype`].
    pub fn chunk_ptr(&mut self, c: usize) -> Option<*mut u8> {
        self.chunks[c].as_mut().map(GradChunk::ptr)
    }

    /// Claims elements `range` for a writer that copies them into place itself, in a backward
    /// whose writes copy ([`Self::copies`]); [`Self::commit`] once they are there. Refused as
    /// [`Self::write`] refuses (and when writes add).
    pub fn reserve(&mut self, range: Range<usize>) -> Result<(), HostGradsError> {
        self.claim(&range, false).map(|_| ())
    }

    /// Marks `range` written by the running backward, unless it lies outside, overlaps an
    /// earlier write, touches a lent chunk, or (`adds` false) the backward's writes add;
    /// whether it holds any element.
    fn claim(&mut self, range: &Range<usize>, adds: bool) -> Result<bool, HostGradsError> {
        if range.end > self.len {
            return Err(HostGradsError::OutOfRange {
                range: range.clone(),
                len: self.len,
            });
        }
        if range.is_empty() {
            return Ok(false);
        }
        let before = self.written.range(..range.end).next_back();
        if (!adds && !self.fresh) || before.is_some_and(|(_, &end)| end > range.start) {
            return Err(HostGradsError::Twice {
                range: range.clone(),
            });
        }
        let (first, last) = (range.start / self.chunk, (range.end - 1) / self.chunk);
        if let Some(chunk) = (first..=last).find(|&c| self.chunks[c].is_none()) {
            return Err(HostGradsError::Lent { chunk });
        }
        self.written.insert(range.start, range.end);
        Ok(true)
    }

    /// Elements `range`, claimed by [`Self::reserve`], are in place: counted, their sum of
    /// squares taken when `boundary`, finished chunks told.
    pub fn commit(&mut self, range: Range<usize>, boundary: bool) {
        for (c, local, part) in self.pieces(&range) {
            if boundary {
                let values = self.chunks[c].as_ref().expect("reserved, so not lent");
                self.squares[c] += values.squares(local, self.threads);
            }
            self.arrived(c, part.len(), boundary);
        }
    }

    /// [`Self::commit`] for a range whose squares the caller took itself (on the device, say)
    /// and added with [`Self::add_squares`] before.
    pub fn commit_squared(&mut self, range: Range<usize>, boundary: bool) {
        for (c, _, part) in self.pieces(&range) {
            self.arrived(c, part.len(), boundary);
        }
    }

    /// Adds `squares` (Σ g² of values written into chunk `c`, taken by the caller) to the
    /// chunk's sum; call before the values' [`Self::commit_squared`], so a watcher told the
    /// chunk has finished sees them.
    pub fn add_squares(&mut self, c: usize, squares: f64) {
        if let Some(s) = self.squares.get_mut(c) {
            *s += squares;
        }
    }

    /// Ends a backward: zeroes what the first backward after a clear did not write, and at the
    /// `boundary` adds the squares of everything it did not write to the sum. Stops telling
    /// the watcher (which sees its channel close).
    ///
    /// # Panics
    /// If a chunk with elements left unwritten is lent (it cannot be: it was not finished).
    pub fn end_pass(&mut self, boundary: bool) {
        let mut gaps = Vec::new();
        let mut at = 0;
        for (&start, &end) in &self.written {
            if start > at {
                gaps.push(at..start);
            }
            at = end;
        }
        if at < self.len {
            gaps.push(at..self.len);
        }
        for gap in gaps {
            for (c, local, _) in self.pieces(&gap) {
                let values = self.chunks[c].as_mut().expect("a lent chunk was finished");
                if self.fresh {
                    values.zero(local);
                } else if boundary {
                    self.squares[c] += values.squares(local, 1);
                }
            }
        }
        self.written.clear();
        self.filled.fill(0);
        self.fresh = false;
        self.watch = None;
    }

    /// Σ g² over the partition after the boundary backward (0 before it).
    pub fn sum_of_squares(&self) -> f64 {
        self.squares.iter().sum()
    }

    /// Σ g² over chunk `c` after the boundary backward (when it finished, for a watcher).
    pub fn chunk_sum_of_squares(&self, c: usize) -> f64 {
        self.squares[c]
    }

    /// Starts a new accumulation window (after a step).
    ///
    /// # Panics
    /// If a chunk is still lent.
    pub fn clear(&mut self) {
        assert!(
            self.chunks.iter().all(Option::is_some),
            "a gradient chunk is still lent at the step's end"
        );
        self.fresh = true;
        self.written.clear();
        self.filled.fill(0);
        self.squares.fill(0.0);
        self.watch = None;
    }

    /// Sends the index of each chunk the next boundary backward finishes to `watcher`, as it
    /// finishes (a chunk no write covers finishes only at [`Self::end_pass`], untold).
    pub fn watch(&mut self, watcher: Sender<usize>) {
        self.watch = Some(watcher);
    }

    /// Stops telling the watcher (whose channel closes), as the end of a pass does.
    pub fn unwatch(&mut self) {
        self.watch = None;
    }

    /// Takes chunk `c` out (a finished chunk, for a step while backward goes on); a write to it
    /// is refused until [`Self::give_back`].
    pub fn lend(&mut self, c: usize) -> Result<GradChunk, HostGradsError> {
        self.chunks[c]
            .take()
            .ok_or(HostGradsError::Lent { chunk: c })
    }

    /// Returns chunk `c`, lent by [`Self::lend`].
    ///
    /// # Panics
    /// If it is not lent, or `values` is not its length or dtype (a writer that copies into
    /// place relies on both, see [`Self::chunk_ptr`]).
    pub fn give_back(&mut self, c: usize, values: GradChunk) {
        assert!(self.chunks[c].is_none(), "chunk {c} was not lent");
        assert_eq!(
            values.len(),
            self.chunk_range(c).len(),
            "chunk {c}'s length"
        );
        assert_eq!(values.dtype(), self.dtype, "chunk {c}'s dtype");
        self.chunks[c] = Some(values);
    }

    /// Elements `range` as they stand, widened to f32.
    ///
    /// # Panics
    /// If a chunk it covers is lent.
    pub fn read(&self, range: Range<usize>) -> Vec<f32> {
        let mut out = Vec::with_capacity(range.len());
        for (c, local, _) in self.pieces(&range) {
            let values = self.chunks[c]
                .as_ref()
                .expect("reading a lent gradient chunk");
            values.extend_f32(local, &mut out);
        }
        out
    }

    /// The chunks in order, for a step that reads them in place; [`Self::clear`] follows.
    ///
    /// # Panics
    /// If a chunk is lent.
    pub fn chunks_mut(&mut self) -> Vec<GradBuf<'_>> {
        self.chunks
            .iter_mut()
            .map(|c| c.as_mut().expect("a gradient chunk is lent").as_buf())
            .collect()
    }
}

/// Copies (or adds, in f32, `add`) `src` into `dst`, each result rounded to `T`; the sum of
/// squares of the results when `squares`.
fn put_into<T: GradElem + OutElem>(
    dst: &mut [T],
    src: &[f32],
    add: bool,
    squares: bool,
    threads: usize,
) -> f64 {
    in_parallel(dst, src, threads, |dst, src| {
        match add {
            false => dst.iter_mut().zip(src).for_each(|(d, s)| *d = T::put(*s)),
            true => dst
                .iter_mut()
                .zip(src)
                .for_each(|(d, s)| *d = T::put(d.get() + s)),
        }
        if squares { sum_squares(dst) } else { 0.0 }
    })
}

fn sum_squares<T: GradElem>(values: &[T]) -> f64 {
    // Eight f64 lanes: vectorizes, and rounds less than one running sum.
    let mut lanes = [0.0f64; 8];
    let chunks = values.chunks_exact(8);
    let tail = chunks.remainder();
    let sq = |v: &T| f64::from(v.get()) * f64::from(v.get());
    for c in chunks {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l += sq(v);
        }
    }
    let tail: f64 = tail.iter().map(sq).sum();
    lanes.iter().sum::<f64>() + tail
}

/// The sum of squares of `values` on up to `threads` threads.
fn sum_squares_parallel<T: GradElem>(values: &[T], threads: usize) -> f64 {
    let threads = threads.min(values.len() / PARALLEL_FROM).max(1);
    if threads == 1 {
        return sum_squares(values);
    }
    let per = values.len().div_ceil(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = values
            .chunks(per)
            .map(|v| s.spawn(move || sum_squares(v)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a sum-of-squares thread panicked"))
            .sum()
    })
}

/// `f` over matching chunks of `dst` and `src` on up to `threads` threads; the sum of its
/// results.
fn in_parallel<T: Send>(
    dst: &mut [T],
    src: &[f32],
    threads: usize,
    f: impl Fn(&mut [T], &[f32]) -> f64 + Sync,
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

    /// A bf16 (or f16) partition holds values of its dtype exactly (a fresh pass equals the
    /// fp32 partition's), rounds each sum to its dtype as accumulating in it does, and sums the
    /// squares of what it holds as an fp32 partition of the same values does; in half the bytes.
    #[test]
    fn a_16_bit_partition_holds_its_values_and_rounds_each_sum() {
        for dtype in [GradDtype::Bf16, GradDtype::F16] {
            holds_and_rounds(dtype);
        }
    }

    fn holds_and_rounds(dtype: GradDtype) {
        let len = PARALLEL_FROM * 2 + 7919;
        let round = |v: f32| match dtype {
            GradDtype::Bf16 => bf16::from_f32(v).to_f32(),
            _ => f16::from_f32(v).to_f32(),
        };
        let bf = |seed| {
            values(len, seed)
                .into_iter()
                .map(round)
                .collect::<Vec<f32>>()
        };
        let (a, b) = (bf(1), bf(2));
        for chunk in [len, 4099] {
            let mut wide = HostGrads::in_chunks(len, 3, chunk);
            let mut narrow = HostGrads::in_chunks_of(len, 3, chunk, dtype);
            assert_eq!(2 * narrow.bytes(), wide.bytes());
            for g in [&mut wide, &mut narrow] {
                g.write(0..len - 3, &a[..len - 3], false).unwrap();
                g.end_pass(false);
            }
            assert_eq!(narrow.read(0..len), wide.read(0..len), "a fresh pass");
            narrow.write(0..len, &b, true).unwrap();
            narrow.end_pass(true);
            let sums: Vec<f32> = (0..len)
                .map(|i| round(if i < len - 3 { a[i] } else { 0.0 } + b[i]))
                .collect();
            assert_eq!(narrow.read(0..len), sums, "{dtype:?}: each sum rounded");
            let mut same = HostGrads::in_chunks(len, 3, chunk);
            same.write(0..len, &sums, true).unwrap();
            same.end_pass(true);
            assert_eq!(narrow.sum_of_squares(), same.sum_of_squares());
            for c in 0..narrow.chunk_count() {
                let r = narrow.chunk_range(c);
                let lent = narrow.lend(c).unwrap();
                let lent_dtype = match lent.grad(r.len()) {
                    Grad::Bf16(_) => GradDtype::Bf16,
                    Grad::F16(_) => GradDtype::F16,
                    Grad::F32(_) => GradDtype::F32,
                };
                assert_eq!(lent_dtype, dtype);
                assert_eq!(lent.to_f32(), sums[r]);
                narrow.give_back(c, lent);
            }
            narrow.clear();
            narrow.write(5..len, &b[5..], true).unwrap();
            narrow.end_pass(true);
            assert_eq!(
                narrow.read(0..5),
                [0.0; 5],
                "a fresh pass zeroes what it missed"
            );
        }
    }

    /// Three micro-steps of writes into an odd partition (a gap never written, pieces in any
    /// order, one part parallel), against a plain vector summed by hand.
    #[test]
    fn accumulates_like_a_zeroed_vector_and_sums_squares_at_the_boundary() {
        // One chunk, small odd chunks, and chunks a parallel write straddles.
        for chunk in [usize::MAX, 4099, PARALLEL_FROM + 13] {
            accumulates_in_chunks(chunk);
        }
    }

    fn accumulates_in_chunks(chunk: usize) {
        let len = PARALLEL_FROM * 2 + 7919;
        let mut grads = HostGrads::in_chunks(len, 3, chunk.min(len));
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
        assert_eq!(grads.read(0..len), expected);
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

    /// A writer placing values itself (reserve, copy, commit) counts as a write: the same
    /// values, squares and notifications; refused where writes add, overlap, or hit a lent chunk.
    #[test]
    fn values_placed_in_place_count_as_writes() {
        let mut placed = HostGrads::in_chunks(25, 2, 10);
        let mut written = HostGrads::in_chunks(25, 2, 10);
        let (tx, rx) = std::sync::mpsc::channel();
        placed.watch(tx);
        let src: Vec<f32> = (0..25).map(|i| i as f32 * 0.5 - 3.0).collect();
        for r in [3..17, 17..25, 0..3] {
            assert!(placed.copies());
            placed.reserve(r.clone()).unwrap();
            assert_eq!(
                placed.reserve(r.start..r.start + 1).unwrap_err(),
                HostGradsError::Twice {
                    range: r.start..r.start + 1
                }
            );
            for c in r.start / 10..=(r.end - 1) / 10 {
                let whole = placed.chunk_range(c);
                let ptr = placed.chunk_ptr(c).unwrap().cast::<f32>();
                let part = r.start.max(whole.start)..r.end.min(whole.end);
                for (e, v) in src.iter().enumerate().take(part.end).skip(part.start) {
                    // SAFETY: `e` lies in chunk `c`, reserved above.
                    unsafe { *ptr.add(e - whole.start) = *v };
                }
            }
            // The second range's squares come from the caller (taken on the device).
            if r.start == 17 {
                for c in [1, 2] {
                    let whole = placed.chunk_range(c);
                    let part = r.start.max(whole.start)..r.end.min(whole.end);
                    let squares = src[part].iter().map(|v| f64::from(v * v)).sum();
                    placed.add_squares(c, squares);
                }
                placed.commit_squared(r.clone(), true);
            } else {
                placed.commit(r.clone(), true);
            }
            written.write(r.clone(), &src[r], true).unwrap();
        }
        assert_eq!(
            rx.try_iter().collect::<Vec<_>>(),
            vec![1, 2, 0],
            "as they finish"
        );
        assert_eq!(placed.read(0..25), written.read(0..25));
        for c in 0..3 {
            let (p, w) = (
                placed.chunk_sum_of_squares(c),
                written.chunk_sum_of_squares(c),
            );
            assert!(
                (p - w).abs() <= 1e-12 * w.abs(),
                "chunk {c}: {p} against {w}"
            );
        }
        placed.end_pass(true);
        assert!(!placed.copies(), "the next backward adds");
        assert_eq!(
            placed.reserve(0..1).unwrap_err(),
            HostGradsError::Twice { range: 0..1 }
        );
        placed.clear();
        let lent = placed.lend(2).unwrap();
        assert_eq!(
            placed.reserve(19..21).unwrap_err(),
            HostGradsError::Lent { chunk: 2 }
        );
        placed.give_back(2, lent);
    }

    /// The boundary backward tells each chunk as its last element arrives; a lent chunk
    /// refuses writes and reads, and comes back with its values.
    #[test]
    fn finished_chunks_are_told_and_can_be_lent() {
        let mut grads = HostGrads::in_chunks(25, 1, 10);
        let (tx, rx) = std::sync::mpsc::channel();
        grads.watch(tx);
        grads.write(0..5, &[1.0; 5], true).unwrap();
        grads.write(12..25, &[2.0; 13], true).unwrap();
        assert_eq!(
            rx.try_iter().collect::<Vec<_>>(),
            vec![2],
            "chunk 2 (20..25) is done"
        );
        grads.write(5..12, &[3.0; 7], true).unwrap();
        assert_eq!(rx.try_iter().collect::<Vec<_>>(), vec![0, 1]);
        let lent = grads.lend(1).unwrap();
        assert_eq!(
            lent.to_f32(),
            [3.0, 3.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
        );
        assert_eq!(
            grads.lend(1).unwrap_err(),
            HostGradsError::Lent { chunk: 1 }
        );
        assert_eq!(grads.chunk_sum_of_squares(1), 2.0 * 9.0 + 8.0 * 4.0);
        grads.end_pass(true);
        assert!(rx.recv().is_err(), "the pass's end closes the channel");
        grads.give_back(1, lent);
        assert_eq!(grads.read(9..13), [3.0, 3.0, 3.0, 2.0]);
        grads.clear();
        // Outside the boundary nothing is told.
        let (tx, rx) = std::sync::mpsc::channel();
        grads.watch(tx);
        grads.write(0..25, &[1.0; 25], false).unwrap();
        assert!(rx.try_recv().is_err());
        let lent = grads.lend(0).unwrap();
        let refused = grads.write(0..1, &[1.0], true);
        assert_eq!(refused.unwrap_err(), HostGradsError::Twice { range: 0..1 });
        grads.end_pass(false);
        assert_eq!(
            grads.write(3..4, &[1.0], true).unwrap_err(),
            HostGradsError::Lent { chunk: 0 }
        );
        grads.give_back(0, lent);
    }
}
