//! The CUDA device's memory pools (`burn_zero.memory_pool`).
//!
//! cubecl reserves device memory through pools fixed when the device is first used. Its
//! default (`SubSlices`) slices pages of up to a quarter of the device: on an 80 GB card every
//! tensor between 2.5 and 20 GiB takes a 20 GiB page, and no page is ever given back, so a
//! 1B-parameter step at 4 × 2048 tokens held 69 GiB for 10 GiB of live tensors (issue 33).
//! The `fitted` layout keeps cubecl's shared pages for small tensors and gives every tensor
//! over 4 MiB a page of its own in one of many size classes an eighth apart: a page is at most
//! an eighth larger than its tensor, and a freed page serves the next tensor of its class.
//!
//! The layout is a plain list ([`PoolSpec`], no burn or cubecl types) so it is tested on the
//! CPU; [`configure_memory_pool`] hands it to the patched cubecl-cuda (`patches/`).

use crate::config::MemoryPoolLayout;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Tensors larger than this get exclusive pages in the fitted layout.
pub const FITTED_EXCLUSIVE_FROM: u64 = 4 * MIB;
/// Each exclusive size class is at most this factor above the one below it.
pub const FITTED_CLASS_RATIO: f64 = 1.125;
/// The largest size class: beyond any device's memory.
const FITTED_LARGEST: u64 = 512 * GIB;

/// One pool of a layout, in the order cubecl tries them (the first that accepts a size takes it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolSpec {
    /// Pages of `page` bytes, cut into slices of at most `max_slice` bytes (cubecl's sliced
    /// pool also takes a size within 20% under `page`).
    Sliced {
        /// Bytes per page.
        page: u64,
        /// The largest slice it cuts.
        max_slice: u64,
    },
    /// One tensor per page, pages of at most `max_alloc` bytes.
    Exclusive {
        /// The largest tensor it takes.
        max_alloc: u64,
    },
}

impl PoolSpec {
    /// Whether cubecl's pool of this kind accepts a tensor of `size` bytes.
    pub fn accepts(&self, size: u64) -> bool {
        match *self {
            PoolSpec::Sliced { page, max_slice } => {
                max_slice >= size || page.checked_sub(size).is_some_and(|d| d * 5 < page)
            }
            PoolSpec::Exclusive { max_alloc } => max_alloc >= size,
        }
    }
}

/// The fitted layout for memory aligned to `alignment` bytes: an exclusive pool for empty
/// tensors (as cubecl's default has), sliced pools of 2 and 4 MiB pages for tensors up to
/// 4 MiB, then exclusive size classes from 4 MiB, each at most [`FITTED_CLASS_RATIO`] above
/// the last.
pub fn fitted_pools(alignment: u64) -> Vec<PoolSpec> {
    // A sliced pool also takes any size within 20% under its page, ahead of the exclusive
    // classes: its page may not exceed the size where those start.
    let mut pools = vec![
        PoolSpec::Exclusive { max_alloc: 0 },
        PoolSpec::Sliced {
            page: 2 * MIB,
            max_slice: 128 * KIB,
        },
        PoolSpec::Sliced {
            page: FITTED_EXCLUSIVE_FROM,
            max_slice: FITTED_EXCLUSIVE_FROM,
        },
    ];
    let mut class = FITTED_EXCLUSIVE_FROM;
    while class < FITTED_LARGEST {
        let next = ((class as f64 * FITTED_CLASS_RATIO) as u64 / alignment).max(1) * alignment;
        class = next.max(class + alignment).min(FITTED_LARGEST);
        pools.push(PoolSpec::Exclusive { max_alloc: class });
    }
    pools
}

/// The pool that takes a tensor of `size` bytes, and the most bytes it may reserve for it alone
/// (an exclusive page's size; for a sliced pool, its page).
pub fn reservation(pools: &[PoolSpec], size: u64) -> Option<(usize, u64)> {
    let index = pools.iter().position(|p| p.accepts(size))?;
    let bytes = match pools[index] {
        PoolSpec::Sliced { page, .. } => page,
        PoolSpec::Exclusive { max_alloc } => max_alloc,
    };
    Some((index, bytes))
}

