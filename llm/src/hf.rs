//! A Hugging Face model directory: `config.json` plus `model.safetensors`, or shards listed in
//! `model.safetensors.index.json`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};

use crate::weights::{LoadError, WeightSource};

/// The safetensors files of a Hugging Face directory, read into memory.
pub struct HfDir {
    dir: PathBuf,
    /// (file, bytes) per shard.
    shards: Vec<(PathBuf, Vec<u8>)>,
    /// Tensor name → shard index.
    index: HashMap<String, usize>,
}

impl HfDir {
    /// Reads `dir`'s safetensors files.
    pub fn open(dir: &Path) -> Result<Self, LoadError> {
        let read = |p: &Path| {
            std::fs::read(p).map_err(|source| LoadError::Io {
                path: p.into(),
                source,
            })
        };
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index_path.exists() {
            let json: serde_json::Value =
                serde_json::from_slice(&read(&index_path)?).map_err(|e| LoadError::Format {
                    path: index_path.clone(),
                    what: format!("not JSON: {e}"),
                })?;
            let map = json.get("weight_map").and_then(|m| m.as_object());
            let mut files: Vec<PathBuf> = map
                .ok_or_else(|| LoadError::Format {
                    path: index_path.clone(),
                    what: "no `weight_map`".into(),
                })?
                .values()
                .filter_map(|f| f.as_str().map(|f| dir.join(f)))
                .collect();
            files.sort();
            files.dedup();
            files
        } else {
            vec![dir.join("model.safetensors")]
        };
        let mut shards = Vec::new();
        let mut index = HashMap::new();
        for file in files {
            let bytes = read(&file)?;
            let parsed = SafeTensors::deserialize(&bytes).map_err(|e| LoadError::Format {
                path: file.clone(),
                what: e.to_string(),
            })?;
            for name in parsed.names() {
                index.insert(name.to_string(), shards.len());
            }
            drop(parsed);
            shards.push((file, bytes));
        }
        Ok(Self {
            dir: dir.into(),
            shards,
            index,
        })
    }
}

impl WeightSource for HfDir {
    fn get(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), LoadError> {
        let shard = *self.index.get(name).ok_or_else(|| LoadError::Format {
            path: self.dir.clone(),
            what: format!("tensor `{name}` is in none of the safetensors files"),
        })?;
        let (file, bytes) = &self.shards[shard];
        let fail = |what: String| LoadError::Format {
            path: file.clone(),
            what,
        };
        let parsed = SafeTensors::deserialize(bytes).map_err(|e| fail(e.to_string()))?;
        let view = parsed.tensor(name).map_err(|e| fail(e.to_string()))?;
        let data = view.data();
        let values: Vec<f32> = match view.dtype() {
            Dtype::F32 => data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
                .collect(),
            Dtype::BF16 => data
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::F16 => data
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => return Err(fail(format!("tensor `{name}` has dtype {other:?}"))),
        };
        Ok((view.shape().to_vec(), values))
    }

    fn half_split_rope(&self) -> bool {
        true
    }

    fn path(&self) -> &Path {
        &self.dir
    }
}
