use crate::compute::{
    storage::{
        cpu::{PINNED_MEMORY_ALIGNMENT, PinnedMemoryStorage},
        gpu::GpuStorage,
    },
    sync::Fence,
};
use cubecl_core::{
    MemoryConfiguration,
    ir::MemoryDeviceProperties,
    server::{Binding, ServerError},
};
use cubecl_runtime::{
    logging::ServerLogger,
    memory_management::{
        MemoryAllocationMode, MemoryManagement, MemoryManagementOptions, drop_queue,
    },
    stream::EventStreamBackend,
};
use std::sync::Arc;

#[derive(Debug)]
pub struct Stream {
    pub sys: cudarc::driver::sys::CUstream,
    pub memory_management_gpu: MemoryManagement<GpuStorage>,
    pub memory_management_cpu: MemoryManagement<PinnedMemoryStorage>,
    pub errors: Vec<ServerError>,
    pub drop_queue: drop_queue::PendingDropQueue<Fence>,
    /// burn-zero's patch: while the stream is captured into a CUDA graph, what the graph keeps.
    pub capture: Option<CaptureState>,
    /// burn-zero's patch: graphs captured on this stream and still alive. Their scratch memory
    /// lies in this stream's pool pages, so no page may go back to the driver meanwhile.
    pub graphs_alive: Arc<std::sync::atomic::AtomicUsize>,
}

/// burn-zero's patch: what a stream being captured keeps for its graph.
#[derive(Debug, Default)]
pub struct CaptureState {
    /// The staging bytes of its uploads (the graph's copy nodes read them on every replay).
    pub staging: Vec<cubecl_common::bytes::Bytes>,
    /// Launch metadata, written once at capture into memory nothing else uses.
    pub constants: ConstantArena,
    /// Why the capture cannot give a graph (a value was read back inside it).
    pub poisoned: Option<String>,
}

/// burn-zero's patch: device memory for the launch metadata of a captured graph. Uploaded as
/// the capture runs (a synchronous copy, outside the graph) into chunks only this arena hands
/// out, so no replay needs a copy node for it: the graph's kernels read the same values on
/// every replay, and no other buffer of the step can overwrite them (a pool slice could be
/// reused by a later tensor of the step).
#[derive(Debug, Default)]
pub struct ConstantArena {
    chunks: Vec<(cudarc::driver::sys::CUdeviceptr, usize)>,
    used: usize,
}

impl ConstantArena {
    const CHUNK: usize = 1 << 20;
    const ALIGN: usize = 256;

    /// `data` at a fresh device address.
    pub fn constant(&mut self, data: &[u8]) -> Result<cudarc::driver::sys::CUdeviceptr, String> {
        let len = data.len().max(1).next_multiple_of(Self::ALIGN);
        let fits = self
            .chunks
            .last()
            .is_some_and(|(_, size)| self.used + len <= *size);
        if !fits {
            let size = len.max(Self::CHUNK);
            // SAFETY: a plain device allocation, freed by `free`.
            let ptr = unsafe { cudarc::driver::result::malloc_sync(size) }
                .map_err(|e| format!("allocating launch metadata: {e:?}"))?;
            self.chunks.push((ptr, size));
            self.used = 0;
        }
        let ptr = self.chunks.last().expect("a chunk").0 + self.used as u64;
        self.used += len;
        // SAFETY: `len >= data.len()` bytes at `ptr` belong to this arena; a synchronous copy
        // from pageable host memory, on the legacy stream (cubecl's streams do not block on it).
        unsafe {
            cudarc::driver::sys::cuMemcpyHtoD_v2(ptr, data.as_ptr() as *const _, data.len())
        }
        .result()
        .map_err(|e| format!("writing launch metadata: {e:?}"))?;
        Ok(ptr)
    }

    /// Gives the memory back (no graph reads it any more).
    pub fn free(self) {
        for (ptr, _) in self.chunks {
            // SAFETY: allocated by `constant`, freed once.
            let _ = unsafe { cudarc::driver::result::free_sync(ptr) };
        }
    }
}

impl Stream {
    /// burn-zero's patch: whether pages of this stream's pool may be given back to the driver
    /// (not while capturing, nor while a captured graph that may use them lives).
    pub fn may_release_pages(&self) -> bool {
        self.capture.is_none() && self.graphs_alive.load(std::sync::atomic::Ordering::SeqCst) == 0
    }
}

impl drop_queue::Fence for Fence {
    fn sync(self) {
        let _ = self.wait_sync().ok();
    }
}

#[derive(new, Debug)]
pub struct CudaStreamBackend {
    mem_props: MemoryDeviceProperties,
    mem_config: MemoryConfiguration,
    mem_alignment: usize,
    logger: Arc<ServerLogger>,
}

impl EventStreamBackend for CudaStreamBackend {
    type Stream = Stream;
    type Event = Fence;

    fn create_stream(&self) -> Self::Stream {
        let stream = cudarc::driver::result::stream::create(
            cudarc::driver::result::stream::StreamKind::NonBlocking,
        )
        .expect("Can create a new stream.");

        let storage = GpuStorage::new(self.mem_alignment, stream);
        let memory_management_gpu = MemoryManagement::from_configuration(
            storage,
            &self.mem_props,
            self.mem_config.clone(),
            self.logger.clone(),
            MemoryManagementOptions::new("Main GPU Memory"),
        );
        // We use the same page size and memory pools configuration for CPU pinned memory, since we
        // expect the CPU to have at least the same amount of RAM as GPU memory.
        let memory_management_cpu = MemoryManagement::from_configuration(
            PinnedMemoryStorage::new(),
            &MemoryDeviceProperties {
                max_page_size: self.mem_props.max_page_size,
                alignment: PINNED_MEMORY_ALIGNMENT as u64,
            },
            self.mem_config.clone(),
            self.logger.clone(),
            MemoryManagementOptions::new("Pinned CPU Memory").mode(MemoryAllocationMode::Auto),
        );

        Stream {
            sys: stream,
            memory_management_gpu,
            memory_management_cpu,
            errors: Vec::new(),
            drop_queue: Default::default(),
            capture: None,
            graphs_alive: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
        }
    }

    fn flush(stream: &mut Self::Stream) -> Self::Event {
        Fence::new(stream.sys)
    }

    fn wait_event(stream: &mut Self::Stream, event: Self::Event) {
        event.wait_async(stream.sys);
    }

    fn wait_event_sync(event: Self::Event) -> Result<(), ServerError> {
        event.wait_sync()
    }

    fn handle_cursor(stream: &Self::Stream, binding: &Binding) -> u64 {
        stream
            .memory_management_gpu
            .get_cursor(binding.memory.clone())
            .unwrap()
    }

    fn is_healthy(stream: &Self::Stream) -> bool {
        stream.errors.is_empty()
    }
}
