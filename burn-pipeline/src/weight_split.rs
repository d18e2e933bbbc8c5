//! A backward split in two, for zero-bubble schedules: the input-gradient half runs the graph
//! with the split linear layers' weights held constant and records, per layer, its input and
//! the gradient of its output; the weight-gradient half turns those into the weights' and
//! biases' gradients (`xᵀ·dy`, `Σ dy`) when the schedule finds the time.
//!
//! The gradient of a layer's output comes from a zero "probe" leaf added to it: adding zero
//! changes no value, and the probe's gradient is exactly `dy`. Everything else of the stage
//! (norms, embeddings, layers not routed here) gets its gradient in the input half.

use burn::module::{Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, module};

/// One split layer of one micro-batch.
struct Deferred<B: AutodiffBackend> {
    weight: ParamId,
    bias: Option<ParamId>,
    /// The layer's input, `[rows, d_in]`.
    x: Tensor<B::InnerBackend, 2>,
    /// The zero leaf added to the output, `[rows, d_out]`.
    probe: Tensor<B, 2>,
}

/// The linear layers of a stage's forward whose weight gradients wait for the schedule's
/// [`crate::Instr::BackwardWeight`]. A stage routes them through [`WeightSplit::linear`] in
/// [`crate::PipeStage::forward_split`].
pub struct WeightSplit<B: AutodiffBackend> {
    layers: Vec<Deferred<B>>,
}

/// The weight-gradient half still to run for one micro-batch: each layer's input and output
/// gradient.
pub(crate) struct WeightWork<B: AutodiffBackend> {
    layers: Vec<LayerWork<B>>,
}

/// One split layer's `(weight, bias, x, dy)`.
type LayerWork<B> = (
    ParamId,
    Option<ParamId>,
    Tensor<<B as AutodiffBackend>::InnerBackend, 2>,
    Tensor<<B as AutodiffBackend>::InnerBackend, 2>,
);

impl<B: AutodiffBackend> WeightSplit<B> {
    pub(crate) fn new() -> Self {
        Self { layers: Vec::new() }
    }

    /// `x · weight + bias` (burn's `Linear`: `weight` is `[d_in, d_out]`) on `[.., d_in]`,
    /// with the gradients of `weight` and `bias` left for the weight half.
    pub fn linear<const D: usize>(
        &mut self,
        x: Tensor<B, D>,
        weight: &Param<Tensor<B, 2>>,
        bias: Option<&Param<Tensor<B, 1>>>,
    ) -> Tensor<B, D> {
        let [d_in, d_out] = weight.dims();
        let y = module::linear(
            x.clone(),
            weight.val().detach(),
            bias.map(|b| b.val().detach()),
        );
        let dims = y.dims();
        let rows = dims[..D - 1].iter().product::<usize>();
        let probe = Tensor::<B, 2>::zeros([rows, d_out], &y.device()).require_grad();
        self.layers.push(Deferred {
            weight: weight.id,
            bias: bias.map(|b| b.id),
            x: x.detach().inner().reshape([rows, d_in]),
            probe: probe.clone(),
        });
        y + probe.reshape(dims)
    }

    /// After the input half's backward: each layer's output gradient, taken from `grads`.
    pub(crate) fn into_work(self, grads: &B::Gradients) -> WeightWork<B> {
        let layers = self
            .layers
            .into_iter()
            .map(|l| {
                let dy = l.probe.grad(grads).unwrap_or_else(|| {
                    Tensor::<B, 2>::zeros(l.probe.dims(), &l.probe.device()).inner()
                });
                (l.weight, l.bias, l.x, dy)
            })
            .collect();
        WeightWork { layers }
    }
}

impl<B: AutodiffBackend> WeightWork<B> {
    /// The weight half: every split layer's weight and bias gradients (summed where a layer
    /// ran more than once).
    pub(crate) fn run(self) -> GradientsParams {
        let mut grads = GradientsParams::new();
        fn add<B: burn::tensor::backend::Backend, const D: usize>(
            grads: &mut GradientsParams,
            id: ParamId,
            g: Tensor<B, D>,
        ) {
            let sum = match grads.remove::<B, D>(id) {
                Some(before) => before + g,
                None => g,
            };
            grads.register(id, sum);
        }
        for (weight, bias, x, dy) in self.layers {
            if let Some(bias) = bias {
                let d_out = dy.dims()[1];
                add(&mut grads, bias, dy.clone().sum_dim(0).reshape([d_out]));
            }
            add(&mut grads, weight, x.transpose().matmul(dy));
        }
        grads
    }
}
