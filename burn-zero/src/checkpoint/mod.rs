//! Checkpoints (sharded save, exact resume, reshard, consolidation): the self-describing
//! manifest first, as a core free of burn types.

mod manifest;

pub use manifest::{
    FORMAT, FileEntry, Manifest, ManifestError, ParamEntry, Partitioning, Piece, VERSION,
};

#[cfg(test)]
mod tests;
