//! Checkpoints (sharded save, exact resume, reshard, consolidation): the self-describing
//! manifest and the atomic directory store, as cores free of burn types.

mod manifest;
mod read;
pub mod safetensors;
mod store;

pub use manifest::{
    FORMAT, FileEntry, Manifest, ManifestError, ParamEntry, Partitioning, Piece, VERSION, ZeroStage,
};
pub use read::{MASTER, PartitionFiles, Span, consolidate, describe, partition_file};
pub use safetensors::Dtype;
pub use store::{
    LATEST, MANIFEST, Staging, StoreError, commit_file, open_manifest, open_verified, replace_file,
    resolve, sha256_file, verify,
};

#[cfg(test)]
mod tests;
