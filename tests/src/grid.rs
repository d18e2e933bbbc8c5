//! Thread-rank communicators for every group of a process grid: one in-process group per
//! group of each axis, so a rank gets its pipe, data and model communicators by axis name.

use std::collections::HashMap;

use burn_pipeline::Topology;
use burn_zero::comm::{LocalComm, LocalGroup};

/// In-process groups for each axis of `topo`.
pub struct GridComms {
    topo: Topology,
    groups: HashMap<String, Vec<LocalGroup>>,
}

impl GridComms {
    /// Groups for `axes` of `topo`.
    pub fn new(topo: Topology, axes: &[&str]) -> Self {
        let groups = axes
            .iter()
            .map(|axis| {
                let groups = topo
                    .groups(axis)
                    .iter()
                    .map(|g| LocalGroup::new(g.len()))
                    .collect();
                (axis.to_string(), groups)
            })
            .collect();
        Self { topo, groups }
    }

    /// The grid.
    pub fn topology(&self) -> &Topology {
        &self.topo
    }

    /// `rank`'s communicator along `axis`.
    pub fn comm(&self, rank: usize, axis: &str) -> LocalComm {
        let (group, place) = self.topo.group_of(rank, axis);
        let index = self
            .topo
            .groups(axis)
            .iter()
            .position(|g| *g == group)
            .expect("the rank's group is one of the axis's groups");
        self.groups[axis][index].comm(place)
    }
}
