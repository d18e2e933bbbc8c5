//! Checkpoints (sharded save, exact resume, reshard, consolidation): the self-describing
//! manifest and the atomic directory store, as cores free of burn types.

mod manifest;
mod store;

pub use manifest::{
    FORMAT, FileEntry, Manifest, ManifestError, ParamEntry, Partitioning, Piece, VERSION,
};
pub use store::{LATEST, MANIFEST, Staging, StoreError, open_verified, resolve, sha256_file};

#[cfg(test)]
mod tests;
