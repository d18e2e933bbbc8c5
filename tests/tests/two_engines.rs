//! Two engines in one process, alive at once on their own threads with different stages and
//! `burn_zero` settings: each keeps its own. The op settings its model's ops read are its
//! config's (none leaks from the engine initialized last), its stage's buffers are its own, it
//! trains exactly as it does alone, and a thread's settings are put back when its engine drops.

use std::sync::{Arc, Barrier};

use burn::backend::NdArray;
use burn::tensor::Tensor;
use burn_zero::DeepSpeedConfig;
use burn_zero::attention::flash_chosen;
use burn_zero::backend::settings::{self, OpSettings};
use burn_zero::comm::Communicator;
use burn_zero::engine::{ZeroAutodiff, initialize};
use burn_zero::testing::run_ranks;
use burn_zero_tests::cases::Mlp;
use burn_zero_tests::cases::engine_run;

type B = ZeroAutodiff<NdArray>;

const WORLD: usize = 2;
const STEPS: usize = 3;

/// Stage 1, flash attention forced on, CUDA-core attention, a small cuBLASLt threshold, host
/// collectives, no fused Adam and a sparse-attention layout.
const A: &str = r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    "zero_optimization": {"stage": 1},
    "sparse_attention": {"mode": "fixed", "block": 16},
    "burn_zero": {"flash_attention": true, "attention_tensor_cores": false,
                  "host_collectives": true, "fused_adam": false,
                  "matmul": {"min_macs": 7, "sm_margin": 2, "tune": false}}}"#;

/// Stage 3, flash attention off, everything else by default.
const B_CONFIG: &str = r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 0.02}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "burn_zero": {"flash_attention": false}}"#;

/// What one rank saw.
#[derive(Debug, PartialEq)]
struct Seen {
    before: OpSettings,
    during: Vec<OpSettings>,
    flash: bool,
    gradient_bytes: usize,
    losses: Vec<f32>,
    after: OpSettings,
}

fn config(text: &str) -> DeepSpeedConfig {
    DeepSpeedConfig::parse_json(text).unwrap().config
}

/// Trains `STEPS` steps of `text`'s engine on this rank; with `barrier`, waits after
/// initializing and before dropping for the other group's ranks, so that both engines live at
/// once through the whole run.
fn train(rank: usize, comm: Arc<dyn Communicator>, text: &str, barrier: Option<&Barrier>) -> Seen {
    let device = Default::default();
    let before = settings::current();
    let mut engine = initialize::<NdArray, _>(Mlp::<B>::new(&device), &config(text), comm).unwrap();
    if let Some(b) = barrier {
        b.wait();
    }
    let micro = engine.config().batch.micro_batch_per_gpu;
    let (mut during, mut losses) = (Vec::new(), Vec::new());
    for step in 0..STEPS {
        let start = rank * micro;
        let (x, y) = engine_run::batch::<B>(step, start..start + micro, &device);
        let loss: Tensor<B, 1> = engine_run::loss(engine.model(), x, y);
        // What an op dispatched from this thread reads now, mid-forward.
        during.push(settings::current());
        losses.push(loss.clone().into_scalar());
        engine.backward(loss).unwrap();
        engine.step().unwrap();
    }
    let flash = flash_chosen(64, 128, false);
    let gradient_bytes = engine.memory_report().gradients;
    if let Some(b) = barrier {
        b.wait();
    }
    drop(engine);
    Seen {
        before,
        during,
        flash,
        gradient_bytes,
        losses,
        after: settings::current(),
    }
}

fn alone(text: &'static str) -> Vec<Seen> {
    run_ranks(WORLD, |ctx| train(ctx.rank, Arc::new(ctx.comm), text, None))
}

#[test]
fn two_engines_in_one_process_keep_their_own_settings() {
    let barrier = Arc::new(Barrier::new(2 * WORLD));
    let group = |text: &'static str| {
        let barrier = barrier.clone();
        std::thread::spawn(move || {
            run_ranks(WORLD, |ctx| {
                train(ctx.rank, Arc::new(ctx.comm), text, Some(&barrier))
            })
        })
    };
    let (a, b) = (group(A), group(B_CONFIG));
    let (a, b) = (a.join().unwrap(), b.join().unwrap());

    let want_a = OpSettings::of(&config(A).resolve(WORLD).unwrap());
    let want_b = OpSettings::of(&config(B_CONFIG).resolve(WORLD).unwrap());
    assert_ne!(want_a, want_b, "the two configs ask for different settings");
    assert!(!want_a.attention_tensor_cores && want_a.matmul.min_macs == 7);
    assert!(want_a.sparse_attention.is_some() && want_b.sparse_attention.is_none());
    for (name, seen, want, flash) in [("A", &a, &want_a, true), ("B", &b, &want_b, false)] {
        for (rank, s) in seen.iter().enumerate() {
            let what = format!("engine {name}, rank {rank}");
            assert!(s.during.iter().all(|d| d == want), "{what}: {:?}", s.during);
            assert_eq!(s.flash, flash, "{what}: flash attention chosen");
            assert_eq!(s.before, OpSettings::default(), "{what}: a fresh thread");
            assert_eq!(
                s.after, s.before,
                "{what}: put back when the engine dropped"
            );
        }
    }
    // Stage 1 keeps the whole gradient; stage 3 this rank's partition of it.
    assert!(
        a[0].gradient_bytes > b[0].gradient_bytes,
        "{} vs {}",
        a[0].gradient_bytes,
        b[0].gradient_bytes
    );
    // Each trains as it does alone, to the bit.
    for (name, together, alone) in [("A", &a, alone(A)), ("B", &b, alone(B_CONFIG))] {
        for (rank, (t, s)) in together.iter().zip(&alone).enumerate() {
            assert_eq!(t.losses, s.losses, "engine {name}, rank {rank}");
        }
    }
}

/// `burn_zero.comm_timeout_s` is the engine's: a rank whose config says half a second stops
/// waiting for a rank that does not come after about that long (its group's communicators
/// would wait 300 s), names it, and carries its flight record.
#[test]
fn comm_timeout_s_bounds_the_wait_for_a_missing_rank() {
    use burn_zero::comm::{CommError, LocalGroup};
    use std::time::{Duration, Instant};
    let group = LocalGroup::new(WORLD);
    assert_eq!(group.comm(0).timeout(), Duration::from_secs(300));
    let text = r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 2}, "burn_zero": {"comm_timeout_s": 0.5}}"#;
    let comm: Arc<dyn Communicator> = Arc::new(group.comm(0));
    let device = Default::default();
    let started = Instant::now();
    let result = initialize::<NdArray, _>(Mlp::<B>::new(&device), &config(text), comm.clone());
    let waited = started.elapsed();
    assert_eq!(comm.timeout(), Duration::from_millis(500));
    let Err(err) = result else {
        panic!("initialize returned without rank 1");
    };
    assert!(
        waited >= Duration::from_millis(500) && waited < Duration::from_secs(10),
        "waited {waited:?}"
    );
    let text = err.to_string();
    assert!(text.contains("waiting for rank(s) [1]"), "{text}");
    assert!(
        matches!(
            err,
            burn_zero::engine::EngineError::Comm(CommError::Timeout { .. })
        ),
        "{err:?}"
    );
}
