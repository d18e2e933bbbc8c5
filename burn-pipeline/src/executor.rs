//! The executor: runs one rank's instruction stream (see [`crate::schedule`]) on its burn
//! modules (one per model chunk; more than one for interleaved schedules). Activations and
//! their gradients travel between neighbouring virtual stages as [`TensorLinks`] carries them:
//! in device memory over the communicator's one-way links where it has them (NCCL), without a
//! host wait; as f32 over its `send`/`recv` otherwise. The loss stays on the device until the
//! step's end. Each backward seeds the chunk's output with the gradient received from the
//! next stage (`sum(output · grad)` has exactly that gradient), and parameter gradients
//! accumulate over the micro-batches until the optimizer step. A split backward
//! (zero-bubble schedules) runs its weight half from what [`WeightSplit`] recorded.

use std::collections::HashMap;

use burn::module::{AutodiffModule, ModuleMapper, Param, ParamId};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, ElementConversion, Tensor};
use burn_zero::comm::{CommError, Communicator};
use burn_zero::p2p::TensorLinks;

use crate::checkpoint::{Checkpointing, Saved};
use crate::optimizer::StageOptimizer;
use crate::schedule::Instr;
use crate::weight_split::{WeightSplit, WeightWork};

/// What one stage computes, and what the pipeline feeds it.
pub trait PipeStage<B: AutodiffBackend>: AutodiffModule<B> {
    /// This stage's layers on a `[rows, features]` activation.
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2>;

    /// [`PipeStage::forward`] with the linear layers whose weight gradients a zero-bubble
    /// schedule defers routed through `split` ([`WeightSplit::linear`]). The default routes
    /// none: the stage still runs under such a schedule, its whole backward in the input half.
    fn forward_split(&self, x: Tensor<B, 2>, split: &mut WeightSplit<B>) -> Tensor<B, 2> {
        let _ = split;
        self.forward(x)
    }

    /// The matrix this stage shares with the other end of the pipeline (a tied embedding: the
    /// first stage's input table, the last stage's output projection), if any. The executor
    /// sums its gradient across the first and last stages before the optimizer step, so both
    /// copies take the same steps.
    fn tied(&self) -> Option<ParamId> {
        None
    }
}

/// Sums the gradient of the tied matrix `id` in `grads` with the other end's (the first and
/// the last virtual stage exchange theirs, on ranks 0 and `ranks − 1`; the first sends first).
fn sum_tied<B: AutodiffBackend>(
    mut grads: GradientsParams,
    id: ParamId,
    spec: &StageSpec<'_, B>,
    ranks: usize,
    links: &mut TensorLinks<'_>,
    device: &B::Device,
) -> Result<GradientsParams, CommError> {
    let last = spec.stages - 1;
    let peer = match spec.stage {
        0 => last % ranks,
        s if s == last => 0,
        s => panic!(
            "stage {s} of {} holds a tied matrix: only the first and last may",
            spec.stages
        ),
    };
    let grad = grads
        .remove::<B::InnerBackend, 2>(id)
        .unwrap_or_else(|| panic!("stage {}: no gradient for its tied matrix", spec.stage));
    let (dims, dtype) = (grad.dims(), grad.dtype());
    let theirs = if spec.stage == 0 {
        links.send(grad.clone(), peer)?;
        links.recv::<B::InnerBackend, 2>(dims, dtype, device, peer)?
    } else {
        let theirs = links.recv::<B::InnerBackend, 2>(dims, dtype, device, peer)?;
        links.send(grad.clone(), peer)?;
        theirs
    };
    // The same order of addition on both ends: first stage's + last stage's.
    let summed = if spec.stage == 0 {
        grad + theirs
    } else {
        theirs + grad
    };
    grads.register(id, summed);
    Ok(grads)
}

/// The time each kind of computation took on this rank, summed with a count (one per
/// forward, backward or backward half of a chunk): [`run_chunks_clocked`] fills it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ComputeClock {
    /// Seconds and count per kind: forward, backward, backward input half, weight half.
    sums: [(f64, usize); 4],
}

