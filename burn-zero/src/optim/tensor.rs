//! The optimizers of [`FlatOptimizer`](super::FlatOptimizer) as tensor ops on one flat
//! partition, so a rank's state stays on its device. Same math, same order of operations.

use std::ops::Range;
use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use cubecl_kernels::lamb::LambConstants;

use super::lamb::FusedPlan;
use super::{
    AdamSettings, CommVolume, LambSettings, OneBitCompressor, OptimizerSettings, SCALE_BLOCK,
    SgdSettings, StepParams, adam_update_bound,
};
use crate::comm::Communicator;
use crate::config::{OptimizerKind, OptimizerParams};

/// Optimizer state for one flat partition, on the partition's device.
pub struct TensorOptimizer<B: Backend> {
    state: State<B>,
    len: usize,
    /// Adam as one fused kernel where the tensors allow (CUDA, feature `cuda`).
    fused: bool,
    /// The data-parallel ranks (1-bit Adam's exchange).
    data: Option<Arc<dyn Communicator>>,
}

enum State<B: Backend> {
    Adam {
        m: Tensor<B, 1>,
        v: Tensor<B, 1>,
        step: u64,
        settings: AdamSettings,
    },
    Sgd {
        /// The momentum buffer once the first gradient arrived (momentum > 0 only).
        buffer: Option<Tensor<B, 1>>,
        settings: SgdSettings,
    },
    Lamb {
        m: Tensor<B, 1>,
        v: Tensor<B, 1>,
        step: u64,
        settings: LambSettings,
        tensors: TensorBounds,
        /// The fused passes' plan of the partition, made at their first step.
        fused: FusedPlan,
    },
    OneBit {
        m: Tensor<B, 1>,
        v: Tensor<B, 1>,
        step: u64,
        settings: AdamSettings,
        freeze_step: u64,
        /// The parameter tensors, each cut into blocks compressed at a scale each.
        tensors: Vec<Range<usize>>,
        /// Made at the first compressed step.
        compressor: Option<OneBitCompressor>,
        /// What the last compressed exchange sent.
        volume: Option<CommVolume>,
    },
}

/// Where each parameter tensor lies in the partition, for LAMB's per-tensor trust ratios.
#[derive(Clone)]
pub struct TensorBounds {
    /// (parameter index, its elements in this partition), in increasing order of position.
    pub segments: Vec<(usize, Range<usize>)>,
    /// Parameter tensors in the model (the length of the norms reduced across ranks).
    pub params: usize,
    /// The ranks whose partitions together hold every tensor (stages 1–3), over which the
    /// norms' partial sums are added; `None` when this partition holds whole tensors.
    pub comm: Option<Arc<dyn Communicator>>,
}

impl<B: Backend> TensorOptimizer<B> {
    /// Zeroed state for a partition of `len` elements on `device`.
    pub fn new(
        kind: OptimizerKind,
        params: &OptimizerParams,
        len: usize,
        device: &B::Device,
    ) -> Self {
        let zeros = || Tensor::zeros([len], device);
        let state = match OptimizerSettings::new(kind, params) {
            OptimizerSettings::Adam(settings) => State::Adam {
                m: zeros(),
                v: zeros(),
                step: 0,
                settings,
            },
            OptimizerSettings::Sgd(settings) => State::Sgd {
                buffer: None,
                settings,
            },
            OptimizerSettings::OneBitAdam(settings, freeze_step) => State::OneBit {
                m: zeros(),
                v: zeros(),
                step: 0,
                settings,
                freeze_step,
                tensors: Vec::new(),
                compressor: None,
                volume: None,
            },
            // One tensor until [`TensorOptimizer::with_segments`] says where the tensors are.
            OptimizerSettings::Lamb(settings) => State::Lamb {
                m: zeros(),
                v: zeros(),
                step: 0,
                settings,
                tensors: TensorBounds {
                    segments: vec![(0, 0..len)],
                    params: 1,
                    comm: None,
                },
                fused: FusedPlan::default(),
            },
        };
        Self {
            state,
            len,
            fused: false,
            data: None,
        }
    }

    /// The data-parallel ranks, over which 1-bit Adam averages its compressed updates.
    pub fn with_data_parallel(mut self, comm: Arc<dyn Communicator>) -> Self {
        self.data = Some(comm);
        self
    }

