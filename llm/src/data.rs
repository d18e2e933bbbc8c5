//! Training data: Jane Austen's novels from Debian's `r-cran-janeaustenr` (an R `.rdb` file),
//! or any text files; token streams packed into fixed-length windows; a distributed,
//! deterministic, resumable sampler (DeepSpeed's simplified data loader). Free of burn types.

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Why the texts could not be read; messages name the file.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {what}")]
pub struct DataError {
    /// The file.
    pub path: PathBuf,
    /// What is wrong.
    pub what: String,
}

/// One book: its title and text (lines joined with `\n`).
#[derive(Clone, Debug)]
pub struct Book {
    /// e.g. "Persuasion".
    pub title: String,
    /// The text.
    pub text: String,
}

/// The six novels in the order the package stores them.
pub const AUSTEN_TITLES: [&str; 6] = [
    "Emma",
    "Mansfield Park",
    "Northanger Abbey",
    "Persuasion",
    "Pride and Prejudice",
    "Sense and Sensibility",
];

/// The novels of `janeaustenr`'s `data/Rdata.rdb`: six blobs, each a big-endian u32 length and
/// a zlib stream holding an R serialization (XDR) of one character vector, one printed line
/// per element.
pub fn read_austen_rdb(path: &Path) -> Result<Vec<Book>, DataError> {
    let fail = |what: String| DataError {
        path: path.into(),
        what,
    };
    let bytes = std::fs::read(path).map_err(|e| fail(e.to_string()))?;
    let mut books = Vec::new();
    let mut pos = 0;
    while pos + 4 <= bytes.len() {
        let len = u32::from_be_bytes(bytes[pos..pos + 4].try_into().expect("4 bytes")) as usize;
        let mut z = flate2::read::ZlibDecoder::new(&bytes[pos + 4..]);
        let mut blob = Vec::with_capacity(len);
        z.read_to_end(&mut blob)
            .map_err(|e| fail(format!("blob {} at byte {pos}: {e}", books.len())))?;
        if blob.len() != len {
            return Err(fail(format!(
                "blob {} at byte {pos}: {} bytes inflated, header says {len}",
                books.len(),
                blob.len()
            )));
        }
        pos += 4 + z.total_in() as usize;
        let lines = r_character_vector(&blob)
            .map_err(|e| fail(format!("blob {} at byte {pos}: {e}", books.len())))?;
        let title = AUSTEN_TITLES
            .get(books.len())
            .map_or_else(|| format!("book {}", books.len()), |t| t.to_string());
        books.push(Book {
            title,
            text: lines.join("\n"),
        });
    }
    if books.len() != AUSTEN_TITLES.len() {
        return Err(fail(format!("{} books, expected 6", books.len())));
    }
    Ok(books)
}

/// The strings of an R XDR serialization (`X\n`, format 2 or 3) of one character vector;
/// NA elements become empty strings.
fn r_character_vector(blob: &[u8]) -> Result<Vec<String>, String> {
    let mut pos = 0;
    let i32_at = |pos: &mut usize| -> Result<i32, String> {
        let b = blob
            .get(*pos..*pos + 4)
            .ok_or_else(|| format!("truncated at {}", *pos))?;
        *pos += 4;
        Ok(i32::from_be_bytes(b.try_into().expect("4 bytes")))
    };
    if blob.get(..2) != Some(b"X\n") {
        return Err("not an R XDR serialization".into());
    }
    pos += 2;
    let version = i32_at(&mut pos)?;
    i32_at(&mut pos)?;
    i32_at(&mut pos)?;
    if version == 3 {
        let n = i32_at(&mut pos)?;
        pos += n.max(0) as usize;
    } else if version != 2 {
        return Err(format!("R serialization version {version}"));
    }
    let flags = i32_at(&mut pos)?;
    if flags & 0xFF != 16 {
        return Err(format!("R type {} is not a character vector", flags & 0xFF));
    }
    let n = i32_at(&mut pos)?;
    if n < 0 {
        return Err("long vectors are not supported".into());
    }
    let mut out = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let _flags = i32_at(&mut pos)?;
        let len = i32_at(&mut pos)?;
        if len < 0 {
            out.push(String::new());
            continue;
        }
        let s = blob
            .get(pos..pos + len as usize)
            .ok_or_else(|| format!("string truncated at {pos}"))?;
        pos += len as usize;
        out.push(String::from_utf8_lossy(s).into_owned());
    }
    Ok(out)
}

/// Text files as books titled by their file names.
pub fn read_text_files(paths: &[PathBuf]) -> Result<Vec<Book>, DataError> {
    paths
        .iter()
        .map(|p| {
            let text = std::fs::read_to_string(p).map_err(|e| DataError {
                path: p.clone(),
                what: e.to_string(),
            })?;
            let title = p.file_stem().map_or_else(
                || p.display().to_string(),
                |s| s.to_string_lossy().into_owned(),
            );
            Ok(Book { title, text })
        })
        .collect()
}

/// `count` token ids below `vocab` from a 64-bit LCG started at `state`: seeded synthetic
/// data for benchmarks and tests (bench/e2e_fsdp2.py draws the same ids).
pub fn synthetic_ids(mut state: u64, count: usize, vocab: usize) -> Vec<i64> {
    (0..count)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % vocab as u64) as i64
        })
        .collect()
}

