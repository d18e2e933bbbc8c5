//! Steps captured as CUDA graphs and replayed (issue 37). A small model's step is paced by the
//! host: burn's autodiff and fusion and cubecl's launch thread issue each of its thousand-odd
//! kernels more slowly than the GPU runs them. Captured once, the step's kernels replay with one
//! launch.
//!
//! How a step is run ([`StepGraphs::run`], decided by [`GraphPolicy`] from the inputs' shapes):
//! - a few eager runs on the graphs' stream, so its memory pool holds the step's pages and the
//!   libraries it calls have met it;
//! - a capture: the inputs are copied into buffers the graph owns, the closure runs with those
//!   while cubecl's stream is captured, and the graph is replayed once (capturing runs nothing);
//! - replays: the new inputs are copied into the graph's buffers and the graph is launched. The
//!   closure does not run, so whatever it returned at the capture is returned again, its device
//!   values those of the replay.
//!
//! Where the work runs: on a cubecl stream of its own (stream id `127 − slot`; cubecl maps ids
//! to its 128 streams modulo 128, and threads take ids counting up from 0), so the graph's scratch
//! memory lies in that stream's pool, which nothing else allocates from: a tensor made between
//! replays cannot land where a replay writes. Each replay waits for the caller's stream's queued
//! work, and the caller's later work waits for it (CUDA events, no host wait).
//!
//! What a captured closure must not do: read a value back to the host (that waits on the
//! device, which a capture cannot), draw random numbers (their seeds are frozen into the
//! graph), or depend on host values that change from step to step; and tensors it reads that
//! were made outside it (parameters) must keep their memory for as long as the graph lives.

mod policy;

#[cfg(feature = "cuda")]
mod cuda;

use std::collections::HashMap;
use std::time::Duration;

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

pub use policy::{GraphAction, GraphKey, GraphPolicy};

/// Why a step did not run.
#[derive(Debug)]
pub enum StepError<E> {
    /// The step's own work failed (returned by the closure).
    Step(E),
    /// The graph machinery failed in the phase named.
    Graph(GraphError),
}

/// A failure of the graphs themselves, by phase.
#[derive(Debug, thiserror::Error)]
pub enum GraphError {
    /// Ordering the graphs' stream around an eager warm-up run failed.
    #[error("the warm-up run on the graphs' stream: {0}")]
    Warm(String),
    /// The capture failed: its key runs eagerly from now on; the step's work did not run.
    #[error("capturing the step as a CUDA graph: {0}")]
    Capture(String),
    /// A replay could not be launched: the step's work did not run.
    #[error("replaying the step's CUDA graph: {0}")]
    Replay(String),
}

/// One captured step: the graph, the buffers its inputs are copied into, and what the closure
/// returned when it was captured.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Captured<B: Backend, T> {
    #[cfg(feature = "cuda")]
    graph: cuda::Graph,
    inputs: Vec<B::IntTensorPrimitive>,
    out: T,
}

/// Host time of replays since the owner last took it ([`StepGraphs::take_timings`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GraphTimings {
    /// Replays.
    pub replays: usize,
    /// Resolving the inputs' memory (burn's fusion hands over their buffers).
    pub prepare: Duration,
    /// Ordering, copying the inputs and launching, through cubecl's device thread.
    pub launch: Duration,
    /// Of `launch`, inside `cuGraphLaunch`.
    pub graph_launch: Duration,
    /// Copying new parameter values into the memory the graphs read (the engine's).
    pub pin: Duration,
}

/// A step's graphs on one device, keyed by [`GraphKey`].
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub struct StepGraphs<B: Backend, T> {
    device: B::Device,
    slot: u8,
    policy: GraphPolicy,
    graphs: HashMap<GraphKey, Captured<B, T>>,
    timings: GraphTimings,
}

