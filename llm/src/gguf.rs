//! GGUF (v2/v3) reader: metadata, tensor directory, and tensors dequantized to f32.
//!
//! Free of burn types. Formats: F32, F16, BF16, Q4_0, Q4_1, Q8_0 — what llama.cpp's converter
//! writes for SmolLM2 (Q4_1 projections, a Q8_0 embedding, f32 norms) and its common siblings.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::{bf16, f16};

/// Why a GGUF file could not be read; every message names the file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// Reading the file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The bytes are not a GGUF this reader understands.
    #[error("{path}: {what}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong, and where.
        what: String,
    },
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// Any unsigned integer type.
    U64(u64),
    /// Any signed integer type.
    I64(i64),
    /// f32 or f64.
    F64(f64),
    /// bool.
    Bool(bool),
    /// A UTF-8 string.
    Str(String),
    /// An array of values.
    Array(Vec<Value>),
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U64(v) => Some(v),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F64(v) => Some(v),
            Value::U64(v) => Some(v as f64),
            Value::I64(v) => Some(v as f64),
            _ => None,
        }
    }

    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(v) => Some(v),
            _ => None,
        }
    }
}

/// Element formats of GGUF tensors (ggml's type ids).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    /// 0
    F32,
    /// 1
    F16,
    /// 2: blocks of 32 as `d: f16, qs: [u8; 16]`, `w = (q - 8)·d`.
    Q4_0,
    /// 3: blocks of 32 as `d: f16, m: f16, qs: [u8; 16]`, `w = q·d + m`.
    Q4_1,
    /// 8: blocks of 32 as `d: f16, qs: [i8; 32]`, `w = q·d`.
    Q8_0,
    /// 30
    Bf16,
}

impl GgmlType {
    /// The format of ggml type id `id`, if this reader knows it.
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            8 => Self::Q8_0,
            30 => Self::Bf16,
            _ => return None,
        })
    }

    /// ggml's id of this format.
    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q8_0 => 8,
            Self::Bf16 => 30,
        }
    }

    /// (elements per block, bytes per block).
    pub fn block(self) -> (usize, usize) {
        match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::Bf16 => (1, 2),
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q8_0 => (32, 34),
        }
    }

    /// Bytes holding `n` elements (`n` a multiple of the block size).
    pub fn bytes(self, n: usize) -> usize {
        let (per, size) = self.block();
        n / per * size
    }
}

/// One tensor of the directory.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// Its name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// GGUF order: `dims[0]` varies fastest (`[in, out]` for a Linear weight).
    pub dims: Vec<usize>,
    /// Element format.
    pub ggml_type: GgmlType,
    /// Byte offset from the start of the data section.
    pub offset: usize,
}

impl TensorInfo {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }

    /// Row-major shape (the reverse of `dims`): `[out, in]` for a Linear weight.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().copied().collect()
    }
}

/// A GGUF file read into memory.
pub struct Gguf {
    path: PathBuf,
    /// GGUF version (2 or 3).
    pub version: u32,
    /// Metadata by key.
    pub metadata: BTreeMap<String, Value>,
    /// Tensor directory, in file order.
    pub tensors: Vec<TensorInfo>,
    bytes: Vec<u8>,
    data_start: usize,
}

/// A little-endian cursor over the file's bytes that reports where it ran out.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.pos.checked_add(n).filter(|e| *e <= self.bytes.len());
        let end = end.ok_or_else(|| format!("truncated at byte {} (wanted {n} more)", self.pos))?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        Ok(self.take(N)?.try_into().expect("N bytes"))
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn len(&mut self, what: &str) -> Result<usize, String> {
        let n = self.u64()?;
        let left = (self.bytes.len() - self.pos) as u64;
        // Every element takes at least one byte: a larger count is corruption, not a length.
        if n > left {
            return Err(format!(
                "{what} count {n} at byte {} exceeds the file",
                self.pos
            ));
        }
        Ok(n as usize)
    }

    fn string(&mut self) -> Result<String, String> {
        let n = self.len("string")?;
        let at = self.pos;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| format!("non-UTF-8 string at {at}"))
    }

    fn value(&mut self, ty: u32) -> Result<Value, String> {
        Ok(match ty {
            0 => Value::U64(self.take(1)?[0] as u64),
            1 => Value::I64(self.take(1)?[0] as i8 as i64),
            2 => Value::U64(u16::from_le_bytes(self.array()?) as u64),
            3 => Value::I64(i16::from_le_bytes(self.array()?) as i64),
            4 => Value::U64(self.u32()? as u64),
            5 => Value::I64(i32::from_le_bytes(self.array()?) as i64),
            6 => Value::F64(f32::from_le_bytes(self.array()?) as f64),
            7 => Value::Bool(self.take(1)?[0] != 0),
            8 => Value::Str(self.string()?),
            9 => {
                let inner = self.u32()?;
                let n = self.len("array")?;
                let mut values = Vec::with_capacity(n);
                for _ in 0..n {
                    values.push(self.value(inner)?);
                }
                Value::Array(values)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.array()?)),
            12 => Value::F64(f64::from_le_bytes(self.array()?)),
            other => {
                return Err(format!(
                    "unknown metadata type {other} at byte {}",
                    self.pos
                ));
            }
        })
    }
}