impl ComputeClock {
    fn slot(instr: Instr) -> Option<usize> {
        match instr {
            Instr::Forward { .. } => Some(0),
            Instr::Backward { .. } => Some(1),
            Instr::BackwardInput { .. } => Some(2),
            Instr::BackwardWeight { .. } => Some(3),
            _ => None,
        }
    }

    /// Adds one computation's `seconds`.
    pub fn record(&mut self, instr: Instr, seconds: f64) {
        if let Some(i) = Self::slot(instr) {
            self.sums[i].0 += seconds;
            self.sums[i].1 += 1;
        }
    }

    /// Mean seconds per computation of each kind, in [`crate::schedule::StageCosts`]' order
    /// (0 for a kind never run).
    pub fn means(&self) -> [f64; 4] {
        self.sums
            .map(|(total, n)| if n == 0 { 0.0 } else { total / n as f64 })
    }
}

/// Where a stage sits and what its data looks like.
pub struct StageSpec<'a, B: AutodiffBackend> {
    /// This (virtual) stage: `chunk × ranks + rank`.
    pub stage: usize,
    /// (Virtual) stages in the pipeline: ranks × chunks per rank.
    pub stages: usize,
    /// Micro-batches per step (the loss is averaged over them).
    pub micro_batches: usize,
    /// Rows of a micro-batch.
    pub rows: usize,
    /// Features this stage receives (its input width).
    pub in_features: usize,
    /// First stage: micro-batch `mb`'s inputs.
    pub inputs: &'a dyn Fn(usize) -> Tensor<B, 2>,
    /// Last stage: micro-batch `mb`'s loss from its output.
    pub loss: &'a dyn Fn(usize, Tensor<B, 2>) -> Tensor<B, 1>,
    /// Activation checkpointing (`None`: every micro-batch keeps its graph until backward).
    pub checkpoint: Option<&'a Checkpointing>,
}

/// `module` with every float parameter a new autodiff leaf over the same values and id.
/// burn merges the graphs of tensors that share a node, and a backward consumes the whole
/// merged graph: micro-batches alive at once must not share parameter nodes, or the first
/// backward would take the others' graphs with it.
fn fresh_leaves<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M) -> M {
    struct Fresh;
    impl<B: AutodiffBackend> ModuleMapper<B> for Fresh {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            let leaf = tensor
                .clone()
                .detach()
                .set_require_grad(tensor.is_require_grad());
            Param::from_mapped_value(id, leaf, mapper)
        }
    }
    module.clone().map(&mut Fresh)
}

/// A micro-batch of one chunk between its forward and its backward.
struct Live<B: AutodiffBackend, M> {
    /// The chunk's parameters as this micro-batch's own leaves.
    module: Option<M>,
    input: Tensor<B, 2>,
    /// The checkpointed input, while the forward's graph is gone (`input` is then detached).
    saved: Option<Saved<B>>,
    output: Tensor<B, 2>,
    loss: Option<Tensor<B, 1>>,
    grad_out: Option<Tensor<B, 2>>,
    grad_in: Option<Tensor<B, 2>>,
    /// The split layers of its forward (a zero-bubble schedule).
    split: Option<WeightSplit<B>>,
}

/// The dtype activations and their gradients travel in: the backend's default float type,
/// which both ends of a link know without a message.
fn wire_dtype<B: Backend>() -> DType {
    <B::FloatElem as burn::tensor::Element>::dtype()
}

/// The last stage's loss of micro-batch `mb` (its share of the step's mean); `None` elsewhere.
fn stage_loss<B: AutodiffBackend>(
    spec: &StageSpec<'_, B>,
    mb: usize,
    output: &Tensor<B, 2>,
) -> Option<Tensor<B, 1>> {
    (spec.stage + 1 == spec.stages).then(|| {
        let loss = (spec.loss)(mb, output.clone());
        loss.div_scalar(spec.micro_batches as f32)
    })
}

