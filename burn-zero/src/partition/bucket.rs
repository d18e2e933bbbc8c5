//! Reduce-scatter of a bucket of whole gradients into the owners' partitions.
//!
//! A bucket holds gradients of several parameters at their offsets in the flat buffer; each
//! spans the partitions of one or more ranks. The send buffer is laid out rank-major — for
//! each rank, the pieces of the bucket that fall in its partition, padded to the longest —
//! so one equal-chunk reduce-scatter delivers every rank exactly its pieces.

use core::ops::Range;

use super::PartitionPlan;
use crate::comm::{CommError, Communicator, ReduceOp};

/// One gradient of a bucket: its offset in the flat buffer and its values.
pub struct BucketItem {
    /// Offset of the first element in the (unpadded) flat buffer.
    pub offset: usize,
    /// The gradient, flattened.
    pub values: Vec<f32>,
}

/// One piece of a bucket item that falls in one rank's chunk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Index of the item in the bucket.
    pub item: usize,
    /// The elements of the item.
    pub range: core::ops::Range<usize>,
    /// Where they go in the owner's chunk.
    pub dst: usize,
}

/// The send layout of one bucket's reduce-scatter: for each rank, its pieces in the order of
/// their places in its partition, padded to the longest rank's total. The same plan serves
/// host and device buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScatterLayout {
    /// Pieces per rank, in send order.
    pub per_rank: Vec<Vec<Piece>>,
    /// Elements each rank sends and receives (the longest rank's pieces).
    pub longest: usize,
}

impl ScatterLayout {
    /// The layout of items given as `(offset in the flat buffer, length)`.
    pub fn new(plan: &PartitionPlan, items: &[(usize, usize)]) -> Self {
        let chunk = plan.chunk();
        let per_rank: Vec<Vec<Piece>> = (0..plan.world_size())
            .map(|rank| {
                let (lo, hi) = (rank * chunk, (rank + 1) * chunk);
                items
                    .iter()
                    .enumerate()
                    .filter_map(|(item, &(offset, len))| {
                        let (start, end) = (offset.max(lo), (offset + len).min(hi));
                        (start < end).then(|| Piece {
                            item,
                            range: start - offset..end - offset,
                            dst: start - lo,
                        })
                    })
                    .collect()
            })
            .collect();
        Self::from_pieces(per_rank)
    }

    /// The layout of the given pieces per rank, each rank's in the order of their place in
    /// its partition: neighbours there are neighbours in what it receives, so they can be
    /// written back as one range.
    pub(crate) fn from_pieces(mut per_rank: Vec<Vec<Piece>>) -> Self {
        for pieces in &mut per_rank {
            pieces.sort_by_key(|p| p.dst);
        }
        let longest = per_rank
            .iter()
            .map(|p| p.iter().map(|piece| piece.range.len()).sum::<usize>())
            .max()
            .unwrap_or(0);
        Self { per_rank, longest }
    }
}

/// Where `pieces`, laid end to end in a received bucket, go: (offset in the bucket, range in
/// the partition) of each run of pieces that are neighbours in the partition too.
pub fn spans(pieces: &[Piece]) -> Vec<(usize, Range<usize>)> {
    let mut spans: Vec<(usize, Range<usize>)> = Vec::with_capacity(pieces.len());
    let mut at = 0;
    for p in pieces {
        let len = p.range.len();
        match spans.last_mut() {
            Some((_, dst)) if dst.end == p.dst => dst.end += len,
            _ => spans.push((at, p.dst..p.dst + len)),
        }
        at += len;
    }
    spans
}

/// Reduces `items` across ranks with `op` and adds this rank's pieces into `partition`
/// (its chunk of the padded flat buffer, `plan.chunk()` elements).
pub fn reduce_scatter_bucket(
    comm: &dyn Communicator,
    plan: &PartitionPlan,
    items: &[BucketItem],
    op: ReduceOp,
    partition: &mut [f32],
) -> Result<(), CommError> {
    assert_eq!(partition.len(), plan.chunk(), "the partition is one chunk");
    let spans: Vec<_> = items.iter().map(|i| (i.offset, i.values.len())).collect();
    let layout = ScatterLayout::new(plan, &spans);
    let longest = layout.longest;
    if longest == 0 {
        return Ok(());
    }
    let mut send = vec![0.0f32; longest * comm.world_size()];
    for (rank, pieces) in layout.per_rank.iter().enumerate() {
        let mut at = rank * longest;
        for piece in pieces {
            let values = &items[piece.item].values[piece.range.clone()];
            send[at..at + values.len()].copy_from_slice(values);
            at += values.len();
        }
    }
    let mut received = vec![0.0f32; longest];
    comm.reduce_scatter(send.as_slice().into(), received.as_mut_slice().into(), op)?;
    let mut at = 0;
    for piece in &layout.per_rank[comm.rank()] {
        let len = piece.range.len();
        for (d, s) in partition[piece.dst..piece.dst + len]
            .iter_mut()
            .zip(&received[at..at + len])
        {
            *d += *s;
        }
        at += len;
    }
    Ok(())
}

