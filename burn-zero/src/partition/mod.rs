//! Partition plans: how a flat buffer of `numel` elements is split among ranks, with padding.
//!
//! Every rank owns one equal, aligned chunk of the padded buffer (collectives such as NCCL's
//! need equal chunks); the last chunks may hold padding only. Free of burn types.

mod bucket;
mod shard;
pub use bucket::{
    BucketItem, Piece, ScatterLayout, all_gather_in_pieces, reduce_scatter_bucket, spans,
};
pub use shard::ShardPlan;

mod plan;
pub use plan::*;
