//! A backward split in two, for zero-bubble schedules: the input-gradient half runs the graph
//! with the split linear layers' weights held constant and records, per layer, its input and
//! the gradient of its output; the weight-gradient half turns those into the weights' and
//! biases' gradients (`xᵀ·dy`, `Σ dy`) when the schedule finds the time.
//!
//! The gradient of a layer's output comes from a zero "probe" leaf added to it: adding zero
//! changes no value, and the probe's gradient is exactly `dy`. Everything else of the stage
//! (norms, embeddings, layers not routed here) gets its gradient in the input half.

use std::any::Any;
use std::sync::{Arc, Mutex};

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
/// [`crate::PipeStage::forward_split`], and a checkpointed layer's recompute through
/// [`WeightSplit::recompute`]'s projector.
pub struct WeightSplit<B: AutodiffBackend> {
    layers: Vec<Deferred<B>>,
    /// Layers split inside checkpointed modules, their output gradients already read from the
    /// recompute's own backward ([`RecomputeSplit::resolve`]).
    resolved: Arc<Mutex<Vec<LayerWork<B>>>>,
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

/// `x · weight + bias` with the weight and bias held constant and a zero probe leaf added to
/// the output, and what the weight half needs of it; `None` for a frozen weight, which is
/// applied as burn applies it.
fn split_linear<B: AutodiffBackend, const D: usize>(
    x: Tensor<B, D>,
    weight: &Param<Tensor<B, 2>>,
    bias: Option<&Param<Tensor<B, 1>>>,
) -> (Tensor<B, D>, Option<Deferred<B>>) {
    if !weight.val().is_require_grad() {
        return (module::linear(x, weight.val(), bias.map(Param::val)), None);
    }
    let [d_in, d_out] = weight.dims();
    // Untracked copies: burn's `detach` keeps `require_grad`, so a detached weight is a new
    // leaf whose gradient the input half would still compute (and drop).
    let y = module::linear(
        x.clone(),
        weight.val().detach().set_require_grad(false),
        bias.map(|b| b.val().detach().set_require_grad(false)),
    );
    let dims = y.dims();
    let rows = dims[..D - 1].iter().product::<usize>();
    // In the output's dtype (bf16 under mixed precision), made before it becomes a leaf.
    let probe = Tensor::<B, 2>::zeros([rows, d_out], &y.device())
        .cast(y.dtype())
        .require_grad();
    let deferred = Deferred {
        weight: weight.id,
        bias: bias.filter(|b| b.val().is_require_grad()).map(|b| b.id),
        x: x.detach().inner().reshape([rows, d_in]),
        probe: probe.clone(),
    };
    (y + probe.reshape(dims), Some(deferred))
}

impl<B: AutodiffBackend> Deferred<B> {
    /// With its output gradient read from `grads` (zeros if the output took no part).
    fn resolve(self, grads: &B::Gradients) -> LayerWork<B> {
        let dy = self.probe.grad(grads).unwrap_or_else(|| {
            Tensor::<B, 2>::zeros(self.probe.dims(), &self.probe.device()).inner()
        });
        (self.weight, self.bias, self.x, dy)
    }
}

impl<B: AutodiffBackend> Default for WeightSplit<B> {
    fn default() -> Self {
        Self::new()
    }
}

impl<B: AutodiffBackend> WeightSplit<B> {
    /// A split with nothing deferred yet (the executor makes one per micro-batch's forward).
    pub fn new() -> Self {
        Self {
            layers: Vec::new(),
            resolved: Arc::default(),
        }
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
        let (y, deferred) = split_linear(x, weight, bias);
        self.layers.extend(deferred);
        y
    }

    /// The projector for one checkpointed module's recompute (`burn_zero::nn::checkpoint_then`
    /// with [`RecomputeSplit::resolve`] as its `after`): its layers defer their weights'
    /// gradients to this split's weight half like [`WeightSplit::linear`]'s, their output
    /// gradients read from the recompute's own backward.
    pub fn recompute(&self) -> RecomputeSplit<B> {
        RecomputeSplit {
            pending: Arc::default(),
            resolved: self.resolved.clone(),
        }
    }

    /// Layers whose weight gradients wait for the weight half so far (those of checkpointed
    /// modules count once their recompute has run, in the input half's backward).
    pub fn deferred(&self) -> usize {
        self.layers.len() + self.resolved.lock().map_or(0, |r| r.len())
    }

    /// After the input half's backward: each layer's output gradient, taken from `grads`.
    pub(crate) fn into_work(self, grads: &B::Gradients) -> WeightWork<B> {
        let mut layers: Vec<LayerWork<B>> =
            self.layers.into_iter().map(|l| l.resolve(grads)).collect();
        layers.append(&mut self.resolved.lock().unwrap_or_else(|e| e.into_inner()));
        WeightWork { layers }
    }
}

/// A checkpointed module's split layers ([`WeightSplit::recompute`]). Its forward runs twice:
/// without a graph (the layers' weights are then untracked, and nothing is recorded), and as
/// the recompute inside the outer backward, whose layers record their input and a probe;
/// [`RecomputeSplit::resolve`] then reads the probes' gradients from the recompute's backward.
pub struct RecomputeSplit<B: AutodiffBackend> {
    pending: Arc<Mutex<Vec<Deferred<B>>>>,
    resolved: Arc<Mutex<Vec<LayerWork<B>>>>,
}

impl<B: AutodiffBackend> Clone for RecomputeSplit<B> {
    fn clone(&self) -> Self {
        Self {
            pending: self.pending.clone(),
            resolved: self.resolved.clone(),
        }
    }
}

impl<B: AutodiffBackend> RecomputeSplit<B> {
    /// A recorder of its own that keeps its layers for the same weight half.
    pub fn fresh(&self) -> Self {
        Self {
            pending: Arc::default(),
            resolved: self.resolved.clone(),
        }
    }

