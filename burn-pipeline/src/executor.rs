//! The executor: runs one stage's instruction stream (see [`crate::schedule`]) on a burn
//! module. Activations and their gradients travel as f32 between neighbouring stages over the
//! communicator's `send`/`recv`; each backward seeds the stage's output with the gradient
//! received from the next stage (`sum(output · grad)` has exactly that gradient), and
//! parameter gradients accumulate over the micro-batches until the optimizer step.

use std::collections::HashMap;

use burn::module::{AutodiffModule, ModuleMapper, Param, ParamId};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Tensor, TensorData};
use burn_zero::comm::{CommError, Communicator};

use crate::checkpoint::{Checkpointing, Saved};
use crate::optimizer::StageOptimizer;
use crate::schedule::Instr;

/// What one stage computes, and what the pipeline feeds it.
pub trait PipeStage<B: AutodiffBackend>: AutodiffModule<B> {
    /// This stage's layers on a `[rows, features]` activation.
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2>;

    /// The matrix this stage shares with the other end of the pipeline (a tied embedding: the
    /// first stage's input table, the last stage's output projection), if any. The executor
    /// sums its gradient across the first and last stages before the optimizer step, so both
    /// copies take the same steps.
    fn tied(&self) -> Option<ParamId> {
        None
    }
}

/// Sums the gradient of the tied matrix `id` in `grads` with the other end's (the first and
/// the last stage exchange theirs; the first sends first).
fn sum_tied<B: AutodiffBackend>(
    mut grads: GradientsParams,
    id: ParamId,
    spec: &StageSpec<'_, B>,
    comm: &dyn Communicator,
    device: &B::Device,
) -> Result<GradientsParams, CommError> {
    let last = spec.stages - 1;
    let peer = match spec.stage {
        0 => last,
        s if s == last => 0,
        s => panic!(
            "stage {s} of {} holds a tied matrix: only the first and last may",
            spec.stages
        ),
    };
    let grad = grads
        .remove::<B::InnerBackend, 2>(id)
        .unwrap_or_else(|| panic!("stage {}: no gradient for its tied matrix", spec.stage));
    let dims = grad.dims();
    let mine: Vec<f32> = grad.into_data().convert::<f32>().into_vec().expect("f32");
    let mut theirs = vec![0.0f32; mine.len()];
    if spec.stage == 0 {
        comm.send(mine.as_slice().into(), peer)?;
        comm.recv(theirs.as_mut_slice().into(), peer)?;
    } else {
        comm.recv(theirs.as_mut_slice().into(), peer)?;
        comm.send(mine.as_slice().into(), peer)?;
    }
    // The same order of addition on both ends: first stage's + last stage's.
    let (a, b) = if spec.stage == 0 {
        (&mine, &theirs)
    } else {
        (&theirs, &mine)
    };
    let sum: Vec<f32> = a.iter().zip(b).map(|(x, y)| x + y).collect();
    let summed = Tensor::<B::InnerBackend, 2>::from_data(TensorData::new(sum, dims), device);
    grads.register(id, summed);
    Ok(grads)
}

/// Where a stage sits and what its data looks like.
pub struct StageSpec<'a, B: AutodiffBackend> {
    /// This stage.
    pub stage: usize,
    /// Stages in the pipeline.
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

/// A micro-batch between its forward and its backward.
struct Live<B: AutodiffBackend, M> {
    /// The stage's parameters as this micro-batch's own leaves.
    module: Option<M>,
    input: Tensor<B, 2>,
    /// The checkpointed input, while the forward's graph is gone (`input` is then detached).
    saved: Option<Saved<B>>,
    output: Tensor<B, 2>,
    loss: Option<Tensor<B, 1>>,
    grad_out: Option<Tensor<B, 2>>,
    grad_in: Option<Tensor<B, 2>>,
}

