//! LoRA (Hu et al., 2021): each chosen projection `x·W` becomes `x·W + (α/r)·x·A·B` with `W`
//! frozen, `A` `[in, r]` random and `B` `[r, out]` zero, so training starts from the loaded
//! model exactly and only `A`, `B` (a few per cent of the parameters) get gradients and
//! optimizer state. [`Llama::merge_lora`] folds the adapters back into `W` for export.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};

use crate::model::{Block, Llama, Projector};

/// The projections of a decoder layer that can carry an adapter (Hugging Face names).
pub const TARGETS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// Which projections get adapters, of what rank and scale.
#[derive(Config, Debug, PartialEq)]
pub struct LoraConfig {
    /// `r`: the inner dimension of `A·B`.
    pub rank: usize,
    /// `α`: the update is scaled by `α / r`.
    #[config(default = 16.0)]
    pub alpha: f64,
    /// Projections to adapt, from [`TARGETS`].
    #[config(default = "TARGETS.iter().map(|s| s.to_string()).collect()")]
    pub targets: Vec<String>,
}

impl LoraConfig {
    /// Checks the rank and the target names; the error names the bad value.
    pub fn validate(&self) -> Result<(), String> {
        if self.rank == 0 {
            return Err("LoRA rank must be at least 1".into());
        }
        if let Some(bad) = self.targets.iter().find(|t| !TARGETS.contains(&t.as_str())) {
            return Err(format!(
                "unknown LoRA target `{bad}`; known: {}",
                TARGETS.join(", ")
            ));
        }
        if self.targets.is_empty() {
            return Err("no LoRA targets".into());
        }
        Ok(())
    }
}

/// One adapter: `x ↦ (α/r)·x·A·B`.
#[derive(Module, Debug)]
pub struct Adapter<B: Backend> {
    /// `[in, r]`.
    pub a: Param<Tensor<B, 2>>,
    /// `[r, out]`, zero at the start.
    pub b: Param<Tensor<B, 2>>,
    scale: f64,
}

impl<B: Backend> Adapter<B> {
    fn new(linear: &Linear<B>, config: &LoraConfig, device: &B::Device) -> Self {
        let [inp, out] = linear.weight.dims();
        // Kaiming-uniform bound for a fan-in of `inp` (what PEFT uses for A).
        let bound = (3.0 / inp as f64).sqrt();
        let a = Tensor::random(
            [inp, config.rank],
            Distribution::Uniform(-bound, bound),
            device,
        );
        Self {
            a: Param::from_tensor(a),
            b: Param::from_tensor(Tensor::zeros([config.rank, out], device)),
            scale: config.alpha / config.rank as f64,
        }
    }

    /// The adapter's update of a projection's output.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let a = self.a.val().unsqueeze::<D>();
        let b = self.b.val().unsqueeze::<D>();
        x.matmul(a).matmul(b) * self.scale
    }

    /// `(α/r)·A·B`, the change of `W` (`[in, out]`).
    fn delta(&self) -> Tensor<B, 2> {
        self.a.val().matmul(self.b.val()) * self.scale
    }
}

/// The adapters of one decoder layer, by projection.
#[derive(Module, Debug)]
pub struct Adapters<B: Backend> {
    pub(crate) q: Option<Adapter<B>>,
    pub(crate) k: Option<Adapter<B>>,
    pub(crate) v: Option<Adapter<B>>,
    pub(crate) o: Option<Adapter<B>>,
    pub(crate) gate: Option<Adapter<B>>,
    pub(crate) up: Option<Adapter<B>>,
    pub(crate) down: Option<Adapter<B>>,
}

impl<B: Backend> Block<B> {
    /// The adapter that `pick` selects from this layer's adapters, if any.
    pub(crate) fn adapter(
        &self,
        pick: fn(&Adapters<B>) -> &Option<Adapter<B>>,
    ) -> Option<&Adapter<B>> {
        self.lora.as_ref().and_then(|l| pick(l).as_ref())
    }
}

/// `linear(x)`, applied by `projector`, plus the adapter's update, if any.
pub(crate) fn project<B: Backend, const D: usize>(
    projector: &mut impl Projector<B>,
    linear: &Linear<B>,
    adapter: Option<&Adapter<B>>,
    x: Tensor<B, D>,
) -> Tensor<B, D> {
    match adapter {
        Some(adapter) => {
            let base = projector.linear(x.clone(), &linear.weight, linear.bias.as_ref());
            base + adapter.forward(x)
        }
        None => projector.linear(x, &linear.weight, linear.bias.as_ref()),
    }
}

/// The projection's weight `[in, out]` with the adapter's update added (no gradient).
pub(crate) fn merged_weight<B: Backend>(
    linear: &Linear<B>,
    adapter: Option<&Adapter<B>>,
) -> Tensor<B, 2> {
    let w = linear.weight.val().detach();
    match adapter {
        Some(adapter) => w + adapter.delta().detach(),
        None => w,
    }
}

/// Folds `adapter` into `linear`'s weight, keeping the weight's id and gradient flag.
fn fold<B: Backend>(linear: &mut Linear<B>, adapter: Option<Adapter<B>>) {
    let Some(adapter) = adapter else {
        return;
    };
    let w = merged_weight(linear, Some(&adapter));
    let grad = linear.weight.val().is_require_grad();
    linear.weight = Param::initialized(linear.weight.id, w.set_require_grad(grad));
}

