//! LAMB on one flat partition: Adam's update scaled per parameter tensor by the trust ratio
//! `‖w‖ / ‖update‖`, the norms' squares summed across the ranks that share a tensor (a ZeRO
//! partition may hold part of one). As tensor ops here; as two fused CubeCL passes on CUDA
//! (`fused_cuda::lamb`), which share [`LambState::trusts`] with them.

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use cubecl_kernels::lamb::LambConstants;

use super::LambSettings;
use super::tensor::TensorBounds;
use crate::comm::ReduceOp;

/// The fused passes' plan of the partition (CUDA only), made at their first step.
#[derive(Default)]
pub(crate) struct FusedPlan {
    #[cfg(feature = "cuda")]
    pub(crate) cuda: Option<Box<super::fused_cuda::LambCache>>,
}

/// What a LAMB step reads besides the tensors.
pub(crate) struct LambState<'a> {
    pub(crate) settings: &'a LambSettings,
    pub(crate) tensors: &'a TensorBounds,
}

impl LambState<'_> {
    /// One step as tensor ops: new `m`, `v` in place, the new weights returned.
    pub(crate) fn step<B: Backend>(
        &self,
        param: Tensor<B, 1>,
        grad: Tensor<B, 1>,
        m: &mut Tensor<B, 1>,
        v: &mut Tensor<B, 1>,
        k: &LambConstants,
        lr: f32,
    ) -> Tensor<B, 1> {
        let (b1, b2) = (k.beta1, k.beta2);
        *m = m.clone().mul_scalar(b1) + grad.clone().mul_scalar(1.0 - b1);
        *v = v.clone().mul_scalar(b2) + grad.clone().mul_scalar(1.0 - b2).mul(grad);
        let denom = v
            .clone()
            .div_scalar(k.bias_correction2)
            .sqrt()
            .add_scalar(k.eps);
        let mut update = m.clone().div_scalar(k.bias_correction1).div(denom);
        if k.weight_decay != 0.0 {
            update = update + param.clone().mul_scalar(k.weight_decay);
        }
        let squares: Vec<Tensor<B, 1>> = self
            .tensors
            .segments
            .iter()
            .flat_map(|(_, r)| {
                let w = param.clone().slice(r.clone());
                let u = update.clone().slice(r.clone());
                [w.clone().mul(w).sum(), u.clone().mul(u).sum()]
            })
            .collect();
        let sums = match squares.is_empty() {
            true => Vec::new(),
            false => {
                let read = Tensor::cat(squares, 0).into_data().convert::<f32>();
                read.to_vec::<f32>().expect("f32 sums")
            }
        };
        let trust = self.trusts(&sums);
        self.apply(param, update, lr, &trust)
    }

    /// Each parameter tensor's trust ratio from `sums`, the squares of `‖w‖` and `‖update‖`
    /// over each of this partition's segments (in order, two per segment), summed per tensor
    /// and across the ranks that share the tensors.
    pub(crate) fn trusts(&self, sums: &[f32]) -> Vec<f64> {
        let tensors = self.tensors;
        let mut per_tensor = vec![0.0f32; 2 * tensors.params];
        for ((p, _), pair) in tensors.segments.iter().zip(sums.chunks(2)) {
            per_tensor[2 * p] += pair[0];
            per_tensor[2 * p + 1] += pair[1];
        }
        if let Some(comm) = &tensors.comm {
            // Burn's backward has no error channel here either: a failed reduce stops the rank.
            if let Err(e) = comm.all_reduce(per_tensor.as_mut_slice().into(), ReduceOp::Sum) {
                panic!("LAMB's norms across ranks: {e}");
            }
        }
        per_tensor
            .chunks(2)
            .map(|pair| {
                let (w, u) = (f64::from(pair[0]).sqrt(), f64::from(pair[1]).sqrt());
                self.settings.trust(w, u)
            })
            .collect()
    }

    /// `param − lr · trust(tensor) · update`, segment by segment; elements outside every
    /// segment (the partition's padding) keep their value.
    fn apply<B: Backend>(
        &self,
        param: Tensor<B, 1>,
        update: Tensor<B, 1>,
        lr: f32,
        trust: &[f64],
    ) -> Tensor<B, 1> {
        let len = param.dims()[0];
        let mut parts = Vec::new();
        let mut at = 0;
        for (p, r) in &self.tensors.segments {
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
}