/// Token streams (one per document, each followed by `separator`) packed into windows of
/// `len + 1` tokens (inputs and shifted targets), consecutive windows sharing one token; the
/// tail shorter than a window is dropped.
pub fn pack(docs: &[Vec<u32>], separator: u32, len: usize) -> Vec<Vec<u32>> {
    assert!(len > 0, "sequence length 0");
    let stream: Vec<u32> = docs
        .iter()
        .flat_map(|d| d.iter().copied().chain([separator]))
        .collect();
    let mut windows = Vec::new();
    let mut start = 0;
    while start + len < stream.len() {
        windows.push(stream[start..start + len + 1].to_vec());
        start += len;
    }
    windows
}

/// Four evaluation windows of `len + 1` tokens at 10, 35, 60 and 85% of `tokens`.
pub fn eval_windows(tokens: &[u32], len: usize) -> Vec<Vec<u32>> {
    [0.10, 0.35, 0.60, 0.85]
        .iter()
        .map(|f| {
            let start = ((tokens.len() - len - 1) as f64 * f) as usize;
            tokens[start..start + len + 1].to_vec()
        })
        .collect()
}

/// Where a sampler is: resumes exactly from here.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerState {
    /// Passes over the data completed.
    pub epoch: u64,
    /// Samples consumed in this epoch, by all ranks together.
    pub consumed: usize,
}

/// Deterministic distributed sampling: each epoch is a seeded permutation of the samples; every
/// micro-step consumes `world × micro_batch` of it, rank `r` taking the `r`-th slice. An epoch's
/// tail too short for a full micro-step is skipped, so all ranks step together.
#[derive(Clone, Debug)]
pub struct DistributedSampler {
    /// Number of samples.
    pub len: usize,
    /// Ranks.
    pub world: usize,
    /// This rank.
    pub rank: usize,
    /// Samples per rank per micro-step.
    pub micro_batch: usize,
    /// Seed of the permutations.
    pub seed: u64,
}

impl DistributedSampler {
    /// Micro-steps per epoch.
    pub fn steps_per_epoch(&self) -> usize {
        self.len / (self.world * self.micro_batch)
    }

    /// The sample order of `epoch` (Fisher–Yates with SplitMix64).
    pub fn order(&self, epoch: u64) -> Vec<usize> {
        let mut state = self.seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut next = move || {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        let mut order: Vec<usize> = (0..self.len).collect();
        for i in (1..self.len).rev() {
            let j = (next() % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
        order
    }

    /// This rank's next micro-batch from `state`, and the state after it.
    pub fn next(&self, state: SamplerState) -> (Vec<usize>, SamplerState) {
        assert!(
            self.steps_per_epoch() > 0,
            "fewer samples than one micro-step takes"
        );
        let step = self.world * self.micro_batch;
        let state = if state.consumed + step > self.len {
            SamplerState {
                epoch: state.epoch + 1,
                consumed: 0,
            }
        } else {
            state
        };
        let order = self.order(state.epoch);
        let start = state.consumed + self.rank * self.micro_batch;
        let batch = order[start..start + self.micro_batch].to_vec();
        let after = SamplerState {
            epoch: state.epoch,
            consumed: state.consumed + step,
        };
        (batch, after)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(rank: usize) -> DistributedSampler {
        DistributedSampler {
            len: 23,
            world: 3,
            rank,
            micro_batch: 2,
            seed: 7,
        }
    }

    #[test]
    fn ranks_take_disjoint_slices_and_resume_exactly() {
        let mut states = [SamplerState::default(); 3];
        let mut seen = Vec::new();
        for _ in 0..sampler(0).steps_per_epoch() {
            for (rank, state) in states.iter_mut().enumerate() {
                let (batch, next) = sampler(rank).next(*state);
                seen.extend(batch);
                *state = next;
            }
        }
        let mut sorted = seen.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(
            sorted.len(),
            seen.len(),
            "a sample was drawn twice in one epoch"
        );
        assert_eq!(seen.len(), 3 * 2 * 3, "23 samples make 3 full steps of 6");
        // Resuming from a saved state gives what an uninterrupted run gives.
        let s = sampler(1);
        let mut state = SamplerState::default();
        let mut run = Vec::new();
        for _ in 0..7 {
            let (b, n) = s.next(state);
            run.push(b);
            state = n;
        }
        let saved: SamplerState = serde_json::from_str(
            &serde_json::to_string(&SamplerState {
                epoch: 1,
                consumed: 6,
            })
            .unwrap(),
        )
        .unwrap();
        assert_eq!(s.next(saved).0, run[4], "epoch 1, second step");
        assert_ne!(s.order(0), s.order(1), "epochs are reshuffled");
        assert_eq!(
            s.order(3),
            sampler(2).order(3),
            "all ranks agree on the order"
        );
    }

    #[test]
    fn packing_shares_one_token_between_windows() {
        let w = pack(&[vec![1, 2, 3], vec![4, 5]], 0, 3);
        // stream 1 2 3 0 4 5 0 → windows [1 2 3 0] [0 4 5 0]
        assert_eq!(w, vec![vec![1, 2, 3, 0], vec![0, 4, 5, 0]]);
    }

    #[test]
    fn r_character_vectors_parse_with_na() {
        let mut b = b"X\n".to_vec();
        for v in [3i32, 0x040200, 0x030500, 5] {
            b.extend(v.to_be_bytes());
        }
        b.extend(b"UTF-8");
        for v in [16i32, 3, 0x40009, 2] {
            b.extend(v.to_be_bytes());
        }
        b.extend(b"hi");
        b.extend(9i32.to_be_bytes());
        b.extend((-1i32).to_be_bytes());
        b.extend(0x40009i32.to_be_bytes());
        b.extend(3i32.to_be_bytes());
        b.extend(b"end");
        assert_eq!(r_character_vector(&b).unwrap(), vec!["hi", "", "end"]);
        assert!(r_character_vector(b"RDX").is_err());
    }
}
