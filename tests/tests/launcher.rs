//! Real processes: the launcher starts ranks that rendezvous over TCP, run collectives and a
//! short ZeRO training loop matching the single-process burn run; a rank that dies makes the
//! launcher stop the others and name it, within a bounded time.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use burn_zero_tests::cases::engine_run::STEPS;
use burn_zero_tests::processes;
use burn_zero_tests::reference::assert_close_to_reference;

/// The launcher starting `nproc` dist-workers with `worker_args`.
fn launcher(nproc: usize, worker_args: &[&str]) -> Command {
    processes::launcher(
        env!("CARGO_BIN_EXE_launcher"),
        env!("CARGO_BIN_EXE_dist-worker"),
        nproc,
        worker_args,
    )
}

fn launch(nproc: usize, worker_args: &[&str]) -> (Output, Duration) {
    let start = Instant::now();
    let output = launcher(nproc, worker_args)
        .output()
        .expect("start the launcher");
    (output, start.elapsed())
}

fn text(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).into(),
        String::from_utf8_lossy(&output.stderr).into(),
    )
}

#[test]
fn ranks_rendezvous_and_run_collectives() {
    for nproc in [2, 3] {
        let (output, _) = launch(nproc, &["collectives"]);
        let (out, err) = text(&output);
        assert!(
            output.status.success(),
            "{nproc} ranks\nstdout:\n{out}\nstderr:\n{err}"
        );
        for rank in 0..nproc {
            assert!(
                out.contains(&format!(
                    "[rank {rank}] collectives ok rank {rank} world {nproc}"
                )),
                "{out}"
            );
        }
    }
}

#[test]
fn zero2_training_across_processes_matches_plain_burn() {
    for (nproc, stage, gas) in [(3, 2, 3), (2, 1, 1)] {
        let (output, _) = launch(nproc, &["train", &stage.to_string(), &gas.to_string()]);
        let (out, err) = text(&output);
        assert!(output.status.success(), "stdout:\n{out}\nstderr:\n{err}");
        let mut found = 0;
        for line in out
            .lines()
            .filter_map(|l| l.strip_prefix("[rank 0] RESULT "))
        {
            let (name, value) = line.split_once(' ').unwrap();
            let values: Vec<f32> = value
                .trim_matches(['[', ']'])
                .split(',')
                .map(|v| v.trim().parse().unwrap())
                .collect();
            assert_close_to_reference(&format!("engine/{name}"), &values, 1e-5, 1e-6);
            found += 1;
        }
        assert_eq!(
            found,
            2 * STEPS + 6,
            "losses, norms and parameters reported:\n{out}"
        );
    }
}

#[test]
fn a_killed_rank_stops_the_others_and_is_named() {
    let (output, elapsed) = launch(3, &["die", "1", "kill"]);
    let (out, err) = text(&output);
    assert!(!output.status.success(), "{err}");
    assert!(
        err.contains("burn-zero run: failed: rank 1 was killed by signal 9 (SIGKILL)"),
        "stderr:\n{err}"
    );
    assert!(
        out.contains("[rank 0] rank 0 sleeping until stopped"),
        "{out}"
    );
    assert!(
        elapsed < Duration::from_secs(30),
        "the survivors (sleeping 600 s) were stopped: {elapsed:?}"
    );
}

#[test]
fn a_failing_rank_sets_the_exit_status() {
    let (output, elapsed) = launch(3, &["die", "2", "exit"]);
    let (_, err) = text(&output);
    assert_eq!(output.status.code(), Some(3), "{err}");
    assert!(err.contains("rank 2 exited with status 3"), "{err}");
    // The verdict comes after every rank's last lines.
    let last = err
        .lines()
        .rfind(|l| !l.trim().is_empty())
        .unwrap_or_default();
    assert!(
        last.contains("burn-zero run: failed: rank 2 exited with status 3"),
        "{err}"
    );
    assert!(elapsed < Duration::from_secs(30));
}

#[test]
fn ctrl_c_is_forwarded_to_every_rank() {
    let start = Instant::now();
    // No rank 9: both ranks sleep until stopped.
    let launcher = launcher(2, &["die", "9", "exit"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    // SAFETY: signalling the launcher this test started.
    unsafe { libc::kill(launcher.id() as libc::pid_t, libc::SIGINT) };
    let output = launcher.wait_with_output().unwrap();
    let (out, err) = text(&output);
    assert_eq!(
        output.status.code(),
        Some(130),
        "stdout:\n{out}\nstderr:\n{err}"
    );
    assert!(
        err.contains("received signal 2: forwarding it to every rank"),
        "{err}"
    );
    assert!(
        out.contains("[rank 1] rank 1 sleeping until stopped"),
        "{out}"
    );
    assert!(start.elapsed() < Duration::from_secs(20));
}
