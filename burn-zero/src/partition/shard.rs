//! ZeRO-3's per-parameter partitions: every parameter is split into equal chunks, one per
//! rank, so gathering one parameter is one balanced all-gather. A rank's partition of the
//! whole model is its chunk of every parameter, end to end (the optimizer's flat buffer).

use core::ops::Range;

use super::{Piece, ScatterLayout};

/// Per-parameter chunks of a list of parameters among `world_size` ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardPlan {
    world_size: usize,
    numels: Vec<usize>,
    chunks: Vec<usize>,
    offsets: Vec<usize>,
    len: usize,
}

impl ShardPlan {
    /// Splits parameters of `numels` elements among `world_size` ranks; every chunk is a
    /// multiple of `align` elements (the tail of a parameter's last chunks is padding).
    pub fn new(numels: &[usize], world_size: usize, align: usize) -> Self {
        assert!(world_size > 0, "a partition needs at least one rank");
        assert!(align > 0, "alignment must be at least one element");
        let chunks: Vec<usize> = numels
            .iter()
            .map(|n| n.div_ceil(world_size).div_ceil(align) * align)
            .collect();
        let mut len = 0;
        let offsets = chunks
            .iter()
            .map(|c| {
                len += c;
                len - c
            })
            .collect();
        Self {
            world_size,
            numels: numels.to_vec(),
            chunks,
            offsets,
            len,
        }
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Number of parameters.
    pub fn params(&self) -> usize {
        self.numels.len()
    }

    /// Elements of every rank's partition (the sum of the chunks).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the partitions hold no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements of parameter `p`.
    pub fn numel(&self, p: usize) -> usize {
        self.numels[p]
    }

    /// Elements of `p` in each rank's partition, padding included.
    pub fn chunk(&self, p: usize) -> usize {
        self.chunks[p]
    }

    /// Where `p`'s chunk starts in a rank's partition.
    pub fn offset(&self, p: usize) -> usize {
        self.offsets[p]
    }

    /// The elements of `p`'s chunk in a rank's partition.
    pub fn span(&self, p: usize) -> Range<usize> {
        self.offsets[p]..self.offsets[p] + self.chunks[p]
    }

    /// The elements of parameter `p` that `rank` holds (may be empty for the last ranks of a
    /// small parameter).
    pub fn owned(&self, p: usize, rank: usize) -> Range<usize> {
        assert!(
            rank < self.world_size,
            "rank {rank} outside {} ranks",
            self.world_size
        );
        let (n, c) = (self.numels[p], self.chunks[p]);
        (rank * c).min(n)..((rank + 1) * c).min(n)
    }
}

impl ScatterLayout {
    /// The reduce-scatter layout of whole gradients of parameters `items` (indices in `plan`):
    /// each rank receives its chunk of each, at the chunk's place in its partition.
    pub fn sharded(plan: &ShardPlan, items: &[usize]) -> Self {
        let per_rank: Vec<Vec<Piece>> = (0..plan.world_size())
            .map(|rank| {
                items
                    .iter()
                    .enumerate()
                    .map(|(item, &p)| Piece {
                        item,
                        range: plan.owned(p, rank),
                        dst: plan.offset(p),
                    })
                    .filter(|piece| !piece.range.is_empty())
                    .collect()
            })
            .collect();
        Self::from_pieces(per_rank)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_parameter_is_split_evenly_with_padding_at_its_end() {
        for world in 1..=5 {
            let plan = ShardPlan::new(&[7, 1, 16, 0, 33], world, 2);
            let mut offset = 0;
            for p in 0..plan.params() {
                let c = plan.chunk(p);
                assert_eq!(c % 2, 0);
                assert_eq!(plan.offset(p), offset);
                offset += c;
                let mut next = 0;
                for rank in 0..world {
                    let owned = plan.owned(p, rank);
                    assert_eq!(owned.start, next, "world {world}, param {p}");
                    assert!(owned.len() <= c);
                    next = owned.end;
                }
                assert_eq!(next, plan.numel(p));
            }
            assert_eq!(plan.len(), offset);
        }
        let plan = ShardPlan::new(&[7], 3, 1);
        assert_eq!(
            (plan.owned(0, 0), plan.owned(0, 1), plan.owned(0, 2)),
            (0..3, 3..6, 6..7)
        );
    }

    #[test]
    fn the_scatter_layout_sends_each_rank_its_chunks() {
        let plan = ShardPlan::new(&[5, 9, 2], 3, 1);
        // Chunks 2, 3, 1 at offsets 0, 2, 5.
        let layout = ScatterLayout::sharded(&plan, &[2, 0, 1]);
        let spans = |rank: usize| -> Vec<(usize, Range<usize>, usize)> {
            layout.per_rank[rank]
                .iter()
                .map(|p| (p.item, p.range.clone(), p.dst))
                .collect()
        };
        // Each rank's pieces in the order of their places in its partition.
        assert_eq!(spans(0), vec![(1, 0..2, 0), (2, 0..3, 2), (0, 0..1, 5)]);
        assert_eq!(spans(1), vec![(1, 2..4, 0), (2, 3..6, 2), (0, 1..2, 5)]);
        assert_eq!(spans(2), vec![(1, 4..5, 0), (2, 6..9, 2)]);
        assert_eq!(layout.longest, 6);
    }
}
