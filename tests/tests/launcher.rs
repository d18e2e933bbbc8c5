//! Real processes: the launcher starts ranks that rendezvous over TCP, run collectives and a
//! short ZeRO training loop matching the single-process burn run; a rank that dies makes the
//! launcher stop the others and name it, within a bounded time. Several nodes from one command:
//! a hostfile of two "hosts" on loopback addresses started through a stand-in for ssh
//! (`tests/fake-ssh`), with the same failing fast across nodes. A rank that stalls is named
//! from the others' flight lines; a job killed with SIGKILL inside a checkpoint save resumes
//! bit for bit from the checkpoint before it.

use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
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
fn a_rank_that_stalls_is_named_from_the_others_flight_records() {
    // Rank 1 sleeps before the second collective; ranks 0 and 2 wait 3 s for it, print their
    // flight lines and fail; the launcher reads them and names rank 1.
    let start = Instant::now();
    let output = launcher(3, &["stall", "1"])
        .env("BURN_ZERO_TIMEOUT", "3")
        .output()
        .expect("start the launcher");
    let elapsed = start.elapsed();
    let (out, err) = text(&output);
    assert!(!output.status.success(), "{err}");
    assert!(out.contains("[rank 1] rank 1 stalling"), "{out}");
    assert!(err.contains("burn-zero flight: "), "no flight line:\n{err}");
    assert!(
        err.contains("burn-zero run: rank 1 fell behind first: rank")
            && err.contains("waited for it in all_reduce")
            && err.contains("it left no flight record"),
        "stderr:\n{err}"
    );
    assert!(
        elapsed < Duration::from_secs(3 + 20),
        "the job ended {elapsed:?} after it started (timeout 3 s)"
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

/// The stand-in for ssh: runs the node's command line here.
const FAKE_SSH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fake-ssh");

/// The launcher on a hostfile of two "hosts" on loopback addresses, 2 slots each (4 ranks),
/// started through the stand-in for ssh (`--launcher-cmd`, or `BURN_ZERO_SSH` when
/// `through_env`), each rank a dist-worker with `worker_args`.
fn multi_node(extra: &[&str], worker_args: &[&str], through_env: bool) -> (Output, Duration) {
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "bz-hostfile-{}-{}",
        std::process::id(),
        RUNS.fetch_add(1, Ordering::SeqCst)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let hostfile = dir.join("hostfile");
    std::fs::write(
        &hostfile,
        "# two nodes on loopback\n127.0.0.1 slots=2\n\n127.0.0.2 slots=2  # the second\n",
    )
    .unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_launcher"));
    command
        .arg("--hostfile")
        .arg(&hostfile)
        .args(["--master-port", &processes::free_port().to_string()])
        .args(["--grace", "2"])
        .args(extra);
    if through_env {
        command.env("BURN_ZERO_SSH", FAKE_SSH);
    } else {
        command.args(["--launcher-cmd", FAKE_SSH]);
    }
    command
        .arg("--")
        .arg(env!("CARGO_BIN_EXE_dist-worker"))
        .args(worker_args)
        .env("BURN_ZERO_TIMEOUT", "60");
    let start = Instant::now();
    let output = command.output().expect("start the launcher");
    std::fs::remove_dir_all(&dir).unwrap();
    (output, start.elapsed())
}

#[test]
fn a_hostfile_starts_every_node_through_the_launcher_command() {
    let (output, _) = multi_node(&[], &["collectives"], false);
    let (out, err) = text(&output);
    assert!(output.status.success(), "stdout:\n{out}\nstderr:\n{err}");
    for rank in 0..4 {
        assert!(
            out.contains(&format!("[rank {rank}] collectives ok rank {rank} world 4")),
            "{out}"
        );
    }
    for host in ["127.0.0.1", "127.0.0.2"] {
        assert!(
            err.contains(&format!("[{host}] fake-ssh: host {host}")),
            "{err}"
        );
    }
    assert!(
        err.contains("4 ranks on 2 node(s)") && err.contains("127.0.0.2 (2 ranks)"),
        "{err}"
    );
}

#[test]
fn include_and_num_nodes_choose_the_ranks() {
    // Slot 1 of the first host and the whole second: 3 ranks.
    let (output, _) = multi_node(
        &["--include", "127.0.0.1:1@127.0.0.2"],
        &["collectives"],
        true,
    );
    let (out, err) = text(&output);
    assert!(output.status.success(), "stdout:\n{out}\nstderr:\n{err}");
    assert!(
        out.contains("[rank 2] collectives ok rank 2 world 3"),
        "{out}"
    );
    assert!(!out.contains("world 4"), "{out}");
    // The first node only.
    let (output, _) = multi_node(&["--num-nodes", "1"], &["collectives"], true);
    let (out, err) = text(&output);
    assert!(output.status.success(), "stdout:\n{out}\nstderr:\n{err}");
    assert!(
        out.contains("[rank 1] collectives ok rank 1 world 2"),
        "{out}"
    );
    assert!(!err.contains("fake-ssh: host 127.0.0.2"), "{err}");
}

#[test]
fn a_dead_rank_on_any_node_ends_every_node_and_is_named() {
    for (victim, how, host, node, code) in [
        ("1", "kill", "127.0.0.1", 0, 137),
        ("3", "exit", "127.0.0.2", 1, 3),
    ] {
        let (output, elapsed) = multi_node(&[], &["die", victim, how], true);
        let (out, err) = text(&output);
        assert_eq!(
            output.status.code(),
            Some(code),
            "stdout:\n{out}\nstderr:\n{err}"
        );
        let died = if how == "kill" {
            "was killed by signal 9 (SIGKILL)"
        } else {
            "exited with status 3"
        };
        let last = err
            .lines()
            .rfind(|l| !l.trim().is_empty())
            .unwrap_or_default();
        assert_eq!(
            last,
            format!("burn-zero run: failed: rank {victim} {died} on node {node} ({host})"),
            "{err}"
        );
        // The other node's ranks were sleeping: it was stopped.
        let other = if node == 0 { "127.0.0.2" } else { "127.0.0.1" };
        assert!(
            err.contains(&format!(
                "[{other}] burn-zero run: received signal 15: forwarding it to every rank"
            )),
            "{err}"
        );
        assert!(
            elapsed < Duration::from_secs(30),
            "the survivors (sleeping 600 s) were stopped: {elapsed:?}"
        );
    }
}

#[test]
fn a_bad_include_is_named_before_anything_starts() {
    let (output, _) = multi_node(&["--include", "127.0.0.3"], &["collectives"], true);
    let (_, err) = text(&output);
    assert_eq!(output.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--include \"127.0.0.3\": host \"127.0.0.3\" is not in the hostfile"),
        "{err}"
    );
    assert!(!err.contains("fake-ssh"), "{err}");
}

/// The `RESULT` lines rank 0 printed: name → values.
fn results(out: &str) -> std::collections::BTreeMap<String, Vec<f32>> {
    out.lines()
        .filter_map(|l| l.strip_prefix("[rank 0] RESULT "))
        .map(|line| {
            let (name, value) = line.split_once(' ').unwrap();
            let values = value
                .trim_matches(['[', ']'])
                .split(',')
                .map(|v| v.trim().parse().unwrap())
                .collect();
            (name.to_string(), values)
        })
        .collect()
}

#[test]
fn a_job_killed_with_sigkill_while_saving_resumes_exactly_from_its_last_checkpoint() {
    // Two ranks train ZeRO-2 and save after every step; the whole job (launcher and ranks, one
    // process group) gets SIGKILL once a few checkpoints exist, most likely inside a save (the
    // saves, fsync'd, are most of each step's time). What is left must load, and a new job
    // resuming from it must end with the uninterrupted job's losses and parameters, bit for bit.
    use std::os::unix::process::CommandExt;
    const STEPS: &str = "24";
    let scratch = |name: &str| {
        let dir =
            std::env::temp_dir().join(format!("burn-zero-kill-save-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    };
    let reference_dir = scratch("reference");
    let (output, _) = launch(
        2,
        &[
            "train-ckpt",
            "2",
            reference_dir.to_str().unwrap(),
            STEPS,
            "0",
        ],
    );
    let (out, err) = text(&output);
    assert!(output.status.success(), "stdout:\n{out}\nstderr:\n{err}");
    let reference = results(&out);
    // Until two kills have cut a save (a staging directory left behind), at most 20 kills.
    let (mut cut_mid_save, mut attempts) = (0, 0);
    for attempt in 0..20u64 {
        if cut_mid_save == 2 {
            break;
        }
        attempts += 1;
        let dir = scratch(&format!("killed{attempt}"));
        let mut job = launcher(2, &["train-ckpt", "2", dir.to_str().unwrap(), STEPS, "0"]);
        job.process_group(0)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        let mut child = job.spawn().expect("start the launcher");
        let latest = dir.join(burn_zero::checkpoint::LATEST);
        let started = Instant::now();
        while std::fs::read_to_string(&latest).map_or(true, |t| t.trim() < "global_step3") {
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "no third checkpoint after 2 minutes"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        std::thread::sleep(Duration::from_millis(3 + 7 * (attempt % 5)));
        // SAFETY: signalling the job's own process group.
        unsafe { libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL) };
        child.wait().unwrap();
        let partial = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(Result::ok)
            .any(|e| e.file_name().to_string_lossy().ends_with(".partial"));
        cut_mid_save += usize::from(partial);
        let kept = burn_zero::checkpoint::resolve(&dir, None).expect("latest resolves");
        burn_zero::checkpoint::open_verified(&kept).expect("the last checkpoint verifies");
        let (output, _) = launch(2, &["train-ckpt", "2", dir.to_str().unwrap(), STEPS, "1"]);
        let (out, err) = text(&output);
        assert!(output.status.success(), "stdout:\n{out}\nstderr:\n{err}");
        let resumed = results(&out);
        let params: Vec<_> = resumed.keys().filter(|k| k.starts_with("param_")).collect();
        assert!(!params.is_empty(), "{out}");
        for (name, values) in &resumed {
            assert_eq!(
                Some(values),
                reference.get(name),
                "attempt {attempt}, {name} after resuming from {}",
                kept.display()
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
    println!("{cut_mid_save} of {attempts} kills cut a save");
    assert!(
        cut_mid_save >= 1,
        "none of {attempts} kills landed inside a save (no staging directory left behind)"
    );
    std::fs::remove_dir_all(&reference_dir).unwrap();
}
