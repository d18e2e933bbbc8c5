//! The engine's memory report against the ZeRO formulas, fp32 edition with Adam: parameters
//! 4Ψ on every rank; stage 0 keeps 4Ψ of gradients and 12Ψ of optimizer state (fp32 master
//! copy and two moments, DeepSpeed's K = 12); stage 1 partitions the optimizer state (12Ψ/N);
//! stage 2 also the gradients (4Ψ + 16Ψ/N in all),
//! each within the padding of the partition plan. The numbers come from the buffers the
//! engine allocated, not from the config.

use std::sync::Arc;

use burn::backend::NdArray;
use burn_zero::DeepSpeedConfig;
use burn_zero::comm::Communicator;
use burn_zero::engine::{MemoryReport, ZeroAutodiff, initialize};
use burn_zero::testing::run_ranks;
use burn_zero_tests::cases::Mlp;

type B = ZeroAutodiff<NdArray>;

/// Ψ: the parameters of the 7→15→9→3 MLP.
const PSI: usize = 7 * 15 + 15 + 15 * 9 + 9 + 9 * 3 + 3;
/// Partitions are multiples of 4 elements: at most 4 padding elements per rank beyond ⌈Ψ/N⌉.
const ALIGN: usize = 4;

fn reports(world: usize, stage: u8) -> Vec<MemoryReport> {
    let json = format!(
        r#"{{"train_batch_size": {world}, "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01}}}},
            "zero_optimization": {{"stage": {stage}, "reduce_bucket_size": 64, "allgather_bucket_size": 64}}}}"#
    );
    let config = DeepSpeedConfig::from_json(&json).unwrap().config;
    run_ranks(world, |ctx| {
        let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
        let engine =
            initialize::<NdArray, _>(Mlp::<B>::new(&Default::default()), &config, comm).unwrap();
        engine.memory_report()
    })
}

#[test]
fn memory_follows_the_zero_formulas_and_drops_with_world_size() {
    let mut previous = [usize::MAX; 3];
    for world in 1..=4 {
        let chunk_bound = PSI.div_ceil(world).div_ceil(ALIGN) * ALIGN;
        for stage in 0..=2u8 {
            let reports = reports(world, stage);
            let optimizer_total: usize = reports.iter().map(|r| r.optimizer_state).sum();
            for (rank, r) in reports.iter().enumerate() {
                let what = format!("world {world}, stage {stage}, rank {rank}: {r}");
                assert_eq!(r.parameters, 4 * PSI, "{what}");
                match stage {
                    0 => {
                        assert_eq!(r.gradients, 4 * PSI, "{what}");
                        assert_eq!(r.optimizer_state, 12 * PSI, "{what}");
                    }
                    1 => {
                        assert_eq!(r.gradients, 4 * PSI, "{what}");
                        assert!(r.optimizer_state <= 12 * chunk_bound, "{what}");
                    }
                    _ => {
                        assert_eq!(r.gradients, 4 * chunk_bound, "{what}: the padded partition");
                        assert!(r.optimizer_state <= 12 * chunk_bound, "{what}");
                        let formula = 4 * PSI + 16 * PSI / world;
                        assert!(
                            r.model_states() <= formula + 16 * ALIGN + 16,
                            "{what} vs 4Ψ + 16Ψ/N = {formula}"
                        );
                    }
                }
                assert!(r.communication_buffers > 0, "{what}");
            }
            // The partitions of optimizer state cover Ψ exactly once across ranks.
            let expected_total = if stage == 0 {
                12 * PSI * world
            } else {
                12 * PSI
            };
            assert_eq!(
                optimizer_total, expected_total,
                "world {world}, stage {stage}"
            );
            let rank0 = reports[0].model_states();
            if stage > 0 && world > 1 {
                assert!(
                    rank0 < previous[stage as usize],
                    "stage {stage}: {rank0} did not drop at world {world}"
                );
            }
            previous[stage as usize] = rank0;
        }
    }
}

#[test]
fn a_second_engine_on_the_same_thread_is_refused_until_the_first_is_dropped() {
    let config =
        DeepSpeedConfig::from_json(r#"{"train_batch_size": 1, "optimizer": {"type": "SGD"}}"#)
            .unwrap()
            .config;
    run_ranks(1, |ctx| {
        let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
        let first =
            initialize::<NdArray, _>(Mlp::<B>::new(&Default::default()), &config, comm.clone())
                .unwrap();
        let second =
            initialize::<NdArray, _>(Mlp::<B>::new(&Default::default()), &config, comm.clone());
        assert!(second.err().unwrap().to_string().contains("another engine"));
        drop(first);
        initialize::<NdArray, _>(Mlp::<B>::new(&Default::default()), &config, comm).unwrap();
    });
}
