//! `burn-zero run`: a torchrun-style launcher. Starts one process per rank with `RANK`,
//! `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`; prefixes every
//! output line with its rank; forwards Ctrl-C; and when a rank exits non-zero or dies, stops the
//! others and exits non-zero naming the rank and how it ended.
//!
//! Several nodes from one command, as DeepSpeed's launcher: `--hostfile FILE` (lines
//! `host slots=N`), filtered by `--include` / `--exclude` / `--num-nodes`, starts this launcher
//! on every node through `--launcher-cmd` (default `ssh`, or `$BURN_ZERO_SSH`), see
//! [`multinode`]. Or by hand: the same command on every host with `--nnodes K --node-rank R
//! --master-addr <host of node 0>` (and the same `--master-port`).

pub mod hosts;
pub mod multinode;

use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::comm::{FlightReport, verdict};
use crate::dist::DEFAULT_MASTER_PORT;

/// What `burn-zero run` starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchOptions {
    /// Processes on this node (with a hostfile: at most this many slots of each host, 0 = all).
    pub nproc_per_node: usize,
    /// Nodes in the job.
    pub nnodes: usize,
    /// This node's index.
    pub node_rank: usize,
    /// Rank 0's host.
    pub master_addr: String,
    /// Rank 0's rendezvous port.
    pub master_port: u16,
    /// How long stopped ranks get to exit after SIGTERM before SIGKILL.
    pub grace: Duration,
    /// The program and its arguments.
    pub command: Vec<String>,
    /// `--hostfile` and its filters: start every node from here.
    pub multi_node: Option<MultiNode>,
    /// Set by the multi-node launcher on each node, whose nodes may have different numbers of
    /// ranks: this node's first rank (`--rank-offset`) and the job's ranks (`--world-size`).
    /// Without them, `node_rank × nproc_per_node` and `nnodes × nproc_per_node`.
    pub rank_offset: Option<usize>,
    /// See `rank_offset`.
    pub world_size: Option<usize>,
    /// `--watch-stdin`: stop every rank when stdin closes. The multi-node launcher sets it on
    /// the nodes, whose stdin is the ssh connection: when it ends, nothing is left behind.
    pub watch_stdin: bool,
}

/// `--hostfile FILE [--include SPEC | --exclude SPEC] [--num-nodes N] [--launcher-cmd CMD]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MultiNode {
    /// DeepSpeed's hostfile.
    pub hostfile: PathBuf,
    /// `host1:0,1@host2`: only these hosts (slots).
    pub include: Option<String>,
    /// `host1:0,1@host2`: all but these hosts (slots).
    pub exclude: Option<String>,
    /// The first N hosts left.
    pub num_nodes: Option<usize>,
    /// `--master-addr`; without it the first node's host.
    pub master_addr: Option<String>,
    /// The command that runs a shell command line on a host, given `HOST COMMAND`: `ssh` by
    /// default (`$BURN_ZERO_SSH` overrides it), split at spaces.
    pub launcher_cmd: Vec<String>,
}

/// Usage of `burn-zero run`.
pub const RUN_USAGE: &str = "burn-zero run --nproc-per-node N [--nnodes K --node-rank R] \
[--master-addr HOST] [--master-port PORT] [--grace SECONDS] -- PROGRAM [ARGS...]
       burn-zero run --hostfile FILE [--include H1:0,1@H2 | --exclude ...] [--num-nodes N] \
[--nproc-per-node N] [--launcher-cmd CMD] [--master-addr HOST] [--master-port PORT] -- PROGRAM [ARGS...]";

impl LaunchOptions {
    /// Parses the arguments after `run` (`BURN_ZERO_SSH` from the environment).
    pub fn parse(args: &[String]) -> Result<Self, String> {
        Self::parse_with(args, std::env::var("BURN_ZERO_SSH").ok())
    }

