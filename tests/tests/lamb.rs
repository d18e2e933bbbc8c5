//! LAMB (`optimizer.type = "Lamb"`) in the engine against a per-tensor LAMB written out here on
//! plain burn gradients of the whole batch: the trust ratio ‖w‖/‖update‖ of every parameter
//! tensor must come out the same when the tensors are cut across ranks (stages 1–2: the flat
//! buffer's chunks; stage 3: per-tensor shards), so the norms are reduced across ranks. Worlds
//! 1–3 (uneven), gradient accumulation, 5 steps, within fp32 rounding.

use std::collections::HashMap;
use std::sync::Arc;

use burn::backend::NdArray;
use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::{Tensor, TensorData};
use burn_zero::DeepSpeedConfig;
use burn_zero::comm::Communicator;
use burn_zero::engine::{ZeroAutodiff, initialize};
use burn_zero::testing::run_ranks;
use burn_zero_tests::cases::engine_run::{self, GLOBAL_BATCH};
use burn_zero_tests::cases::{Mlp, param_values};
use burn_zero_tests::engine_loop::train_step;

type B = ZeroAutodiff<NdArray>;

const STEPS: usize = 5;
const LR: f32 = 0.01;
const B1: f32 = 0.9;
const B2: f32 = 0.999;
const EPS: f32 = 1e-6;
const WD: f32 = 0.01;
/// A narrow clamp, so that some trust ratios hit it.
const MIN_COEFF: f64 = 0.05;
const MAX_COEFF: f64 = 4.0;

/// LAMB over one tensor, in the engine's order of operations.
struct TensorLamb {
    m: Vec<f32>,
    v: Vec<f32>,
}

struct Step<'a> {
    t: i32,
    grads: &'a <B as burn::tensor::backend::AutodiffBackend>::Gradients,
    state: &'a mut HashMap<ParamId, TensorLamb>,
}

impl ModuleMapper<B> for Step<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let shape = tensor.shape();
        let g: Vec<f32> = tensor
            .grad(self.grads)
            .expect("a gradient")
            .into_data()
            .to_vec()
            .unwrap();
        let mut w: Vec<f32> = tensor.clone().into_data().to_vec().unwrap();
        let n = w.len();
        let s = self.state.entry(id).or_insert_with(|| TensorLamb {
            m: vec![0.0; n],
            v: vec![0.0; n],
        });
        let (bc1, bc2) = (1.0 - B1.powi(self.t), 1.0 - B2.powi(self.t));
        let mut u = vec![0.0f32; n];
        for i in 0..n {
            s.m[i] = s.m[i] * B1 + g[i] * (1.0 - B1);
            s.v[i] = s.v[i] * B2 + g[i] * (1.0 - B2) * g[i];
            let denom = (s.v[i] / bc2).sqrt() + EPS;
            u[i] = s.m[i] / bc1 / denom + w[i] * WD;
        }
        let norm = |x: &[f32]| x.iter().map(|a| f64::from(*a).powi(2)).sum::<f64>().sqrt();
        let (wn, un) = (norm(&w), norm(&u));
        let trust = if wn > 0.0 && un > 0.0 {
            (wn / un).clamp(MIN_COEFF, MAX_COEFF)
        } else {
            1.0
        };
        let scale = LR * trust as f32;
        w.iter_mut().zip(&u).for_each(|(w, u)| *w -= u * scale);
        let device = tensor.device();
        let new = Tensor::from_data(TensorData::new(w, shape), &device).require_grad();
        Param::from_mapped_value(id, new, mapper)
    }
}

/// The whole batch on one process, LAMB per tensor: losses and final parameters.
fn reference() -> (Vec<f32>, Vec<Vec<f32>>) {
    let device = Default::default();
    let mut model = Mlp::<B>::new(&device);
    let mut state = HashMap::new();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = engine_run::batch::<B>(step, 0..GLOBAL_BATCH, &device);
        let loss = engine_run::loss(&model, x, y);
        losses.push(loss.clone().into_scalar());
        let grads = loss.backward();
        let mut mapper = Step {
            t: step as i32 + 1,
            grads: &grads,
            state: &mut state,
        };
        model = model.map(&mut mapper);
    }
    let params = param_values(&model);
    (losses, params)
}

fn config(stage: u8, gas: usize) -> DeepSpeedConfig {
    let json = format!(
        r#"{{"train_batch_size": {GLOBAL_BATCH}, "gradient_accumulation_steps": {gas},
            "gradient_clipping": 0.0,
            "optimizer": {{"type": "Lamb", "params": {{"lr": {LR}, "betas": [{B1}, {B2}],
                "eps": {EPS}, "weight_decay": {WD}, "min_coeff": {MIN_COEFF}, "max_coeff": {MAX_COEFF}}}}},
            "zero_optimization": {{"stage": {stage}, "reduce_bucket_size": 50,
                "allgather_bucket_size": 40, "stage3_param_persistence_threshold": 16}}}}"#
    );
    DeepSpeedConfig::from_json(&json).unwrap().config
}

fn close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 2e-5 * y.abs().max(1.0),
            "{what}[{i}]: {x} vs {y}"
        );
    }
}

#[test]
fn lamb_trust_ratios_survive_partitioning() {
    let (ref_losses, ref_params) = reference();
    assert!(
        ref_losses[STEPS - 1] < ref_losses[0],
        "it trains: {ref_losses:?}"
    );
    for (stage, world, gas) in [
        (0, 1, 1),
        (0, 2, 1),
        (1, 3, 2),
        (2, 2, 1),
        (2, 3, 1),
        (3, 2, 2),
        (3, 3, 1),
    ] {
        let what = format!("stage {stage}, world {world}, accumulation {gas}");
        let results = run_ranks(world, |ctx| {
            let device = Default::default();
            let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
            let model = Mlp::<B>::new(&device);
            let mut engine =
                initialize::<NdArray, _>(model, &config(stage, gas), comm.clone()).unwrap();
            let losses: Vec<f32> = (0..STEPS)
                .map(|step| train_step(&mut engine, comm.as_ref(), step, ctx.rank, world))
                .collect();
            let model = engine.into_model().unwrap();
            let params: Vec<Vec<f32>> = param_values(&model);
            (losses, params)
        });
        for (losses, params) in results {
            close(&losses, &ref_losses, &format!("{what}: losses"));
            for (i, (p, r)) in params.iter().zip(&ref_params).enumerate() {
                close(p, r, &format!("{what}: parameter {i}"));
            }
        }
    }
}

#[test]
fn lamb_is_refused_for_the_offloaded_optimizer() {
    let json = r#"{"train_batch_size": 4, "optimizer": {"type": "LAMB", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}"#;
    let err = DeepSpeedConfig::from_json(json)
        .and_then(|c| c.config.resolve(1))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("Lamb") && err.contains("offload_optimizer"),
        "{err}"
    );
}