impl Gguf {
    /// Reads and parses `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref().to_path_buf();
        let bytes = std::fs::read(&path).map_err(|source| GgufError::Io {
            path: path.clone(),
            source,
        })?;
        Self::parse(path, bytes)
    }

    /// Parses `bytes` (named `path` in errors).
    pub fn parse(path: PathBuf, bytes: Vec<u8>) -> Result<Self, GgufError> {
        let fail = |what: String| GgufError::Format {
            path: path.clone(),
            what,
        };
        let mut c = Cursor {
            bytes: &bytes,
            pos: 0,
        };
        if c.take(4).map_err(&fail)? != b"GGUF" {
            return Err(fail("not a GGUF file (no GGUF magic)".into()));
        }
        let version = c.u32().map_err(&fail)?;
        if !(2..=3).contains(&version) {
            return Err(fail(format!(
                "GGUF version {version} (this reader knows 2 and 3)"
            )));
        }
        let n_tensors = c.len("tensor").map_err(&fail)?;
        let n_kv = c.len("metadata").map_err(&fail)?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string().map_err(&fail)?;
            let ty = c.u32().map_err(&fail)?;
            let value = c
                .value(ty)
                .map_err(|e| fail(format!("metadata `{key}`: {e}")))?;
            metadata.insert(key, value);
        }
        let mut tensors = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = c.string().map_err(&fail)?;
            let at = |e: String| fail(format!("tensor `{name}`: {e}"));
            let n_dims = c.u32().map_err(at)? as usize;
            if n_dims > 8 {
                return Err(at(format!("{n_dims} dims")));
            }
            let dims = (0..n_dims)
                .map(|_| c.u64().map(|d| d as usize))
                .collect::<Result<Vec<_>, _>>()
                .map_err(at)?;
            let id = c.u32().map_err(at)?;
            let ggml_type = GgmlType::from_id(id)
                .ok_or_else(|| at(format!("ggml type {id} is not supported")))?;
            let offset = c.u64().map_err(at)? as usize;
            tensors.push(TensorInfo {
                name,
                dims,
                ggml_type,
                offset,
            });
        }
        let align = metadata
            .get("general.alignment")
            .and_then(Value::as_u64)
            .unwrap_or(32) as usize;
        if align == 0 {
            return Err(fail("general.alignment is 0".into()));
        }
        let data_start = c.pos.div_ceil(align) * align;
        for t in &tensors {
            let (per, _) = t.ggml_type.block();
            if t.dims.first().is_some_and(|d| d % per != 0) {
                return Err(fail(format!(
                    "tensor `{}`: row length {} is not a multiple of the {:?} block ({per})",
                    t.name, t.dims[0], t.ggml_type
                )));
            }
            let end = data_start + t.offset + t.ggml_type.bytes(t.numel());
            if end > bytes.len() {
                return Err(fail(format!(
                    "tensor `{}` ends at byte {end}, past the end of the file ({} bytes)",
                    t.name,
                    bytes.len()
                )));
            }
        }
        Ok(Self {
            path,
            version,
            metadata,
            tensors,
            bytes,
            data_start,
        })
    }

    /// The file this was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Metadata `key`, or an error naming the key and the file.
    pub fn get(&self, key: &str) -> Result<&Value, GgufError> {
        self.metadata.get(key).ok_or_else(|| GgufError::Format {
            path: self.path.clone(),
            what: format!("metadata `{key}` is missing"),
        })
    }

    /// The directory entry of tensor `name`.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Tensor `name` dequantized to f32, with its row-major shape.
    pub fn tensor_f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), GgufError> {
        let info = self.info(name).ok_or_else(|| GgufError::Format {
            path: self.path.clone(),
            what: format!("tensor `{name}` is missing"),
        })?;
        let start = self.data_start + info.offset;
        let raw = &self.bytes[start..start + info.ggml_type.bytes(info.numel())];
        Ok((info.shape(), dequantize(info.ggml_type, raw)))
    }
}

/// `raw` (whole blocks of `ty`) as f32 values.
pub fn dequantize(ty: GgmlType, raw: &[u8]) -> Vec<f32> {
    let h = |b: &[u8]| f16::from_le_bytes([b[0], b[1]]).to_f32();
    let (per, size) = ty.block();
    let mut out = Vec::with_capacity(raw.len() / size * per);
    for block in raw.chunks_exact(size) {
        match ty {
            GgmlType::F32 => out.push(f32::from_le_bytes(block.try_into().expect("4 bytes"))),
            GgmlType::F16 => out.push(h(block)),
            GgmlType::Bf16 => out.push(bf16::from_le_bytes([block[0], block[1]]).to_f32()),
            GgmlType::Q8_0 => {
                let d = h(block);
                out.extend(block[2..].iter().map(|q| *q as i8 as f32 * d));
            }
            GgmlType::Q4_0 | GgmlType::Q4_1 => {
                let (d, m, qs) = match ty {
                    GgmlType::Q4_0 => (h(block), None, &block[2..]),
                    _ => (h(block), Some(h(&block[2..])), &block[4..]),
                };
                // Low nibbles are elements 0..16, high nibbles 16..32.
                let nibbles = qs.iter().map(|q| q & 0xF).chain(qs.iter().map(|q| q >> 4));
                out.extend(nibbles.map(|q| match m {
                    None => (q as f32 - 8.0) * d,
                    Some(m) => q as f32 * d + m,
                }));
            }
        }
    }
    out
}

#[cfg(test)]
pub(crate) mod tests;
