//! The checkpoint manifest (`manifest.json`): everything needed to read a checkpoint without
//! burn-zero — parameter names and full shapes, how every rank's flat partition is cut from
//! them (offsets, chunks, padding), the stage and world size, the files with sizes and
//! checksums, and the engine's state. Free of burn types; parsing never panics.

use core::ops::Range;

use serde::{Deserialize, Serialize};

pub use crate::config::ZeroStage;

/// The `format` field of every manifest.
pub const FORMAT: &str = "burn-zero-checkpoint";
/// The manifest version this build writes and reads.
pub const VERSION: u32 = 1;

/// A checkpoint's manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// [`VERSION`] when written by this build.
    pub version: u32,
    /// The checkpoint's tag (`global_step12`, ...).
    pub tag: String,
    /// The ZeRO stage of the run that wrote it.
    pub stage: ZeroStage,
    /// Ranks of the run that wrote it (one partition file per rank).
    pub world_size: usize,
    /// How each rank's flat partition is cut from the parameters.
    pub partitioning: Partitioning,
    /// The trainable parameters, in the engine's layout order.
    pub params: Vec<ParamEntry>,
    /// The tensors of every partition file (`master`, `exp_avg`, ...), each the rank's flat
    /// partition of that quantity, with its dtype.
    #[serde(default)]
    pub tensors: std::collections::BTreeMap<String, super::Dtype>,
    /// Every file of the checkpoint, with its size and SHA-256.
    pub files: Vec<FileEntry>,
    /// The engine's state (steps, scheduler, loss scaler, data position, ...), as written.
    #[serde(default)]
    pub engine: serde_json::Value,
}

/// How parameters map to the ranks' flat partitions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Partitioning {
    /// Stages 0–2: the parameters end to end in one flat buffer, zero-padded to
    /// `world_size × chunk` elements; rank `r` holds elements `r·chunk .. (r+1)·chunk`.
    Flat {
        /// Elements per rank.
        chunk: usize,
    },
    /// Stage 3: each parameter split on its own into `world_size` chunks (its
    /// [`ParamEntry::chunk`], padded at its end); a rank's partition is its chunk of every
    /// parameter, in order.
    PerParam,
}

/// One trainable parameter.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamEntry {
    /// Its module path (`blocks.3.attn.q_proj.weight`).
    pub name: String,
    /// Its full shape.
    pub shape: Vec<usize>,
    /// [`Partitioning::PerParam`]: elements of it in each rank's partition, padding included.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk: Option<usize>,
}

/// One file of the checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Path relative to the checkpoint directory.
    pub path: String,
    /// The rank whose partition it holds, if any.
    #[serde(default)]
    pub rank: Option<usize>,
    /// Size in bytes.
    pub bytes: u64,
    /// SHA-256 of the contents, lowercase hex.
    pub sha256: String,
}

/// One contiguous piece of a parameter held by one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The rank holding it.
    pub rank: usize,
    /// Its elements, as a range of the flattened parameter.
    pub elements: Range<usize>,
    /// Where it starts in that rank's flat partition.
    pub at: usize,
}

/// Why a manifest cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    /// Not valid JSON for a manifest.
    #[error("the manifest is not valid: {0}")]
    Parse(String),
    /// Valid JSON with a value that cannot be right.
    #[error("the manifest's `{field}` is invalid: {reason}")]
    Invalid {
        /// The field, as a path.
        field: String,
        /// What is wrong.
        reason: String,
    },
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ManifestError {
    ManifestError::Invalid {
        field: field.into(),
        reason: reason.into(),
    }
}

impl ParamEntry {
    /// Elements of the parameter (`None` when the shape's product overflows).
    pub fn numel(&self) -> Option<usize> {
        self.shape.iter().try_fold(1usize, |n, d| n.checked_mul(*d))
    }
}

impl Manifest {
    /// Parses and validates a manifest; never panics, whatever the bytes.
    pub fn parse(bytes: &[u8]) -> Result<Self, ManifestError> {
        let mut json = serde_json::Deserializer::from_slice(bytes);
        let manifest: Manifest =
            serde_path_to_error::deserialize(&mut json).map_err(|e| {
                match e.path().to_string().as_str() {
                    "." => ManifestError::Parse(e.inner().to_string()),
                    path => ManifestError::Parse(format!("`{path}`: {}", e.inner())),
                }
            })?;
        manifest.validate()?;
        Ok(manifest)
    }

