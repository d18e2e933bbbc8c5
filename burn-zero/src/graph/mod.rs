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

/// One captured step: the graph, the buffers its inputs are copied into, and what the closure
/// returned when it was captured.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Captured<B: Backend, T> {
    inputs: Vec<B::IntTensorPrimitive>,
    out: T,
    #[cfg(feature = "cuda")]
    graph: std::sync::Arc<cubecl::cuda::CapturedGraph>,
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

/// A step's graphs on one device, keyed by its inputs' shapes and a variant.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub struct StepGraphs<B: Backend, T> {
    device: B::Device,
    slot: u8,
    enabled: bool,
    policy: GraphPolicy,
    graphs: HashMap<GraphKey, Captured<B, T>>,
    timings: GraphTimings,
}

impl<B: Backend, T: Clone> StepGraphs<B, T> {
    /// Graphs of steps on `device`, on graph stream `slot` (each owner of graphs on a device
    /// takes its own), captured after `warmup` eager runs, at most `max_graphs` kept. With
    /// `enabled` false every step runs eagerly.
    pub fn new(
        device: B::Device,
        slot: u8,
        warmup: usize,
        max_graphs: usize,
        enabled: bool,
    ) -> Self {
        Self {
            device,
            slot,
            enabled,
            policy: GraphPolicy::new(warmup, max_graphs),
            graphs: HashMap::new(),
            timings: GraphTimings::default(),
        }
    }

