//! The safetensors format, written as a stream and read by ranges: an 8-byte little-endian
//! header length, a JSON header (`{"name": {"dtype", "shape", "data_offsets"}, "__metadata__":
//! {...}}`, space-padded to 8 bytes) and the tensors' bytes. Our own because a checkpoint's
//! readers need pieces of tensors (`pread`), and its writers need not hold a whole model;
//! the files are plain safetensors that any reader (Hugging Face's included) opens.

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::StoreError;

/// Headers larger than this are refused (a corrupt length would otherwise allocate it).
const MAX_HEADER: u64 = 100 << 20;

/// Element types of the tensors we write and read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Dtype {
    /// 32-bit float.
    F32,
    /// bfloat16.
    BF16,
    /// IEEE half.
    F16,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::BF16 | Dtype::F16 => 2,
        }
    }

    /// `values` in this dtype, little-endian (rounded to nearest even for 16-bit types).
    pub fn encode(self, values: &[f32]) -> Vec<u8> {
        match self {
            Dtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Dtype::BF16 => values
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect(),
            Dtype::F16 => values
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                .collect(),
        }
    }

    /// Little-endian `bytes` of this dtype as f32 values (exact).
    pub fn decode(self, bytes: &[u8], out: &mut [f32]) {
        match self {
            Dtype::F32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            Dtype::BF16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            Dtype::F16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
        }
    }
}

/// One tensor of a file's header.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorInfo {
    /// Its element type.
    pub dtype: Dtype,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its bytes, relative to the end of the header.
    pub data_offsets: [u64; 2],
}