/// Why the pools could not be set.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MemoryPoolError {
    /// The device was used before: its pools are fixed.
    #[error(
        "CUDA device {device} was used before `burn_zero.memory_pool` = {wanted:?} could be set: \
         its pools stay cubecl's {current}. Call `burn_zero::backend::configure_memory_pool` \
         before the first tensor on the device (before building the model)"
    )]
    AlreadyInitialized {
        /// The device index.
        device: usize,
        /// The layout asked for.
        wanted: MemoryPoolLayout,
        /// What the device has.
        current: String,
    },
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::sync::Mutex;

    use cubecl_runtime::memory_management::{MemoryConfiguration, MemoryPoolOptions, PoolType};

    use super::{MemoryPoolError, PoolSpec, fitted_pools};
    use crate::config::MemoryPoolLayout;

    /// cubecl-cuda's memory alignment (`mem_alignment` in its runtime).
    const CUDA_ALIGNMENT: u64 = 512;

    /// The layout each device index was given: the device's pools are process-wide, like the
    /// device itself, so this records them rather than choosing for any engine.
    static SET: Mutex<Vec<(usize, MemoryPoolLayout)>> = Mutex::new(Vec::new());

    fn options(layout: MemoryPoolLayout) -> MemoryConfiguration {
        match layout {
            MemoryPoolLayout::Sliced => MemoryConfiguration::SubSlices,
            MemoryPoolLayout::Exclusive => MemoryConfiguration::ExclusivePages,
            MemoryPoolLayout::Fitted => MemoryConfiguration::Custom {
                pool_options: fitted_pools(CUDA_ALIGNMENT)
                    .into_iter()
                    .map(|spec| MemoryPoolOptions {
                        pool_type: match spec {
                            PoolSpec::Sliced { page, max_slice } => PoolType::SlicedPages {
                                page_size: page,
                                max_slice_size: max_slice,
                            },
                            PoolSpec::Exclusive { max_alloc } => PoolType::ExclusivePages {
                                max_alloc_size: max_alloc,
                            },
                        },
                        dealloc_period: None,
                    })
                    .collect(),
            },
        }
    }

    /// The layout CUDA device `device` has or will have: the one set, else cubecl's default.
    pub fn memory_pool_of(device: usize) -> MemoryPoolLayout {
        let set = SET.lock().unwrap_or_else(|e| e.into_inner());
        set.iter()
            .find(|(d, _)| *d == device)
            .map_or(MemoryPoolLayout::Sliced, |(_, l)| *l)
    }

    /// Makes CUDA's stream-ordered allocator (where cubecl's pages come from) keep the memory
    /// the pools hand back instead of returning it to the driver at the next synchronization,
    /// so pages released between phases ([`crate::config::BurnZeroConfig`]'s
    /// `release_cached_memory`) are cheap to take again, at any size.
    pub fn keep_released_memory(device: usize) -> Result<(), String> {
        use cudarc::driver::{result, sys};
        // SAFETY: the driver is initialized first; the device comes from `device::get`, the pool
        // from the driver, and the attribute's value is the u64 the driver expects.
        unsafe {
            result::init().map_err(|e| e.to_string())?;
            let dev = result::device::get(device as i32).map_err(|e| e.to_string())?;
            let pool = result::device::get_default_mem_pool(dev).map_err(|e| e.to_string())?;
            let mut threshold = u64::MAX;
            result::mem_pool::set_attribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            )
            .map_err(|e| e.to_string())
        }
    }

    /// Lays out CUDA device `device`'s memory pools as `layout`; must come before the device's
    /// first use. Setting the layout it already has is not an error.
    pub fn configure_memory_pool(
        device: usize,
        layout: MemoryPoolLayout,
    ) -> Result<(), MemoryPoolError> {
        if memory_pool_of(device) == layout && cubecl::cuda::is_initialized(device) {
            return Ok(());
        }
        if !cubecl::cuda::set_memory_configuration(device, options(layout)) {
            return Err(MemoryPoolError::AlreadyInitialized {
                device,
                wanted: layout,
                current: format!("{:?}", memory_pool_of(device)).to_lowercase(),
            });
        }
        let mut set = SET.lock().unwrap_or_else(|e| e.into_inner());
        set.retain(|(d, _)| *d != device);
        set.push((device, layout));
        Ok(())
    }
}

