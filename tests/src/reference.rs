//! Builds and runs the independent reference program (`reference/`) once per test process.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use crate::cases::{Outcome, encode};

/// Reference results by name (`plain/…`, `autodiff/…`, `grad/…`, `mlp/…`), one encoded line each.
pub fn reference() -> &'static HashMap<String, String> {
    static REFERENCE: OnceLock<HashMap<String, String>> = OnceLock::new();
    REFERENCE.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| root.join("target"))
            .join("reference");
        std::fs::create_dir_all(&target).expect("create the reference target dir");
        let out = target.join(format!("outcomes-{}.txt", std::process::id()));
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let status = Command::new(cargo)
            .args(["run", "--release", "--quiet", "--manifest-path"])
            .arg(root.join("reference/Cargo.toml"))
            .arg("--")
            .arg(&out)
            .env("CARGO_TARGET_DIR", &target)
            .status()
            .expect("run cargo for the reference program");
        assert!(status.success(), "the reference program failed: {status}");
        let text = std::fs::read_to_string(&out).expect("read the reference outcomes");
        let _ = std::fs::remove_file(&out);
        text.lines()
            .map(|line| {
                (
                    line.split(' ').next().unwrap_or_default().to_string(),
                    line.to_string(),
                )
            })
            .collect()
    })
}

/// Asserts that `outcomes` equal the reference's `prefix/…` entries bit for bit.
pub fn assert_matches_reference(prefix: &str, outcomes: &[Outcome]) {
    let reference = reference();
    assert!(!outcomes.is_empty(), "nothing to compare");
    for outcome in outcomes {
        let named = (format!("{prefix}/{}", outcome.0), outcome.1.clone());
        let ours = encode(std::slice::from_ref(&named));
        let theirs = reference
            .get(&named.0)
            .unwrap_or_else(|| panic!("the reference has no `{}`", named.0));
        assert_eq!(
            ours.trim_end(),
            theirs,
            "`{}` differs from plain burn",
            named.0
        );
    }
}

/// Asserts two outcome lists are equal bit for bit, naming the first difference.
pub fn assert_same(ours: &[Outcome], theirs: &[Outcome]) {
    assert_eq!(ours.len(), theirs.len(), "different number of outcomes");
    for (a, b) in ours.iter().zip(theirs) {
        assert_eq!(a.0, b.0);
        assert_eq!(
            encode(std::slice::from_ref(a)),
            encode(std::slice::from_ref(b)),
            "`{}` differs",
            a.0
        );
    }
}

/// The f32 values of reference entry `name` (decoded from its hex bytes).
pub fn reference_f32(name: &str) -> Vec<f32> {
    let line = reference()
        .get(name)
        .unwrap_or_else(|| panic!("the reference has no `{name}`"));
    let mut fields = line.split(' ');
    let (_, dtype, _, hex) = (
        fields.next(),
        fields.next(),
        fields.next(),
        fields.next().unwrap_or_default(),
    );
    assert_eq!(dtype, Some("F32"), "`{name}` is not f32");
    (0..hex.len() / 8)
        .map(|i| {
            let bytes: Vec<u8> = (0..4)
                .map(|j| u8::from_str_radix(&hex[i * 8 + j * 2..i * 8 + j * 2 + 2], 16).unwrap())
                .collect();
            f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
        })
        .collect()
}

/// Asserts `ours` is within `rtol`·|reference| + `atol` of the reference's f32 entry `name`.
pub fn assert_close_to_reference(name: &str, ours: &[f32], rtol: f32, atol: f32) {
    let theirs = reference_f32(name);
    assert_eq!(ours.len(), theirs.len(), "`{name}`: different lengths");
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert!(
            (a - b).abs() <= rtol * b.abs() + atol,
            "`{name}`[{i}]: ours {a}, plain burn {b}"
        );
    }
}