/// The chunk's forward on fresh leaves, through a [`WeightSplit`] when the backward is split.
fn forward_on<B: AutodiffBackend, M: PipeStage<B>>(
    module: &M,
    input: Tensor<B, 2>,
    split: bool,
) -> (M, Tensor<B, 2>, Option<WeightSplit<B>>) {
    let leaves = fresh_leaves(module);
    if split {
        let mut record = WeightSplit::new();
        let output = leaves.forward_split(input, &mut record);
        (leaves, output, Some(record))
    } else {
        let output = leaves.forward(input);
        (leaves, output, None)
    }
}

/// Runs `stream` for one optimizer step of `module` with `optimizer` at learning rate `lr`,
/// exchanging activations over `comm` (neighbouring stages at ranks `stage ± 1`) and, at
/// `ReduceGrads` and `OptimizerStep`, reducing gradients over `data` when given as the
/// optimizer does it ([`crate::Replicated`]: averaged; [`crate::Zero1`]: reduce-scattered);
/// returns the new module and, on the last stage, the step's loss (mean over micro-batches).
pub fn run_step<B, M, O>(
    module: M,
    optimizer: &mut O,
    lr: f64,
    stream: &[Instr],
    spec: &StageSpec<'_, B>,
    comm: &dyn Communicator,
    data: Option<&dyn Communicator>,
) -> Result<(M, Option<f32>), CommError>
where
    B: AutodiffBackend,
    M: PipeStage<B>,
    O: StageOptimizer<B, M>,
{
    let (mut modules, loss) = run_chunks(
        vec![module],
        std::slice::from_mut(optimizer),
        lr,
        stream,
        std::slice::from_ref(spec),
        comm,
        data,
    )?;
    Ok((modules.remove(0), loss))
}