#[cfg(feature = "cuda")]
pub use cuda::{configure_memory_pool, keep_released_memory, memory_pool_of};

/// For an engine on `device`: lays out its pools as `layout` if it is a CUDA device not yet
/// used; an error when it is one whose pools are fixed otherwise. Other devices: nothing.
#[cfg(feature = "cuda")]
pub(crate) fn ensure_memory_pool<D: core::any::Any>(
    device: &D,
    layout: MemoryPoolLayout,
) -> Result<(), MemoryPoolError> {
    match cuda_index(device) {
        Some(index) => configure_memory_pool(index, layout),
        None => Ok(()),
    }
}

/// The index of `device` if it is a CUDA device.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_index<D: core::any::Any>(device: &D) -> Option<usize> {
    (device as &dyn core::any::Any)
        .downcast_ref::<cubecl::cuda::CudaDevice>()
        .map(|cuda| cuda.index)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fitted_pools_reserve_at_most_an_eighth_over_large_tensors() {
        let pools = fitted_pools(512);
        assert!(pools.len() < 255, "cubecl numbers pools with a u8");
        let mut size = FITTED_EXCLUSIVE_FROM + 1;
        while size < 300 * GIB {
            let (index, bytes) = reservation(&pools, size).expect("a pool takes it");
            assert!(matches!(pools[index], PoolSpec::Exclusive { .. }), "{size}");
            assert!(bytes >= size, "{size}: page {bytes}");
            // The class bound, plus the alignment the bound is rounded to.
            assert!(
                bytes as f64 <= size as f64 * FITTED_CLASS_RATIO + 512.0,
                "{size} bytes reserve {bytes}"
            );
            size = size * 21 / 20 + 4093; // odd steps: not only class edges
        }
    }

    #[test]
    fn fitted_pools_put_small_tensors_on_shared_pages() {
        let pools = fitted_pools(512);
        for size in [1, 511, 512, 4096, 300 * KIB, 512 * KIB, MIB, 4 * MIB] {
            let (index, bytes) = reservation(&pools, size).expect("a pool takes it");
            assert!(
                matches!(pools[index], PoolSpec::Sliced { .. }),
                "{size} bytes went to {:?}",
                pools[index]
            );
            assert!(bytes <= FITTED_EXCLUSIVE_FROM);
        }
        assert_eq!(reservation(&pools, 0).map(|r| r.0), Some(0));
    }

    #[test]
    fn fitted_classes_grow_and_stay_aligned() {
        let pools = fitted_pools(512);
        let classes: Vec<u64> = pools
            .iter()
            .filter_map(|p| match p {
                PoolSpec::Exclusive { max_alloc } if *max_alloc > 0 => Some(*max_alloc),
                _ => None,
            })
            .collect();
        assert!(classes.windows(2).all(|w| w[0] < w[1]));
        assert!(classes.iter().all(|c| c % 512 == 0));
        assert!(*classes.last().unwrap() >= 256 * GIB);
    }

    #[test]
    fn cubecl_default_would_give_a_3_gib_tensor_a_20_gib_page() {
        // cubecl 0.10's SubSlices on an 80 GiB card (max page = a quarter), for contrast: the
        // page sizes and slice limits its `from_configuration` derives.
        let max_page = 20 * GIB;
        let mut pools = vec![PoolSpec::Exclusive { max_alloc: 0 }];
        let (mut current, mut base, mut levels) = (max_page, 1u32, Vec::new());
        while current >= 32 * MIB {
            current = (current / 4).next_multiple_of(512);
            levels.push((current, current / 2u64.pow(base)));
            base += 1;
        }
        for (page, max_slice) in levels.into_iter().rev() {
            pools.push(PoolSpec::Sliced { page, max_slice });
        }
        pools.push(PoolSpec::Sliced {
            page: max_page,
            max_slice: max_page,
        });
        assert_eq!(reservation(&pools, 3 * GIB).map(|r| r.1), Some(max_page));
        assert!(reservation(&fitted_pools(512), 3 * GIB).unwrap().1 < 3 * GIB * 9 / 8 + 512);
    }
}