    /// The manifest as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a manifest serializes")
    }

    /// Checks everything a reader relies on.
    pub fn validate(&self) -> Result<(), ManifestError> {
        if self.format != FORMAT {
            return Err(invalid(
                "format",
                format!("`{}`, not `{FORMAT}`", self.format),
            ));
        }
        if self.version != VERSION {
            return Err(invalid(
                "version",
                format!("{} (this build reads version {VERSION})", self.version),
            ));
        }
        if self.world_size == 0 {
            return Err(invalid("world_size", "0 (at least 1)"));
        }
        let mut names = std::collections::HashSet::new();
        let mut total = 0usize;
        for (i, p) in self.params.iter().enumerate() {
            let field = |f: &str| format!("params[{i}].{f}");
            if p.name.is_empty() || !names.insert(p.name.as_str()) {
                return Err(invalid(
                    field("name"),
                    format!("`{}` is empty or repeated", p.name),
                ));
            }
            let numel = p
                .numel()
                .ok_or_else(|| invalid(field("shape"), "its element count overflows"))?;
            total = total
                .checked_add(numel)
                .ok_or_else(|| invalid(field("shape"), "the total element count overflows"))?;
            match (self.partitioning, p.chunk) {
                (Partitioning::PerParam, Some(c)) => {
                    if c.checked_mul(self.world_size).is_none_or(|all| all < numel) {
                        return Err(invalid(
                            field("chunk"),
                            format!(
                                "{c} × {} ranks cannot hold {numel} elements",
                                self.world_size
                            ),
                        ));
                    }
                }
                (Partitioning::PerParam, None) => {
                    return Err(invalid(
                        field("chunk"),
                        "missing (per-parameter partitioning)",
                    ));
                }
                (Partitioning::Flat { .. }, _) => {}
            }
        }
        if let Partitioning::Flat { chunk } = self.partitioning
            && chunk
                .checked_mul(self.world_size)
                .is_none_or(|all| all < total)
        {
            return Err(invalid(
                "partitioning.chunk",
                format!(
                    "{chunk} × {} ranks cannot hold {total} elements",
                    self.world_size
                ),
            ));
        }
        for (i, f) in self.files.iter().enumerate() {
            let field = |x: &str| format!("files[{i}].{x}");
            let path = std::path::Path::new(&f.path);
            let relative = !f.path.is_empty()
                && path
                    .components()
                    .all(|c| matches!(c, std::path::Component::Normal(_)));
            if !relative {
                return Err(invalid(
                    field("path"),
                    format!("`{}` must be relative, inside the checkpoint", f.path),
                ));
            }
            if f.rank.is_some_and(|r| r >= self.world_size) {
                return Err(invalid(
                    field("rank"),
                    format!("{:?} outside the world", f.rank),
                ));
            }
            if f.sha256.len() != 64 || !f.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(invalid(field("sha256"), "not 64 hex digits"));
            }
        }
        Ok(())
    }

    /// Where the elements of parameter `p` live: the pieces held by each rank, in element
    /// order, with their place in the ranks' flat partitions. Padding is not listed.
    pub fn pieces(&self, p: usize) -> Vec<Piece> {
        let numel = self.params[p].numel().unwrap_or(0);
        let mut pieces = Vec::new();
        match self.partitioning {
            Partitioning::Flat { chunk } => {
                let start: usize = self.params[..p].iter().filter_map(|q| q.numel()).sum();
                let end = start + numel;
                for rank in 0..self.world_size {
                    let (lo, hi) = (rank * chunk, (rank + 1) * chunk);
                    let (a, b) = (start.max(lo), end.min(hi));
                    if a < b {
                        pieces.push(Piece {
                            rank,
                            elements: a - start..b - start,
                            at: a - lo,
                        });
                    }
                }
            }
            Partitioning::PerParam => {
                let chunk = self.params[p].chunk.unwrap_or(0);
                let at: usize = self.params[..p].iter().filter_map(|q| q.chunk).sum();
                for rank in 0..self.world_size {
                    let (a, b) = ((rank * chunk).min(numel), ((rank + 1) * chunk).min(numel));
                    if a < b {
                        pieces.push(Piece {
                            rank,
                            elements: a..b,
                            at,
                        });
                    }
                }
            }
        }
        pieces
    }

    /// Elements of each rank's flat partition.
    pub fn partition_len(&self) -> usize {
        match self.partitioning {
            Partitioning::Flat { chunk } => chunk,
            Partitioning::PerParam => self.params.iter().filter_map(|p| p.chunk).sum(),
        }
    }
}
