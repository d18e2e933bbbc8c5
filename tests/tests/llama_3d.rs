//! The recipe's Llama in 3D across 8 processes: pipe 2 × data 2 × model 2
//! (`ParallelLlamaStage`: pipeline stages whose layers, embedding rows and logit columns are
//! sliced over the model axis; gradients averaged over the data axis; 1F1B over 4
//! micro-batches), against the unsplit, unsliced model trained on the whole batch in this
//! process: the loss of 5 Adam steps within fp32 tolerance on every model rank, with tied and
//! untied embeddings, on shapes the model axis does not divide evenly (3 key/value heads, 21
//! MLP features and 25 vocabulary ids over 2 ranks). Processes, not thread ranks: see
//! `tests/src/llama_3d.rs`.

use burn::backend::NdArray;
use burn_zero::engine::ZeroAutodiff;
use burn_zero_llm::parallel_stage::ParallelLlamaStage;
use burn_zero_tests::llama_3d::tiny;
use burn_zero_tests::processes;

fn three_d_matches(tied: bool) {
    three_d_matches_with(tied, "1f1b");
}

fn three_d_matches_with(tied: bool, schedule: &str) {
    let want = tiny(tied).reference::<ZeroAutodiff<NdArray>>(&Default::default());
    assert!(
        want[want.len() - 1] < want[0],
        "the reference trains: {want:?}"
    );
    let output = processes::launcher(
        env!("CARGO_BIN_EXE_launcher"),
        env!("CARGO_BIN_EXE_dist-worker"),
        8,
        &["llama-3d", if tied { "tied" } else { "untied" }, schedule],
    )
    .output()
    .expect("start the launcher");
    let (out, err) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert!(output.status.success(), "stdout:\n{out}\nstderr:\n{err}");
    // `[rank r] LOSSES [pipe, data, model] [l0, l1, ...]` from the four last-stage ranks.
    let mut reported = Vec::new();
    for line in out
        .lines()
        .filter_map(|l| l.split_once("] LOSSES ").map(|p| p.1))
    {
        let (coords, losses) = line.split_once("] ").expect("coordinates, then losses");
        let losses: Vec<f32> = losses
            .trim_matches(['[', ']'])
            .split(',')
            .map(|v| v.trim().parse().unwrap())
            .collect();
        assert_eq!(losses.len(), want.len(), "{line}");
        for (step, (got, w)) in losses.iter().zip(&want).enumerate() {
            assert!(
                (got - w).abs() <= 2e-5 * w.abs().max(1.0),
                "{schedule}, tied {tied}, rank {coords}], step {step}: {got} vs {w}\n{losses:?}\n{want:?}"
            );
        }
        reported.push(coords.to_string());
    }
    reported.sort();
    let last_stage = ["[1, 0, 0", "[1, 0, 1", "[1, 1, 0", "[1, 1, 1"];
    assert_eq!(
        reported, last_stage,
        "every last-stage rank reports:\n{out}"
    );
}

#[test]
fn pipe_by_data_by_model_llama_matches_the_unsplit_one() {
    three_d_matches(false);
}

/// Tied: the last stage's copy of each rank's embedding rows sums its gradient with the first
/// stage's rows of the same model rank.
#[test]
fn tied_pipe_by_data_by_model_llama_matches_the_unsplit_one() {
    three_d_matches(true);
}

/// ZB-H1 in 3D: every projection slice's weight gradient in the weight halves.
#[test]
fn zero_bubble_pipe_by_data_by_model_llama_matches_the_unsplit_one() {
    three_d_matches_with(true, "zb-h1");
}

#[test]
fn a_bad_split_is_refused() {
    type B = ZeroAutodiff<NdArray>;
    let device = Default::default();
    let model = tiny(true).config.init::<B>(&device);
    let results = burn_zero::testing::run_ranks(1, |ctx| {
        let group = burn_pipeline::ModelGroup::new(std::sync::Arc::new(ctx.comm));
        ParallelLlamaStage::new(&model, &[0..1, 2..4], 0, 6, group)
            .err()
            .unwrap_or_default()
    });
    assert!(
        results[0].contains("do not split 4 layers"),
        "{}",
        results[0]
    );
}