    /// 1-bit Adam: whether the next step exchanges the momentum compressed (its gradients
    /// then stay local: the engine skips their all-reduce).
    pub fn compresses_next_step(&self) -> bool {
        matches!(&self.state, State::OneBit { step, freeze_step, .. } if step + 1 > *freeze_step)
    }

    /// 1-bit Adam: what the last compressed exchange sent.
    pub fn compressed_volume(&self) -> Option<CommVolume> {
        match &self.state {
            State::OneBit { volume, .. } => *volume,
            _ => None,
        }
    }

    /// LAMB's parameter tensors in the partition (other optimizers ignore them).
    pub fn with_segments(mut self, bounds: TensorBounds) -> Self {
        match &mut self.state {
            State::Lamb { tensors, fused, .. } => {
                *tensors = bounds;
                *fused = FusedPlan::default();
            }
            State::OneBit { tensors, .. } => {
                *tensors = bounds.segments.iter().map(|(_, r)| r.clone()).collect();
            }
            _ => {}
        }
        self
    }

    /// Runs Adam/AdamW as one fused CubeCL kernel and LAMB as two fused passes on CUDA tensors
    /// (`burn_zero.fused_adam`); other tensors, and builds without feature `cuda`, keep the
    /// tensor ops.
    pub fn with_fused(mut self, fused: bool) -> Self {
        self.fused = fused;
        self
    }

    /// Bytes of state held (f32), counting SGD's momentum buffer from the start as PyTorch's
    /// memory peak does.
    pub fn state_bytes(&self) -> usize {
        match &self.state {
            State::Adam { .. } | State::Lamb { .. } | State::OneBit { .. } => 4 * 2 * self.len,
            State::Sgd { settings, .. } if settings.momentum > 0.0 => 4 * self.len,
            State::Sgd { .. } => 0,
        }
    }

    /// The state as named flat partitions (PyTorch's names: `exp_avg`, `exp_avg_sq`,
    /// `momentum_buffer`) and the step count, for checkpoints.
    pub fn export(&self) -> (u64, Vec<(&'static str, Tensor<B, 1>)>) {
        match &self.state {
            State::Adam { m, v, step, .. }
            | State::Lamb { m, v, step, .. }
            | State::OneBit { m, v, step, .. } => (
                *step,
                vec![("exp_avg", m.clone()), ("exp_avg_sq", v.clone())],
            ),
            State::Sgd { buffer, .. } => (
                0,
                buffer
                    .iter()
                    .map(|b| ("momentum_buffer", b.clone()))
                    .collect(),
            ),
        }
    }

    /// The names [`TensorOptimizer::import`] needs (SGD's momentum buffer is optional: it
    /// exists once a step was taken with momentum).
    pub fn required(&self) -> &'static [&'static str] {
        match &self.state {
            State::Adam { .. } | State::Lamb { .. } | State::OneBit { .. } => {
                &["exp_avg", "exp_avg_sq"]
            }
            State::Sgd { .. } => &[],
        }
    }

    /// Replaces the state with `tensors` (named as [`TensorOptimizer::export`] names them,
    /// each `len` elements) at step `step`; an error names what is missing or mis-sized.
    pub fn import(
        &mut self,
        step: u64,
        mut tensors: Vec<(String, Tensor<B, 1>)>,
    ) -> Result<(), String> {
        if let Some((name, t)) = tensors.iter().find(|(_, t)| t.dims()[0] != self.len) {
            return Err(format!(
                "optimizer state `{name}` has {} elements, the partition {}",
                t.dims()[0],
                self.len
            ));
        }
        let mut take = |name: &str| {
            let i = tensors.iter().position(|(n, _)| n == name)?;
            Some(tensors.swap_remove(i).1)
        };
        match &mut self.state {
            State::Adam { m, v, step: s, .. }
            | State::Lamb { m, v, step: s, .. }
            | State::OneBit { m, v, step: s, .. } => {
                let missing = |n: &str| format!("the checkpoint has no `{n}` (Adam's state)");
                *m = take("exp_avg").ok_or_else(|| missing("exp_avg"))?;
                *v = take("exp_avg_sq").ok_or_else(|| missing("exp_avg_sq"))?;
                *s = step;
            }
            State::Sgd { buffer, .. } => *buffer = take("momentum_buffer"),
        }
        Ok(())
    }

