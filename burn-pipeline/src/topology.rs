//! The process grid of 3D parallelism (DeepSpeed's `ProcessTopology`): ranks laid out over
//! named axes (`pipe`, `data`, `model` by default), the last axis varying fastest, so the
//! ranks of one tensor-parallel group are neighbours (one node's fast links). Maps ranks to
//! coordinates and back, and lists the groups of ranks that differ along one axis only (each
//! becomes a sub-communicator, [`Topology::axis_comm`]). Free of burn types.

use std::sync::Arc;

use burn_zero::comm::{Communicator, SubComm};

/// A grid of ranks over named axes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    axes: Vec<String>,
    dims: Vec<usize>,
}

impl Topology {
    /// A grid with `axes` of sizes `dims` (the last axis varies fastest).
    ///
    /// # Panics
    /// If the lists differ in length, an axis is repeated, or a size is 0.
    pub fn new(axes: &[&str], dims: &[usize]) -> Self {
        assert_eq!(axes.len(), dims.len(), "one size per axis");
        assert!(
            dims.iter().all(|d| *d > 0),
            "axes need at least one rank: {dims:?}"
        );
        for (i, a) in axes.iter().enumerate() {
            assert!(!axes[..i].contains(a), "axis `{a}` is repeated");
        }
        Self {
            axes: axes.iter().map(|a| a.to_string()).collect(),
            dims: dims.to_vec(),
        }
    }

    /// DeepSpeed's `PipeModelDataParallelTopology` order: pipe, data, model.
    pub fn pipe_data_model(pipe: usize, data: usize, model: usize) -> Self {
        Self::new(&["pipe", "data", "model"], &[pipe, data, model])
    }

    /// Ranks in the grid.
    pub fn world_size(&self) -> usize {
        self.dims.iter().product()
    }

    /// The size of `axis`.
    ///
    /// # Panics
    /// If there is no such axis.
    pub fn dim(&self, axis: &str) -> usize {
        self.dims[self.axis(axis)]
    }

    fn axis(&self, axis: &str) -> usize {
        self.axes
            .iter()
            .position(|a| a == axis)
            .unwrap_or_else(|| panic!("no axis `{axis}` in {:?}", self.axes))
    }

    /// The rank at `coord` (one index per axis, in axis order).
    ///
    /// # Panics
    /// If `coord` is outside the grid.
    pub fn rank(&self, coord: &[usize]) -> usize {
        assert_eq!(coord.len(), self.dims.len(), "one index per axis");
        coord.iter().zip(&self.dims).fold(0, |rank, (c, d)| {
            assert!(
                c < d,
                "coordinate {coord:?} outside the grid {:?}",
                self.dims
            );
            rank * d + c
        })
    }

    /// The coordinate of `rank`.
    ///
    /// # Panics
    /// If `rank` is outside the grid.
    pub fn coord(&self, rank: usize) -> Vec<usize> {
        assert!(
            rank < self.world_size(),
            "rank {rank} outside {} ranks",
            self.world_size()
        );
        let mut rest = rank;
        let mut coord = vec![0; self.dims.len()];
        for (i, d) in self.dims.iter().enumerate().rev() {
            coord[i] = rest % d;
            rest /= d;
        }
        coord
    }

    /// `rank`'s index along `axis`.
    pub fn coord_along(&self, rank: usize, axis: &str) -> usize {
        self.coord(rank)[self.axis(axis)]
    }

    /// The groups of ranks that differ along `axis` only, each in increasing order of that
    /// axis (its sub-communicator's rank order); groups ordered by their first rank.
    pub fn groups(&self, axis: &str) -> Vec<Vec<usize>> {
        let a = self.axis(axis);
        let mut groups: Vec<Vec<usize>> = (0..self.world_size())
            .filter(|r| self.coord(*r)[a] == 0)
            .map(|first| {
                let mut coord = self.coord(first);
                (0..self.dims[a])
                    .map(|i| {
                        coord[a] = i;
                        self.rank(&coord)
                    })
                    .collect()
            })
            .collect();
        groups.sort();
        groups
    }