impl<B: Backend, T: Clone> StepGraphs<B, T> {
    /// Graphs of steps on `device`, on graph stream `slot` (each owner of graphs on a device
    /// takes its own), captured after `warmup` eager runs, at most `max_graphs` kept.
    pub fn new(device: B::Device, slot: u8, warmup: usize, max_graphs: usize) -> Self {
        Self {
            device,
            slot,
            policy: GraphPolicy::new(warmup, max_graphs),
            graphs: HashMap::new(),
            timings: GraphTimings::default(),
        }
    }

    /// The key of a step of `f` on `inputs`: their shapes, `variant` (whatever else its
    /// kernels depend on, in the caller's terms) and `F`'s type, so that another closure with
    /// inputs of the same shapes is not given this one's graph. (A closure's captured values
    /// are frozen into the graph: what changes from step to step must come in `inputs`.)
    pub fn key<const D: usize, F>(variant: &[u64], inputs: &[Tensor<B, D, Int>]) -> GraphKey {
        GraphKey {
            shapes: inputs.iter().map(|t| t.dims().to_vec()).collect(),
            variant: variant.to_vec(),
            closure: std::any::type_name::<F>(),
        }
    }

    /// Whether a step of `key` would be replayed now.
    pub fn would_replay(&self, key: &GraphKey) -> bool {
        self.policy.peek(key) == GraphAction::Replay
    }

    /// Drops `key`'s graph: its next step warms up and is captured anew.
    pub fn forget(&mut self, key: &GraphKey) {
        self.graphs.remove(key);
        self.policy.forget(key);
    }

    /// Runs `f` on `inputs` under `key` as the policy decides (eagerly on the graphs' stream,
    /// captured, or replayed) and returns its outputs and what was done. Inputs of a backend
    /// other than burn-cuda run eagerly on the caller's stream.
    pub fn run<const D: usize, E>(
        &mut self,
        key: GraphKey,
        inputs: Vec<Tensor<B, D, Int>>,
        f: impl FnOnce(Vec<Tensor<B, D, Int>>) -> Result<T, E>,
    ) -> Result<(T, GraphAction), StepError<E>> {
        if !self.supported(&inputs) {
            return f(inputs)
                .map(|t| (t, GraphAction::Eager))
                .map_err(StepError::Step);
        }
        let action = self.policy.decide(&key);
        let out = match action {
            GraphAction::Eager => f(inputs).map_err(StepError::Step)?,
            GraphAction::Warm => self.warm(inputs, f)?,
            GraphAction::Capture => {
                let captured = self.capture(&key, inputs, f);
                if captured.is_err() {
                    self.policy.refuse(&key);
                }
                captured?
            }
            GraphAction::Replay => self.replay(&key, inputs).map_err(StepError::Graph)?,
        };
        Ok((out, action))
    }

    /// Drops every graph: each key is captured anew after its warm-up (call it when the
    /// memory of something the step reads, such as the parameters, changed).
    pub fn reset(&mut self) {
        self.graphs.clear();
        self.policy.reset();
    }

    /// The replays' host time since the last call.
    pub fn take_timings(&mut self) -> GraphTimings {
        core::mem::take(&mut self.timings)
    }

    /// Adds `time` to the parameter copies' host time.
    pub fn add_pin_time(&mut self, time: Duration) {
        self.timings.pin += time;
    }

    /// Graphs held now.
    pub fn len(&self) -> usize {
        self.graphs.len()
    }

    /// Whether no graph is held.
    pub fn is_empty(&self) -> bool {
        self.graphs.is_empty()
    }

    /// The captured step's output of `key`, if it has a graph.
    pub fn captured_out(&self, key: &GraphKey) -> Option<&T> {
        self.graphs.get(key).map(|c| &c.out)
    }
}

