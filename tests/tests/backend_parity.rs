//! `ZeroBackend<NdArray>` gives bitwise the results of plain `NdArray`, with and without
//! `Autodiff`. Without autodiff both sides run in this process (NdArray itself is independent
//! of burn-zero); with autodiff the plain side comes from the `reference/` program, built
//! without burn's `distributed` feature.

use burn::backend::{Autodiff, NdArray};
use burn_zero::ZeroBackend;
use burn_zero_tests::cases;
use burn_zero_tests::reference::{assert_matches_reference, assert_same};

type Zero = ZeroBackend<NdArray>;

#[test]
fn op_suite_is_bitwise_plain_ndarray() {
    let device = Default::default();
    assert_same(
        &cases::op_suite::<Zero>(&device),
        &cases::op_suite::<NdArray>(&device),
    );
}

#[test]
fn mlp_forward_is_bitwise_plain_ndarray() {
    let device = Default::default();
    let (x, _) = cases::batch::<Zero>(0, 0..cases::BATCH, &device);
    let ours = cases::Mlp::<Zero>::new(&device).forward(x).into_data();
    let (x, _) = cases::batch::<NdArray>(0, 0..cases::BATCH, &device);
    let theirs = cases::Mlp::<NdArray>::new(&device).forward(x).into_data();
    assert_same(&[("forward".into(), ours)], &[("forward".into(), theirs)]);
}

#[test]
fn op_suite_under_autodiff_is_bitwise_the_reference() {
    let device = Default::default();
    assert_matches_reference("plain", &cases::op_suite::<NdArray>(&device));
    assert_matches_reference("autodiff", &cases::op_suite::<Autodiff<Zero>>(&device));
}

#[test]
fn gradients_are_bitwise_the_reference() {
    let device = Default::default();
    assert_matches_reference("grad", &cases::autodiff_suite::<Autodiff<Zero>>(&device));
}

#[test]
fn mlp_training_is_bitwise_the_reference() {
    let device = Default::default();
    let outcomes = cases::train_mlp::<Autodiff<Zero>>(&device, cases::TRAIN_STEPS);
    assert_eq!(
        outcomes.len(),
        cases::TRAIN_STEPS + 6,
        "10 losses and 6 parameters"
    );
    assert_matches_reference("mlp", &outcomes);
}
