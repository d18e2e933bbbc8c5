//! `rope`: rotary position embedding, one kernel each way on CUDA, from one table per
//! sequence length.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor, TensorData};
pub use cubecl_kernels::fused::RopePairs;

use super::dispatch::{FusedOp, apply};

/// The cosines and sines of RoPE's angles for positions `0..seq` of heads of `head_dim`
/// (`[seq, head_dim / 2]` f32 each), computed in f64 on the host: made once per sequence
/// length and shared by every layer, batch and head.
#[derive(Clone, Debug)]
pub struct RopeTable<B: Backend> {
    cos: Tensor<B, 2>,
    sin: Tensor<B, 2>,
}

impl<B: Backend> RopeTable<B> {
    /// The table of base `theta` (`rope_theta`).
    ///
    /// # Panics
    /// On an odd `head_dim`, naming it.
    pub fn new(seq: usize, head_dim: usize, theta: f64, device: &B::Device) -> Self {
        assert!(
            head_dim.is_multiple_of(2),
            "RoPE: head_dim {head_dim} is odd (RoPE rotates pairs)"
        );
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(seq * half);
        let mut sin = Vec::with_capacity(seq * half);
        for pos in 0..seq {
            for i in 0..half {
                let angle = pos as f64 * theta.powf(-2.0 * i as f64 / head_dim as f64);
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        let t = |v: Vec<f32>| {
            Tensor::<B, 2>::from_data(TensorData::new(v, [seq, half]), (device, DType::F32))
        };
        Self {
            cos: t(cos),
            sin: t(sin),
        }
    }

    /// Positions the table covers.
    pub fn seq(&self) -> usize {
        self.cos.dims()[0]
    }
}

/// `x` (`[batch, seq, heads, head_dim]`) with each pair of `pairs` rotated by its position's
/// angle, in f32 arithmetic. On `ZeroBackend<Cuda>` (`burn_zero.fused_kernels.rope`, default on)
/// one kernel forward and one backward (the inverse rotation); elsewhere burn ops.
///
/// # Panics
/// When the table is not of `x`'s sequence length and head width, naming both.
pub fn rope<B: Backend>(x: Tensor<B, 4>, table: &RopeTable<B>, pairs: RopePairs) -> Tensor<B, 4> {
    let [_, seq, _, head_dim] = x.dims();
    let [tseq, half] = table.cos.dims();
    assert!(
        tseq == seq && 2 * half == head_dim,
        "rope: a table of {tseq} positions × {} does not fit x of shape {:?} ([batch, seq, heads, head_dim])",
        2 * half,
        x.dims()
    );
    let tables = [&table.cos, &table.sin].map(|t| t.clone().reshape([1, seq, 1, half]));
    let [cos, sin] = tables;
    if !super::enabled(|f| f.rope) {
        return rotate(x, cos, sin, pairs, false);
    }
    apply(Rope { pairs }, [x, cos, sin])
}

/// The rotation in burn ops, in f32 (`inverse`: by the opposite angle); tables `[1, seq, 1,
/// head_dim / 2]`.
fn rotate<B: Backend>(
    x: Tensor<B, 4>,
    cos: Tensor<B, 4>,
    sin: Tensor<B, 4>,
    pairs: RopePairs,
    inverse: bool,
) -> Tensor<B, 4> {
    let [b, s, h, d] = x.dims();
    let dtype = x.dtype();
    let x = x.cast(FloatDType::F32);
    let sin = if inverse { -sin } else { sin };
    let out = match pairs {
        RopePairs::Interleaved => {
            let x = x.reshape([b, s, h, d / 2, 2]);
            let x0 = x.clone().slice_dim(4, 0..1);
            let x1 = x.slice_dim(4, 1..2);
            let (cos, sin) = (cos.unsqueeze_dim::<5>(4), sin.unsqueeze_dim::<5>(4));
            let r0 = x0.clone() * cos.clone() - x1.clone() * sin.clone();
            let r1 = x0 * sin + x1 * cos;
            Tensor::cat(vec![r0, r1], 4).reshape([b, s, h, d])
        }
        RopePairs::HalfSplit => {
            let x0 = x.clone().slice_dim(3, 0..d / 2);
            let x1 = x.slice_dim(3, d / 2..d);
            let r0 = x0.clone() * cos.clone() - x1.clone() * sin.clone();
            let r1 = x0 * sin + x1 * cos;
            Tensor::cat(vec![r0, r1], 3)
        }
    };
    out.cast(dtype)
}

/// The op on `[x, cos, sin]`; only `x` takes a gradient.
#[derive(Clone, Copy, Debug)]
struct Rope {
    pairs: RopePairs,
}

impl Rope {
    fn run<Z: Backend>(&self, [x, cos, sin]: &[Tensor<Z, 4>; 3], inverse: bool) -> Tensor<Z, 4> {
        #[cfg(feature = "cuda")]
        {
            let [_, seq, _, half] = cos.dims();
            let table = |t: &Tensor<Z, 4>| t.clone().reshape([seq, half]);
            if let Some(out) =
                super::cuda::rope_op(x, &table(cos), &table(sin), self.pairs, inverse)
            {
                return out;
            }
        }
        rotate(x.clone(), cos.clone(), sin.clone(), self.pairs, inverse)
    }
}

impl FusedOp<3, 4> for Rope {
    fn forward<Z: Backend>(&self, inputs: &[Tensor<Z, 4>; 3]) -> (Tensor<Z, 4>, Vec<Tensor<Z, 4>>) {
        (self.run(inputs, false), Vec::new())
    }

    fn backward<Z: Backend>(
        &self,
        [_, cos, sin]: &[Tensor<Z, 4>; 3],
        _: &[Tensor<Z, 4>],
        d_out: Tensor<Z, 4>,
    ) -> [Option<Tensor<Z, 4>>; 3] {
        let dx = self.run(&[d_out, cos.clone(), sin.clone()], true);
        [Some(dx), None, None]
    }
}
