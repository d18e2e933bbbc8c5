//! Writes the reference outcomes of the shared cases, computed by plain burn, to a file.

#[path = "../../tests/src/cases.rs"]
#[allow(dead_code)]
mod cases;

use burn::backend::{Autodiff, NdArray};

fn main() {
    let out = std::env::args().nth(1).expect("usage: burn-zero-reference OUT_FILE");
    let device = Default::default();
    let mut outcomes = Vec::new();
    for (name, data) in cases::op_suite::<NdArray>(&device) {
        outcomes.push((format!("plain/{name}"), data));
    }
    for (name, data) in cases::op_suite::<Autodiff<NdArray>>(&device) {
        outcomes.push((format!("autodiff/{name}"), data));
    }
    for (name, data) in cases::autodiff_suite::<Autodiff<NdArray>>(&device) {
        outcomes.push((format!("grad/{name}"), data));
    }
    for (name, data) in cases::train_mlp::<Autodiff<NdArray>>(&device, cases::TRAIN_STEPS) {
        outcomes.push((format!("mlp/{name}"), data));
    }
    for (name, data) in cases::engine_run::train::<Autodiff<NdArray>>(&device) {
        outcomes.push((format!("engine/{name}"), data));
    }
    std::fs::write(&out, cases::encode(&outcomes)).expect("write the reference file");
}
