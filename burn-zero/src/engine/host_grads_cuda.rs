//! The CUDA side of [`super::host_grads`]: a thread that copies reduced buckets from burn's
//! device memory into the host partition while backward goes on. Each bucket goes down in
//! chunks through two page-locked staging buffers, each with its own stream, so one chunk's
//! copy overlaps the previous chunk's write into the partition (a copy when fresh, an add
//! when accumulating, on the partition's threads).
//!
//! In a backward whose writes copy (the first after a step), the partition itself is the
//! copy's destination: its chunks are page-locked in place (`cuMemHostRegister`) once, and
//! each piece goes down straight into them, with no staging copy on the CPU (only the sum of
//! squares reads it, unless it was taken on the device); the next piece's copy overlaps that
//! read. Accumulating backwards add, so they go through the staging buffers (and take their
//! squares on the host: they are of the sums).
//!
//! A bucket comes in fp32, or in bf16 / f16 for a partition of that dtype: straight into it
//! when the copy goes there, else widened on the host after its staged copy.
//!
//! Ordering: the caller synchronizes burn's stream before handing a bucket over (it is
//! complete), and the bucket's memory is held until its last chunk has been copied.

use std::ops::Range;
use std::sync::atomic::AtomicU64;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use burn_offload::{GradDtype, HostGrads};
use cudarc::driver::{CudaContext, CudaStream, PinnedHostSlice, result};
use half::{bf16, f16};

use super::host_grads::{Span, add_busy};
use crate::backend::cuda::CudaBuffer;

/// Elements of one staging buffer (64 MiB of f32).
const STAGING: usize = 1 << 24;

/// Σ g² of a bucket's pieces taken on the device: (chunk, sum).
pub(crate) type Squares = Vec<(usize, f64)>;

enum Job {
    Copy {
        src: Box<CudaBuffer>,
        /// The bucket's elements.
        dtype: GradDtype,
        spans: Vec<Span>,
        boundary: bool,
        squares: Option<Squares>,
    },
    /// Reply once every earlier copy is done.
    Flush,
}

/// The copy thread.
pub(crate) struct Copier {
    jobs: Option<Sender<Job>>,
    replies: Receiver<Result<(), String>>,
    thread: Option<JoinHandle<()>>,
}

impl Copier {
    /// The thread, adding its busy time to `busy` (nanoseconds).
    pub(crate) fn new(grads: Arc<Mutex<HostGrads>>, busy: Arc<AtomicU64>) -> Self {
        let (jobs, inbox) = channel::<Job>();
        let (reply, replies) = channel();
        let thread = std::thread::Builder::new()
            .name("burn-zero-grad-copy".into())
            .spawn(move || serve(&grads, &busy, &inbox, &reply))
            .expect("spawning the gradient copy thread");
        Self {
            jobs: Some(jobs),
            replies,
            thread: Some(thread),
        }
    }

    /// Queues `src`'s `spans` (elements of `dtype`) for the partition (their sums of squares
    /// taken already when `squares` is given; used where the copy goes straight into the
    /// partition).
    pub(crate) fn copy(
        &self,
        src: CudaBuffer,
        dtype: GradDtype,
        spans: Vec<Span>,
        boundary: bool,
        squares: Option<Squares>,
    ) {
        let job = Job::Copy {
            src: Box::new(src),
            dtype,
            spans,
            boundary,
            squares,
        };
        // A closed channel means the thread died; `flush` reports it.
        let _ = self.jobs.as_ref().map(|j| j.send(job));
    }

    /// Waits for every queued copy: the first failure since the last flush.
    pub(crate) fn flush(&self) -> Result<(), String> {
        let sent = self.jobs.as_ref().map(|j| j.send(Job::Flush));
        match sent {
            Some(Ok(())) => self
                .replies
                .recv()
                .unwrap_or_else(|_| Err("the gradient copy thread stopped".into())),
            _ => Err("the gradient copy thread stopped".into()),
        }
    }
}

impl Drop for Copier {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Two page-locked buffers and their streams on one GPU.
struct Staging {
    ordinal: usize,
    context: Arc<CudaContext>,
    streams: [Arc<CudaStream>; 2],
    /// Keep the buffers `ptrs` point into.
    _buffers: [PinnedHostSlice<f32>; 2],
    ptrs: [*mut f32; 2],
}

impl Staging {
    fn new(ordinal: usize) -> Result<Self, String> {
        let (context, streams) = super::offload_cuda::copy_streams::<2>(ordinal)?;
        // Flags 0: cached memory, as the CPU reads it.
        // SAFETY: each buffer is written by a copy before it is read.
        let pinned = || {
            unsafe { context.alloc_pinned_with_flags::<f32>(STAGING, 0) }
                .map_err(|e| format!("{STAGING} elements of page-locked memory: {e:?}"))
        };
        let mut buffers = [pinned()?, pinned()?];
        let ptrs = [ptr(&mut buffers[0])?, ptr(&mut buffers[1])?];
        Ok(Self {
            ordinal,
            streams,
            context,
            _buffers: buffers,
            ptrs,
        })
    }

