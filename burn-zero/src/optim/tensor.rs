//! The optimizers of [`FlatOptimizer`](super::FlatOptimizer) as tensor ops on one flat
//! partition, so a rank's state stays on its device. Same math, same order of operations.

use std::ops::Range;
use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use super::{
    AdamSettings, CommVolume, LambSettings, OneBitCompressor, OptimizerSettings, SgdSettings,
    StepParams,
};
use crate::comm::{Communicator, ReduceOp};
use crate::config::{OptimizerKind, OptimizerParams};

/// Optimizer state for one flat partition, on the partition's device.
pub struct TensorOptimizer<B: Backend> {
    state: State<B>,
    len: usize,
    /// Adam as one fused kernel where the tensors allow (CUDA, feature `cuda`).
    fused: bool,
    /// The data-parallel ranks (1-bit Adam's momentum exchange).
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
    },
    OneBit {
        m: Tensor<B, 1>,
        v: Tensor<B, 1>,
        step: u64,
        settings: AdamSettings,
        freeze_step: u64,
        /// The parameter tensors, compressed at a scale each.
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
            },
        };
        Self {
            state,
            len,
            fused: false,
            data: None,
        }
    }

    /// The data-parallel ranks, over which 1-bit Adam averages its compressed momentum.
    pub fn with_data_parallel(mut self, comm: Arc<dyn Communicator>) -> Self {
        self.data = Some(comm);
        self
    }

    /// 1-bit Adam: whether the next step exchanges the momentum compressed (its gradients
    /// then stay local: the engine skips their all-reduce).
    pub fn compresses_next_step(&self) -> bool {
        matches!(&self.state, State::OneBit { step, freeze_step, .. } if step + 1 > *freeze_step)
    }

    /// 1-bit Adam: what the last compressed momentum exchange sent.
    pub fn compressed_volume(&self) -> Option<CommVolume> {
        match &self.state {
            State::OneBit { volume, .. } => *volume,
            _ => None,
        }
    }

    /// LAMB's parameter tensors in the partition (other optimizers ignore them).
    pub fn with_segments(mut self, bounds: TensorBounds) -> Self {
        match &mut self.state {
            State::Lamb { tensors, .. } => *tensors = bounds,
            State::OneBit { tensors, .. } => {
                *tensors = bounds.segments.iter().map(|(_, r)| r.clone()).collect();
            }
            _ => {}
        }
        self
    }

    /// Runs Adam/AdamW as one fused CubeCL kernel on CUDA tensors (`burn_zero.fused_adam`);
    /// other tensors, and builds without feature `cuda`, keep the tensor ops.
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
        assert_eq!(
            (param.dims()[0], grad.dims()[0]),
            (self.len, self.len),
            "parameter, gradient and optimizer state differ in length"
        );
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
                #[cfg(feature = "cuda")]
                if self.fused {
                    let k = cubecl_kernels::adam::AdamConstants {
                        beta1: b1,
                        beta2: b2,
                        eps,
                        shrink: if settings.decoupled {
                            1.0 - lr * wd
                        } else {
                            1.0
                        },
                        l2: if settings.decoupled { 0.0 } else { wd },
                        bias_correction2_sqrt: bc2.sqrt(),
                        step_size: lr / bc1,
                    };
                    if let Some([w, m_new, v_new]) =
                        super::fused_cuda::adamw(&param, &grad, m, v, &k)
                    {
                        (*m, *v) = (m_new, v_new);
                        return w;
                    }
                }
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
            } => {
                *step += 1;
                let adam = &settings.adam;
                let (bc1, bc2) = adam.corrections(*step, (b1, b2));
                let (eps, wd) = (adam.eps as f32, adam.weight_decay as f32);
                *m = m.clone().mul_scalar(b1) + grad.clone().mul_scalar(1.0 - b1);
                *v = v.clone().mul_scalar(b2) + grad.clone().mul_scalar(1.0 - b2).mul(grad);
                let denom = v.clone().div_scalar(bc2).sqrt().add_scalar(eps);
                let mut update = m.clone().div_scalar(bc1).div(denom);
                if wd != 0.0 {
                    update = update + param.clone().mul_scalar(wd);
                }
                let trust = lamb_trust(&param, &update, settings, tensors);
                lamb_apply(param, update, lr, &trust, tensors)
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
                if *step <= *freeze_step {
                    *v = v.clone().mul_scalar(b2) + grad.clone().mul_scalar(1.0 - b2).mul(grad);
                } else if let Some(comm) = &self.data {
                    // The local momentum, averaged over the ranks 1-bit compressed.
                    let device = m.device();
                    let data = m.clone().into_data().convert::<f32>();
                    let mut local = data.into_vec::<f32>().expect("f32 momentum");
                    let c = compressor.get_or_insert_with(|| {
                        OneBitCompressor::new(self.len, comm.world_size()).with_tensors(tensors)
                    });
                    match c.all_reduce(&mut local, comm.as_ref()) {
                        Ok(sent) => *volume = Some(sent),
                        Err(e) => panic!("1-bit Adam's momentum exchange: {e}"),
                    }
                    let n = local.len();
                    *m = Tensor::from_data(TensorData::new(local, [n]), &device);
                }
                let (eps, wd) = (settings.eps as f32, settings.weight_decay as f32);
                let mut update = m.clone().div(v.clone().sqrt().add_scalar(eps));
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

/// Each parameter tensor's trust ratio: ‖w‖ and ‖update‖ from this partition's segments,
/// their squares summed across the ranks that share the tensors, one read back.
fn lamb_trust<B: Backend>(
    param: &Tensor<B, 1>,
    update: &Tensor<B, 1>,
    settings: &LambSettings,
    tensors: &TensorBounds,
) -> Vec<f64> {
    let squares: Vec<Tensor<B, 1>> = tensors
        .segments
        .iter()
        .flat_map(|(_, r)| {
            let w = param.clone().slice(r.clone());
            let u = update.clone().slice(r.clone());
            [w.clone().mul(w).sum(), u.clone().mul(u).sum()]
        })
        .collect();
    let mut sums = vec![0.0f32; 2 * tensors.params];
    if !squares.is_empty() {
        let read = Tensor::cat(squares, 0).into_data().convert::<f32>();
        let values = read.to_vec::<f32>().expect("f32 sums");
        for ((p, _), pair) in tensors.segments.iter().zip(values.chunks(2)) {
            sums[2 * p] += pair[0];
            sums[2 * p + 1] += pair[1];
        }
    }
    if let Some(comm) = &tensors.comm {
        // Burn's backward has no error channel here either: a failed reduce stops the rank.
        if let Err(e) = comm.all_reduce(sums.as_mut_slice().into(), ReduceOp::Sum) {
            panic!("LAMB's norms across ranks: {e}");
        }
    }
    sums.chunks(2)
        .map(|pair| settings.trust(f64::from(pair[0]).sqrt(), f64::from(pair[1]).sqrt()))
        .collect()
}

/// `param − lr · trust(tensor) · update`, segment by segment; elements outside every segment
/// (the partition's padding) keep their value.
fn lamb_apply<B: Backend>(
    param: Tensor<B, 1>,
    update: Tensor<B, 1>,
    lr: f32,
    trust: &[f64],
    tensors: &TensorBounds,
) -> Tensor<B, 1> {
    let len = param.dims()[0];
    let mut parts = Vec::new();
    let mut at = 0;
    for (p, r) in &tensors.segments {
        if r.start > at {
            parts.push(param.clone().slice(at..r.start));
        }
        let step = update
            .clone()
            .slice(r.clone())
            .mul_scalar(lr * trust[*p] as f32);
        parts.push(param.clone().slice(r.clone()) - step);
        at = r.end;
    }
    if at < len {
        parts.push(param.clone().slice(at..len));
    }
    match parts.len() {
        0 => param,
        _ => Tensor::cat(parts, 0),
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
}
