//! DeepSpeed's hostfile and its `--include` / `--exclude` / `--num-nodes` filters: which hosts
//! a multi-node job runs on and which slots (GPUs) of each.
//!
//! A hostfile has one `host slots=N` line per node; `#` starts a comment and blank lines are
//! skipped (DeepSpeed's `_parse_hostfile`). A filter is `host@host:0,2`: nodes separated by
//! `@`, a node either a whole host or `host:` with a comma-separated list of slot indices
//! (DeepSpeed's `parse_resource_filter`).

use std::path::Path;

/// One node of the job: its host and the slots (local device indices) its ranks use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    /// What the launcher command (ssh) is given.
    pub host: String,
    /// Slot indices on this host, ascending; one rank each.
    pub slots: Vec<usize>,
}

/// Parses a hostfile's text (`name` is what errors call it).
pub fn parse_hostfile(name: &str, text: &str) -> Result<Vec<Node>, String> {
    let mut nodes: Vec<Node> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let bad = |why: &str| format!("{name} line {}: {why}: {raw:?}", i + 1);
        let mut words = line.split_whitespace();
        let host = words.next().expect("a non-empty line has a word");
        // `slots=4` or `slots = 4`.
        let rest: String = words.collect();
        let count = rest
            .strip_prefix("slots=")
            .ok_or_else(|| bad("expected `host slots=N`"))?;
        let slots: usize = count
            .parse()
            .map_err(|_| bad(&format!("slots={count:?} is not a whole number")))?;
        if slots == 0 {
            return Err(bad("slots=0 gives the host nothing to run"));
        }
        if nodes.iter().any(|n| n.host == host) {
            return Err(bad(&format!("host {host:?} is listed twice")));
        }
        nodes.push(Node {
            host: host.to_string(),
            slots: (0..slots).collect(),
        });
    }
    if nodes.is_empty() {
        return Err(format!(
            "{name} lists no hosts (expected lines `host slots=N`)"
        ));
    }
    Ok(nodes)
}

/// Reads and parses a hostfile.
pub fn read_hostfile(path: &Path) -> Result<Vec<Node>, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("hostfile {}: {e}", path.display()))?;
    parse_hostfile(&format!("hostfile {}", path.display()), &text)
}

/// Whether a filter keeps or drops what it names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Filter {
    /// `--include`: only what is named.
    Include,
    /// `--exclude`: all but what is named.
    Exclude,
}