    /// [`WeightSplit::linear`] inside the recompute.
    pub fn linear<const D: usize>(
        &self,
        x: Tensor<B, D>,
        weight: &Param<Tensor<B, 2>>,
        bias: Option<&Param<Tensor<B, 1>>>,
    ) -> Tensor<B, D> {
        let (y, deferred) = split_linear(x, weight, bias);
        if let Some(d) = deferred {
            self.pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(d);
        }
        y
    }

    /// After the recompute's backward, with its gradients (`B::Gradients` as `&dyn Any`, what
    /// `checkpoint_then` hands over): the recorded layers' output gradients, kept for the
    /// weight half.
    ///
    /// # Panics
    /// If `grads` is not `B`'s gradients.
    pub fn resolve(&self, grads: &dyn Any) {
        let grads = grads
            .downcast_ref::<B::Gradients>()
            .expect("the recompute's gradients are the stage backend's");
        let pending = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|e| e.into_inner()));
        let mut resolved = self.resolved.lock().unwrap_or_else(|e| e.into_inner());
        resolved.extend(pending.into_iter().map(|d| d.resolve(grads)));
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

    /// The same layer used twice inside a checkpointed module, split in the recompute: the
    /// input half's gradient of `x` and the weight half's of the weight and bias are burn's
    /// own (unscaled: a pipeline's Adam would not see a gradient off by a constant factor),
    /// and nothing is deferred by the forward that keeps no graph.
    #[test]
    fn a_checkpointed_module_s_split_layers_give_burn_s_gradients() {
        use burn::nn::{Linear, LinearConfig};
        let layer: Linear<A> = LinearConfig::new(5, 5).init(&Default::default());
        let x = random([2, 3, 5]).require_grad();
        let y = random::<3>([2, 3, 5]);
        let whole = (layer.forward(layer.forward(x.clone()).tanh()) * y.clone())
            .sum()
            .backward();
        let split = WeightSplit::<A>::new();
        let recorder = split.recompute().fresh();
        let resolver = recorder.clone();
        let out = burn_zero::nn::checkpoint_then(
            &layer,
            x.clone(),
            move |m: &Linear<A>, h| {
                let h = recorder.linear(h, &m.weight, m.bias.as_ref()).tanh();
                recorder.linear(h, &m.weight, m.bias.as_ref())
            },
            move |grads| resolver.resolve(grads),
        );
        assert_eq!(
            split.deferred(),
            0,
            "the forward without a graph records nothing"
        );
        let grads = (out * y).sum().backward();
        assert_eq!(split.deferred(), 2);
        close(x.grad(&grads).unwrap(), x.grad(&whole).unwrap());
        assert!(layer.weight.val().grad(&grads).is_none());
        let mut halves = split.into_work(&grads).run();
        let bias = layer.bias.as_ref().unwrap();
        close(
            halves.remove::<Inner, 2>(layer.weight.id).unwrap(),
            layer.weight.val().grad(&whole).unwrap(),
        );
        close(
            halves.remove::<Inner, 1>(bias.id).unwrap(),
            bias.val().grad(&whole).unwrap(),
        );
    }

    /// The products each half runs (counted by `ZeroBackend`'s FLOPs profiler), for two
    /// `64 × 64` layers on 8 rows inside a checkpointed module: the fused backward recomputes
    /// the forward and takes each layer's `dX` and `dW` (6 products of 8·64·64); the input
    /// half recomputes and takes `dX` only (4), the weight half `dW` (2). Until the split's
    /// weights were made untracked (burn's `detach` keeps `require_grad`) the input half ran
    /// 6: the `dW` products too, into leaves nobody read, which is why on GPUs it cost as much
    /// as the fused backward (bench/README, ZB-H1's split).
    #[test]
    fn the_input_half_of_a_checkpointed_module_runs_two_thirds_of_the_products() {
        use burn::nn::{Linear, LinearConfig};
        use burn_zero::profile::{Phase, set_phase, start, stop};
        let unit = 8 * 64 * 64;
        let layer: Linear<A> = LinearConfig::new(64, 64).init(&Default::default());
        let x = random([8, 64]).require_grad();
        let backward_macs = |out: Tensor<A, 2>| {
            let out = out.sum();
            start(None);
            set_phase(Phase::Backward);
            let grads = out.backward();
            let macs: u64 = stop().values().map(|c| c.macs).sum();
            (grads, macs)
        };
        let (_, fused) = backward_macs(burn_zero::nn::checkpoint_then(
            &layer,
            x.clone(),
            |m: &Linear<A>, h| m.forward(m.forward(h).tanh()),
            |_| {},
        ));
        let split = WeightSplit::<A>::new();
        let recorder = split.recompute().fresh();
        let resolver = recorder.clone();
        let (grads, input_half) = backward_macs(burn_zero::nn::checkpoint_then(
            &layer,
            x.clone(),
            move |m: &Linear<A>, h| {
                let h = recorder.linear(h, &m.weight, m.bias.as_ref()).tanh();
                recorder.linear(h, &m.weight, m.bias.as_ref())
            },
            move |grads| resolver.resolve(grads),
        ));
        start(None);
        let _ = split.into_work(&grads).run();
        let weight_half: u64 = stop().values().map(|c| c.macs).sum();
        assert_eq!(fused, 6 * unit, "fused");
        assert_eq!(input_half, 4 * unit, "input half");
        assert_eq!(weight_half, 2 * unit, "weight half");
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