impl<B: Backend> Llama<B> {
    /// This model with adapters per `config` on every layer and every other parameter frozen
    /// (no gradient, so the engine neither reduces nor optimizes them).
    pub fn with_lora(self, config: &LoraConfig, device: &B::Device) -> Result<Self, String> {
        config.validate()?;
        let mut model = self.no_grad();
        let wants = |name: &str| config.targets.iter().any(|t| t == name);
        for block in model.blocks.iter_mut() {
            let make = |name: &str, linear: &Linear<B>| {
                wants(name).then(|| Adapter::new(linear, config, device))
            };
            block.lora = Some(Adapters {
                q: make("q_proj", &block.q),
                k: make("k_proj", &block.k),
                v: make("v_proj", &block.v),
                o: make("o_proj", &block.o),
                gate: make("gate_proj", &block.gate),
                up: make("up_proj", &block.up),
                down: make("down_proj", &block.down),
            });
        }
        Ok(model)
    }

    /// The model with each adapter folded into its projection (`W + (α/r)·A·B`) and removed:
    /// the same function, in the plain Llama layout that export and `transformers` read.
    pub fn merge_lora(mut self) -> Self {
        for block in self.blocks.iter_mut() {
            let Some(lora) = block.lora.take() else {
                continue;
            };
            fold(&mut block.q, lora.q);
            fold(&mut block.k, lora.k);
            fold(&mut block.v, lora.v);
            fold(&mut block.o, lora.o);
            fold(&mut block.gate, lora.gate);
            fold(&mut block.up, lora.up);
            fold(&mut block.down, lora.down);
        }
        self
    }

    /// Parameters that get gradients (all, or the adapters under LoRA).
    pub fn num_trainable(&self) -> usize {
        struct Count(usize);
        impl<B: Backend> burn::module::ModuleVisitor<B> for Count {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                if param.val().is_require_grad() {
                    self.0 += param.val().shape().num_elements();
                }
            }
        }
        let mut count = Count(0);
        self.visit(&mut count);
        count.0
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::{Int, TensorData, Tolerance};

    use super::*;
    use crate::LlamaConfig;

    type B = Autodiff<NdArray>;

    fn tokens(device: &burn::backend::ndarray::NdArrayDevice) -> Tensor<B, 2, Int> {
        Tensor::from_data(
            TensorData::new(vec![3i64, 1, 4, 1, 5, 9, 2, 6], [2, 4]),
            device,
        )
    }

    fn small() -> LlamaConfig {
        LlamaConfig::new(11, 12, 20, 2, 2, 1)
    }

    #[test]
    fn adapters_start_as_the_identity_and_freeze_the_rest() {
        let device = Default::default();
        let base: Llama<B> = small().init(&device);
        let before = base.forward(tokens(&device));
        let total = base.num_trainable();
        let lora = base
            .with_lora(
                &LoraConfig::new(3).with_targets(vec!["q_proj".into(), "down_proj".into()]),
                &device,
            )
            .unwrap();
        lora.forward(tokens(&device))
            .into_data()
            .assert_approx_eq::<f32>(&before.into_data(), Tolerance::absolute(0.0));
        // Per layer: q (12→12) and down (20→12) adapters of rank 3.
        assert_eq!(lora.num_trainable(), 2 * (3 * (12 + 12) + 3 * (20 + 12)));
        assert!(lora.num_trainable() < total);
    }

    #[test]
    fn merging_keeps_the_function() {
        let device = Default::default();
        B::seed(&device, 7);
        let mut lora = small()
            .init::<B>(&device)
            .with_lora(&LoraConfig::new(2), &device)
            .unwrap();
        // Nonzero B everywhere, as after training.
        for block in lora.blocks.iter_mut() {
            let adapters = block.lora.as_mut().unwrap();
            for a in [
                &mut adapters.q,
                &mut adapters.k,
                &mut adapters.v,
                &mut adapters.o,
            ]
            .into_iter()
            .chain([&mut adapters.gate, &mut adapters.up, &mut adapters.down])
            {
                let a = a.as_mut().unwrap();
                let dims = a.b.dims();
                a.b = Param::from_tensor(Tensor::random(
                    dims,
                    Distribution::Uniform(-0.5, 0.5),
                    &device,
                ));
            }
        }
        let with = lora.forward(tokens(&device));
        // The export folds the adapters in: a plain Llama directory with the same function.
        // Folding `W + s·A·B` and running `x·W + s·(x·A)·B` round differently, by an amount
        // that grows with the logits (~2e-4 was seen at |logit| 1.4 with B in [0, 1)); the
        // random draw is not fixed (other tests share the global generator), so the tolerance
        // is 1e-3: a scale off by 1% already moves them by ~5e-2.
        let dir = std::env::temp_dir().join(format!("bz-lora-{}", std::process::id()));
        lora.save_hf(&small(), &dir).unwrap();
        let source = crate::hf::HfDir::open(&dir).unwrap();
        let loaded: Llama<B> = small().load(&source, &device).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        loaded
            .forward(tokens(&device))
            .into_data()
            .assert_approx_eq::<f32>(&with.clone().into_data(), Tolerance::rel_abs(1e-3, 1e-3));
        let merged = lora.merge_lora();
        assert!(merged.blocks.iter().all(|b| b.lora.is_none()));
        merged
            .forward(tokens(&device))
            .into_data()
            .assert_approx_eq::<f32>(&with.into_data(), Tolerance::rel_abs(1e-3, 1e-3));
    }

    #[test]
    fn bad_configs_are_named() {
        let device = Default::default();
        let model = small().init::<B>(&device);
        let err = model
            .clone()
            .with_lora(&LoraConfig::new(0), &device)
            .unwrap_err();
        assert!(err.contains("rank"), "{err}");
        let err = model
            .with_lora(
                &LoraConfig::new(2).with_targets(vec!["qkv".into()]),
                &device,
            )
            .unwrap_err();
        assert!(err.contains("`qkv`") && err.contains("q_proj"), "{err}");
    }
}