/// Applies `--include` or `--exclude` (`spec`, DeepSpeed's `host1:0,1@host2`) to `nodes`;
/// hosts keep the hostfile's order and hosts left without slots are dropped.
pub fn filter(nodes: &[Node], spec: &str, how: Filter) -> Result<Vec<Node>, String> {
    let flag = match how {
        Filter::Include => "--include",
        Filter::Exclude => "--exclude",
    };
    let mut chosen: Vec<Node> = match how {
        Filter::Include => nodes
            .iter()
            .map(|n| Node {
                host: n.host.clone(),
                slots: Vec::new(),
            })
            .collect(),
        Filter::Exclude => nodes.to_vec(),
    };
    for part in spec.split('@') {
        let (host, slots) = match part.split_once(':') {
            Some((host, list)) => {
                let slots = list
                    .split(',')
                    .map(|s| {
                        s.trim().parse::<usize>().map_err(|_| {
                            format!("{flag} {spec:?}: slot {s:?} of host {host:?} is not a number")
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                (host, Some(slots))
            }
            None => (part, None),
        };
        let known = nodes.iter().position(|n| n.host == host).ok_or_else(|| {
            let hosts: Vec<&str> = nodes.iter().map(|n| n.host.as_str()).collect();
            format!("{flag} {spec:?}: host {host:?} is not in the hostfile (its hosts: {hosts:?})")
        })?;
        let available = &nodes[known].slots;
        let slots = slots.unwrap_or_else(|| available.clone());
        if let Some(bad) = slots.iter().find(|s| !available.contains(s)) {
            return Err(format!(
                "{flag} {spec:?}: host {host:?} has no slot {bad} (it has slots 0..{})",
                available.len()
            ));
        }
        let node = &mut chosen[known];
        match how {
            Filter::Include => node.slots.extend(slots),
            Filter::Exclude => node.slots.retain(|s| !slots.contains(s)),
        }
        node.slots.sort_unstable();
        node.slots.dedup();
    }
    chosen.retain(|n| !n.slots.is_empty());
    if chosen.is_empty() {
        return Err(format!("{flag} {spec:?} leaves no host to run on"));
    }
    Ok(chosen)
}

/// The nodes a job runs on: the hostfile's, filtered by `include` or `exclude`, the first
/// `num_nodes` of them, each with at most its first `per_node` slots.
pub fn select(
    nodes: Vec<Node>,
    include: Option<&str>,
    exclude: Option<&str>,
    num_nodes: Option<usize>,
    per_node: Option<usize>,
) -> Result<Vec<Node>, String> {
    let mut nodes = match (include, exclude) {
        (Some(_), Some(_)) => {
            return Err("--include and --exclude cannot be used together".into());
        }
        (Some(spec), None) => filter(&nodes, spec, Filter::Include)?,
        (None, Some(spec)) => filter(&nodes, spec, Filter::Exclude)?,
        (None, None) => nodes,
    };
    if let Some(n) = num_nodes {
        if n == 0 || n > nodes.len() {
            return Err(format!(
                "--num-nodes {n}: {} host(s) are available",
                nodes.len()
            ));
        }
        nodes.truncate(n);
    }
    if let Some(k) = per_node {
        if let Some(short) = nodes.iter().find(|n| n.slots.len() < k) {
            return Err(format!(
                "--nproc-per-node {k}: host {:?} has only {} slot(s)",
                short.host,
                short.slots.len()
            ));
        }
        for node in &mut nodes {
            node.slots.truncate(k);
        }
    }
    Ok(nodes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(text: &str) -> Vec<Node> {
        parse_hostfile("hostfile", text).unwrap()
    }

    fn node(host: &str, slots: &[usize]) -> Node {
        Node {
            host: host.into(),
            slots: slots.to_vec(),
        }
    }

    #[test]
    fn hostfile_lines_comments_and_blanks() {
        let text = "# the cluster\nworker-0 slots=4\n\n  worker-1   slots = 2 # small\n";
        assert_eq!(
            hosts(text),
            vec![node("worker-0", &[0, 1, 2, 3]), node("worker-1", &[0, 1])]
        );
    }

    #[test]
    fn bad_hostfiles_are_named() {
        let err = |text: &str| parse_hostfile("hostfile h", text).unwrap_err();
        assert_eq!(
            err("# nothing\n\n"),
            "hostfile h lists no hosts (expected lines `host slots=N`)"
        );
        assert_eq!(
            err("a slots=2\nb slots=two\n"),
            "hostfile h line 2: slots=\"two\" is not a whole number: \"b slots=two\""
        );
        assert_eq!(
            err("a 4\n"),
            "hostfile h line 1: expected `host slots=N`: \"a 4\""
        );
        assert!(err("a slots=0").contains("slots=0"), "{}", err("a slots=0"));
        assert!(err("a slots=1\na slots=2").contains("host \"a\" is listed twice"));
    }

    #[test]
    fn include_and_exclude_in_deepspeed_syntax() {
        let all = hosts("h1 slots=4\nh2 slots=2\nh3 slots=2\n");
        let include = |s| filter(&all, s, Filter::Include);
        let exclude = |s| filter(&all, s, Filter::Exclude);
        assert_eq!(include("h2").unwrap(), vec![node("h2", &[0, 1])]);
        // The hostfile's order, whatever the filter's.
        assert_eq!(
            include("h3@h1:0,2").unwrap(),
            vec![node("h1", &[0, 2]), node("h3", &[0, 1])]
        );
        assert_eq!(
            exclude("h1:1,3@h3").unwrap(),
            vec![node("h1", &[0, 2]), node("h2", &[0, 1])]
        );
        assert_eq!(
            include("h4").unwrap_err(),
            "--include \"h4\": host \"h4\" is not in the hostfile (its hosts: [\"h1\", \"h2\", \"h3\"])"
        );
        assert_eq!(
            exclude("h2:2").unwrap_err(),
            "--exclude \"h2:2\": host \"h2\" has no slot 2 (it has slots 0..2)"
        );
        assert!(include("h1:x").unwrap_err().contains("slot \"x\""));
        assert!(
            exclude("h1@h2@h3")
                .unwrap_err()
                .contains("leaves no host to run on")
        );
    }

    #[test]
    fn num_nodes_and_slots_per_node() {
        let all = hosts("h1 slots=4\nh2 slots=2\nh3 slots=2\n");
        assert_eq!(
            select(all.clone(), None, Some("h1"), Some(1), None).unwrap(),
            vec![node("h2", &[0, 1])]
        );
        assert_eq!(
            select(all.clone(), None, None, Some(2), Some(1)).unwrap(),
            vec![node("h1", &[0]), node("h2", &[0])]
        );
        assert_eq!(
            select(all.clone(), None, None, Some(4), None).unwrap_err(),
            "--num-nodes 4: 3 host(s) are available"
        );
        assert_eq!(
            select(all.clone(), None, None, None, Some(3)).unwrap_err(),
            "--nproc-per-node 3: host \"h2\" has only 2 slot(s)"
        );
        assert!(
            select(all, Some("h1"), Some("h2"), None, None)
                .unwrap_err()
                .contains("cannot be used together")
        );
    }
}
