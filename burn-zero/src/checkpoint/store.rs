//! Checkpoint directories on disk, atomically: files are written into a staging directory,
//! checksummed, and the directory becomes visible under its tag by one rename once the
//! manifest (the last file) is complete; `latest` is replaced by rename too. A crash at any
//! point leaves the previous checkpoint and `latest` as they were. Free of burn types.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::{FileEntry, Manifest, ManifestError};

/// The name of the manifest inside a checkpoint directory.
pub const MANIFEST: &str = "manifest.json";
/// The file naming the newest complete tag (DeepSpeed's `latest`).
pub const LATEST: &str = "latest";

/// Why a checkpoint could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A file operation failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The failure.
        source: std::io::Error,
    },
    /// The manifest is unusable.
    #[error("{path}: {source}")]
    Manifest {
        /// The manifest file.
        path: PathBuf,
        /// Why.
        source: ManifestError,
    },
    /// A file does not match its recorded size or checksum.
    #[error("{path} is corrupted or truncated: {what}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What differs.
        what: String,
    },
    /// No checkpoint to load.
    #[error("no checkpoint in {0} (no `latest` file and no tag given)")]
    NoCheckpoint(PathBuf),
    /// The tag asked for, or the one `latest` names, is not a checkpoint under the root.
    #[error("{root} has no checkpoint `{tag}`{how}")]
    NoTag {
        /// The checkpoint root.
        root: PathBuf,
        /// The tag.
        tag: String,
        /// Where the tag came from, when from `latest`.
        how: String,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// SHA-256 of a file, lowercase hex, and its size.
pub fn sha256_file(path: &Path) -> Result<(String, u64), StoreError> {
    let mut file = fs::File::open(path).map_err(io(path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = file.read(&mut buf).map_err(io(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bytes += n as u64;
    }
    let hex = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    Ok((hex, bytes))
}

/// Flushes directory `path`'s entries (files created or renamed in it) to disk.
fn sync_dir(path: &Path) -> Result<(), StoreError> {
    fs::File::open(path)
        .and_then(|dir| dir.sync_all())
        .map_err(io(path))
}

/// Makes the written file `tmp` durable under `dst`: flushed, renamed over `dst`, and the
/// directory's entry flushed. A crash leaves `dst` old or new, never cut short.
pub fn commit_file(tmp: &Path, dst: &Path) -> std::io::Result<()> {
    fs::File::open(tmp)?.sync_all()?;
    fs::rename(tmp, dst)?;
    let dir = match dst.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    fs::File::open(dir)?.sync_all()
}

/// Writes `contents` to `dst` whole: into the hidden `.NAME.partial` beside it, then
/// [`commit_file`].
pub fn replace_file(dst: &Path, contents: &[u8]) -> std::io::Result<()> {
    let name = dst
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    let tmp = dst.with_file_name(format!(".{name}.partial"));
    fs::write(&tmp, contents)?;
    commit_file(&tmp, dst)
}

/// Where a checkpoint of `tag` replaced by a newer save of the same tag waits until the new
/// one and `latest` are on disk (a crash between the two renames leaves it the only copy).
fn replaced(root: &Path, tag: &str) -> PathBuf {
    root.join(format!(".{tag}.old"))
}

/// Writes `contents` to `path` and flushes it to disk.
fn write_synced(path: &Path, contents: &[u8]) -> Result<(), StoreError> {
    let mut file = fs::File::create(path).map_err(io(path))?;
    file.write_all(contents).map_err(io(path))?;
    file.sync_all().map_err(io(path))
}

/// A checkpoint being written under `root/tag`.
#[derive(Debug)]
pub struct Staging {
    root: PathBuf,
    tag: String,
    dir: PathBuf,
}

impl Staging {
    /// The staging directory of `root/tag` (`root/.tag.partial`), created empty. Every rank
    /// calls it with the same arguments; rank 0 creates it (`create`), the others after a
    /// barrier.
    pub fn open(root: &Path, tag: &str, create: bool) -> Result<Self, StoreError> {
        let dir = root.join(format!(".{tag}.partial"));
        if create {
            fs::create_dir_all(root).map_err(io(root))?;
            if dir.exists() {
                // Left by a crashed save: never visible, safe to discard.
                fs::remove_dir_all(&dir).map_err(io(&dir))?;
            }
            fs::create_dir(&dir).map_err(io(&dir))?;
        }
        Ok(Self {
            root: root.to_path_buf(),
            tag: tag.to_string(),
            dir,
        })
    }

    /// Where to write file `name` of the checkpoint.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The entry of file `name` once written: its size and checksum (each rank describes its
    /// own files; rank 0 collects them into the manifest).
    pub fn describe(&self, name: &str, rank: Option<usize>) -> Result<FileEntry, StoreError> {
        let path = self.path(name);
        fs::File::open(&path)
            .and_then(|f| f.sync_all())
            .map_err(io(&path))?;
        let (sha256, bytes) = sha256_file(&path)?;
        Ok(FileEntry {
            path: name.to_string(),
            rank,
            bytes,
            sha256,
        })
    }

    /// Rank 0, once every rank's files are written: checks them against `manifest`, writes
    /// the manifest, and makes the checkpoint visible as `root/tag` and `latest`. A previous
    /// checkpoint of the same tag is replaced only at that point.
    pub fn commit(self, manifest: &Manifest) -> Result<PathBuf, StoreError> {
        verify_files(&self.dir, manifest)?;
        write_synced(&self.path(MANIFEST), manifest.to_json().as_bytes())?;
        sync_dir(&self.dir)?;
        let target = self.root.join(&self.tag);
        let old = replaced(&self.root, &self.tag);
        if target.exists() {
            if old.exists() {
                // Left by a save whose new copy did reach `target`: the older one goes.
                fs::remove_dir_all(&old).map_err(io(&old))?;
            }
            fs::rename(&target, &old).map_err(io(&target))?;
        }
        fs::rename(&self.dir, &target).map_err(io(&self.dir))?;
        sync_dir(&self.root)?;
        let latest = self.root.join(LATEST);
        replace_file(&latest, self.tag.as_bytes()).map_err(io(&latest))?;
        // The checkpoint and `latest` are on disk: the copy it replaced is no longer needed,
        // and failing to remove it loses nothing (the next save of the tag tries again).
        if old.exists() {
            let _ = fs::remove_dir_all(&old);
        }
        Ok(target)
    }
}

/// Checks every file of `manifest` in `dir` against its recorded size and checksum.
fn verify_files(dir: &Path, manifest: &Manifest) -> Result<(), StoreError> {
    verify(dir, manifest, |_| true)
}

/// Checks the files of `manifest` in `dir` that `wanted` selects against their recorded size
/// and checksum (a rank checks the files it reads).
pub fn verify(
    dir: &Path,
    manifest: &Manifest,
    wanted: impl Fn(&FileEntry) -> bool,
) -> Result<(), StoreError> {
    for f in manifest.files.iter().filter(|f| wanted(f)) {
        let path = dir.join(&f.path);
        let (sha256, bytes) = sha256_file(&path)?;
        if bytes != f.bytes {
            return Err(StoreError::Corrupt {
                path,
                what: format!("{bytes} bytes, {} recorded", f.bytes),
            });
        }
        if sha256 != f.sha256 {
            return Err(StoreError::Corrupt {
                path,
                what: "its SHA-256 differs from the manifest's".into(),
            });
        }
    }
    Ok(())
}

/// The directory of checkpoint `tag` under `root`, or of the `latest` one. A tag whose save
/// was cut off between its two renames (see [`Staging::commit`]) is found in the copy it was
/// replacing.
pub fn resolve(root: &Path, tag: Option<&str>) -> Result<PathBuf, StoreError> {
    let (tag, how) = match tag {
        Some(t) => (t.to_string(), String::new()),
        None => {
            let latest = root.join(LATEST);
            let named = match fs::read_to_string(&latest) {
                Ok(named) => named.trim().to_string(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(StoreError::NoCheckpoint(root.to_path_buf()));
                }
                Err(source) => {
                    return Err(StoreError::Io {
                        path: latest,
                        source,
                    });
                }
            };
            (named, format!(" (named by {})", latest.display()))
        }
    };
    let plain = !tag.is_empty() && !tag.starts_with('.') && !tag.contains(['/', '\\']);
    let missing = || StoreError::NoTag {
        root: root.to_path_buf(),
        tag: tag.clone(),
        how: how.clone(),
    };
    if !plain {
        return Err(missing());
    }
    let dir = root.join(&tag);
    if dir.is_dir() {
        return Ok(dir);
    }
    let old = replaced(root, &tag);
    match old.join(MANIFEST).is_file() {
        true => Ok(old),
        false => Err(missing()),
    }
}

/// Reads and validates a checkpoint directory's manifest (its files unchecked: see [`verify`]).
pub fn open_manifest(dir: &Path) -> Result<Manifest, StoreError> {
    let path = dir.join(MANIFEST);
    let bytes = fs::read(&path).map_err(io(&path))?;
    Manifest::parse(&bytes).map_err(|source| StoreError::Manifest { path, source })
}

/// Reads and checks a checkpoint directory: its manifest, and every file's size and checksum.
pub fn open_verified(dir: &Path) -> Result<Manifest, StoreError> {
    let manifest = open_manifest(dir)?;
    verify_files(dir, &manifest)?;
    Ok(manifest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::{FORMAT, Partitioning, VERSION, ZeroStage};

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("bz-store-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    /// Saves checkpoint `tag` with one file per rank of `world`, as the ranks would.
    fn save(root: &Path, tag: &str, world: usize, fill: u8) -> PathBuf {
        let staging = Staging::open(root, tag, true).unwrap();
        let files = (0..world)
            .map(|r| {
                let name = format!("rank{r}.bin");
                write_synced(&staging.path(&name), &vec![fill + r as u8; 100 + r]).unwrap();
                staging.describe(&name, Some(r)).unwrap()
            })
            .collect();
        staging.commit(&manifest(tag, world, files)).unwrap()
    }

    fn manifest(tag: &str, world: usize, files: Vec<FileEntry>) -> Manifest {
        Manifest {
            format: FORMAT.into(),
            version: VERSION,
            tag: tag.into(),
            stage: ZeroStage::Gradients,
            world_size: world,
            partitioning: Partitioning::Flat { chunk: 0 },
            params: vec![],
            tensors: Default::default(),
            files,
            engine: serde_json::json!({}),
        }
    }

    #[test]
    fn saves_become_visible_whole_and_latest_follows() {
        let root = scratch("visible");
        save(&root, "step1", 2, 1);
        let dir = save(&root, "step2", 3, 7);
        assert_eq!(resolve(&root, None).unwrap(), dir);
        let m = open_verified(&dir).unwrap();
        assert_eq!((m.tag.as_str(), m.files.len()), ("step2", 3));
        assert!(open_verified(&resolve(&root, Some("step1")).unwrap()).is_ok());
        // Saving a tag again replaces it whole.
        save(&root, "step1", 1, 9);
        assert_eq!(open_verified(&root.join("step1")).unwrap().world_size, 1);
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn an_interrupted_save_leaves_the_previous_checkpoint_loadable() {
        let root = scratch("crash");
        let good = save(&root, "step1", 2, 1);
        // A save that dies after writing its files, before the commit.
        let staging = Staging::open(&root, "step2", true).unwrap();
        write_synced(&staging.path("rank0.bin"), b"half of a checkpoint").unwrap();
        drop(staging);
        assert_eq!(resolve(&root, None).unwrap(), good);
        assert!(open_verified(&good).is_ok());
        assert!(!root.join("step2").exists(), "never visible");
        // The next save of that tag discards the leftovers and succeeds.
        save(&root, "step2", 2, 3);
        assert!(open_verified(&resolve(&root, None).unwrap()).is_ok());
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_save_cut_between_its_renames_leaves_the_replaced_copy_loadable() {
        let root = scratch("renames");
        save(&root, "step1", 2, 1);
        // As if a second save of `step1` died after moving the old copy aside.
        fs::rename(root.join("step1"), root.join(".step1.old")).unwrap();
        let dir = resolve(&root, None).unwrap();
        assert_eq!(open_verified(&dir).unwrap().world_size, 2);
        // The next save of the tag replaces it, and nothing is left aside.
        save(&root, "step1", 3, 5);
        assert_eq!(resolve(&root, None).unwrap(), root.join("step1"));
        assert_eq!(open_verified(&root.join("step1")).unwrap().world_size, 3);
        assert!(!root.join(".step1.old").exists());
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_missing_or_odd_tag_is_named() {
        let root = scratch("tags");
        save(&root, "step1", 1, 1);
        let err = resolve(&root, Some("step9")).unwrap_err().to_string();
        assert!(err.contains("no checkpoint `step9`"), "{err}");
        fs::write(root.join(LATEST), "step7\n").unwrap();
        let err = resolve(&root, None).unwrap_err().to_string();
        assert!(
            err.contains("`step7`") && err.contains("named by") && err.contains(LATEST),
            "{err}"
        );
        for odd in ["", "../step1", ".step1.partial"] {
            fs::write(root.join(LATEST), odd).unwrap();
            let err = resolve(&root, None).unwrap_err().to_string();
            assert!(err.contains("no checkpoint"), "{odd}: {err}");
        }
        // `latest` that cannot be read (here: a directory) is an I/O error, not "no checkpoint".
        fs::remove_file(root.join(LATEST)).unwrap();
        fs::create_dir(root.join(LATEST)).unwrap();
        let err = resolve(&root, None).unwrap_err();
        assert!(matches!(err, StoreError::Io { .. }), "{err}");
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn corruption_and_truncation_are_named_by_file() {
        let root = scratch("corrupt");
        let dir = save(&root, "step1", 2, 1);
        let victim = dir.join("rank1.bin");
        let mut bytes = fs::read(&victim).unwrap();
        bytes[50] ^= 0x01;
        fs::write(&victim, &bytes).unwrap();
        let err = open_verified(&dir).unwrap_err().to_string();
        assert!(
            err.contains("rank1.bin") && err.contains("SHA-256"),
            "{err}"
        );
        bytes.truncate(10);
        fs::write(&victim, &bytes).unwrap();
        let err = open_verified(&dir).unwrap_err().to_string();
        assert!(
            err.contains("rank1.bin") && err.contains("truncated"),
            "{err}"
        );
        fs::remove_dir_all(&root).unwrap();
        assert!(matches!(
            resolve(&root, None),
            Err(StoreError::NoCheckpoint(_))
        ));
    }

    #[test]
    fn a_commit_refuses_files_that_changed_after_they_were_described() {
        let root = scratch("refuse");
        let staging = Staging::open(&root, "step1", true).unwrap();
        write_synced(&staging.path("rank0.bin"), b"one").unwrap();
        let entry = staging.describe("rank0.bin", Some(0)).unwrap();
        write_synced(&staging.path("rank0.bin"), b"two").unwrap();
        let err = staging
            .commit(&manifest("step1", 1, vec![entry]))
            .unwrap_err();
        assert!(err.to_string().contains("rank0.bin"), "{err}");
        assert!(!root.join("step1").exists() && !root.join(LATEST).exists());
        fs::remove_dir_all(&root).unwrap();
    }
}