    /// Runs `f` on `inputs` as the policy decides (eagerly, captured, or replayed) and returns
    /// its outputs and what was done. A capture that fails is an error, and its key runs eagerly
    /// from then on: the failed step's work did not run.
    pub fn run<const D: usize>(
        &mut self,
        variant: u64,
        inputs: Vec<Tensor<B, D, Int>>,
        f: impl FnOnce(Vec<Tensor<B, D, Int>>) -> T,
    ) -> Result<(T, GraphAction), String> {
        if !self.enabled || !self.supported(&inputs) {
            return Ok((f(inputs), GraphAction::Eager));
        }
        let key = GraphKey {
            shapes: inputs.iter().map(|t| t.dims().to_vec()).collect(),
            variant,
        };
        let action = self.policy.decide(&key);
        let out = match action {
            GraphAction::Eager => f(inputs),
            GraphAction::Warm => self.warm(inputs, f)?,
            GraphAction::Capture => match self.capture(&key, inputs, f) {
                Ok(out) => out,
                Err(e) => {
                    self.policy.refuse(&key);
                    return Err(e);
                }
            },
            GraphAction::Replay => self.replay(&key, inputs)?,
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
}

/// Copies each pair's first tensor into the second's memory, in order on the calling
/// thread's stream (float primitives of burn-cuda, as `ZeroTensor`, fusion's or cubecl's;
/// same shapes, rows pitched alike or not). An error for other backends.
pub(crate) fn copy_values(
    pairs: &[(&dyn core::any::Any, &dyn core::any::Any)],
) -> Result<(), String> {
    #[cfg(feature = "cuda")]
    {
        if cuda::copy_in_stream(pairs) {
            return Ok(());
        }
        let cubes = pairs
            .iter()
            .map(
                |(from, into)| match (cuda::cube_of(*from), cuda::cube_of(*into)) {
                    (Some(f), Some(i)) => Ok((f, i)),
                    _ => Err("not a CUDA tensor".to_string()),
                },
            )
            .collect::<Result<Vec<_>, String>>()?;
        let Some(device) = cubes.first().map(|(f, _)| f.device.clone()) else {
            return Ok(());
        };
        cuda::copy(&device, cubes)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = pairs;
        Err("CUDA graphs need the `cuda` feature".into())
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

    fn supported<const D: usize>(&self, inputs: &[Tensor<B, D, Int>]) -> bool {
        self.cuda_device().is_some()
            && inputs.iter().all(|t| {
                let p = t.clone().into_primitive();
                cuda::cube_of(&p as &dyn core::any::Any).is_some()
            })
    }

    fn cube(
        p: &B::IntTensorPrimitive,
    ) -> Result<burn_cubecl::tensor::CubeTensor<cubecl::cuda::CudaRuntime>, String> {
        cuda::cube_of(p as &dyn core::any::Any).ok_or_else(|| "not a CUDA tensor".to_string())
    }

    /// `f` eagerly on the graphs' stream, ordered after the caller's queued work and before
    /// its later work (cubecl orders a stream after another's writes only into memory that
    /// stream allocated; gradients are written in place).
    fn warm<const D: usize>(
        &mut self,
        inputs: Vec<Tensor<B, D, Int>>,
        f: impl FnOnce(Vec<Tensor<B, D, Int>>) -> T,
    ) -> Result<T, String> {
        let device = self.cuda_device().expect("checked by supported");
        let stream = self.stream();
        cuda::replay(&device, stream, None, Vec::new())?;
        let out = stream.executes(|| f(inputs));
        // Fusion's queue of the graphs' stream is drained by the fence's visit.
        stream.executes(|| cuda::replay(&device, stream, None, Vec::new()))?;
        cuda::replay(&device, stream, None, Vec::new())?;
        Ok(out)
    }

    fn capture<const D: usize>(
        &mut self,
        key: &GraphKey,
        inputs: Vec<Tensor<B, D, Int>>,
        f: impl FnOnce(Vec<Tensor<B, D, Int>>) -> T,
    ) -> Result<T, String> {
        let device = self.cuda_device().expect("checked by supported");
        let stream = self.stream();
        // The graph's own input buffers, in its stream's pool, filled with this step's inputs.
        let owned: Vec<Tensor<B, D, Int>> = stream.executes(|| {
            inputs
                .iter()
                .map(|t| Tensor::<B, D, Int>::empty(t.shape(), &self.device))
                .collect()
        });
        let copies = inputs
            .into_iter()
            .zip(&owned)
            .map(|(from, into)| {
                Ok((
                    Self::cube(&from.into_primitive())?,
                    stream.executes(|| Self::cube(&into.clone().into_primitive()))?,
                ))
            })
            .collect::<Result<Vec<_>, String>>()?;
        cuda::replay(&device, stream, None, copies)?;
        cuda::begin(&device, stream)?;
        let out = stream.executes(|| f(owned.clone()));
        let graph = cuda::end(&device, stream)?;
        // Capturing ran nothing: this step's work is the first replay.
        cuda::replay(&device, stream, Some(graph.clone()), Vec::new())?;
        let inputs = owned.into_iter().map(|t| t.into_primitive()).collect();
        for dropped in self.policy.captured(key) {
            self.graphs.remove(&dropped);
        }
        self.graphs.insert(
            key.clone(),
            Captured {
                inputs,
                out: out.clone(),
                graph,
            },
        );
        Ok(out)
    }

    fn replay<const D: usize>(
        &mut self,
        key: &GraphKey,
        inputs: Vec<Tensor<B, D, Int>>,
    ) -> Result<T, String> {
        let device = self.cuda_device().expect("checked by supported");
        let stream = self.stream();
        let start = std::time::Instant::now();
        let captured = self.graphs.get(key).ok_or("no graph for a replayed key")?;
        let copies = inputs
            .into_iter()
            .zip(&captured.inputs)
            .map(|(from, into)| {
                Ok((
                    Self::cube(&from.into_primitive())?,
                    stream.executes(|| Self::cube(into))?,
                ))
            })
            .collect::<Result<Vec<_>, String>>()?;
        let prepared = std::time::Instant::now();
        let graph_launch = cuda::replay(&device, stream, Some(captured.graph.clone()), copies)?;
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

    fn warm<const D: usize>(
        &mut self,
        inputs: Vec<Tensor<B, D, Int>>,
        f: impl FnOnce(Vec<Tensor<B, D, Int>>) -> T,
    ) -> Result<T, String> {
        Ok(f(inputs))
    }

    fn capture<const D: usize>(
        &mut self,
        _key: &GraphKey,
        _inputs: Vec<Tensor<B, D, Int>>,
        _f: impl FnOnce(Vec<Tensor<B, D, Int>>) -> T,
    ) -> Result<T, String> {
        Err("CUDA graphs need the `cuda` feature".into())
    }

    fn replay<const D: usize>(
        &mut self,
        _key: &GraphKey,
        _inputs: Vec<Tensor<B, D, Int>>,
    ) -> Result<T, String> {
        Err("CUDA graphs need the `cuda` feature".into())
    }
}
