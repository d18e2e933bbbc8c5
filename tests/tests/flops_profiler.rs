//! The FLOPs profiler (`flops_profiler`) against counts worked out by hand: an MLP (MACs,
//! FLOPs of the products, biases and activation; parameters per layer; backward MACs) and a
//! small Llama (parameters and MACs of every projection, attention and the head), on 2 thread
//! ranks, with the report printed in DeepSpeed's layout to `output_file`; and
//! `wall_clock_breakdown`'s phases (forward, backward, the reduce inside it, step) measured.

use std::sync::Arc;

use burn::backend::NdArray;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData, activation::relu};
use burn_zero::DeepSpeedConfig;
use burn_zero::comm::Communicator;
use burn_zero::engine::{ZeroAutodiff, initialize};
use burn_zero::profile::{Profile, scope};
use burn_zero::testing::run_ranks;
use burn_zero_llm::LlamaConfig;
use burn_zero_llm::data::synthetic_ids;
use burn_zero_llm::model::draw_parameters;

type B = ZeroAutodiff<NdArray>;

fn config(stage: u8, output: &std::path::Path) -> DeepSpeedConfig {
    let json = format!(
        r#"{{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}},
            "zero_optimization": {{"stage": {stage}}},
            "flops_profiler": {{"enabled": true, "profile_step": 1, "module_depth": -1,
                "top_modules": 2, "detailed": true, "output_file": "{}"}}}}"#,
        output.display()
    );
    DeepSpeedConfig::from_json(&json).unwrap().config
}

#[derive(Module, Debug)]
struct TwoLayers<B: Backend> {
    fc1: Linear<B>,
    fc2: Linear<B>,
}

const BATCH: usize = 4;
const IN: usize = 5;
const HIDDEN: usize = 7;
const OUT: usize = 3;

impl<B: Backend> TwoLayers<B> {
    fn loss(&self, x: Tensor<B, 2>) -> Tensor<B, 1> {
        let h = relu(scope("fc1", || self.fc1.forward(x)));
        // A sum: reductions count nothing, so the loss adds no FLOPs.
        scope("fc2", || self.fc2.forward(h)).sum()
    }
}

fn profiled<T: Send>(world: usize, f: impl Fn(Arc<dyn Communicator>) -> T + Sync) -> Vec<T> {
    run_ranks(world, |ctx| f(Arc::new(ctx.comm)))
}

