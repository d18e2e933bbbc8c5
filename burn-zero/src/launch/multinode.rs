//! One command for several nodes, as DeepSpeed's launcher: the hosts of a hostfile (after
//! `--include` / `--exclude` / `--num-nodes`), each node started through the launcher command
//! (`ssh HOST COMMAND` by default) as this launcher for that node's ranks.
//!
//! Every node runs `burn-zero run --node-rank I --rank-offset R --world-size W ... --watch-stdin
//! -- PROGRAM`, in this directory, with this launcher's `BURN_ZERO_*`, `NCCL_*` and `RUST_*`
//! variables; ranks are numbered node by node in the hostfile's order, and `MASTER_ADDR` is the
//! first node's host unless `--master-addr` says otherwise. Output comes back with each node's
//! `[rank N]` prefixes, the nodes' own lines prefixed `[HOST]`. When a node ends badly (one of
//! its ranks died: that node stopped its other ranks), the other nodes are stopped and the
//! verdict names the rank and its host. A node whose connection ends stops its ranks: it
//! watches its stdin, which is the ssh connection.

use std::io::BufReader;
use std::process::{ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::hosts::{Node, read_hostfile, select};
use super::{FAILED, LaunchOptions, MultiNode, Outcome, describe, failure_code, output_lines};

/// What one node is asked to run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodePlan {
    /// The host, as the launcher command is given it.
    pub host: String,
    /// The argument vector run on the host: this launcher for the node's ranks.
    pub argv: Vec<String>,
    /// `argv` as one shell command line (what ssh runs), `cd` and variables included.
    pub command_line: String,
}

/// Variables a node's ranks get from this launcher's environment (DeepSpeed exports `NCCL_*`
/// and a few others the same way): everything else comes from the node's own login.
const FORWARDED: [&str; 3] = ["BURN_ZERO_", "NCCL_", "RUST_"];

/// Quotes `word` for a POSIX shell, unless it needs no quoting.
pub fn shell_quote(word: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_-./=:,@%+".contains(c);
    if !word.is_empty() && word.chars().all(plain) {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// Each node's command: `agent` (this launcher's argv prefix, e.g. `[/path/burn-zero, run]`)
/// with the node's options, run in `cwd` with `env`.
pub fn plan(
    nodes: &[Node],
    opts: &LaunchOptions,
    multi: &MultiNode,
    agent: &[String],
    cwd: &str,
    env: &[(String, String)],
) -> Vec<NodePlan> {
    let world: usize = nodes.iter().map(|n| n.slots.len()).sum();
    let master = multi
        .master_addr
        .clone()
        .unwrap_or_else(|| nodes[0].host.clone());
    let mut offset = 0;
    nodes
        .iter()
        .enumerate()
        .map(|(i, node)| {
            let mut argv: Vec<String> = agent.to_vec();
            let k = node.slots.len();
            for (flag, value) in [
                ("--nproc-per-node", k.to_string()),
                ("--nnodes", nodes.len().to_string()),
                ("--node-rank", i.to_string()),
                ("--rank-offset", offset.to_string()),
                ("--world-size", world.to_string()),
                ("--master-addr", master.clone()),
                ("--master-port", opts.master_port.to_string()),
                ("--grace", opts.grace.as_secs_f64().to_string()),
            ] {
                argv.push(flag.into());
                argv.push(value);
            }
            argv.push("--watch-stdin".into());
            argv.push("--".into());
            argv.extend(opts.command.iter().cloned());
            offset += k;
            let mut vars: Vec<(String, String)> = env.to_vec();
            // A subset of the host's slots (`--include host:1,3`): LOCAL_RANK counts the
            // visible devices, as DeepSpeed does it.
            if node.slots.iter().copied().ne(0..k) {
                let list: Vec<String> = node.slots.iter().map(|s| s.to_string()).collect();
                vars.push(("CUDA_VISIBLE_DEVICES".into(), list.join(",")));
            }
            let mut line = format!("cd {} && exec", shell_quote(cwd));
            if !vars.is_empty() {
                line.push_str(" env");
                for (k, v) in &vars {
                    line.push(' ');
                    line.push_str(&shell_quote(&format!("{k}={v}")));
                }
            }
            for word in &argv {
                line.push(' ');
                line.push_str(&shell_quote(word));
            }
            NodePlan {
                host: node.host.clone(),
                argv,
                command_line: line,
            }
        })
        .collect()
}

/// The variables passed on to every node.
fn forwarded_env() -> Vec<(String, String)> {
    let mut vars: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| FORWARDED.iter().any(|p| k.starts_with(p)) && k != "BURN_ZERO_SSH")
        .collect();
    vars.sort();
    vars
}

/// Starts every node and watches them; returns the launcher's exit code.
pub fn run(opts: &LaunchOptions, multi: &MultiNode) -> i32 {
    let nodes = read_hostfile(&multi.hostfile).and_then(|nodes| {
        let per_node = (opts.nproc_per_node > 0).then_some(opts.nproc_per_node);
        select(
            nodes,
            multi.include.as_deref(),
            multi.exclude.as_deref(),
            multi.num_nodes,
            per_node,
        )
    });
    let nodes = match nodes {
        Ok(nodes) => nodes,
        Err(e) => {
            eprintln!("burn-zero run: {e}");
            return 2;
        }
    };
    let (exe, cwd) = match (std::env::current_exe(), std::env::current_dir()) {
        (Ok(exe), Ok(cwd)) => (exe, cwd),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("burn-zero run: cannot find this launcher or the working directory: {e}");
            return 1;
        }
    };
    let agent = vec![exe.display().to_string(), "run".to_string()];
    let plans = plan(
        &nodes,
        opts,
        multi,
        &agent,
        &cwd.display().to_string(),
        &forwarded_env(),
    );
    let world: usize = nodes.iter().map(|n| n.slots.len()).sum();
    let hosts: Vec<String> = nodes
        .iter()
        .map(|n| format!("{} ({} ranks)", n.host, n.slots.len()))
        .collect();
    eprintln!(
        "burn-zero run: {world} ranks on {} node(s) through `{}`: {}",
        nodes.len(),
        multi.launcher_cmd.join(" "),
        hosts.join(", ")
    );
    super::install_handlers(false);
    let mut children = Vec::new();
    // Kept open until the end: a node whose stdin closes stops its ranks.
    let mut stdins: Vec<ChildStdin> = Vec::new();
    let mut printers = Vec::new();
    let verdicts: Vec<Arc<Mutex<Option<String>>>> =
        nodes.iter().map(|_| Arc::new(Mutex::new(None))).collect();
    // A node stops its own ranks within its grace: it gets that and a margin before SIGKILL.
    let grace = opts.grace + Duration::from_secs(5);
    for (i, node) in plans.iter().enumerate() {
        let spawned = Command::new(&multi.launcher_cmd[0])
            .args(&multi.launcher_cmd[1..])
            .arg(&node.host)
            .arg(&node.command_line)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => {
                eprintln!(
                    "burn-zero run: cannot start node {i} ({}) with `{}`: {e}",
                    node.host,
                    multi.launcher_cmd.join(" ")
                );
                super::stop_all(&mut children, libc::SIGTERM, grace);
                return 1;
            }
        };
        stdins.extend(child.stdin.take());
        let stdout = child.stdout.take().expect("piped stdout");
        let stderr = child.stderr.take().expect("piped stderr");
        let host = node.host.clone();
        printers.push(std::thread::spawn(move || {
            for line in output_lines(BufReader::new(stdout)) {
                println!("{}", prefixed(&host, &line));
            }
        }));
        let (host, verdict) = (node.host.clone(), verdicts[i].clone());
        printers.push(std::thread::spawn(move || {
            for line in output_lines(BufReader::new(stderr)) {
                if let Some(rest) = line.strip_prefix(FAILED) {
                    *verdict.lock().unwrap() = Some(rest.to_string());
                }
                eprintln!("{}", prefixed(&host, &line));
            }
        }));
        children.push((i, child));
    }
    let name = |i: usize| format!("node {i} ({})", plans[i].host);
    let outcome = super::supervise(&mut children, grace, name);
    drop(stdins);
    for printer in printers {
        let _ = printer.join();
    }
    match outcome {
        Outcome::Code(code) => code,
        Outcome::Failed(i, status) => {
            match verdicts[i].lock().unwrap().take() {
                Some(rank) => eprintln!("{FAILED}{rank} on node {i} ({})", plans[i].host),
                // Not a rank: the launcher command itself (ssh could not connect, ...).
                None => eprintln!("{FAILED}{} {}", name(i), describe(status)),
            }
            failure_code(status)
        }
    }
}