    /// The updated partition from `param` and `grad` (both `len` elements).
    pub fn step(
        &mut self,
        param: Tensor<B, 1>,
        grad: Tensor<B, 1>,
        hp: StepParams,
    ) -> Tensor<B, 1> {
        self.step_scaled(param, vec![grad], hp, 1.0, None).0
    }

    /// The updated partition from `param` and the gradient, given as its consecutive pieces
    /// `grads`, multiplied by `grad_scale` (the clipping factor). The fused AdamW kernel reads
    /// the pieces where they lie; the tensor ops get them concatenated. Asked for a `working`
    /// dtype, the fused kernel also writes the new weights in it in the same pass (the model's
    /// compute-dtype copy); `None` comes back where it did not, and the caller converts.
    pub fn step_scaled(
        &mut self,
        param: Tensor<B, 1>,
        grads: Vec<Tensor<B, 1>>,
        hp: StepParams,
        grad_scale: f32,
        working: Option<DType>,
    ) -> (Tensor<B, 1>, Option<Tensor<B, 1>>) {
        assert_eq!(
            (param.dims()[0], grads.iter().map(|g| g.dims()[0]).sum()),
            (self.len, self.len),
            "parameter, gradient and optimizer state differ in length"
        );
        // Adam/AdamW as one fused kernel (`burn_zero.fused_adam`) where the tensors allow.
        #[cfg(feature = "cuda")]
        let (param, grads) = match &mut self.state {
            State::Adam {
                m,
                v,
                step,
                settings,
            } if self.fused => {
                let state = ([m, v], step, &*settings);
                match super::fused_cuda::adam(param, grads, state, hp, grad_scale, working) {
                    Ok(stepped) => return stepped,
                    Err(inputs) => inputs,
                }
            }
            _ => (param, grads),
        };
        let _ = working;
        let grad = joined(grads);
        let grad = if grad_scale == 1.0 {
            grad
        } else {
            grad.mul_scalar(grad_scale)
        };
        (self.step_ops(param, grad, hp), None)
    }

