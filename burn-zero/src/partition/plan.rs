//! The flat partition plan: each rank's equal chunk of the padded buffer.

use core::ops::Range;

/// Equal chunks of a padded flat buffer, one per rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartitionPlan {
    numel: usize,
    world_size: usize,
    chunk: usize,
}

impl PartitionPlan {
    /// Splits `numel` elements among `world_size` ranks with no alignment.
    pub fn new(numel: usize, world_size: usize) -> Self {
        Self::aligned(numel, world_size, 1)
    }

    /// Splits `numel` elements among `world_size` ranks, each chunk a multiple of `align`.
    pub fn aligned(numel: usize, world_size: usize, align: usize) -> Self {
        assert!(world_size > 0, "a partition needs at least one rank");
        assert!(align > 0, "alignment must be at least one element");
        let chunk = numel.div_ceil(world_size).div_ceil(align) * align;
        Self {
            numel,
            world_size,
            chunk,
        }
    }

    /// Elements of the unpadded buffer.
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Elements per rank, padding included.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Elements of the padded buffer: `chunk × world_size`.
    pub fn padded_numel(&self) -> usize {
        self.chunk * self.world_size
    }

    /// Padding elements at the end of the padded buffer.
    pub fn padding(&self) -> usize {
        self.padded_numel() - self.numel
    }

    /// The real (unpadded) elements `rank` owns, as a range of the unpadded buffer.
    pub fn owned(&self, rank: usize) -> Range<usize> {
        assert!(
            rank < self.world_size,
            "rank {rank} outside {} ranks",
            self.world_size
        );
        let start = (rank * self.chunk).min(self.numel);
        let end = ((rank + 1) * self.chunk).min(self.numel);
        start..end
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_buffer_once_with_padding_at_the_end() {
        for numel in [0, 1, 7, 16, 1000003] {
            for world in 1..=5 {
                for align in [1, 4, 32] {
                    let plan = PartitionPlan::aligned(numel, world, align);
                    assert_eq!(plan.chunk() % align, 0);
                    assert!(plan.padded_numel() >= numel);
                    assert!(plan.padding() < world * align + world, "{plan:?}");
                    let mut next = 0;
                    for rank in 0..world {
                        let owned = plan.owned(rank);
                        assert_eq!(owned.start, next);
                        assert!(owned.len() <= plan.chunk());
                        next = owned.end;
                    }
                    assert_eq!(next, numel);
                }
            }
        }
    }

    #[test]
    fn uneven_split_example() {
        let plan = PartitionPlan::new(7, 3);
        assert_eq!(plan.chunk(), 3);
        assert_eq!(
            (plan.owned(0), plan.owned(1), plan.owned(2)),
            (0..3, 3..6, 6..7)
        );
        assert_eq!(plan.padding(), 2);
    }
}
