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
    /// with the gradients of `weight` and `bias` left for the weight half. A frozen weight
    /// (a LoRA base, say) is applied as burn applies it: nothing is deferred, and a trainable
    /// bias beside it gets its gradient in the input half; a frozen bias gets none.
    pub fn linear<const D: usize>(
        &mut self,
        x: Tensor<B, D>,
        weight: &Param<Tensor<B, 2>>,
        bias: Option<&Param<Tensor<B, 1>>>,
    ) -> Tensor<B, D> {
        if !weight.val().is_require_grad() {
            return module::linear(x, weight.val(), bias.map(Param::val));
        }
        let [d_in, d_out] = weight.dims();
        let y = module::linear(
            x.clone(),
            weight.val().detach(),
            bias.map(|b| b.val().detach()),
        );
        let dims = y.dims();
        let rows = dims[..D - 1].iter().product::<usize>();
        // In the output's dtype (bf16 under mixed precision), made before it becomes a leaf.
        let probe = Tensor::<B, 2>::zeros([rows, d_out], &y.device())
            .cast(y.dtype())
            .require_grad();
        self.layers.push(Deferred {
            weight: weight.id,
            bias: bias.filter(|b| b.val().is_require_grad()).map(|b| b.id),
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

#[cfg(test)]
mod tests {
    use burn::backend::NdArray;
    use burn::module::Param;
    use burn::tensor::backend::{AutodiffBackend, Backend};
    use burn::tensor::{Distribution, Tensor};
    use burn_zero::engine::ZeroAutodiff;

    use super::WeightSplit;

    type A = ZeroAutodiff<NdArray>;
    type Inner = <A as AutodiffBackend>::InnerBackend;

    fn random<const D: usize>(shape: [usize; D]) -> Tensor<A, D> {
        Tensor::random(shape, Distribution::Uniform(-1.0, 1.0), &Default::default())
    }

    fn close<I: Backend, const D: usize>(a: Tensor<I, D>, b: Tensor<I, D>) {
        let (a, b) = (
            a.into_data().to_vec::<f32>().unwrap(),
            b.into_data().to_vec::<f32>().unwrap(),
        );
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-5 * x.abs().max(1.0), "{a:?}\n{b:?}");
        }
    }

    /// On a `[2, 3, 5]` input with the layer used twice: the input half's gradient of `x`
    /// and the weight half's of the weight and bias are burn's own.
    #[test]
    fn the_two_halves_give_burn_s_gradients() {
        let weight = Param::from_tensor(random([5, 5]));
        let bias = Param::from_tensor(random([5]));
        let x = random([2, 3, 5]).require_grad();
        let y = random::<3>([2, 3, 5]);
        let twice = |f: &mut dyn FnMut(Tensor<A, 3>) -> Tensor<A, 3>| {
            let h = f(x.clone()).tanh();
            (f(h) * y.clone()).sum()
        };
        let whole = twice(&mut |h| burn::tensor::module::linear(h, weight.val(), Some(bias.val())))
            .backward();
        let mut split = WeightSplit::<A>::new();
        let grads = twice(&mut |h| split.linear(h, &weight, Some(&bias))).backward();
        close(x.grad(&grads).unwrap(), x.grad(&whole).unwrap());
        assert!(
            weight.val().grad(&grads).is_none(),
            "the input half leaves the weight"
        );
        let mut halves = split.into_work(&grads).run();
        let dw = halves.remove::<Inner, 2>(weight.id).unwrap();
        let db = halves.remove::<Inner, 1>(bias.id).unwrap();
        close(dw, weight.val().grad(&whole).unwrap());
        close(db, bias.val().grad(&whole).unwrap());
    }

    /// A frozen weight runs as burn runs it and defers nothing; its trainable bias gets its
    /// gradient in the input half.
    #[test]
    fn a_frozen_weight_defers_nothing() {
        let weight = Param::from_tensor(random([5, 4])).set_require_grad(false);
        let bias = Param::from_tensor(random([4]));
        let x = random([3, 5]).require_grad();
        let mut split = WeightSplit::<A>::new();
        let grads = split.linear(x, &weight, Some(&bias)).sum().backward();
        assert!(bias.val().grad(&grads).is_some());
        assert!(split.into_work(&grads).run().is_empty());
    }
}