/// A node's line: the ranks' lines carry their `[rank N]` already, the node's own get its host.
fn prefixed(host: &str, line: &str) -> String {
    if line.starts_with("[rank ") {
        line.to_string()
    } else {
        format!("[{host}] {line}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_survives_the_remote_shell() {
        assert_eq!(shell_quote("--lr=3e-4"), "--lr=3e-4");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("$HOME"), "'$HOME'");
    }

    #[test]
    fn each_node_gets_its_ranks_and_the_first_host_as_master() {
        let args: Vec<String> = ["--hostfile", "h", "--master-port", "1234", "--", "prog"]
            .into_iter()
            .chain(["--name", "x y"])
            .map(String::from)
            .collect();
        let opts = LaunchOptions::parse_with(&args, Some("fake-ssh -q".into())).unwrap();
        let multi = opts.multi_node.clone().unwrap();
        assert_eq!(multi.launcher_cmd, vec!["fake-ssh", "-q"]);
        let nodes = vec![
            Node {
                host: "a".into(),
                slots: vec![0, 1, 2],
            },
            Node {
                host: "b".into(),
                slots: vec![1],
            },
        ];
        let env = vec![("BURN_ZERO_TIMEOUT".to_string(), "60".to_string())];
        let plans = plan(
            &nodes,
            &opts,
            &multi,
            &["bz".into(), "run".into()],
            "/w d",
            &env,
        );
        assert_eq!(
            plans[0].command_line,
            "cd '/w d' && exec env BURN_ZERO_TIMEOUT=60 bz run --nproc-per-node 3 --nnodes 2 \
             --node-rank 0 --rank-offset 0 --world-size 4 --master-addr a --master-port 1234 \
             --grace 5 --watch-stdin -- prog --name 'x y'"
        );
        // Slot 1 only: the rank sees that device as its device 0.
        assert!(
            plans[1].command_line.contains(
                "env BURN_ZERO_TIMEOUT=60 CUDA_VISIBLE_DEVICES=1 bz run --nproc-per-node 1 \
                 --nnodes 2 --node-rank 1 --rank-offset 3 --world-size 4 --master-addr a"
            ),
            "{}",
            plans[1].command_line
        );
        // What the node's launcher parses back.
        let node = LaunchOptions::parse_with(&plans[1].argv[2..], None).unwrap();
        assert_eq!(
            (node.first_rank(), node.world(), node.watch_stdin),
            (3, 4, true)
        );
        assert_eq!(node.command, vec!["prog", "--name", "x y"]);
    }
}