    /// Copies `chunks` (device address, partition range) straight into the partition's
    /// registered memory (elements of the partition's dtype on both sides), claiming each
    /// piece before its copy and committing it once there (with the `squares` taken on the
    /// device, if given, instead of reading it again).
    fn run_direct(
        &self,
        chunks: &[(u64, Range<usize>)],
        dtype: GradDtype,
        grads: &Mutex<HostGrads>,
        boundary: bool,
        squares: Option<Squares>,
    ) -> Result<(), String> {
        self.context
            .bind_to_thread()
            .map_err(|e| format!("{e:?}"))?;
        let lock = || grads.lock().unwrap_or_else(|e| e.into_inner());
        // Pieces within one chunk of the partition (its chunks are separate buffers).
        let (per, size) = {
            let g = lock();
            if g.dtype() != dtype {
                return Err(format!(
                    "a {dtype:?} bucket cannot be copied into a {:?} partition",
                    g.dtype()
                ));
            }
            (g.chunk_len(), dtype.size())
        };
        let pieces: Vec<(u64, Range<usize>)> = chunks
            .iter()
            .flat_map(|(src, dst)| {
                let (src, start) = (*src, dst.start);
                split_at_multiples(dst.clone(), per)
                    .map(move |r| (src + (size * (r.start - start)) as u64, r))
            })
            .collect();
        let issue = |k: usize| -> Result<(), String> {
            let (src, dst) = &pieces[k];
            let ptr = {
                let mut g = lock();
                g.reserve(dst.clone()).map_err(|e| e.to_string())?;
                let c = dst.start / per;
                let base = g.chunk_ptr(c).ok_or("a reserved chunk is lent")?;
                // SAFETY: `dst` lies inside chunk `c` (split above), `base` is its buffer.
                unsafe { base.add(size * (dst.start - c * per)) }
            };
            // SAFETY: the destination is registered (page-locked) memory of a piece reserved
            // for this copy: nothing reads or writes it before `commit`, nor frees it (the
            // partition lives while this thread does); `src` lies in a live, complete bucket.
            let buf = unsafe { std::slice::from_raw_parts_mut(ptr, size * dst.len()) };
            unsafe { result::memcpy_dtoh_async(buf, *src, self.streams[k % 2].cu_stream()) }
                .map_err(|e| format!("{e:?}"))
        };
        let squared = squares.is_some();
        if let Some(squares) = squares {
            let mut g = lock();
            squares
                .into_iter()
                .for_each(|(c, sum)| g.add_squares(c, sum));
        }
        self.pipelined(pieces.len(), issue, |k| {
            match squared {
                true => lock().commit_squared(pieces[k].1.clone(), boundary),
                false => lock().commit(pieces[k].1.clone(), boundary),
            }
            Ok(())
        })
    }

    /// Copies `0..n` issued by `issue(k)` on stream `k % 2`, the next issued before the last
    /// is waited for; `landed(k)` once copy `k` is done.
    fn pipelined(
        &self,
        n: usize,
        issue: impl Fn(usize) -> Result<(), String>,
        mut landed: impl FnMut(usize) -> Result<(), String>,
    ) -> Result<(), String> {
        let mut run = || -> Result<(), String> {
            if n > 0 {
                issue(0)?;
            }
            for k in 0..n {
                if k + 1 < n {
                    issue(k + 1)?;
                }
                self.streams[k % 2]
                    .synchronize()
                    .map_err(|e| format!("{e:?}"))?;
                landed(k)?;
            }
            Ok(())
        };
        let done = run();
        if done.is_err() {
            // No copy may still read the bucket or write the host once this returns.
            for s in &self.streams {
                let _ = s.synchronize();
            }
        }
        done
    }