/// Copies each pair's first tensor into the second's memory, in order on the calling
/// thread's stream (float primitives of burn-cuda, as `ZeroTensor`, fusion's or cubecl's;
/// same shapes, rows pitched alike or not). An error for other backends.
pub(crate) fn copy_values(
    pairs: &[(&dyn core::any::Any, &dyn core::any::Any)],
) -> Result<(), String> {
    #[cfg(feature = "cuda")]
    {
        cuda::copy_values(pairs)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = pairs;
        Err("CUDA graphs need the `cuda` feature".into())
    }
}

/// Zeroes each tensor's memory in place, in order on the calling thread's stream (burn-cuda's
/// fusion tensors, or the same inside `ZeroTensor`); `false`, doing nothing, for others.
pub(crate) fn zero_values(tensors: &[&dyn core::any::Any]) -> bool {
    #[cfg(feature = "cuda")]
    {
        cuda::zero_in_stream(tensors)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = tensors;
        false
    }
}

/// Whether the tensors of `a` and `b` are the same tensors, pairwise (burn-cuda's fusion
/// tensors: the same tensor ids). `false` for other backends.
pub(crate) fn same_tensors(a: &[&dyn core::any::Any], b: &[&dyn core::any::Any]) -> bool {
    #[cfg(feature = "cuda")]
    {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|(x, y)| cuda::same_tensor(*x, *y) == Some(true))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (a, b);
        false
    }
}

#[cfg(feature = "cuda")]
impl<B: Backend, T: Clone> StepGraphs<B, T> {
    fn stream(&self) -> cubecl::stream_id::StreamId {
        cubecl::stream_id::StreamId {
            value: 127 - u64::from(self.slot.min(63)),
        }
    }

    fn cuda_device(&self) -> Option<cubecl::cuda::CudaDevice> {
        (&self.device as &dyn core::any::Any)
            .downcast_ref::<cubecl::cuda::CudaDevice>()
            .cloned()
    }

    /// Whether the inputs are burn-cuda tensors (checked by type, without resolving them).
    fn supported<const D: usize>(&self, inputs: &[Tensor<B, D, Int>]) -> bool {
        self.cuda_device().is_some()
            && inputs.iter().all(|t| {
                let p = t.clone().into_primitive();
                cuda::is_cuda(&p as &dyn core::any::Any)
            })
    }

