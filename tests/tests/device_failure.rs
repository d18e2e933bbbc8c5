//! A panic in one of the GPU runtime's device threads (cubecl names them `DSU-…`/`DSD-…`)
//! never reaches the training loop by itself: the engine must stop at its next `backward` or
//! `step` with the panic's message instead of training on memory nothing wrote. Its own test
//! binary: the failure is recorded for the whole process.

use std::sync::Arc;

use burn::backend::NdArray;
use burn::tensor::Tensor;
use burn_zero::DeepSpeedConfig;
use burn_zero::comm::Communicator;
use burn_zero::engine::{ZeroAutodiff, initialize};
use burn_zero::testing::run_ranks;
use burn_zero_tests::cases::Mlp;
use burn_zero_tests::cases::engine_run::{self, GLOBAL_BATCH};
use burn_zero_tests::engine_loop::train_step;

type B = ZeroAutodiff<NdArray>;

#[test]
fn a_device_thread_panic_stops_the_engine() {
    let json = format!(
        r#"{{"train_batch_size": {GLOBAL_BATCH}, "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01}}}},
            "zero_optimization": {{"stage": 2}}}}"#
    );
    let config = DeepSpeedConfig::from_json(&json).unwrap().config;
    let errors = run_ranks(1, |ctx| {
        let device = Default::default();
        let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
        let mut engine =
            initialize::<NdArray, _>(Mlp::<B>::new(&device), &config, comm.clone()).unwrap();
        let loss = train_step(&mut engine, comm.as_ref(), 0, 0, 1);
        assert!(loss.is_finite(), "a healthy step first: {loss}");
        // An ordinary thread's panic is the caller's business, not a device failure.
        let plain = std::thread::spawn(|| panic!("a panic of the user's own"));
        assert!(plain.join().is_err());
        let (x, y) = engine_run::batch::<B>(1, 0..GLOBAL_BATCH, &device);
        let loss: Tensor<B, 1> = engine_run::loss(engine.model(), x, y);
        engine.backward(loss).expect("no device thread failed yet");
        let device_thread = std::thread::Builder::new()
            .name("DSD-7-0".into())
            .spawn(|| panic!("can't allocate buffer of size: 37527470080"))
            .unwrap();
        assert!(device_thread.join().is_err());
        let step = engine.step().expect_err("the step after a device failure");
        let (x, y) = engine_run::batch::<B>(2, 0..GLOBAL_BATCH, &device);
        let loss: Tensor<B, 1> = engine_run::loss(engine.model(), x, y);
        let backward = engine
            .backward(loss)
            .expect_err("every later call fails too");
        [step.to_string(), backward.to_string()]
    });
    for error in &errors[0] {
        assert!(
            error.contains("DSD-7-0") && error.contains("37527470080"),
            "the error names the thread and its message: {error}"
        );
    }
}