    /// Parses the arguments after `run`; `ssh` is the default launcher command.
    pub fn parse_with(args: &[String], ssh: Option<String>) -> Result<Self, String> {
        let mut opts = LaunchOptions {
            nproc_per_node: 0,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_MASTER_PORT,
            grace: Duration::from_secs(5),
            command: Vec::new(),
            multi_node: None,
            rank_offset: None,
            world_size: None,
            watch_stdin: false,
        };
        let mut master_addr_given = false;
        let mut node_flags = Vec::new();
        let (mut hostfile, mut include, mut exclude, mut num_nodes, mut launcher_cmd) =
            (None, None, None, None, None);
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            if arg == "--" {
                opts.command = it.cloned().collect();
                break;
            }
            if !arg.starts_with('-') {
                return Err(format!(
                    "{arg:?} is not an option: put the program and its arguments after `--` \
                     ({RUN_USAGE})"
                ));
            }
            if arg == "--watch-stdin" {
                opts.watch_stdin = true;
                continue;
            }
            // `--flag value` or torchrun's `--flag=value`.
            let (flag, value) = match arg.split_once('=') {
                Some((flag, value)) => (flag.to_string(), value.to_string()),
                None => {
                    let value = it.next().ok_or_else(|| format!("{arg} needs a value"))?;
                    (arg.clone(), value.clone())
                }
            };
            let value = &value;
            let number = |v: &str| {
                v.parse::<usize>()
                    .map_err(|_| format!("{flag} {v:?} is not a whole number"))
            };
            match flag.as_str() {
                "--nproc-per-node" | "--nproc_per_node" => opts.nproc_per_node = number(value)?,
                "--nnodes" => {
                    opts.nnodes = number(value)?;
                    node_flags.push("--nnodes");
                }
                "--node-rank" | "--node_rank" => {
                    opts.node_rank = number(value)?;
                    node_flags.push("--node-rank");
                }
                "--rank-offset" => opts.rank_offset = Some(number(value)?),
                "--world-size" => opts.world_size = Some(number(value)?),
                "--master-addr" | "--master_addr" => {
                    opts.master_addr = value.clone();
                    master_addr_given = true;
                }
                "--master-port" | "--master_port" => {
                    opts.master_port = value
                        .parse()
                        .map_err(|_| format!("--master-port {value:?} is not a port number"))?
                }
                "--grace" => {
                    opts.grace = value
                        .parse::<f64>()
                        .ok()
                        .and_then(|s| Duration::try_from_secs_f64(s).ok())
                        .ok_or_else(|| format!("--grace {value:?} is not a number of seconds"))?
                }
                "--hostfile" => hostfile = Some(PathBuf::from(value)),
                "--include" => include = Some(value.clone()),
                "--exclude" => exclude = Some(value.clone()),
                "--num-nodes" | "--num_nodes" => num_nodes = Some(number(value)?),
                "--launcher-cmd" => launcher_cmd = Some(value.clone()),
                other => return Err(format!("unknown option {other:?}")),
            }
        }
        if opts.command.is_empty() {
            return Err("no program given: put it after `--`".into());
        }
        if let Some(hostfile) = hostfile {
            if let Some(flag) = node_flags.first() {
                return Err(format!(
                    "{flag} is for starting each node by hand; --hostfile starts them all"
                ));
            }
            let launcher = launcher_cmd.or(ssh).unwrap_or_else(|| "ssh".into());
            let launcher_cmd: Vec<String> = launcher.split_whitespace().map(String::from).collect();
            if launcher_cmd.is_empty() {
                return Err("--launcher-cmd (or BURN_ZERO_SSH) is empty".into());
            }
            opts.multi_node = Some(MultiNode {
                hostfile,
                include,
                exclude,
                num_nodes,
                master_addr: master_addr_given.then(|| opts.master_addr.clone()),
                launcher_cmd,
            });
            return Ok(opts);
        }
        for (flag, given) in [
            ("--include", include.is_some()),
            ("--exclude", exclude.is_some()),
            ("--num-nodes", num_nodes.is_some()),
            ("--launcher-cmd", launcher_cmd.is_some()),
        ] {
            if given {
                return Err(format!(
                    "{flag} needs --hostfile FILE (the hosts to choose from)"
                ));
            }
        }
        if opts.nproc_per_node == 0 {
            return Err("--nproc-per-node N (N >= 1) is required".into());
        }
        if opts.nnodes == 0 || opts.node_rank >= opts.nnodes {
            return Err(format!(
                "--node-rank {} must be below --nnodes {}",
                opts.node_rank, opts.nnodes
            ));
        }
        if opts.nnodes > 1 && !master_addr_given {
            return Err(format!(
                "--nnodes {} needs --master-addr (the host of node 0): without it every node \
                 would wait for itself",
                opts.nnodes
            ));
        }
        let first = opts.first_rank();
        if opts.world() < first + opts.nproc_per_node {
            return Err(format!(
                "--world-size {} is too small for ranks {first}..{} of this node",
                opts.world(),
                first + opts.nproc_per_node
            ));
        }
        Ok(opts)
    }

    /// This node's first rank.
    fn first_rank(&self) -> usize {
        self.rank_offset
            .unwrap_or(self.node_rank * self.nproc_per_node)
    }

    /// Ranks in the job.
    fn world(&self) -> usize {
        self.world_size.unwrap_or(self.nnodes * self.nproc_per_node)
    }
}

