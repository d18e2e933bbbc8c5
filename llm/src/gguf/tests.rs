//! A GGUF writer for tests, and the reader's tests.

use super::*;

/// Writes a GGUF v3 file: what llama.cpp's writer does, for tests.
pub(crate) struct Writer {
    kv: Vec<u8>,
    n_kv: u64,
    infos: Vec<u8>,
    data: Vec<u8>,
    n_tensors: u64,
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

impl Writer {
    pub(crate) fn new() -> Self {
        Self {
            kv: Vec::new(),
            n_kv: 0,
            infos: Vec::new(),
            data: Vec::new(),
            n_tensors: 0,
        }
    }

    /// Metadata of type `ty` whose encoded value is `value`.
    pub(crate) fn kv(&mut self, key: &str, ty: u32, value: &[u8]) -> &mut Self {
        string(&mut self.kv, key);
        self.kv.extend(ty.to_le_bytes());
        self.kv.extend(value);
        self.n_kv += 1;
        self
    }

    pub(crate) fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.kv(key, 4, &v.to_le_bytes())
    }

    pub(crate) fn kv_f32(&mut self, key: &str, v: f32) -> &mut Self {
        self.kv(key, 6, &v.to_le_bytes())
    }

    pub(crate) fn kv_str(&mut self, key: &str, v: &str) -> &mut Self {
        let mut b = Vec::new();
        string(&mut b, v);
        self.kv(key, 8, &b)
    }

    pub(crate) fn kv_strs(&mut self, key: &str, v: &[&str]) -> &mut Self {
        let mut b = 8u32.to_le_bytes().to_vec();
        b.extend((v.len() as u64).to_le_bytes());
        v.iter().for_each(|s| string(&mut b, s));
        self.kv(key, 9, &b)
    }

    pub(crate) fn kv_i32s(&mut self, key: &str, v: &[i32]) -> &mut Self {
        let mut b = 5u32.to_le_bytes().to_vec();
        b.extend((v.len() as u64).to_le_bytes());
        v.iter().for_each(|x| b.extend(x.to_le_bytes()));
        self.kv(key, 9, &b)
    }

    /// A tensor with GGUF dims `dims` and already-encoded bytes.
    pub(crate) fn tensor(&mut self, name: &str, dims: &[usize], ty: GgmlType, raw: &[u8]) {
        while !self.data.len().is_multiple_of(32) {
            self.data.push(0);
        }
        string(&mut self.infos, name);
        self.infos.extend((dims.len() as u32).to_le_bytes());
        dims.iter()
            .for_each(|d| self.infos.extend((*d as u64).to_le_bytes()));
        self.infos.extend(ty.id().to_le_bytes());
        self.infos.extend((self.data.len() as u64).to_le_bytes());
        self.data.extend(raw);
        self.n_tensors += 1;
    }

    pub(crate) fn bytes(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend(self.n_tensors.to_le_bytes());
        out.extend(self.n_kv.to_le_bytes());
        out.extend(&self.kv);
        out.extend(&self.infos);
        while !out.len().is_multiple_of(32) {
            out.push(0);
        }
        out.extend(&self.data);
        out
    }
}

/// Encodes f32 values as F32 bytes.
pub(crate) fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f16_bytes(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_le_bytes()
}

#[test]
fn dequantizes_every_format_by_its_formula() {
    // Q4_1: two blocks with chosen scales, minima and nibbles.
    let (d, m) = (0.5f32, -1.25f32);
    let qs: Vec<u8> = (0..16).map(|j| (j as u8) | ((15 - j as u8) << 4)).collect();
    let mut q41 = Vec::new();
    for b in 0..2 {
        q41.extend(f16_bytes(d * (b + 1) as f32));
        q41.extend(f16_bytes(m));
        q41.extend(&qs);
    }
    // Q8_0: one block of -16..16.
    let mut q80 = f16_bytes(0.25).to_vec();
    q80.extend((0..32).map(|i| (i as i8 - 16) as u8));
    // Q4_0: one block.
    let mut q40 = f16_bytes(2.0).to_vec();
    q40.extend(&qs);
    let f32s = [1.5f32, -2.0, 3.25];
    let mut w = Writer::new();
    w.kv_u32("general.alignment", 32)
        .kv_str("general.architecture", "llama");
    w.tensor("q41", &[32, 2], GgmlType::Q4_1, &q41);
    w.tensor("q80", &[32], GgmlType::Q8_0, &q80);
    w.tensor("q40", &[32], GgmlType::Q4_0, &q40);
    w.tensor("f32", &[3], GgmlType::F32, &f32_bytes(&f32s));
    let f16s: Vec<u8> = [0.5f32, -1.0].iter().flat_map(|v| f16_bytes(*v)).collect();
    w.tensor("f16", &[2], GgmlType::F16, &f16s);
    let g = Gguf::parse("synthetic.gguf".into(), w.bytes()).expect("parse");
    assert_eq!(g.version, 3);
    assert_eq!(
        g.get("general.architecture").unwrap().as_str(),
        Some("llama")
    );

    let (shape, v) = g.tensor_f32("q41").unwrap();
    assert_eq!(shape, vec![2, 32]);
    for b in 0..2 {
        let d = d * (b + 1) as f32;
        for j in 0..16 {
            assert_eq!(v[b * 32 + j], j as f32 * d + m, "q4_1 low nibble {j}");
            assert_eq!(v[b * 32 + j + 16], (15 - j) as f32 * d + m, "high {j}");
        }
    }
    let (_, v) = g.tensor_f32("q80").unwrap();
    assert!(
        v.iter()
            .enumerate()
            .all(|(i, x)| *x == (i as f32 - 16.0) * 0.25)
    );
    let (_, v) = g.tensor_f32("q40").unwrap();
    assert_eq!(v[3], (3.0 - 8.0) * 2.0);
    assert_eq!(v[16 + 3], (12.0 - 8.0) * 2.0);
    assert_eq!(g.tensor_f32("f32").unwrap().1, f32s);
    assert_eq!(g.tensor_f32("f16").unwrap().1, vec![0.5, -1.0]);
}

#[test]
fn errors_name_the_file_and_the_problem() {
    let bad = |bytes: Vec<u8>| {
        Gguf::parse("x.gguf".into(), bytes)
            .err()
            .unwrap()
            .to_string()
    };
    assert!(bad(b"GGML....".to_vec()).contains("x.gguf: not a GGUF file"));
    let mut w = Writer::new();
    w.tensor("t", &[32], GgmlType::Q8_0, &[0; 34]);
    let mut bytes = w.bytes();
    bytes.truncate(bytes.len() - 1);
    let e = bad(bytes);
    assert!(e.contains("tensor `t` ends at byte"), "{e}");
    let mut w = Writer::new();
    w.tensor("odd", &[31], GgmlType::Q4_1, &[0; 20]);
    assert!(bad(w.bytes()).contains("not a multiple of the Q4_1 block"));
    let g = Gguf::parse("x.gguf".into(), Writer::new().bytes()).unwrap();
    assert!(
        g.tensor_f32("nope")
            .err()
            .unwrap()
            .to_string()
            .contains("`nope` is missing")
    );
}