/// All-gathers every rank's `chunk` into `full` (`world_size × chunk` elements, rank-major),
/// in pieces of at most `piece` elements per rank (DeepSpeed's `allgather_bucket_size`).
pub fn all_gather_in_pieces(
    comm: &dyn Communicator,
    chunk: &[f32],
    full: &mut [f32],
    piece: usize,
) -> Result<(), CommError> {
    let (world, len) = (comm.world_size(), chunk.len());
    assert_eq!(
        full.len(),
        world * len,
        "the output holds every rank's chunk"
    );
    let piece = piece.max(1);
    let mut gathered = Vec::new();
    for start in (0..len).step_by(piece) {
        let end = (start + piece).min(len);
        let n = end - start;
        gathered.resize(n * world, 0.0);
        comm.all_gather(chunk[start..end].into(), gathered.as_mut_slice().into())?;
        for rank in 0..world {
            full[rank * len + start..rank * len + end]
                .copy_from_slice(&gathered[rank * n..(rank + 1) * n]);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{for_world_sizes, run_ranks};

    #[test]
    fn all_gather_in_small_pieces() {
        for_world_sizes(&[1, 3], |world| {
            let fulls = run_ranks(world, |ctx| {
                let chunk: Vec<f32> = (0..7).map(|i| (ctx.rank * 10 + i) as f32).collect();
                let mut full = vec![0.0; 7 * world];
                all_gather_in_pieces(&ctx.comm, &chunk, &mut full, 3).unwrap();
                full
            });
            let want: Vec<f32> = (0..world)
                .flat_map(|r| (0..7).map(move |i| (r * 10 + i) as f32))
                .collect();
            assert!(fulls.iter().all(|f| f == &want));
        });
    }

    #[test]
    fn buckets_land_in_the_owners_partitions() {
        // Three uneven "parameters" (7, 15, 5 elements) in two buckets, any world size.
        let sizes = [7usize, 15, 5];
        let offsets = [0usize, 7, 22];
        let value = |rank: usize, p: usize, i: usize| (rank * 100 + p * 10 + i) as f32 * 0.5;
        for_world_sizes(&[1, 2, 3, 4], |world| {
            let plan = PartitionPlan::aligned(27, world, 2);
            let parts = run_ranks(world, |ctx| {
                let item = |p: usize| BucketItem {
                    offset: offsets[p],
                    values: (0..sizes[p]).map(|i| value(ctx.rank, p, i)).collect(),
                };
                let mut partition = vec![0.0f32; plan.chunk()];
                reduce_scatter_bucket(
                    &ctx.comm,
                    &plan,
                    &[item(2), item(0)],
                    ReduceOp::Sum,
                    &mut partition,
                )
                .unwrap();
                reduce_scatter_bucket(&ctx.comm, &plan, &[item(1)], ReduceOp::Sum, &mut partition)
                    .unwrap();
                partition
            });
            let full: Vec<f32> = (0..3)
                .flat_map(|p| {
                    (0..sizes[p]).map(move |i| (0..world).map(|r| value(r, p, i)).sum::<f32>())
                })
                .collect();
            for (rank, part) in parts.iter().enumerate() {
                let owned = plan.owned(rank);
                assert_eq!(
                    &part[..owned.len()],
                    &full[owned.clone()],
                    "rank {rank} of {world}"
                );
                assert!(
                    part[owned.len()..].iter().all(|v| *v == 0.0),
                    "padding stays zero"
                );
            }
        });
    }

    fn piece(item: usize, len: usize, dst: usize) -> Piece {
        Piece {
            item,
            range: 0..len,
            dst,
        }
    }

    /// Pieces laid end to end in a received bucket make one span where they are neighbours in
    /// the partition too, and separate spans across a gap (a stage-3 chunk's padding), a jump
    /// back or a repeated place.
    #[test]
    fn spans_merge_only_partition_neighbours() {
        let pieces = [
            piece(0, 3, 10),
            piece(1, 2, 13),
            piece(2, 4, 15),
            piece(3, 1, 22),
            piece(4, 2, 0),
            piece(5, 2, 2),
            piece(6, 2, 2),
        ];
        assert_eq!(
            spans(&pieces),
            vec![(0, 10..19), (9, 22..23), (10, 0..4), (14, 2..4)]
        );
        assert!(spans(&[]).is_empty());
    }
}