/// The signal the launcher received (0: none).
static RECEIVED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(signal: libc::c_int) {
    RECEIVED.store(signal, Ordering::SeqCst);
}

fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(signal)) => {
            let name = match signal {
                libc::SIGKILL => " (SIGKILL)",
                libc::SIGSEGV => " (SIGSEGV)",
                libc::SIGABRT => " (SIGABRT)",
                libc::SIGTERM => " (SIGTERM)",
                libc::SIGINT => " (SIGINT)",
                _ => "",
            };
            format!("was killed by signal {signal}{name}")
        }
        _ => "ended".into(),
    }
}

fn signal_all(children: &mut [(usize, Child)], signal: libc::c_int) {
    for (_, child) in children.iter_mut() {
        if let Ok(None) = child.try_wait() {
            // SAFETY: sending a signal to a child we started; its pid is valid until reaped.
            unsafe { libc::kill(child.id() as libc::pid_t, signal) };
        }
    }
}

/// Stops every child still running: `signal`, then SIGKILL after `grace`.
fn stop_all(children: &mut [(usize, Child)], signal: libc::c_int, grace: Duration) {
    signal_all(children, signal);
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline
        && children
            .iter_mut()
            .any(|(_, c)| matches!(c.try_wait(), Ok(None)))
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    signal_all(children, libc::SIGKILL);
    for (_, child) in children.iter_mut() {
        let _ = child.wait();
    }
}

/// Installs the handlers of SIGINT and SIGTERM (forwarded to every child) and, with
/// `watch_stdin`, a thread that notes when stdin closes.
fn install_handlers(watch_stdin: bool) {
    // SAFETY: installing a handler that only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    if watch_stdin {
        std::thread::spawn(|| {
            let mut sink = [0u8; 256];
            let mut stdin = std::io::stdin();
            while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
            STDIN_CLOSED.store(true, Ordering::SeqCst);
        });
    }
}

/// Stdin closed under `--watch-stdin`: the multi-node launcher (or its ssh) is gone.
static STDIN_CLOSED: AtomicBool = AtomicBool::new(false);

/// How watching the children ended.
enum Outcome {
    /// All exited successfully (0) or the launcher was stopped (128 + signal).
    Code(i32),
    /// The child at this index failed first, with this status; the others were stopped.
    Failed(usize, ExitStatus),
}

