//! Collectives on buffers whose length does not divide by the world size.

use super::base::{CommElement, CommError, Communicator, ReduceOp};
use crate::partition::PartitionPlan;

/// All-gather and reduce-scatter over the uneven partitions of a [`PartitionPlan`], padding
/// to equal chunks on the way in and dropping the padding on the way out.
pub trait PaddedCollectives: Communicator {
    /// Gathers every rank's `owned` elements (`plan.owned(rank)`) into the full `out`.
    fn all_gather_padded<T: CommElement>(
        &self,
        plan: &PartitionPlan,
        owned: &[T],
        out: &mut [T],
    ) -> Result<(), CommError> {
        assert_eq!(
            owned.len(),
            plan.owned(self.rank()).len(),
            "owned slice of the plan"
        );
        assert_eq!(out.len(), plan.numel(), "output is the full buffer");
        let mut chunk = vec![T::default(); plan.chunk()];
        chunk[..owned.len()].copy_from_slice(owned);
        let mut padded = vec![T::default(); plan.padded_numel()];
        self.all_gather(T::buf(&chunk), T::buf_mut(&mut padded))?;
        out.copy_from_slice(&padded[..plan.numel()]);
        Ok(())
    }

    /// Reduces the full buffer `full` across ranks; this rank keeps its owned elements.
    fn reduce_scatter_padded<T: CommElement>(
        &self,
        plan: &PartitionPlan,
        full: &[T],
        owned: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        assert_eq!(full.len(), plan.numel(), "input is the full buffer");
        assert_eq!(
            owned.len(),
            plan.owned(self.rank()).len(),
            "owned slice of the plan"
        );
        let mut padded = vec![T::default(); plan.padded_numel()];
        padded[..full.len()].copy_from_slice(full);
        let mut chunk = vec![T::default(); plan.chunk()];
        self.reduce_scatter(T::buf(&padded), T::buf_mut(&mut chunk), op)?;
        owned.copy_from_slice(&chunk[..owned.len()]);
        Ok(())
    }
}

impl<C: Communicator + ?Sized> PaddedCollectives for C {}
