//! burn-zero's patch: a cubecl stream's work captured into a CUDA graph and replayed
//! (`CudaServer::{begin_capture, end_capture, launch_graph}`); see patches/README.md.

use super::*;

impl CudaServer {
    /// burn-zero's patch: starts capturing the work of `stream_id` into a CUDA graph (relaxed
    /// mode, so kernels may still be compiled and pages allocated). Until [`Self::end_capture`]
    /// the stream's uploads keep their staging bytes, its drop queue does not flush, its pool
    /// allocates pages with `cuMemAlloc` and gives none back.
    pub fn begin_capture(&mut self, stream_id: StreamId) -> Result<(), ServerError> {
        let mut command = self.command_no_inputs(
            stream_id,
            StreamErrorMode {
                ignore: false,
                flush: true,
            },
        )?;
        let current = command.streams.current();
        if current.capture.is_some() {
            return Err(capture_error("the stream is already being captured".into()));
        }
        // SAFETY: cubecl's live stream of this device.
        unsafe {
            cudarc::driver::result::stream::begin_capture(
                current.sys,
                cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
            )
        }
        .map_err(|e| capture_error(format!("cuStreamBeginCapture: {e:?}")))?;
        current.capture = Some(Default::default());
        current.memory_management_gpu.storage().set_capturing(true);
        Ok(())
    }

    /// burn-zero's patch: ends the capture begun by [`Self::begin_capture`] and instantiates
    /// the graph. An error (a host wait inside the capture invalidates it) leaves the stream
    /// uncaptured and usable.
    pub fn end_capture(&mut self, stream_id: StreamId) -> Result<CapturedGraph, ServerError> {
        let mut command = self.command_no_inputs(
            stream_id,
            StreamErrorMode {
                ignore: true,
                flush: false,
            },
        )?;
        let current = command.streams.current();
        let Some(kept) = current.capture.take() else {
            return Err(capture_error("the stream is not being captured".into()));
        };
        current.memory_management_gpu.storage().set_capturing(false);
        // SAFETY: the stream whose capture began above.
        let graph = match unsafe { cudarc::driver::result::stream::end_capture(current.sys) } {
            Ok(graph) => graph,
            Err(e) => {
                kept.constants.free();
                return Err(capture_error(format!("cuStreamEndCapture: {e:?}")));
            }
        };
        // The launch metadata was copied from pageable memory, which `cuMemcpyHtoD` may
        // return from before the transfer ends: the first replay must not start before it.
        // And a capture that read a value back (refused, see `read_async`) is no graph.
        let ready = cudarc::driver::result::ctx::synchronize()
            .map_err(|e| format!("waiting for the launch metadata: {e:?}"))
            .and_then(|()| kept.poisoned.clone().map_or(Ok(()), Err));
        if let Err(reason) = ready {
            // SAFETY: the graph above, not instantiated.
            let _ = unsafe { cudarc::driver::result::graph::destroy(graph) };
            kept.constants.free();
            return Err(capture_error(reason));
        }
        // SAFETY: a graph just captured.
        let exec = unsafe {
            cudarc::driver::result::graph::instantiate(
                graph,
                cudarc::driver::sys::CUgraphInstantiate_flags(0),
            )
        };
        let exec = match exec {
            Ok(exec) => exec,
            Err(e) => {
                // SAFETY: the graph above, not instantiated.
                let _ = unsafe { cudarc::driver::result::graph::destroy(graph) };
                kept.constants.free();
                return Err(capture_error(format!("cuGraphInstantiate: {e:?}")));
            }
        };
        let alive = current.graphs_alive.clone();
        alive.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(CapturedGraph {
            graph,
            exec,
            stream: current.sys,
            nodes: graph_nodes(graph),
            _staging: kept.staging,
            constants: Some(kept.constants),
            alive,
        })
    }

    /// burn-zero's patch: replays `graph` on the stream of `stream_id` (the one it was captured
    /// on), after the work queued there before.
    pub fn launch_graph(
        &mut self,
        stream_id: StreamId,
        graph: &CapturedGraph,
    ) -> Result<(), ServerError> {
        let mut command = self.command_no_inputs(
            stream_id,
            StreamErrorMode {
                ignore: false,
                flush: false,
            },
        )?;
        let current = command.streams.current();
        if current.sys != graph.stream {
            return Err(capture_error(
                "a graph replays on the stream it was captured on".into(),
            ));
        }
        // SAFETY: a live instantiated graph and its stream.
        unsafe { cudarc::driver::result::graph::launch(graph.exec, current.sys) }
            .map_err(|e| capture_error(format!("cuGraphLaunch: {e:?}")))
    }
}

/// burn-zero's patch: a CUDA graph captured from one of cubecl's streams, with the staging bytes
/// its copy nodes read. Dropping it waits for its stream first (a replay may still run).
pub struct CapturedGraph {
    graph: cudarc::driver::sys::CUgraph,
    exec: cudarc::driver::sys::CUgraphExec,
    stream: cudarc::driver::sys::CUstream,
    nodes: usize,
    _staging: Vec<cubecl_common::bytes::Bytes>,
    constants: Option<crate::compute::stream::ConstantArena>,
    alive: alloc::sync::Arc<std::sync::atomic::AtomicUsize>,
}

// SAFETY: CUDA graphs and executable graphs may be used and destroyed from any thread; the
// staging bytes are owned host memory.
unsafe impl Send for CapturedGraph {}
// SAFETY: shared references only read the handles (to launch or count). burn-zero launches a
// graph only on cubecl's device thread, one launch at a time, and drops it there.
unsafe impl Sync for CapturedGraph {}

impl CapturedGraph {
    /// The nodes of the captured graph (kernels, copies, memsets).
    pub fn nodes(&self) -> usize {
        self.nodes
    }
}

impl core::fmt::Debug for CapturedGraph {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("CapturedGraph")
            .field("nodes", &self.nodes)
            .finish()
    }
}

impl Drop for CapturedGraph {
    fn drop(&mut self) {
        // SAFETY: the graph's own stream, executable graph and graph, destroyed once.
        unsafe {
            let _ = cudarc::driver::result::stream::synchronize(self.stream);
            let _ = cudarc::driver::result::graph::exec_destroy(self.exec);
            let _ = cudarc::driver::result::graph::destroy(self.graph);
        }
        if let Some(constants) = self.constants.take() {
            constants.free();
        }
        self.alive
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

fn graph_nodes(graph: cudarc::driver::sys::CUgraph) -> usize {
    let mut count = 0usize;
    // SAFETY: a live graph; a null node array asks for the count only.
    let _ = unsafe {
        cudarc::driver::sys::cuGraphGetNodes(graph, core::ptr::null_mut(), &mut count)
    };
    count
}

fn capture_error(reason: String) -> ServerError {
    ServerError::Generic {
        reason,
        backtrace: BackTrace::capture(),
    }
}