    /// This rank's communicator along `axis`, over its group of [`Topology::groups`] ranked
    /// by the axis: split from `world` (the whole grid's communicator) where it splits (NCCL:
    /// a communicator of the GPUs' own, [`Communicator::split_group`]), else a [`SubComm`] of
    /// it. Collective over `world`: every rank asks for the same axes in the same order.
    pub fn axis_comm(
        &self,
        world: Arc<dyn Communicator>,
        axis: &str,
    ) -> Result<Box<dyn Communicator>, String> {
        if world.world_size() != self.world_size() {
            return Err(format!(
                "a grid of {} ranks ({:?} = {:?}) over a communicator of {}",
                self.world_size(),
                self.axes,
                self.dims,
                world.world_size()
            ));
        }
        let rank = world.rank();
        let groups = self.groups(axis);
        let color = groups
            .iter()
            .position(|g| g.contains(&rank))
            .expect("every rank is in one group per axis");
        let place = self.coord_along(rank, axis);
        let color = u32::try_from(color).map_err(|_| format!("{color} groups along `{axis}`"))?;
        match world.split_group(Some(color), place) {
            Some(split) => split
                .map_err(|e| format!("splitting the `{axis}` axis: {e}"))?
                .ok_or_else(|| format!("rank {rank} is in no group along `{axis}`")),
            None => Ok(Box::new(SubComm::new(
                world,
                groups.into_iter().nth(color as usize).expect("found above"),
            )?)),
        }
    }

    /// The group along `axis` that holds `rank`, and `rank`'s place in it.
    pub fn group_of(&self, rank: usize, axis: &str) -> (Vec<usize>, usize) {
        let group = self
            .groups(axis)
            .into_iter()
            .find(|g| g.contains(&rank))
            .expect("every rank is in one group per axis");
        let place = self.coord_along(rank, axis);
        (group, place)
    }
}

/// A pipeline's neighbouring pairs of ranks, both ways, and the last rank's link to the first
/// (an interleaved schedule's wrap-around and a tied matrix's gradients travel there): what
/// [`Communicator::open_links`] opens on a pipeline's communicator of `ranks` ranks.
pub fn pipeline_links(ranks: usize) -> Vec<(usize, usize)> {
    let mut pairs = Vec::new();
    for r in 0..ranks {
        let next = (r + 1) % ranks;
        for pair in [(r, next), (next, r)] {
            if pair.0 != pair.1 && !pairs.contains(&pair) {
                pairs.push(pair);
            }
        }
    }
    pairs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_and_coordinates_round_trip_with_the_last_axis_fastest() {
        let t = Topology::pipe_data_model(2, 3, 2);
        assert_eq!(t.world_size(), 12);
        for r in 0..12 {
            assert_eq!(t.rank(&t.coord(r)), r);
        }
        assert_eq!(t.coord(0), vec![0, 0, 0]);
        assert_eq!(t.coord(1), vec![0, 0, 1], "model varies fastest");
        assert_eq!(t.coord(2), vec![0, 1, 0]);
        assert_eq!(t.coord(6), vec![1, 0, 0]);
        assert_eq!(t.rank(&[1, 2, 1]), 11);
        assert_eq!(t.coord_along(7, "model"), 1);
        assert_eq!(t.dim("data"), 3);
    }

    /// The groups of the 2×2×2 grid, written out.
    #[test]
    fn axis_groups_of_a_two_by_two_by_two_grid() {
        let t = Topology::pipe_data_model(2, 2, 2);
        assert_eq!(
            t.groups("model"),
            vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
        );
        assert_eq!(
            t.groups("data"),
            vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
        );
        assert_eq!(
            t.groups("pipe"),
            vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
        );
        assert_eq!(t.group_of(5, "data"), (vec![5, 7], 0));
        assert_eq!(t.group_of(7, "pipe"), (vec![3, 7], 1));
    }

    #[test]
    fn every_rank_is_in_exactly_one_group_per_axis() {
        let t = Topology::pipe_data_model(3, 2, 4);
        for axis in ["pipe", "data", "model"] {
            let groups = t.groups(axis);
            assert_eq!(groups.len(), t.world_size() / t.dim(axis));
            let mut all: Vec<usize> = groups.iter().flatten().copied().collect();
            all.sort();
            assert_eq!(all, (0..t.world_size()).collect::<Vec<_>>(), "{axis}");
            for g in &groups {
                // Along the axis only: the other coordinates agree.
                let a = t.axes.iter().position(|x| x == axis).unwrap();
                let strip = |r: usize| {
                    let mut c = t.coord(r);
                    c.remove(a);
                    c
                };
                assert!(g.iter().all(|r| strip(*r) == strip(g[0])), "{axis}: {g:?}");
            }
        }
    }

    #[test]
    #[should_panic(expected = "no axis `tensor`")]
    fn unknown_axes_are_named() {
        Topology::pipe_data_model(1, 2, 1).groups("tensor");
    }

    #[test]
    fn pipeline_links_join_neighbours_both_ways_and_wrap_around() {
        assert!(pipeline_links(1).is_empty());
        assert_eq!(pipeline_links(2), vec![(0, 1), (1, 0)]);
        let four = pipeline_links(4);
        assert_eq!(four.len(), 8);
        for r in 0..4 {
            assert!(four.contains(&(r, (r + 1) % 4)) && four.contains(&((r + 1) % 4, r)));
        }
    }
}
