//! The CUDA side of [`super::host_grads`]: a thread that copies reduced buckets from burn's
//! device memory into the host partition while backward goes on. Each bucket goes down in
//! chunks through two page-locked staging buffers, each with its own stream, so one chunk's
//! copy overlaps the previous chunk's write into the partition (a copy when fresh, an add
//! when accumulating, on the partition's threads).
//!
//! Ordering: the caller synchronizes burn's stream before handing a bucket over (it is
//! complete), and the bucket's memory is held until its last chunk has been copied.

use std::ops::Range;
use std::sync::atomic::AtomicU64;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use burn_offload::HostGrads;
use cudarc::driver::{CudaContext, CudaStream, PinnedHostSlice, result};

use super::host_grads::{Span, add_busy};
use crate::backend::cuda::CudaBuffer;

/// Elements of one staging buffer (64 MiB of f32).
const STAGING: usize = 1 << 24;

enum Job {
    Copy {
        src: Box<CudaBuffer>,
        spans: Vec<Span>,
        boundary: bool,
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

    /// Queues `src`'s `spans` for the partition.
    pub(crate) fn copy(&self, src: CudaBuffer, spans: Vec<Span>, boundary: bool) {
        let job = Job::Copy {
            src: Box::new(src),
            spans,
            boundary,
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

    /// Copies `chunks` (device address, partition range) down and writes each into `grads`.
    fn run(
        &self,
        chunks: &[(u64, Range<usize>)],
        grads: &Mutex<HostGrads>,
        boundary: bool,
    ) -> Result<(), String> {
        self.context
            .bind_to_thread()
            .map_err(|e| format!("{e:?}"))?;
        let issue = |k: usize| -> Result<(), String> {
            let (src, dst) = &chunks[k];
            // SAFETY: the staging buffer is not read until its stream is synchronized, and
            // not written again before it was read; `src` lies in a live, complete bucket.
            let buf = unsafe { std::slice::from_raw_parts_mut(self.ptrs[k % 2], dst.len()) };
            unsafe { result::memcpy_dtoh_async(buf, *src, self.streams[k % 2].cu_stream()) }
                .map_err(|e| format!("{e:?}"))
        };
        if !chunks.is_empty() {
            issue(0)?;
        }
        for (k, (_, dst)) in chunks.iter().enumerate() {
            if k + 1 < chunks.len() {
                issue(k + 1)?;
            }
            self.streams[k % 2]
                .synchronize()
                .map_err(|e| format!("{e:?}"))?;
            // SAFETY: the copy into this buffer is done (synchronized above).
            let values = unsafe { std::slice::from_raw_parts(self.ptrs[k % 2], dst.len()) };
            grads
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .write(dst.clone(), values, boundary)
                .map_err(|e| e.to_string())?;
        }
        Ok(())
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
    let mut failure: Option<String> = None;
    for job in inbox {
        match job {
            Job::Flush => {
                let _ = reply.send(failure.take().map_or(Ok(()), Err));
            }
            Job::Copy { .. } if failure.is_some() => {}
            Job::Copy {
                src,
                spans,
                boundary,
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
                            (base + 4 * (at + s - dst.start) as u64, s..e)
                        })
                    })
                    .collect();
                let stage = staging.as_ref().expect("made above");
                if let Err(e) = stage.run(&chunks, grads, boundary) {
                    failure = Some(e);
                }
                drop(src);
                add_busy(busy, start);
            }
        }
    }
}
