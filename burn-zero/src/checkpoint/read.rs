//! Reading a checkpoint back whatever the world size or stage that reads it: any range of
//! any parameter is found in the pieces the writing ranks held (the "universal checkpoint"),
//! and `consolidate` writes every parameter whole into one safetensors file. Free of burn
//! types.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::safetensors::{Dtype, Reader, Writer};
use super::{Manifest, StoreError, open_verified};

/// The tensor of the fp32 master weights in every partition file.
pub const MASTER: &str = "master";

/// The partition file of `rank`.
pub fn partition_file(rank: usize) -> String {
    format!("zero_rank{rank:05}.safetensors")
}

/// Elements `elements` of parameter `param` (an index into the manifest's params), to be
/// placed at `at` of the reader's buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Span {
    /// Index into [`Manifest::params`].
    pub param: usize,
    /// Elements of the flattened parameter.
    pub elements: Range<usize>,
    /// Where they go in the output buffer.
    pub at: usize,
}

/// The partition files of one checkpoint, opened as they are needed.
pub struct PartitionFiles<'a> {
    dir: PathBuf,
    manifest: &'a Manifest,
    open: HashMap<usize, Reader>,
}

impl<'a> PartitionFiles<'a> {
    /// The partition files of the checkpoint in `dir` described by `manifest`.
    pub fn new(dir: &Path, manifest: &'a Manifest) -> Self {
        Self {
            dir: dir.to_path_buf(),
            manifest,
            open: HashMap::new(),
        }
    }

    fn reader(&mut self, rank: usize) -> Result<&Reader, StoreError> {
        if !self.open.contains_key(&rank) {
            let entry = self
                .manifest
                .files
                .iter()
                .find(|f| f.rank == Some(rank))
                .ok_or_else(|| StoreError::Corrupt {
                    path: self.dir.join(partition_file(rank)),
                    what: format!(
                        "rank {rank} holds elements but the manifest lists no file for it"
                    ),
                })?;
            let reader = Reader::open(&self.dir.join(&entry.path))?;
            self.open.insert(rank, reader);
        }
        Ok(&self.open[&rank])
    }

    /// Fills `out` with the spans of partition tensor `name` (`master`, `exp_avg`, ...).
    pub fn read_spans(
        &mut self,
        name: &str,
        spans: &[Span],
        out: &mut [f32],
    ) -> Result<(), StoreError> {
        for span in spans {
            for piece in self.manifest.pieces(span.param) {
                let lo = span.elements.start.max(piece.elements.start);
                let hi = span.elements.end.min(piece.elements.end);
                if lo >= hi {
                    continue;
                }
                let from = piece.at + (lo - piece.elements.start);
                let to = span.at + (lo - span.elements.start);
                self.reader(piece.rank)?
                    .read(name, from, &mut out[to..to + (hi - lo)])?;
            }
        }
        Ok(())
    }

    /// The whole parameter `p` of partition tensor `name`.
    pub fn read_param(&mut self, name: &str, p: usize) -> Result<Vec<f32>, StoreError> {
        let numel = self.manifest.params[p].numel().unwrap_or(0);
        let mut out = vec![0.0; numel];
        let span = Span {
            param: p,
            elements: 0..numel,
            at: 0,
        };
        self.read_spans(name, &[span], &mut out)?;
        Ok(out)
    }
}

/// Writes the full parameters of the checkpoint in `dir` (verified first) into one
/// safetensors file `out` in `dtype` (DeepSpeed's `zero_to_fp32`), one parameter in memory at
/// a time; `progress(i, n)` is called after each. The file appears by rename when complete.
pub fn consolidate(
    dir: &Path,
    out: &Path,
    dtype: Dtype,
    mut progress: impl FnMut(usize, usize),
) -> Result<Manifest, StoreError> {
    let manifest = open_verified(dir)?;
    let specs: Vec<_> = manifest
        .params
        .iter()
        .map(|p| (p.name.clone(), dtype, p.shape.clone()))
        .collect();
    let metadata = BTreeMap::from([
        ("format".to_string(), "pt".to_string()),
        ("burn_zero_tag".to_string(), manifest.tag.clone()),
    ]);
    let partial = out.with_extension("safetensors.partial");
    let mut writer = Writer::create(&partial, &specs, &metadata)?;
    let mut files = PartitionFiles::new(dir, &manifest);
    for p in 0..manifest.params.len() {
        writer.write_next(&dtype.encode(&files.read_param(MASTER, p)?))?;
        progress(p + 1, manifest.params.len());
    }
    writer.finish()?;
    std::fs::rename(&partial, out).map_err(|source| StoreError::Io {
        path: out.to_path_buf(),
        source,
    })?;
    drop(files);
    Ok(manifest)
}

/// A summary of a checkpoint for people (`burn-zero inspect`).
pub fn describe(dir: &Path, manifest: &Manifest) -> String {
    let elements: usize = manifest.params.iter().filter_map(|p| p.numel()).sum();
    let bytes: u64 = manifest.files.iter().map(|f| f.bytes).sum();
    let mut text = format!(
        "checkpoint {}\n  tag {}, format {} v{}, ZeRO stage {}, {} ranks\n  {} parameters, {} elements ({:.1} MB in fp32), partitioning {:?}\n",
        dir.display(),
        manifest.tag,
        manifest.format,
        manifest.version,
        manifest.stage,
        manifest.world_size,
        manifest.params.len(),
        elements,
        elements as f64 * 4.0 / 1e6,
        manifest.partitioning,
    );
    let engine = &manifest.engine;
    for key in ["global_steps", "micro_steps", "skipped_steps", "optimizer"] {
        if let Some(v) = engine.get(key) {
            text += &format!("  {key}: {v}\n");
        }
    }
    if let Some(s) = engine.get("loss_scaler").and_then(|s| s.get("cur_scale")) {
        text += &format!("  loss scale: {s}\n");
    }
    text += &format!("  files ({:.1} MB):\n", bytes as f64 / 1e6);
    for f in &manifest.files {
        let rank = f.rank.map_or(String::new(), |r| format!(" rank {r}"));
        text += &format!(
            "    {}{rank}: {} bytes, sha256 {}…\n",
            f.path,
            f.bytes,
            &f.sha256[..12]
        );
    }
    let shown = manifest.params.len().min(8);
    text += "  parameters:\n";
    for p in &manifest.params[..shown] {
        text += &format!("    {} {:?}\n", p.name, p.shape);
    }
    if manifest.params.len() > shown {
        text += &format!("    … and {} more\n", manifest.params.len() - shown);
    }
    text
}
