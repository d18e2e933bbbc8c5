//! Progressive layer dropping on the recipe's Llama: a dropped decoder layer is skipped in
//! forward (its weights do not change the loss) and in backward (its parameters get no
//! gradient), while the kept layers train as usual; keeping every layer is plain `forward`.

use burn::backend::NdArray;
use burn::module::{Module, ModuleMapper, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Int, Tensor, TensorData};
use burn_zero::engine::ZeroAutodiff;
use burn_zero::schedule::{PldConfig, ProgressiveLayerDrop};
use burn_zero_llm::model::draw_parameters;
use burn_zero_llm::{Llama, LlamaConfig};

type B = ZeroAutodiff<NdArray>;

fn tokens(device: &burn::tensor::Device<B>) -> Tensor<B, 2, Int> {
    let ids: Vec<i64> = (0..2 * 9).map(|i| (i * 7 + 3) % 24).collect();
    Tensor::from_data(TensorData::new(ids, [2, 9]), device)
}

/// Every parameter under `blocks.{i}` for `i` in `layers`, scaled by `factor`; returns how
/// many were.
fn scale_layers(model: Llama<B>, layers: &[usize], factor: f32) -> (Llama<B>, usize) {
    struct Scale<'a> {
        path: Vec<String>,
        layers: &'a [usize],
        factor: f32,
        scaled: usize,
    }
    impl ModuleMapper<B> for Scale<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let path = self.path.join(".");
            let hit = self.layers.iter().any(|l| {
                path.starts_with(&format!("blocks.{l}.")) || path == format!("blocks.{l}")
            });
            if !hit {
                return param;
            }
            self.scaled += 1;
            let (id, tensor, mapper) = param.consume();
            let scaled = tensor.mul_scalar(self.factor).detach().require_grad();
            Param::from_mapped_value(id, scaled, mapper)
        }
    }
    let mut scale = Scale {
        path: Vec::new(),
        layers,
        factor,
        scaled: 0,
    };
    let model = model.map(&mut scale);
    (model, scale.scaled)
}

#[test]
fn dropped_layers_are_skipped_in_forward_and_backward() {
    let device = Default::default();
    let model = draw_parameters(LlamaConfig::new(24, 16, 20, 4, 4, 2).init::<B>(&device));
    let keep = [true, false, true, false];
    let all = model.loss(tokens(&device)).into_scalar();
    let all_kept = model
        .loss_kept(tokens(&device), Some(&[true; 4]))
        .into_scalar();
    assert_eq!(all, all_kept, "keeping every layer is plain forward");
    let dropped = model.loss_kept(tokens(&device), Some(&keep));
    assert_ne!(
        dropped.clone().into_scalar(),
        all,
        "dropping layers changes the loss"
    );
    // The dropped layers' weights do not matter; a kept layer's do.
    let (perturbed, n) = scale_layers(model.clone(), &[1, 3], 3.0);
    assert!(n > 0, "the dropped layers have parameters");
    let same = perturbed
        .loss_kept(tokens(&device), Some(&keep))
        .into_scalar();
    assert_eq!(same, dropped.clone().into_scalar());
    let (perturbed, _) = scale_layers(model.clone(), &[2], 3.0);
    let other = perturbed
        .loss_kept(tokens(&device), Some(&keep))
        .into_scalar();
    assert_ne!(other, dropped.clone().into_scalar());
    // Backward reaches the kept layers only.
    let grads = GradientsParams::from_grads(dropped.backward(), &model);
    struct Count<'a> {
        path: Vec<String>,
        grads: &'a GradientsParams,
        with: Vec<String>,
        without: Vec<String>,
    }
    impl burn::module::ModuleVisitor<B> for Count<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let path = self.path.join(".");
            match self
                .grads
                .get::<burn_zero::ZeroBackend<NdArray>, D>(param.id)
            {
                Some(_) => self.with.push(path),
                None => self.without.push(path),
            }
        }
    }
    let mut count = Count {
        path: Vec::new(),
        grads: &grads,
        with: Vec::new(),
        without: Vec::new(),
    };
    model.visit(&mut count);
    assert!(
        count
            .without
            .iter()
            .all(|p| p.starts_with("blocks.1") || p.starts_with("blocks.3")),
        "{:?}",
        count.without
    );
    assert!(!count.without.is_empty());
    assert!(count.with.iter().any(|p| p.starts_with("blocks.0")));
    assert!(count.with.iter().any(|p| p.starts_with("blocks.2")));
    assert!(
        !count
            .with
            .iter()
            .any(|p| p.starts_with("blocks.1") || p.starts_with("blocks.3"))
    );
}

/// The config section turns the schedule on; off, nothing is dropped.
#[test]
fn the_config_section_enables_the_schedule() {
    let on = burn_zero::DeepSpeedConfig::from_json(
        r#"{"train_batch_size": 1, "progressive_layer_drop": {"enabled": true, "theta": 0.6, "gamma": 0.01}}"#,
    )
    .unwrap()
    .config;
    let pld = ProgressiveLayerDrop::from_config(&on.progressive_layer_drop).expect("enabled");
    assert_eq!((pld.theta, pld.gamma), (0.6, 0.01));
    assert!(ProgressiveLayerDrop::from_config(&PldConfig::default()).is_none());
    let bad = burn_zero::DeepSpeedConfig::from_json(
        r#"{"train_batch_size": 1, "progressive_layer_drop": {"enabled": true, "theta": 1.5}}"#,
    )
    .unwrap_err()
    .to_string();
    assert!(bad.contains("progressive_layer_drop.theta"), "{bad}");
}