    /// The step as tensor ops (the reference of the fused kernels, and every other backend).
    fn step_ops(
        &mut self,
        param: Tensor<B, 1>,
        grad: Tensor<B, 1>,
        hp: StepParams,
    ) -> Tensor<B, 1> {
        let (lr, (b1, b2)) = hp.f32();
        match &mut self.state {
            State::Adam {
                m,
                v,
                step,
                settings,
            } => {
                *step += 1;
                let (bc1, bc2) = settings.corrections(*step, (b1, b2));
                let (eps, wd) = (settings.eps as f32, settings.weight_decay as f32);
                let g = if settings.decoupled || wd == 0.0 {
                    grad
                } else {
                    grad + param.clone().mul_scalar(wd)
                };
                *m = m.clone().mul_scalar(b1) + g.clone().mul_scalar(1.0 - b1);
                *v = v.clone().mul_scalar(b2) + g.clone().mul_scalar(1.0 - b2).mul(g);
                let param = if settings.decoupled {
                    param.mul_scalar(1.0 - lr * wd)
                } else {
                    param
                };
                let denom = v.clone().sqrt().div_scalar(bc2.sqrt()).add_scalar(eps);
                param - m.clone().div(denom).mul_scalar(lr / bc1)
            }
            State::Lamb {
                m,
                v,
                step,
                settings,
                tensors,
                fused,
            } => {
                *step += 1;
                let (bc1, bc2) = settings.adam.corrections(*step, (b1, b2));
                let k = LambConstants {
                    beta1: b1,
                    beta2: b2,
                    eps: settings.adam.eps as f32,
                    weight_decay: settings.adam.weight_decay as f32,
                    bias_correction1: bc1,
                    bias_correction2: bc2,
                };
                #[cfg(feature = "cuda")]
                if self.fused {
                    let state = super::lamb::LambState { settings, tensors };
                    if let Some([w, m_new, v_new]) =
                        super::fused_cuda::lamb(&param, &grad, m, v, &k, lr, &state, fused)
                    {
                        (*m, *v) = (m_new, v_new);
                        return w;
                    }
                }
                let _ = fused;
                super::lamb::LambState { settings, tensors }.step(param, grad, m, v, &k, lr)
            }
            State::OneBit {
                m,
                v,
                step,
                settings,
                freeze_step,
                tensors,
                compressor,
                volume,
            } => {
                *step += 1;
                *m = m.clone().mul_scalar(b1) + grad.clone().mul_scalar(1.0 - b1);
                let (eps, wd) = (settings.eps as f32, settings.weight_decay as f32);
                if *step <= *freeze_step {
                    *v = v.clone().mul_scalar(b2) + grad.clone().mul_scalar(1.0 - b2).mul(grad);
                }
                let denom = v.clone().sqrt().add_scalar(eps);
                let mut update = m.clone().div(denom.clone());
                if let (true, Some(comm)) = (*step > *freeze_step, &self.data) {
                    let exchange = Exchange {
                        len: self.len,
                        tensors,
                        compressor,
                        volume,
                        comm,
                    };
                    update = exchange.average(update, adam_update_bound(b1, b2));
                    // DeepSpeed's momentum approximation: the momentum becomes the average.
                    *m = update.clone().mul(denom);
                }
                if wd != 0.0 {
                    update = update + param.clone().mul_scalar(wd);
                }
                param - update.mul_scalar(lr)
            }
            State::Sgd { buffer, settings } => {
                let (mu, damp, wd) = (
                    settings.momentum as f32,
                    settings.dampening as f32,
                    settings.weight_decay as f32,
                );
                let mut g = if wd == 0.0 {
                    grad
                } else {
                    grad + param.clone().mul_scalar(wd)
                };
                if mu > 0.0 {
                    let next = match buffer.take() {
                        Some(b) => b.mul_scalar(mu) + g.clone().mul_scalar(1.0 - damp),
                        None => g.clone(),
                    };
                    g = if settings.nesterov {
                        g + next.clone().mul_scalar(mu)
                    } else {
                        next.clone()
                    };
                    *buffer = Some(next);
                }
                param - g.mul_scalar(lr)
            }
        }
    }
}

/// 1-bit Adam's exchange after `freeze_step`, over the data-parallel ranks.
struct Exchange<'a> {
    len: usize,
    tensors: &'a [Range<usize>],
    compressor: &'a mut Option<OneBitCompressor>,
    volume: &'a mut Option<CommVolume>,
    comm: &'a Arc<dyn Communicator>,
}

impl Exchange<'_> {
    /// The ranks' updates `m/√v`, bounded by `bound`, averaged 1-bit compressed with error
    /// feedback. The update is what is compressed, not the momentum: the frozen denominator
    /// is the same on every rank, so the average commutes with it, and a compression error
    /// then moves a weight by at most its block's scale. The bound is Adam's own
    /// ([`adam_update_bound`]): with the variance frozen, a weight whose gradients were tiny
    /// during the warm-up (an embedding row first seen now) had updates of up to 1.25e5 on the
    /// CPU recipe, which set its block's scale. See `optim::onebit` for the measurements.
    fn average<B: Backend>(self, update: Tensor<B, 1>, bound: f32) -> Tensor<B, 1> {
        let device = update.device();
        let data = update.clamp(-bound, bound).into_data().convert::<f32>();
        let mut local = data.into_vec::<f32>().expect("f32 update");
        let world = self.comm.world_size();
        let compressor = self.compressor.get_or_insert_with(|| {
            OneBitCompressor::new(self.len, world).with_tensors(self.tensors, SCALE_BLOCK)
        });
        match compressor.all_reduce(&mut local, self.comm.as_ref()) {
            Ok(sent) => *self.volume = Some(sent),
            Err(e) => panic!("1-bit Adam's exchange: {e}"),
        }
        Tensor::from_data(TensorData::new(local, [self.len]), &device)
    }
}