    /// Copies `chunks` (device address, partition range; elements of `dtype`) down and
    /// writes each into `grads`.
    fn run(
        &self,
        chunks: &[(u64, Range<usize>)],
        dtype: GradDtype,
        grads: &Mutex<HostGrads>,
        boundary: bool,
    ) -> Result<(), String> {
        self.context
            .bind_to_thread()
            .map_err(|e| format!("{e:?}"))?;
        let size = dtype.size();
        let issue = |k: usize| -> Result<(), String> {
            let (src, dst) = &chunks[k];
            // SAFETY: the staging buffer is not read until its stream is synchronized, and
            // not written again before it was read; `src` lies in a live, complete bucket;
            // a chunk's bytes fit the buffer (at most STAGING elements of at most 4 bytes).
            let buf = unsafe {
                std::slice::from_raw_parts_mut(self.ptrs[k % 2].cast::<u8>(), size * dst.len())
            };
            unsafe { result::memcpy_dtoh_async(buf, *src, self.streams[k % 2].cu_stream()) }
                .map_err(|e| format!("{e:?}"))
        };
        self.pipelined(chunks.len(), issue, |k| {
            let dst = &chunks[k].1;
            let at = self.ptrs[k % 2];
            // SAFETY: the copy into this buffer is done (synchronized before `landed`), and
            // wrote `dst.len()` elements of `dtype` there.
            let widened: Vec<f32>;
            let values = match dtype {
                GradDtype::F32 => unsafe { std::slice::from_raw_parts(at, dst.len()) },
                GradDtype::Bf16 => {
                    let b = unsafe { std::slice::from_raw_parts(at.cast::<bf16>(), dst.len()) };
                    widened = b.iter().map(|x| x.to_f32()).collect();
                    &widened
                }
                GradDtype::F16 => {
                    let h = unsafe { std::slice::from_raw_parts(at.cast::<f16>(), dst.len()) };
                    widened = h.iter().map(|x| x.to_f32()).collect();
                    &widened
                }
            };
            grads
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .write(dst.clone(), values, boundary)
                .map_err(|e| e.to_string())
        })
    }
}

/// `range` cut where multiples of `per` fall.
pub(crate) fn split_at_multiples(
    range: Range<usize>,
    per: usize,
) -> impl Iterator<Item = Range<usize>> {
    let mut at = range.start;
    std::iter::from_fn(move || {
        (at < range.end).then(|| {
            let end = ((at / per + 1) * per).min(range.end);
            let piece = at..end;
            at = end;
            piece
        })
    })
}

/// The partition's chunks, page-locked in place while this lives.
struct Registered {
    ptrs: Vec<*mut core::ffi::c_void>,
}

impl Registered {
    /// Registers every chunk of `grads` (all present: before the first step); an error, with
    /// whatever was registered undone, if the driver refuses one.
    fn new(grads: &Mutex<HostGrads>) -> Result<Self, String> {
        let mut g = grads.lock().unwrap_or_else(|e| e.into_inner());
        let mut done = Self { ptrs: Vec::new() };
        for c in 0..g.chunk_count() {
            let bytes = g.dtype().size() * g.chunk_range(c).len();
            let ptr = g.chunk_ptr(c).ok_or("a gradient chunk is lent")?;
            if bytes == 0 {
                continue;
            }
            // SAFETY: `ptr` is the start of a live buffer of `bytes` bytes, kept (not moved)
            // while the partition lives, which outlives this (both held by the copy thread).
            let r = unsafe { cudarc::driver::sys::cuMemHostRegister_v2(ptr.cast(), bytes, 0) };
            if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
                return Err(format!(
                    "registering {bytes} bytes of the host gradient partition: {r:?}"
                ));
            }
            done.ptrs.push(ptr.cast());
        }
        Ok(done)
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        for &p in &self.ptrs {
            // SAFETY: registered above, still alive.
            unsafe { cudarc::driver::sys::cuMemHostUnregister(p) };
        }
    }
}

fn ptr(buf: &mut PinnedHostSlice<f32>) -> Result<*mut f32, String> {
    buf.as_mut_ptr().map_err(|e| format!("{e:?}"))
}

fn serve(
    grads: &Mutex<HostGrads>,
    busy: &AtomicU64,
    inbox: &Receiver<Job>,
    reply: &Sender<Result<(), String>>,
) {
    let mut staging: Option<Staging> = None;
    // The partition page-locked at the first copy (`Err`: refused, staged copies only).
    let mut registered: Option<Result<Registered, String>> = None;
    let mut failure: Option<String> = None;
    for job in inbox {
        match job {
            Job::Flush => {
                let _ = reply.send(failure.take().map_or(Ok(()), Err));
            }
            Job::Copy { .. } if failure.is_some() => {}
            Job::Copy {
                src,
                dtype,
                spans,
                boundary,
                squares,
            } => {
                let start = std::time::Instant::now();
                let ordinal = src._keep.device.index;
                if staging.as_ref().is_none_or(|s| s.ordinal != ordinal) {
                    match Staging::new(ordinal) {
                        Ok(s) => staging = Some(s),
                        Err(e) => {
                            failure = Some(e);
                            continue;
                        }
                    }
                }
                let base = src.buf.ptr;
                let chunks: Vec<(u64, Range<usize>)> = spans
                    .iter()
                    .flat_map(|(at, dst)| {
                        (dst.start..dst.end).step_by(STAGING).map(move |s| {
                            let e = (s + STAGING).min(dst.end);
                            (base + (dtype.size() * (at + s - dst.start)) as u64, s..e)
                        })
                    })
                    .collect();
                let stage = staging.as_ref().expect("made above");
                let registered = registered.get_or_insert_with(|| {
                    let r = stage
                        .context
                        .bind_to_thread()
                        .map_err(|e| format!("{e:?}"))
                        .and_then(|()| Registered::new(grads));
                    if let Err(e) = &r {
                        crate::log::warn(&format!(
                            "{e}; gradients go down through staging buffers"
                        ));
                    }
                    r
                });
                let (copies, same) = {
                    let g = grads.lock().unwrap_or_else(|e| e.into_inner());
                    (g.copies(), g.dtype() == dtype)
                };
                let done = match registered.is_ok() && copies && same {
                    true => stage.run_direct(&chunks, dtype, grads, boundary, squares),
                    false => stage.run(&chunks, dtype, grads, boundary),
                };
                if let Err(e) = done {
                    failure = Some(e);
                }
                drop(src);
                add_busy(busy, start);
            }
        }
    }
}
