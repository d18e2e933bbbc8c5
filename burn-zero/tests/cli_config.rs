//! `burn-zero config` as a user runs it: the report on stdout and the exit status (0 resolved,
//! 1 a config that does not resolve, 2 a bad command line).

use std::process::Command;

fn burn_zero(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_burn-zero"))
        .args(args)
        .output()
        .expect("burn-zero runs");
    (
        out.status.code().expect("an exit code"),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_shipped_config_resolves_for_each_world_size() {
    let file = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/configs/quickstart.json"
    );
    let (code, out, err) = burn_zero(&["config", file, "--world-size", "1,2", "--world-size", "4"]);
    assert_eq!(code, 0, "{out}{err}");
    for world in [1, 2, 4] {
        assert!(out.contains(&format!("world size {world}:\n")), "{out}");
    }
    assert!(out.contains("4 ranks, ZeRO stage 2"), "{out}");
}

#[test]
fn a_config_that_does_not_resolve_exits_1_naming_the_keys() {
    let dir = std::env::temp_dir().join(format!("burn-zero-cli-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("triad.json");
    std::fs::write(
        &file,
        r#"{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}"#,
    )
    .unwrap();
    let (code, out, err) = burn_zero(&["config", file.to_str().unwrap(), "--world-size", "1,3"]);
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("world size 1:\n"), "{out}");
    let last = out.lines().last().unwrap_or_default();
    assert!(last.starts_with("world size 3: "), "{out}");
    assert!(last.contains("train_batch_size"), "{out}");
}

#[test]
fn a_bad_command_line_exits_2_with_the_usage() {
    let (code, _, err) = burn_zero(&["config", "--world-size", "zero"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--world-size \"zero\""), "{err}");
    assert!(err.contains("usage:"), "{err}");
    let (code, _, err) = burn_zero(&["config"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("which FILE?"), "{err}");
}