    /// Each `(from, into)` as cubecl tensors: `from` the caller's, `into` the graph's.
    fn copies<'a, const D: usize>(
        &self,
        from: Vec<Tensor<B, D, Int>>,
        into: impl IntoIterator<Item = &'a B::IntTensorPrimitive>,
    ) -> Result<Vec<cuda::CopyPair>, String> {
        let stream = self.stream();
        from.into_iter()
            .zip(into)
            .enumerate()
            .map(|(i, (from, into))| {
                let cube = |p: &dyn core::any::Any| {
                    crate::backend::cuda::cube_tensor_of(p)
                        .ok_or_else(|| format!("input {i} is not a CUDA tensor"))
                };
                let from = cube(&from.into_primitive() as &dyn core::any::Any)?;
                let into = stream.executes(|| cube(into as &dyn core::any::Any))?;
                Ok((from, into))
            })
            .collect()
    }

    /// `f` eagerly on the graphs' stream, ordered after the caller's queued work and before
    /// its later work (cubecl orders a stream after another's writes only into memory that
    /// stream allocated; gradients are written in place).
    fn warm<const D: usize, E>(
        &mut self,
        inputs: Vec<Tensor<B, D, Int>>,
        f: impl FnOnce(Vec<Tensor<B, D, Int>>) -> Result<T, E>,
    ) -> Result<T, StepError<E>> {
        let device = self.cuda_device().expect("checked by supported");
        let stream = self.stream();
        let warm = |e| StepError::Graph(GraphError::Warm(e));
        cuda::order_after_caller(&device, stream).map_err(warm)?;
        let out = stream.executes(|| f(inputs)).map_err(StepError::Step);
        cuda::order_caller_after(&device, stream).map_err(warm)?;
        out
    }

    fn capture<const D: usize, E>(
        &mut self,
        key: &GraphKey,
        inputs: Vec<Tensor<B, D, Int>>,
        f: impl FnOnce(Vec<Tensor<B, D, Int>>) -> Result<T, E>,
    ) -> Result<T, StepError<E>> {
        let device = self.cuda_device().expect("checked by supported");
        let stream = self.stream();
        let failed = |e| StepError::Graph(GraphError::Capture(e));
        // The graph's own input buffers, in its stream's pool, filled with this step's inputs.
        let owned: Vec<Tensor<B, D, Int>> = stream.executes(|| {
            inputs
                .iter()
                .map(|t| Tensor::<B, D, Int>::empty(t.shape(), &self.device))
                .collect()
        });
        let primitives: Vec<_> = owned.iter().map(|t| t.clone().into_primitive()).collect();
        let copies = self.copies(inputs, &primitives).map_err(failed)?;
        cuda::copy_inputs(&device, stream, copies).map_err(failed)?;
        // Ends the capture (dropping the graph) unless disarmed: on the closure's error or a
        // panic inside it the stream must not stay captured.
        let capture = cuda::Capture::begin(&device, stream).map_err(failed)?;
        let out = stream.executes(|| f(owned));
        let out = match out {
            Ok(out) => out,
            Err(e) => {
                drop(capture);
                return Err(StepError::Step(e));
            }
        };
        let graph = capture.end().map_err(failed)?;
        // Capturing ran nothing: this step's work is the first replay.
        graph.launch(Vec::new()).map_err(failed)?;
        for dropped in self.policy.captured(key) {
            self.graphs.remove(&dropped);
        }
        self.graphs.insert(
            key.clone(),
            Captured {
                graph,
                inputs: primitives,
                out: out.clone(),
            },
        );
        Ok(out)
    }

    fn replay<const D: usize>(
        &mut self,
        key: &GraphKey,
        inputs: Vec<Tensor<B, D, Int>>,
    ) -> Result<T, GraphError> {
        let start = std::time::Instant::now();
        let captured = self
            .graphs
            .get(key)
            .ok_or_else(|| GraphError::Replay(format!("no graph for {key:?}")))?;
        let copies = self
            .copies(inputs, &captured.inputs)
            .map_err(GraphError::Replay)?;
        let prepared = std::time::Instant::now();
        let graph_launch = captured.graph.launch(copies).map_err(GraphError::Replay)?;
        let out = captured.out.clone();
        let t = &mut self.timings;
        t.replays += 1;
        t.prepare += prepared - start;
        t.launch += prepared.elapsed();
        t.graph_launch += graph_launch;
        Ok(out)
    }
}

#[cfg(not(feature = "cuda"))]
impl<B: Backend, T: Clone> StepGraphs<B, T> {
    fn supported<const D: usize>(&self, _inputs: &[Tensor<B, D, Int>]) -> bool {
        false
    }

    fn warm<const D: usize, E>(
        &mut self,
        inputs: Vec<Tensor<B, D, Int>>,
        f: impl FnOnce(Vec<Tensor<B, D, Int>>) -> Result<T, E>,
    ) -> Result<T, StepError<E>> {
        f(inputs).map_err(StepError::Step)
    }

    fn capture<const D: usize, E>(
        &mut self,
        _key: &GraphKey,
        _inputs: Vec<Tensor<B, D, Int>>,
        _f: impl FnOnce(Vec<Tensor<B, D, Int>>) -> Result<T, E>,
    ) -> Result<T, StepError<E>> {
        Err(StepError::Graph(GraphError::Capture(
            "CUDA graphs need the `cuda` feature".into(),
        )))
    }

    fn replay<const D: usize>(
        &mut self,
        _key: &GraphKey,
        _inputs: Vec<Tensor<B, D, Int>>,
    ) -> Result<T, GraphError> {
        Err(GraphError::Replay(
            "CUDA graphs need the `cuda` feature".into(),
        ))
    }
}