impl TensorInfo {
    /// Elements of the tensor.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

fn corrupt(path: &Path, what: impl Into<String>) -> StoreError {
    StoreError::Corrupt {
        path: path.to_path_buf(),
        what: what.into(),
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A safetensors file being written: the header first (all tensors declared up front), then
/// each tensor's bytes in declaration order.
pub struct Writer {
    path: PathBuf,
    out: BufWriter<fs::File>,
    sizes: Vec<(String, u64)>,
    next: usize,
}

impl Writer {
    /// Creates `path` declaring `tensors` (name, dtype, shape) in order, with `metadata`.
    pub fn create(
        path: &Path,
        tensors: &[(String, Dtype, Vec<usize>)],
        metadata: &BTreeMap<String, String>,
    ) -> Result<Self, StoreError> {
        let mut header = serde_json::Map::new();
        if !metadata.is_empty() {
            header.insert("__metadata__".into(), serde_json::json!(metadata));
        }
        let mut at = 0u64;
        let mut sizes = Vec::new();
        for (name, dtype, shape) in tensors {
            let bytes = (shape.iter().product::<usize>() * dtype.size()) as u64;
            let info = TensorInfo {
                dtype: *dtype,
                shape: shape.clone(),
                data_offsets: [at, at + bytes],
            };
            header.insert(
                name.clone(),
                serde_json::to_value(info).expect("serializes"),
            );
            sizes.push((name.clone(), bytes));
            at += bytes;
        }
        let mut json = serde_json::to_vec(&header).expect("serializes");
        json.resize(json.len().next_multiple_of(8), b' ');
        let file = fs::File::create(path).map_err(io(path))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(&(json.len() as u64).to_le_bytes())
            .and_then(|()| out.write_all(&json))
            .map_err(io(path))?;
        Ok(Self {
            path: path.to_path_buf(),
            out,
            sizes,
            next: 0,
        })
    }

    /// Writes the bytes of the next declared tensor.
    pub fn write_next(&mut self, bytes: &[u8]) -> Result<(), StoreError> {
        let (name, size) = self
            .sizes
            .get(self.next)
            .ok_or_else(|| corrupt(&self.path, "more tensors written than declared".to_string()))?;
        if bytes.len() as u64 != *size {
            return Err(corrupt(
                &self.path,
                format!("tensor `{name}` got {} bytes, {size} declared", bytes.len()),
            ));
        }
        self.next += 1;
        self.out.write_all(bytes).map_err(io(&self.path))
    }

    /// Flushes the file to disk once every declared tensor is written.
    pub fn finish(self) -> Result<(), StoreError> {
        if self.next != self.sizes.len() {
            return Err(corrupt(
                &self.path,
                format!(
                    "{} of {} declared tensors written",
                    self.next,
                    self.sizes.len()
                ),
            ));
        }
        let file = self.out.into_inner().map_err(|e| StoreError::Io {
            path: self.path.clone(),
            source: e.into_error(),
        })?;
        file.sync_all().map_err(io(&self.path))
    }
}

/// A safetensors file opened for reading pieces of its tensors.
pub struct Reader {
    path: PathBuf,
    file: fs::File,
    data_start: u64,
    tensors: BTreeMap<String, TensorInfo>,
    metadata: BTreeMap<String, String>,
}

impl Reader {
    /// Opens `path` and checks its header against the file's size.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let file = fs::File::open(path).map_err(io(path))?;
        let len = file.metadata().map_err(io(path))?.len();
        let mut head = [0u8; 8];
        file.read_exact_at(&mut head, 0)
            .map_err(|_| corrupt(path, "shorter than a safetensors header"))?;
        let header_len = u64::from_le_bytes(head);
        if header_len > MAX_HEADER || 8 + header_len > len {
            return Err(corrupt(
                path,
                format!("header of {header_len} bytes in a file of {len}"),
            ));
        }
        let mut json = vec![0u8; header_len as usize];
        file.read_exact_at(&mut json, 8).map_err(io(path))?;
        let mut raw: BTreeMap<String, serde_json::Value> = serde_json::from_slice(&json)
            .map_err(|e| corrupt(path, format!("header is not valid JSON: {e}")))?;
        let metadata = match raw.remove("__metadata__") {
            Some(m) => serde_json::from_value(m)
                .map_err(|e| corrupt(path, format!("`__metadata__`: {e}")))?,
            None => BTreeMap::new(),
        };
        let data_start = 8 + header_len;
        let mut tensors = BTreeMap::new();
        for (name, value) in raw {
            let info: TensorInfo = serde_json::from_value(value)
                .map_err(|e| corrupt(path, format!("tensor `{name}`: {e}")))?;
            let [a, b] = info.data_offsets;
            let expected = info
                .shape
                .iter()
                .try_fold(info.dtype.size() as u64, |n, d| n.checked_mul(*d as u64));
            if a > b
                || Some(b - a) != expected
                || data_start.checked_add(b).is_none_or(|end| end > len)
            {
                return Err(corrupt(
                    path,
                    format!(
                        "tensor `{name}` has offsets {a}..{b} that do not fit its shape or the file"
                    ),
                ));
            }
            tensors.insert(name, info);
        }
        Ok(Self {
            path: path.to_path_buf(),
            file,
            data_start,
            tensors,
            metadata,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The tensors of the header, by name.
    pub fn tensors(&self) -> &BTreeMap<String, TensorInfo> {
        &self.tensors
    }

    /// The header's `__metadata__`.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// The header entry of tensor `name`, or an error naming the file.
    pub fn info(&self, name: &str) -> Result<&TensorInfo, StoreError> {
        self.tensors
            .get(name)
            .ok_or_else(|| corrupt(&self.path, format!("has no tensor `{name}`")))
    }

    /// Reads elements `start..start + out.len()` of the flattened tensor `name` as f32.
    pub fn read(&self, name: &str, start: usize, out: &mut [f32]) -> Result<(), StoreError> {
        let info = self.info(name)?;
        if start + out.len() > info.numel() {
            return Err(corrupt(
                &self.path,
                format!(
                    "tensor `{name}` has {} elements, {}..{} requested",
                    info.numel(),
                    start,
                    start + out.len()
                ),
            ));
        }
        let size = info.dtype.size();
        let mut bytes = vec![0u8; out.len() * size];
        let offset = self.data_start + info.data_offsets[0] + (start * size) as u64;
        self.file
            .read_exact_at(&mut bytes, offset)
            .map_err(io(&self.path))?;
        info.dtype.decode(&bytes, out);
        Ok(())
    }

    /// The whole tensor `name` as f32.
    pub fn read_all(&self, name: &str) -> Result<Vec<f32>, StoreError> {
        let mut out = vec![0.0; self.info(name)?.numel()];
        self.read(name, 0, &mut out)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_files_read_back_by_range_in_every_dtype() {
        let dir = std::env::temp_dir().join(format!("bz-st-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.safetensors");
        let a: Vec<f32> = (0..13).map(|i| i as f32 * 0.5 - 3.0).collect();
        let b = vec![1.5f32, -2.25, 0.0];
        let specs = vec![
            ("a".to_string(), Dtype::F32, vec![13]),
            ("b.x".to_string(), Dtype::BF16, vec![1, 3]),
            ("c".to_string(), Dtype::F16, vec![3]),
        ];
        let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        let mut w = Writer::create(&path, &specs, &meta).unwrap();
        w.write_next(&Dtype::F32.encode(&a)).unwrap();
        assert!(w.write_next(&[0u8; 5]).is_err(), "wrong size refused");
        w.write_next(&Dtype::BF16.encode(&b)).unwrap();
        w.write_next(&Dtype::F16.encode(&b)).unwrap();
        w.finish().unwrap();

        let r = Reader::open(&path).unwrap();
        assert_eq!(r.metadata(), &meta);
        assert_eq!(r.read_all("a").unwrap(), a);
        let mut mid = [0.0f32; 4];
        r.read("a", 5, &mut mid).unwrap();
        assert_eq!(mid, a[5..9]);
        assert_eq!(r.read_all("b.x").unwrap(), b, "exact in bf16");
        assert_eq!(r.read_all("c").unwrap(), b);
        assert_eq!(r.info("b.x").unwrap().shape, vec![1, 3]);
        let err = r.read("a", 10, &mut mid).unwrap_err().to_string();
        assert!(
            err.contains("t.safetensors") && err.contains("`a`"),
            "{err}"
        );
        assert!(r.info("nope").unwrap_err().to_string().contains("nope"));

        // Truncation is caught by the header check, naming the file.
        let bytes = fs::read(&path).unwrap();
        fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
        let err = Reader::open(&path).err().unwrap().to_string();
        assert!(err.contains("t.safetensors"), "{err}");
        fs::write(&path, &bytes[..4]).unwrap();
        assert!(Reader::open(&path).is_err());
        fs::remove_dir_all(&dir).unwrap();
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(200))]
        /// Whatever a file holds, opening and reading it fails cleanly instead of panicking.
        #[test]
        fn arbitrary_files_never_panic(
            header in proptest::prelude::any::<String>(),
            offsets in proptest::prelude::any::<(u64, u64, u32)>(),
            tail in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
        ) {
            let dir = std::env::temp_dir().join(format!("bz-st-fuzz-{}", std::process::id()));
            fs::create_dir_all(&dir).unwrap();
            let path = dir.join("f.safetensors");
            let (a, b, n) = offsets;
            let headers = [
                header.clone(),
                format!(r#"{{"t":{{"dtype":"F32","shape":[{n}],"data_offsets":[{a},{b}]}}}}"#),
                format!(r#"{{"t":{{"dtype":"BF16","shape":[{n},{a}],"data_offsets":[0,{b}]}}}}"#),
            ];
            for h in headers {
                let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
                bytes.extend(h.as_bytes());
                bytes.extend(&tail);
                fs::write(&path, &bytes).unwrap();
                if let Ok(r) = Reader::open(&path) {
                    let _ = r.read_all("t");
                }
            }
        }
    }
}