#[test]
fn an_mlp_counts_what_is_worked_out_by_hand() {
    let dir = std::env::temp_dir().join(format!("bz-flops-mlp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let report = dir.join("profile.txt");
    let profiles: Vec<(Profile, burn_zero::engine::Timings)> = profiled(2, |comm| {
        let device = Default::default();
        let model = TwoLayers::<B> {
            fc1: LinearConfig::new(IN, HIDDEN).init(&device),
            fc2: LinearConfig::new(HIDDEN, OUT).init(&device),
        };
        let mut engine = initialize::<NdArray, _>(model, &config(2, &report), comm).unwrap();
        for step in 0..3 {
            let values: Vec<f32> = (0..BATCH * IN).map(|i| (i + step) as f32 * 0.01).collect();
            let x = Tensor::<B, 2>::from_data(TensorData::new(values, [BATCH, IN]), &device);
            let loss = engine.model().loss(x);
            engine.backward(loss).unwrap();
            engine.step().unwrap();
        }
        let profile = engine
            .flops_profile()
            .cloned()
            .expect("step 1 was profiled");
        (profile, engine.take_timings())
    });
    let (fc1_macs, fc2_macs) = (BATCH * IN * HIDDEN, BATCH * HIDDEN * OUT);
    for (p, t) in profiles {
        let zero = std::time::Duration::ZERO;
        let phases = t.forward > zero && t.step > zero;
        assert!(phases && t.backward > t.reduce && t.reduce > zero, "{t:?}");
        assert_eq!(p.step, 2, "the second step (one completed before it)");
        let (fc1, fc2, model) = (p.modules["fc1"], p.modules["fc2"], p.model());
        assert_eq!(
            (fc1.params, fc2.params),
            ((IN * HIDDEN + HIDDEN) as u64, (HIDDEN * OUT + OUT) as u64)
        );
        assert_eq!(model.params, fc1.params + fc2.params);
        assert_eq!((fc1.macs, fc2.macs), (fc1_macs as u64, fc2_macs as u64));
        // 2 per MAC, plus each bias add; the ReLU between the scopes counts for the model.
        assert_eq!(fc1.flops, (2 * fc1_macs + BATCH * HIDDEN) as u64);
        assert_eq!(fc2.flops, (2 * fc2_macs + BATCH * OUT) as u64);
        assert_eq!(model.flops, fc1.flops + fc2.flops + (BATCH * HIDDEN) as u64);
        assert_eq!(model.macs, (fc1_macs + fc2_macs) as u64);
        // Backward: both weight gradients and fc2's input gradient (the input needs none).
        assert_eq!(p.bwd_macs, (fc1_macs + 2 * fc2_macs) as u64);
        assert!(p.fwd_s > 0.0 && p.bwd_s > 0.0 && p.step_s > 0.0);
        assert!(fc1.latency_s > 0.0 && fc1.latency_s <= p.fwd_s);
    }
    let text = std::fs::read_to_string(&report).unwrap();
    for needle in [
        "Profile Summary at step 2",
        "fwd MACs per GPU:",
        "depth 1:",
        "fc1: 42.00, ",
    ] {
        assert!(text.contains(needle), "`{needle}` missing from\n{text}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_small_llama_counts_every_product_by_hand() {
    let (vocab, h, inter, layers, heads, kv) = (37, 24, 40, 2, 6, 2);
    let (batch, seq) = (BATCH, 9);
    let config = LlamaConfig::new(vocab, h, inter, layers, heads, kv);
    let dir = std::env::temp_dir().join(format!("bz-flops-llama-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let report = dir.join("profile.txt");
    let profiles: Vec<Profile> = profiled(1, |comm| {
        let device = Default::default();
        let model = draw_parameters(config.init::<B>(&device));
        let mut engine = initialize::<NdArray, _>(model, &self::config(3, &report), comm).unwrap();
        for step in 0..2 {
            let ids = synthetic_ids(step as u64 + 1, batch * (seq + 1), vocab);
            let tokens =
                Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [batch, seq + 1]), &device);
            let loss = engine.model().loss(tokens);
            engine.backward(loss).unwrap();
            engine.step().unwrap();
        }
        engine
            .flops_profile()
            .cloned()
            .expect("step 1 was profiled")
    });
    let p = &profiles[0];
    let (t, hd) = ((batch * seq) as u64, (h / heads) as u64);
    let (h, inter, vocab, kvw) = (
        h as u64,
        inter as u64,
        vocab as u64,
        (kv * h / heads) as u64,
    );
    let get = |path: &str| p.modules.get(path).copied().unwrap_or_default();
    for l in 0..layers {
        let b = |m: &str| get(&format!("blocks.{l}.{m}"));
        assert_eq!(
            [b("q").macs, b("k").macs, b("v").macs, b("o").macs],
            [t * h * h, t * h * kvw, t * h * kvw, t * h * h]
        );
        assert_eq!(
            [b("gate").macs, b("up").macs, b("down").macs],
            [t * h * inter, t * h * inter, t * inter * h]
        );
        assert_eq!(
            [
                b("q").params,
                b("k").params,
                b("o").params,
                b("down").params
            ],
            [h * h, h * kvw, h * h, inter * h]
        );
        assert_eq!(b("attn_norm").params, h);
        // The block itself adds the attention products: QKᵀ and AV over every query head.
        let attention = 2 * batch as u64 * heads as u64 * seq as u64 * seq as u64 * hd;
        let projections = 2 * t * h * h + 2 * t * h * kvw + 3 * t * h * inter;
        assert_eq!(get(&format!("blocks.{l}")).macs, projections + attention);
    }
    // Tied embeddings: the head multiplies by the embedding table and holds no parameters.
    assert_eq!(
        (get("lm_head").macs, get("lm_head").params),
        (t * h * vocab, 0)
    );
    assert_eq!(get("embed").params, vocab * h);
    let block_params = 2 * h + 2 * h * h + 2 * h * kvw + 3 * h * inter;
    assert_eq!(
        p.model().params,
        vocab * h + layers as u64 * block_params + h
    );
    let blocks: u64 = (0..layers).map(|l| get(&format!("blocks.{l}")).macs).sum();
    assert_eq!(p.model().macs, blocks + t * h * vocab);
    let text = std::fs::read_to_string(&report).unwrap();
    assert!(
        text.contains("blocks.1.down") && text.contains("depth 3:"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