/// A gradient given as its consecutive pieces, in one tensor (the piece itself when one).
pub(crate) fn joined<B: Backend>(mut pieces: Vec<Tensor<B, 1>>) -> Tensor<B, 1> {
    match pieces.len() {
        1 => pieces.pop().expect("one piece"),
        _ => Tensor::cat(pieces, 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::FlatOptimizer;
    use burn::backend::NdArray;
    use burn::tensor::TensorData;

    /// Five steps of every optimizer on the device agree with the host implementation.
    #[test]
    fn tensor_optimizers_match_the_host_ones() {
        let device = Default::default();
        let len = 37;
        let kinds = [
            (
                true,
                OptimizerKind::Adam {
                    decoupled_weight_decay: true,
                },
            ),
            (
                false,
                OptimizerKind::Adam {
                    decoupled_weight_decay: false,
                },
            ),
            (true, OptimizerKind::Sgd),
            (false, OptimizerKind::Sgd),
        ];
        for (variant, kind) in kinds {
            let params = OptimizerParams {
                weight_decay: 0.05,
                momentum: 0.9,
                nesterov: variant,
                bias_correction: variant,
                ..Default::default()
            };
            let mut host = FlatOptimizer::new(kind, &params, len);
            let mut tensor = TensorOptimizer::<NdArray>::new(kind, &params, len, &device);
            let mut p_host: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin()).collect();
            let mut p_dev = Tensor::<NdArray, 1>::from_floats(p_host.as_slice(), &device);
            for step in 0..5 {
                let g: Vec<f32> = (0..len)
                    .map(|i| ((i * 7 + step * 3) as f32 * 0.11).cos())
                    .collect();
                let hp = StepParams {
                    lr: 0.01 * (step + 1) as f64,
                    betas: (0.9, 0.99),
                };
                host.step(&mut p_host, &g, hp);
                let g_dev = Tensor::from_floats(g.as_slice(), &device);
                p_dev = tensor.step(p_dev, g_dev, hp);
            }
            p_dev
                .into_data()
                .assert_approx_eq::<f32>(&TensorData::from(p_host.as_slice()), Default::default());
        }
    }
    /// 1-bit Adam after `freeze_step`: a weight whose gradients were tiny during the warm-up
    /// and are large now moves by at most Adam's own bound times the learning rate (without
    /// the bound: its update over a frozen variance of 1e-12), and both ranks hold the same
    /// parameters. Two tensors of 100 and 200 elements, 2 ranks.
    #[test]
    fn a_frozen_variance_cannot_blow_up_an_update() {
        let (len, lr, freeze) = (300usize, 0.01f32, 3usize);
        let results = crate::testing::run_ranks(2, |ctx| {
            let device = Default::default();
            let params = OptimizerParams {
                freeze_step: freeze as u64,
                weight_decay: 0.0,
                ..Default::default()
            };
            let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
            let bounds = TensorBounds {
                segments: vec![(0, 0..100), (1, 100..len)],
                params: 2,
                comm: None,
            };
            let mut opt =
                TensorOptimizer::<NdArray>::new(OptimizerKind::OneBitAdam, &params, len, &device)
                    .with_data_parallel(comm)
                    .with_segments(bounds);
            let hp = StepParams {
                lr: f64::from(lr),
                betas: (0.9, 0.95),
            };
            let mut p = Tensor::<NdArray, 1>::zeros([len], &device);
            let mut moves = Vec::new();
            for step in 0..freeze + 3 {
                let g: Vec<f32> = (0..len)
                    .map(|i| match (i, step < freeze) {
                        (0, true) => 1e-6,
                        (0, false) => 10.0,
                        // The engine averages the gradients before `freeze_step`: the same
                        // on both ranks until then.
                        _ => ((i * 7 + step * 3 + ctx.rank * (step / freeze)) as f32 * 0.11).cos(),
                    })
                    .collect();
                let before = p.clone();
                p = opt.step(p, Tensor::from_floats(g.as_slice(), &device), hp);
                let moved = (p.clone() - before).abs().max().into_scalar();
                moves.push(moved);
            }
            (moves, p.into_data().to_vec::<f32>().unwrap())
        });
        assert_eq!(
            results[0].1, results[1].1,
            "both ranks hold the same parameters"
        );
        let most = lr * adam_update_bound(0.9, 0.95) * (1.0 + 1e-5);
        for (step, moved) in results[0].0.iter().enumerate() {
            assert!(
                *moved <= most,
                "step {step}: a weight moved {moved} > {most}"
            );
        }
    }
}