/// Watches `children` until all exit, one fails (then stops the others: SIGTERM, SIGKILL
/// after `grace`), or the launcher gets a signal or loses stdin (forwarded to every child).
/// `name` says what a child is in messages ("rank 3", "node 1 (host)").
fn supervise(
    children: &mut [(usize, Child)],
    grace: Duration,
    name: impl Fn(usize) -> String,
) -> Outcome {
    loop {
        let signal = RECEIVED.swap(0, Ordering::SeqCst);
        if signal != 0 {
            eprintln!("burn-zero run: received signal {signal}: forwarding it to every rank");
            stop_all(children, signal, grace);
            return Outcome::Code(128 + signal);
        }
        if STDIN_CLOSED.load(Ordering::SeqCst) {
            eprintln!("burn-zero run: stdin closed (the launcher is gone): stopping every rank");
            stop_all(children, libc::SIGTERM, grace);
            return Outcome::Code(128 + libc::SIGHUP);
        }
        let mut failed = None;
        let mut running = 0;
        for (i, (id, child)) in children.iter_mut().enumerate() {
            match child.try_wait() {
                Ok(Some(status)) if !status.success() => {
                    failed = Some((i, status));
                    break;
                }
                Ok(Some(_)) => {}
                Ok(None) => running += 1,
                Err(e) => {
                    eprintln!("burn-zero run: cannot watch {}: {e}", name(*id));
                    running += 1;
                }
            }
        }
        if let Some((i, status)) = failed {
            eprintln!(
                "burn-zero run: {} {}; stopping the others",
                name(children[i].0),
                describe(status)
            );
            stop_all(children, libc::SIGTERM, grace);
            return Outcome::Failed(children[i].0, status);
        }
        if running == 0 {
            return Outcome::Code(0);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The launcher's exit code for a child that ended with `status`: its code, or 128 + the
/// signal that killed it; never 0.
fn failure_code(status: ExitStatus) -> i32 {
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
        .max(1)
}

/// A name for one launch: this process, the time and the port.
fn fresh_run_id(port: u16) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{}-{nanos}-{port}", std::process::id())
}

/// Runs the job; returns the launcher's exit code.
pub fn run(opts: &LaunchOptions) -> i32 {
    if let Some(multi) = &opts.multi_node {
        return multinode::run(opts, multi);
    }
    let world = opts.world();
    let first = opts.first_rank();
    install_handlers(opts.watch_stdin);
    // One node: this launcher names the job, so that rank 0 can tell its ranks from another
    // job's that reached its port. Several nodes' launchers cannot agree on a name by
    // themselves: there the user's (or the scheduler's) id, if any, is what the ranks compare.
    let run_id = std::env::var("BURN_ZERO_RUN_ID")
        .ok()
        .or_else(|| (opts.nnodes == 1).then(|| fresh_run_id(opts.master_port)));
    let mut children = Vec::new();
    let mut printers = Vec::new();
    // The flight lines ranks print when a collective times out: read to name the rank that
    // fell behind first.
    let reports: Arc<Mutex<Vec<FlightReport>>> = Arc::default();
    for local_rank in 0..opts.nproc_per_node {
        let rank = first + local_rank;
        let spawned = Command::new(&opts.command[0])
            .args(&opts.command[1..])
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local_rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_WORLD_SIZE", opts.nproc_per_node.to_string())
            .env("GROUP_RANK", opts.node_rank.to_string())
            .env("MASTER_ADDR", &opts.master_addr)
            .env("MASTER_PORT", opts.master_port.to_string())
            .envs(run_id.as_ref().map(|id| ("BURN_ZERO_RUN_ID", id)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => {
                eprintln!(
                    "burn-zero run: cannot start rank {rank} ({:?}): {e}",
                    opts.command[0]
                );
                stop_all(&mut children, libc::SIGTERM, opts.grace);
                return 1;
            }
        };
        let stdout = child.stdout.take().expect("piped stdout");
        let stderr = child.stderr.take().expect("piped stderr");
        printers.push(std::thread::spawn(move || {
            for line in output_lines(BufReader::new(stdout)) {
                println!("[rank {rank}] {line}");
            }
        }));
        let heard = reports.clone();
        printers.push(std::thread::spawn(move || {
            for line in output_lines(BufReader::new(stderr)) {
                if let Some(report) = FlightReport::parse(&line) {
                    heard.lock().unwrap_or_else(|e| e.into_inner()).push(report);
                }
                eprintln!("[rank {rank}] {line}");
            }
        }));
        children.push((rank, child));
    }

    let outcome = supervise(&mut children, opts.grace, |rank| format!("rank {rank}"));
    // Every rank's last lines are printed before the verdict.
    for printer in printers {
        let _ = printer.join();
    }
    match outcome {
        Outcome::Code(code) => code,
        Outcome::Failed(rank, status) => {
            eprintln!("{FAILED}rank {rank} {}", describe(status));
            let reports = reports.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(verdict) = verdict(&reports, world) {
                eprintln!("burn-zero run: {verdict}");
            }
            failure_code(status)
        }
    }
}

/// How the verdict on a failed rank starts: the multi-node launcher finds it in a node's
/// output to name the rank.
const FAILED: &str = "burn-zero run: failed: ";

/// The lines of a rank's output, bytes that are not UTF-8 replaced (a rank's output is never
/// cut short by them: a reader that stopped would leave the rank blocked on a full pipe).
fn output_lines(mut reader: impl BufRead) -> impl Iterator<Item = String> {
    let mut buf = Vec::new();
    std::iter::from_fn(move || {
        buf.clear();
        match reader.read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => None,
            Ok(_) => {
                let line = buf.strip_suffix(b"\n").unwrap_or(&buf);
                let line = line.strip_suffix(b"\r").unwrap_or(line);
                Some(String::from_utf8_lossy(line).into_owned())
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<LaunchOptions, String> {
        LaunchOptions::parse(&s.split_whitespace().map(String::from).collect::<Vec<_>>())
    }

    #[test]
    fn parses_torchrun_style_flags() {
        let o = parse("--nproc-per-node 4 --nnodes 2 --node-rank 1 --master-addr h0 --master-port 1234 -- prog --lr 3").unwrap();
        assert_eq!(
            (
                o.nproc_per_node,
                o.nnodes,
                o.node_rank,
                o.master_addr.as_str(),
                o.master_port
            ),
            (4, 2, 1, "h0", 1234)
        );
        assert_eq!(o.command, vec!["prog", "--lr", "3"]);
        assert!(parse("-- prog").unwrap_err().contains("--nproc-per-node"));
        assert!(
            parse("--nproc-per-node 2")
                .unwrap_err()
                .contains("no program")
        );
        assert!(
            parse("--nproc-per-node 2 --node-rank 3 --nnodes 2 -- p")
                .unwrap_err()
                .contains("below --nnodes")
        );
        assert!(
            parse("--nproc-per-node x -- p")
                .unwrap_err()
                .contains("\"x\"")
        );
    }

    #[test]
    fn torchrun_habits_are_understood_or_named() {
        let o = parse("--nproc-per-node=3 --master_port=2345 -- prog").unwrap();
        assert_eq!((o.nproc_per_node, o.master_port), (3, 2345));
        let err = parse("--nproc-per-node 2 ./train --lr 3").unwrap_err();
        assert!(
            err.contains("\"./train\"") && err.contains("after `--`"),
            "{err}"
        );
        for grace in ["inf", "1e300", "-1", "NaN"] {
            let err = parse(&format!("--nproc-per-node 2 --grace {grace} -- p")).unwrap_err();
            assert!(err.contains("--grace"), "{grace}: {err}");
        }
        let err = parse("--nproc-per-node 2 --nnodes 2 --node-rank 1 -- p").unwrap_err();
        assert!(err.contains("--master-addr"), "{err}");
    }

    #[test]
    fn output_lines_survive_bytes_that_are_not_utf8() {
        let bytes: &[u8] = b"one\r\ntw\xffo\nthree";
        let lines: Vec<String> = output_lines(bytes).collect();
        assert_eq!(lines, vec!["one", "tw\u{fffd}o", "three"]);
    }
}