/// [`run_step`] for a rank holding several model chunks (an interleaved schedule): chunk `c`
/// is `chunks[c]`, stepped by `optimizers[c]`, described by `specs[c]` (virtual stage
/// `c × ranks + rank`). Neighbouring virtual stages are at pipe ranks `(stage ± 1) mod ranks`.
///
/// # Panics
/// If the three slices differ in length or the specs' stages are not one rank's chunks.
pub fn run_chunks<B, M, O>(
    chunks: Vec<M>,
    optimizers: &mut [O],
    lr: f64,
    stream: &[Instr],
    specs: &[StageSpec<'_, B>],
    comm: &dyn Communicator,
    data: Option<&dyn Communicator>,
) -> Result<(Vec<M>, Option<f32>), CommError>
where
    B: AutodiffBackend,
    M: PipeStage<B>,
    O: StageOptimizer<B, M>,
{
    run_chunks_clocked(chunks, optimizers, lr, stream, specs, comm, data, None)
}

/// [`run_chunks`], and with `clock` each computation timed alone: the device is synchronized
/// before and after it (a step run this way is slower; its times are the costs a schedule's
/// bubble is simulated with, [`crate::schedule::Schedule::bubble_with`]).
#[allow(clippy::too_many_arguments)]
pub fn run_chunks_clocked<B, M, O>(
    chunks: Vec<M>,
    optimizers: &mut [O],
    lr: f64,
    stream: &[Instr],
    specs: &[StageSpec<'_, B>],
    comm: &dyn Communicator,
    data: Option<&dyn Communicator>,
    mut clock: Option<&mut ComputeClock>,
) -> Result<(Vec<M>, Option<f32>), CommError>
where
    B: AutodiffBackend,
    M: PipeStage<B>,
    O: StageOptimizer<B, M>,
{
    let v = chunks.len();
    assert!(
        v > 0 && optimizers.len() == v && specs.len() == v,
        "{v} chunks, {} optimizers and {} specs: one of each per chunk",
        optimizers.len(),
        specs.len()
    );
    let ranks = specs[0].stages / v;
    let rank = specs[0].stage;
    for (c, spec) in specs.iter().enumerate() {
        assert!(
            spec.stages == ranks * v && spec.stage == c * ranks + rank,
            "chunk {c} of rank {rank} is virtual stage {} of {}, not {} of {}",
            spec.stage,
            spec.stages,
            c * ranks + rank,
            ranks * v
        );
    }
    let device = chunks[0].devices().into_iter().next().unwrap_or_default();
    // The rank at the other end of a message instruction.
    let peer = |i: &Instr| {
        i.peer(rank, ranks, v)
            .expect("the schedule's messages have peers")
            .0
    };
    // Whether the schedule splits backwards: then forwards record their split layers.
    let split = stream
        .iter()
        .any(|i| matches!(i, Instr::BackwardWeight { .. }));
    let mut live: HashMap<(usize, usize), Live<B, M>> = HashMap::new();
    let mut weight_work: HashMap<(usize, usize), WeightWork<B>> = HashMap::new();
    let mut accumulated: Vec<GradientsAccumulator<M>> =
        (0..v).map(|_| GradientsAccumulator::new()).collect();
    let mut reduced: Vec<Option<GradientsParams>> = (0..v).map(|_| None).collect();
    // The step's loss, summed on the device and read once at the step's end.
    let mut loss_sum: Option<Tensor<B, 1>> = None;
    let mut links = TensorLinks::new(comm);
    let wire = wire_dtype::<B>();
    let sync = |device: &B::Device| {
        B::sync(device).map_err(|e| CommError::Aborted(format!("timing a computation: {e:?}")))
    };
    for instr in stream {
        let timed = clock.is_some() && instr.is_compute();
        if timed {
            sync(&device)?;
        }
        let start = std::time::Instant::now();
        match *instr {
            // Inputs are produced at the forward (first stage), labels inside the loss.
            Instr::Load { .. } => {}
            Instr::RecvActivation { mb, chunk } => {
                let spec = &specs[chunk];
                let dims = [spec.rows, spec.in_features];
                let x = links.recv::<B::InnerBackend, 2>(dims, wire, &device, peer(instr))?;
                let x = Tensor::<B, 2>::from_inner(x).require_grad();
                live.insert(
                    (mb, chunk),
                    Live {
                        module: None,
                        input: x.clone(),
                        saved: None,
                        output: x,
                        loss: None,
                        grad_out: None,
                        grad_in: None,
                        split: None,
                    },
                );
            }
            Instr::Forward { mb, chunk } => {
                let spec = &specs[chunk];
                let input = match live.remove(&(mb, chunk)) {
                    Some(l) => l.input,
                    None => (spec.inputs)(mb),
                };
                let (leaves, output, record) = forward_on(&chunks[chunk], input.clone(), split);
                let l = match spec.checkpoint {
                    // Only the input is kept; the graph of the activations goes with `leaves`.
                    Some(ckpt) => Live {
                        module: None,
                        saved: Some(ckpt.save(input.clone())),
                        input: input.detach(),
                        output: output.detach(),
                        loss: None,
                        grad_out: None,
                        grad_in: None,
                        split: None,
                    },
                    None => {
                        let loss = stage_loss(spec, mb, &output);
                        Live {
                            module: Some(leaves),
                            input,
                            saved: None,
                            output,
                            loss,
                            grad_out: None,
                            grad_in: None,
                            split: record,
                        }
                    }
                };
                live.insert((mb, chunk), l);
            }
            Instr::SendActivation { mb, chunk } => {
                let out = live[&(mb, chunk)].output.clone().inner().cast(wire);
                links.send(out, peer(instr))?;
            }
            Instr::RecvGrad { mb, chunk } => {
                let l = live.get_mut(&(mb, chunk)).expect("forwarded before");
                let dims = l.output.dims();
                let g = links.recv::<B::InnerBackend, 2>(dims, wire, &device, peer(instr))?;
                l.grad_out = Some(Tensor::from_inner(g.cast(l.output.dtype())));
            }
            Instr::Backward { mb, chunk } | Instr::BackwardInput { mb, chunk } => {
                let spec = &specs[chunk];
                let l = live.get_mut(&(mb, chunk)).expect("forwarded before");
                if let (Some(saved), Some(ckpt)) = (l.saved.take(), spec.checkpoint) {
                    // The forward again, from the checkpoint, with its graph this time.
                    let input = ckpt.restore(saved, &device)?;
                    let input = if spec.stage > 0 {
                        input.require_grad()
                    } else {
                        input
                    };
                    let (leaves, output, record) = forward_on(&chunks[chunk], input.clone(), split);
                    l.output = output;
                    l.loss = stage_loss(spec, mb, &l.output);
                    l.input = input;
                    l.module = Some(leaves);
                    l.split = record;
                }
                let seed = match (&l.loss, &l.grad_out) {
                    (Some(loss), _) => {
                        let value = loss.clone().detach();
                        loss_sum = Some(match loss_sum.take() {
                            Some(sum) => sum + value,
                            None => value,
                        });
                        loss.clone()
                    }
                    (None, Some(g)) => (l.output.clone() * g.clone()).sum(),
                    (None, None) => {
                        panic!("micro-batch {mb}: backward without a loss or a gradient")
                    }
                };
                let grads = seed.backward();
                if spec.stage > 0 {
                    let g = l.input.grad(&grads).unwrap_or_else(|| {
                        panic!(
                            "stage {} micro-batch {mb}: no gradient for the received activation \
                             (require_grad {})",
                            spec.stage,
                            l.input.is_require_grad()
                        )
                    });
                    l.grad_in = Some(Tensor::from_inner(g));
                }
                let work = l.split.take().map(|record| record.into_work(&grads));
                let leaves = l.module.take().expect("forwarded before");
                let module = &chunks[chunk];
                let tied = module.tied();
                let grads = GradientsParams::from_grads(grads, &leaves);
                let opt = &mut optimizers[chunk];
                opt.accumulate(module, grads, tied, &mut accumulated[chunk], data)?;
                if let Some(work) = work {
                    if matches!(instr, Instr::Backward { .. }) {
                        opt.accumulate(module, work.run(), tied, &mut accumulated[chunk], data)?;
                    } else {
                        weight_work.insert((mb, chunk), work);
                    }
                }
                if spec.stage == 0 {
                    live.remove(&(mb, chunk));
                }
            }
            Instr::BackwardWeight { mb, chunk } => {
                if let Some(work) = weight_work.remove(&(mb, chunk)) {
                    let module = &chunks[chunk];
                    optimizers[chunk].accumulate(
                        module,
                        work.run(),
                        module.tied(),
                        &mut accumulated[chunk],
                        data,
                    )?;
                }
            }
            Instr::SendGrad { mb, chunk } => {
                let l = live.remove(&(mb, chunk)).expect("backwarded before");
                let g = l.grad_in.expect("backward computed it");
                links.send(g.inner().cast(wire), peer(instr))?;
            }
            Instr::ReduceGrads => {
                for c in 0..v {
                    let mut grads = accumulated[c].grads();
                    if let Some(id) = chunks[c].tied().filter(|_| specs[c].stages > 1) {
                        grads = sum_tied(grads, id, &specs[c], ranks, &mut links, &device)?;
                    }
                    reduced[c] = Some(optimizers[c].reduce(&chunks[c], grads, data)?);
                }
            }
            Instr::OptimizerStep => {
                let mut stepped = Vec::with_capacity(v);
                for (c, module) in chunks.into_iter().enumerate() {
                    let grads = match reduced[c].take() {
                        Some(grads) => grads,
                        None => optimizers[c].reduce(&module, accumulated[c].grads(), data)?,
                    };
                    stepped.push(optimizers[c].step(lr, module, grads, data)?);
                }
                links.finish()?;
                let last = specs[v - 1].stage + 1 == specs[v - 1].stages;
                let loss =
                    last.then(|| loss_sum.map_or(0.0, |sum| sum.into_scalar().elem::<f32>()));
                return Ok((stepped, loss));
            }
        }
        if let Some(clock) = clock.as_deref_mut().filter(|_| timed) {
            sync(&device)?;
            clock.record(*instr, start.elapsed().as_secs_f64());
        }
    }
    links.finish()?;
    Ok((chunks, None))
}
