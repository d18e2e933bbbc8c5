//! Persistent CubeCL caches: compiled kernels (PTX) and autotune results kept on disk, so the
//! seconds of NVRTC compilation and autotuning per new (shape, dtype) are paid once per
//! machine, not once per process.
//!
//! The caches live in `$BURN_ZERO_CACHE_DIR`, else `$XDG_CACHE_HOME/burn-zero/cubecl`, else
//! `~/.cache/burn-zero/cubecl` (subfolders `compilation/` and `autotune/`). Delete the folder
//! to start cold. A location set explicitly in a `cubecl.toml` / `burn.toml` is kept.

use std::path::{Path, PathBuf};

use cubecl_runtime::config::cache::CacheConfig;
use cubecl_runtime::config::{CubeClRuntimeConfig, RuntimeConfig};

/// The folder burn-zero keeps CubeCL's caches in (see the module documentation).
pub fn default_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("BURN_ZERO_CACHE_DIR") {
        return PathBuf::from(dir);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("burn-zero").join("cubecl")
}

/// Points CubeCL's kernel and autotune caches at `dir`. Must run before the first tensor op of
/// the process: CubeCL reads its configuration once.
pub fn persist(dir: &Path) -> Result<(), String> {
    if CubeClRuntimeConfig::storage().lock().is_some() {
        return Err(
            "CubeCL's configuration was already read: call burn_zero::kernel_cache::persist \
                    before the first tensor operation"
                .into(),
        );
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| format!("cannot create the kernel cache {}: {e}", dir.display()))?;
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    if config.compilation.cache.is_none() {
        config.compilation.cache = Some(CacheConfig::File(dir.join("compilation")));
    }
    if matches!(config.autotune.cache, CacheConfig::Target) {
        config.autotune.cache = CacheConfig::File(dir.join("autotune"));
    }
    CubeClRuntimeConfig::set(config);
    Ok(())
}