fn values<B: AutodiffBackend>(t: Tensor<B, 2>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .into_vec()
        .expect("f32 values")
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

/// Runs `stream` for one optimizer step of `module` with `optimizer` at learning rate `lr`,
/// exchanging activations over `pipe` (neighbouring stages at ranks `stage ± 1`) and, at
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
    let device = module.devices().into_iter().next().unwrap_or_default();
    let (prev, next) = (spec.stage.wrapping_sub(1), spec.stage + 1);
    let mut live: HashMap<usize, Live<B, M>> = HashMap::new();
    let mut accumulated = GradientsAccumulator::<M>::new();
    let mut reduced: Option<GradientsParams> = None;
    let mut loss_sum = 0.0f32;
    // The output's shape: a stage may change the rows too (the Llama's first stage turns
    // `[batch, seq]` token ids into `[batch·seq, hidden]`).
    let mut out_dims = [0usize; 2];
    for instr in stream {
        match *instr {
            // Inputs are produced at the forward (first stage), labels inside the loss.
            Instr::Load { .. } => {}
            Instr::RecvActivation { mb } => {
                let mut buf = vec![0.0f32; spec.rows * spec.in_features];
                comm.recv(buf.as_mut_slice().into(), prev)?;
                let x = Tensor::<B, 2>::from_data(
                    TensorData::new(buf, [spec.rows, spec.in_features]),
                    &device,
                )
                .require_grad();
                live.insert(
                    mb,
                    Live {
                        module: None,
                        input: x.clone(),
                        saved: None,
                        output: x,
                        loss: None,
                        grad_out: None,
                        grad_in: None,
                    },
                );
            }
            Instr::Forward { mb } => {
                let input = match live.remove(&mb) {
                    Some(l) => l.input,
                    None => (spec.inputs)(mb),
                };
                let leaves = fresh_leaves(&module);
                let output = leaves.forward(input.clone());
                out_dims = output.dims();
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
                        }
                    }
                };
                live.insert(mb, l);
            }
            Instr::SendActivation { mb } => {
                let out = live[&mb].output.clone().detach();
                comm.send(values(out).as_slice().into(), next)?;
            }
            Instr::RecvGrad { mb } => {
                let mut buf = vec![0.0f32; out_dims[0] * out_dims[1]];
                comm.recv(buf.as_mut_slice().into(), next)?;
                let g = Tensor::<B, 2>::from_data(TensorData::new(buf, out_dims), &device);
                live.get_mut(&mb).expect("forwarded before").grad_out = Some(g);
            }
            Instr::Backward { mb } => {
                let l = live.get_mut(&mb).expect("forwarded before");
                if let (Some(saved), Some(ckpt)) = (l.saved.take(), spec.checkpoint) {
                    // The forward again, from the checkpoint, with its graph this time.
                    let input = ckpt.restore(saved, &device)?;
                    let input = if spec.stage > 0 {
                        input.require_grad()
                    } else {
                        input
                    };
                    let leaves = fresh_leaves(&module);
                    l.output = leaves.forward(input.clone());
                    l.loss = stage_loss(spec, mb, &l.output);
                    l.input = input;
                    l.module = Some(leaves);
                }
                let seed = match (&l.loss, &l.grad_out) {
                    (Some(loss), _) => {
                        loss_sum += loss.clone().into_scalar().elem::<f32>();
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
                let leaves = l.module.take().expect("forwarded before");
                accumulated.accumulate(&module, GradientsParams::from_grads(grads, &leaves));
                if spec.stage == 0 {
                    live.remove(&mb);
                }
            }
            Instr::SendGrad { mb } => {
                let l = live.remove(&mb).expect("backwarded before");
                let g = l.grad_in.expect("backward computed it");
                comm.send(values(g).as_slice().into(), prev)?;
            }
            Instr::ReduceGrads => {
                let mut grads = accumulated.grads();
                if let Some(id) = module.tied().filter(|_| spec.stages > 1) {
                    grads = sum_tied(grads, id, spec, comm, &device)?;
                }
                reduced = Some(optimizer.reduce(&module, grads, data)?);
            }
            Instr::OptimizerStep => {
                let grads = match reduced.take() {
                    Some(grads) => grads,
                    None => optimizer.reduce(&module, accumulated.grads(), data)?,
                };
                let module = optimizer.step(lr, module, grads, data)?;
                let last = spec.stage + 1 == spec.stages;
                return Ok((module, last.then_some(loss_sum)));
            }
        }
    }
    Ok((module, None))
}
