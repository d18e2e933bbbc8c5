//! The optimizer's new weights as consecutive pieces rather than one flat tensor: a large
//! partition (billions of elements on one GPU under ZeRO-Offload) is past what one device
//! buffer and cubecl's 32-bit indexing take, so parameters are rebuilt from the pieces (views
//! where a parameter lies in one piece) and stages 1–2 gather every rank's chunk piece by
//! piece instead of into one full flat buffer.

use core::ops::Range;

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use super::collective::FlatComm;
use super::grad_buffer::{overlaps, piece_ranges};
use crate::comm::CommError;

/// Elements `range` of the flat buffer made of consecutive `pieces` (a view when the range
/// lies in one piece).
pub(crate) fn slice_pieces<I: Backend>(
    pieces: &[Tensor<I, 1>],
    range: Range<usize>,
) -> Tensor<I, 1> {
    let mut parts: Vec<Tensor<I, 1>> = overlaps(piece_ranges(pieces), &range)
        .into_iter()
        .map(|(i, local, _)| pieces[i].clone().slice(local))
        .collect();
    match parts.len() {
        1 => parts.pop().expect("one part"),
        0 => panic!("elements {range:?} lie outside the flat pieces"),
        _ => Tensor::cat(parts, 0),
    }
}

/// Every rank's chunk of a partitioned flat buffer (rank `r`'s chunk holds elements
/// `r·chunk..(r+1)·chunk`), gathered in pieces: a piece's gathered tensor holds, rank after
/// rank, each rank's elements `local` of its chunk.
pub(crate) struct Gathered<I: Backend> {
    chunk: usize,
    tables: Vec<(Range<usize>, Tensor<I, 1>)>,
}

impl<I: Backend> Gathered<I> {
    /// All-gathers this rank's `owned` pieces (its part of the chunk; zeros pad it to `chunk`
    /// elements), at most `piece` elements per rank at a time (`allgather_bucket_size`).
    pub(crate) fn gather(
        flat: &mut FlatComm<I>,
        owned: &[Tensor<I, 1>],
        chunk: usize,
        piece: usize,
    ) -> Result<Self, CommError> {
        let piece = piece.max(1);
        let mut local: Vec<Tensor<I, 1>> = owned.to_vec();
        let have: usize = local.iter().map(|t| t.dims()[0]).sum();
        if have < chunk {
            let like = owned.first().map(|t| (t.device(), t.dtype()));
            let (device, dtype) = like.unwrap_or((flat.device().clone(), burn::tensor::DType::F32));
            local.push(Tensor::zeros([chunk - have], (&device, dtype)));
        }
        // The same ranges on every rank, whatever its own pieces.
        let mut tables = Vec::new();
        for start in (0..chunk).step_by(piece) {
            let end = (start + piece).min(chunk);
            let gathered = flat.all_gather(slice_pieces(&local, start..end))?;
            tables.push((start..end, gathered));
        }
        flat.wait()?;
        Ok(Self { chunk, tables })
    }

    /// Elements `range` of the full (rank-major) flat buffer: a view of one gathered tensor
    /// where the range lies in one, so a parameter's weights are not copied out of it (burn-cuda
    /// makes a slice a view when both its ends fall on its memory alignment, 512 bytes on CUDA,
    /// and copies it otherwise).
    pub(crate) fn slice(&self, range: Range<usize>) -> Tensor<I, 1> {
        let mut parts = Vec::new();
        let mut at = range.start;
        while at < range.end {
            let rank = at / self.chunk;
            let end = range.end.min((rank + 1) * self.chunk);
            let local = at - rank * self.chunk..end - rank * self.chunk;
            let ranges = self.tables.iter().map(|(r, _)| r.clone());
            for (i, within, _) in overlaps(ranges, &local) {
                let (width, table) = (self.tables[i].0.len(), &self.tables[i].1);
                let row = rank * width;
                parts.push(table.clone().slice(row + within.start..row + within.end));
            }
            at = end;
        }
        match parts.len() {
            1 => parts.pop().expect("one part"),
            _ => Tensor::cat(parts, 0),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use burn::backend::NdArray;
    use burn::tensor::TensorData;

    use super::*;
    use crate::comm::Communicator;
    use crate::testing::run_ranks;

    type B = NdArray;

    fn tensor(values: Vec<f32>) -> Tensor<B, 1> {
        let n = values.len();
        Tensor::from_data(TensorData::new(values, [n]), &Default::default())
    }

    fn values(t: Tensor<B, 1>) -> Vec<f32> {
        t.into_data().to_vec().unwrap()
    }

    #[test]
    fn slices_across_pieces_equal_slices_of_the_whole() {
        let whole: Vec<f32> = (0..23).map(|i| i as f32).collect();
        let pieces = vec![
            tensor(whole[..5].to_vec()),
            tensor(whole[5..6].to_vec()),
            tensor(whole[6..].to_vec()),
        ];
        for range in [0..23, 0..5, 3..7, 5..6, 6..23, 4..19, 22..23] {
            assert_eq!(
                values(slice_pieces(&pieces, range.clone())),
                whole[range.clone()]
            );
        }
    }

    /// Three ranks own 9, 9 and 5 elements of chunks of 9 (the last padded), in pieces of
    /// uneven lengths, gathered 4 at a time: any range of the full buffer, across ranks and
    /// pieces, equals the same range of the whole.
    #[test]
    fn gathered_chunks_read_as_the_full_flat_buffer() {
        let whole: Vec<f32> = (0..23).map(|i| 100.0 + i as f32).collect();
        let results = run_ranks(3, |ctx| {
            let rank = ctx.rank;
            let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
            let mut flat = FlatComm::<B>::new(comm, Default::default(), false, false);
            let owned = &whole[rank * 9..(rank * 9 + 9).min(23)];
            let pieces = vec![tensor(owned[..2].to_vec()), tensor(owned[2..].to_vec())];
            let gathered = Gathered::gather(&mut flat, &pieces, 9, 4).unwrap();
            [0..23, 0..27, 8..10, 2..20, 17..19, 18..27]
                .into_iter()
                .map(|r| (r.clone(), values(gathered.slice(r))))
                .collect::<Vec<_>>()
        });
        let mut padded = whole.clone();
        padded.resize(27, 0.0);
        for got in results {
            for (range, v) in got {
                assert_eq!(v, padded[range.clone()], "{range:?}");
            }
        }
    }
}
