//! The FLOPs profiler's report: per-module parameters, MACs, FLOPs and forward latency at each
//! depth, and the model-level figures, printed in DeepSpeed's layout.

use std::collections::BTreeMap;
use std::fmt::Write;

use super::{Counts, Phase};

/// One module's totals (itself and everything under it).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct ModuleStats {
    /// Trainable and frozen parameters.
    pub params: u64,
    /// Forward multiply-accumulates.
    pub macs: u64,
    /// Forward FLOPs.
    pub flops: u64,
    /// Forward time inside the module's scope (0 when the model opens no scope for it).
    pub latency_s: f64,
}

/// One profiled step.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Profile {
    /// The global step profiled.
    pub step: u64,
    /// Data-parallel ranks.
    pub world_size: usize,
    /// Micro-batch per GPU.
    pub batch_size: usize,
    /// Per module path ("" is the model), totals including sub-modules.
    pub modules: BTreeMap<String, ModuleStats>,
    /// Backward MACs and FLOPs, measured (not estimated).
    pub bwd_macs: u64,
    /// Backward FLOPs.
    pub bwd_flops: u64,
    /// Forward, backward and optimizer-step wall time.
    pub fwd_s: f64,
    /// Backward wall time.
    pub bwd_s: f64,
    /// Optimizer step wall time.
    pub step_s: f64,
    /// The device's dense peak FLOP/s for MFU (0: unknown).
    pub peak_flops: f64,
}

impl Profile {
    /// The profile of recorded `counts` and per-module-path `params`.
    pub fn new(counts: &BTreeMap<(Phase, String), Counts>, params: &BTreeMap<String, u64>) -> Self {
        let mut modules: BTreeMap<String, ModuleStats> = BTreeMap::new();
        // Every prefix of a path (and the model, "") gets the path's totals.
        let prefixes = |path: &str| {
            let parts: Vec<&str> = if path.is_empty() {
                Vec::new()
            } else {
                path.split('.').collect()
            };
            (0..=parts.len())
                .map(move |n| parts[..n].join("."))
                .collect::<Vec<_>>()
        };
        for (path, n) in params {
            for p in prefixes(path) {
                modules.entry(p).or_default().params += n;
            }
        }
        let (mut bwd_macs, mut bwd_flops) = (0, 0);
        for ((phase, path), c) in counts {
            match phase {
                Phase::Forward => {
                    for p in prefixes(path) {
                        let m = modules.entry(p).or_default();
                        m.macs += c.macs;
                        m.flops += c.flops;
                    }
                    // Scopes time themselves inclusively.
                    modules.entry(path.clone()).or_default().latency_s += c.latency.as_secs_f64();
                }
                Phase::Backward => {
                    bwd_macs += c.macs;
                    bwd_flops += c.flops;
                }
            }
        }
        Self {
            modules,
            bwd_macs,
            bwd_flops,
            ..Default::default()
        }
    }

    /// Gives modules no scope timed (containers such as a list of layers, and the model) the
    /// sum of their children's latencies, and the model the forward's time if still none.
    pub fn fill_latencies(&mut self) {
        let deepest = self.modules.keys().map(|k| depth(k)).max().unwrap_or(0);
        for d in (0..deepest).rev() {
            let parents: Vec<String> = self
                .modules
                .iter()
                .filter(|(k, m)| depth(k) == d && m.latency_s == 0.0)
                .map(|(k, _)| k.clone())
                .collect();
            for parent in parents {
                let prefix = if parent.is_empty() {
                    String::new()
                } else {
                    format!("{parent}.")
                };
                let sum: f64 = self
                    .modules
                    .iter()
                    .filter(|(k, _)| depth(k) == d + 1 && k.starts_with(&prefix))
                    .map(|(_, m)| m.latency_s)
                    .sum();
                self.modules.get_mut(&parent).expect("listed").latency_s = sum;
            }
        }
        let fwd = self.fwd_s;
        let model = self.modules.entry(String::new()).or_default();
        if fwd > 0.0 {
            model.latency_s = fwd;
        }
    }

    /// The model's totals.
    pub fn model(&self) -> ModuleStats {
        self.modules.get("").copied().unwrap_or_default()
    }
}

fn num(v: f64, unit: &str) -> String {
    let (scaled, prefix) = [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")]
        .into_iter()
        .find(|(s, _)| v.abs() >= *s)
        .map_or((v, ""), |(s, p)| (v / s, p));
    format!("{scaled:.2} {prefix}{unit}").trim_end().to_string()
}

fn time(s: f64) -> String {
    match s {
        s if s >= 1.0 => format!("{s:.2} s"),
        s if s >= 1e-3 => format!("{:.2} ms", s * 1e3),
        s => format!("{:.2} us", s * 1e6),
    }
}

fn pct(part: f64, whole: f64) -> String {
    if whole > 0.0 {
        format!("{:.2}%", 100.0 * part / whole)
    } else {
        "0.00%".into()
    }
}

fn depth(path: &str) -> usize {
    if path.is_empty() {
        0
    } else {
        path.split('.').count()
    }
}

/// DeepSpeed's printout of `p`: the summary, the top `top_modules` per depth up to
/// `module_depth` (-1: all), and, when `detailed`, every module with its shares.
pub fn format_report(p: &Profile, module_depth: i64, top_modules: usize, detailed: bool) -> String {
    let m = p.model();
    let mut o = String::new();
    let line = |o: &mut String, k: &str, v: String| {
        let _ = writeln!(o, "{k:<62}{v}");
    };
    let _ = writeln!(
        o,
        "\n-------------------------- burn-zero Flops Profiler --------------------------"
    );
    let _ = writeln!(o, "Profile Summary at step {}:", p.step);
    let _ = writeln!(
        o,
        "Notations:\ndata parallel size (dp_size), model parallel size(mp_size),\nnumber of parameters (params), number of multiply-accumulate operations(MACs),\nnumber of floating-point operations (flops), floating-point operations per second (FLOPS),\nfwd latency (forward propagation latency), bwd latency (backward propagation latency),\nstep (weights update latency), iter latency (sum of fwd, bwd and step latency)\n"
    );
    line(&mut o, "world size:", p.world_size.to_string());
    line(&mut o, "data parallel size:", p.world_size.to_string());
    line(&mut o, "batch size per GPU:", p.batch_size.to_string());
    line(&mut o, "params per GPU:", num(m.params as f64, ""));
    line(&mut o, "fwd MACs per GPU:", num(m.macs as f64, "MACs"));
    line(&mut o, "fwd flops per GPU:", num(m.flops as f64, ""));
    line(&mut o, "fwd latency:", time(p.fwd_s));
    let rate = |flops: f64, s: f64| {
        if s > 0.0 {
            num(flops / s, "FLOPS")
        } else {
            "-".into()
        }
    };
    line(
        &mut o,
        "fwd FLOPS per GPU = fwd flops per GPU / fwd latency:",
        rate(m.flops as f64, p.fwd_s),
    );
    line(
        &mut o,
        "bwd MACs per GPU (measured):",
        num(p.bwd_macs as f64, "MACs"),
    );
    line(
        &mut o,
        "bwd flops per GPU (measured):",
        num(p.bwd_flops as f64, ""),
    );
    line(&mut o, "bwd latency:", time(p.bwd_s));
    line(
        &mut o,
        "bwd FLOPS per GPU = bwd flops per GPU / bwd latency:",
        rate(p.bwd_flops as f64, p.bwd_s),
    );
    let total = (m.flops + p.bwd_flops) as f64;
    line(
        &mut o,
        "fwd+bwd FLOPS per GPU:",
        rate(total, p.fwd_s + p.bwd_s),
    );
    line(&mut o, "step latency:", time(p.step_s));
    let iter = p.fwd_s + p.bwd_s + p.step_s;
    line(&mut o, "iter latency:", time(iter));
    line(
        &mut o,
        "FLOPS per GPU = (fwd + bwd flops) / iter latency:",
        rate(total, iter),
    );
    if p.peak_flops > 0.0 && iter > 0.0 {
        line(
            &mut o,
            "MFU = FLOPS per GPU / peak:",
            pct(total / iter, p.peak_flops),
        );
    }
    if iter > 0.0 {
        line(
            &mut o,
            "samples/second:",
            format!("{:.2}", (p.batch_size * p.world_size) as f64 / iter),
        );
    }
    let max_depth = p.modules.keys().map(|k| depth(k)).max().unwrap_or(0);
    let last = if module_depth < 0 {
        max_depth
    } else {
        (module_depth as usize).min(max_depth)
    };
    let _ = writeln!(
        o,
        "\n----------------------------- Aggregated Profile per GPU -----------------------------"
    );
    let _ = writeln!(
        o,
        "Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"
    );
    for d in 0..=last {
        let at: Vec<(&String, &ModuleStats)> =
            p.modules.iter().filter(|(k, _)| depth(k) == d).collect();
        let top = |key: &dyn Fn(&ModuleStats) -> f64, show: &dyn Fn(&ModuleStats) -> String| {
            let mut v = at.clone();
            v.sort_by(|a, b| key(b.1).total_cmp(&key(a.1)));
            let items: Vec<String> = v
                .iter()
                .take(top_modules)
                .map(|(k, s)| {
                    format!(
                        "'{}': '{}'",
                        if k.is_empty() { "model" } else { k },
                        show(s)
                    )
                })
                .collect();
            format!("{{{}}}", items.join(", "))
        };
        let _ = writeln!(o, "depth {d}:");
        let _ = writeln!(
            o,
            "    params      - {}",
            top(&|s| s.params as f64, &|s| num(s.params as f64, ""))
        );
        let _ = writeln!(
            o,
            "    MACs        - {}",
            top(&|s| s.macs as f64, &|s| num(s.macs as f64, "MACs"))
        );
        let _ = writeln!(
            o,
            "    fwd latency - {}",
            top(&|s| s.latency_s, &|s| time(s.latency_s))
        );
    }
    if detailed {
        let _ = writeln!(
            o,
            "\n------------------------------ Detailed Profile per GPU ------------------------------"
        );
        let _ = writeln!(
            o,
            "Each module profile is listed after its name in the following order:\nparams, percentage of total params, MACs, percentage of total MACs, fwd latency, percentage of total fwd latency, fwd FLOPS\n"
        );
        for (path, s) in p.modules.iter().filter(|(k, _)| depth(k) <= last) {
            let name = if path.is_empty() {
                "model"
            } else {
                path.as_str()
            };
            let _ = writeln!(
                o,
                "{}{name}: {}, {}, {}, {}, {}, {}, {}",
                "  ".repeat(depth(path)),
                num(s.params as f64, ""),
                pct(s.params as f64, m.params as f64),
                num(s.macs as f64, "MACs"),
                pct(s.macs as f64, m.macs as f64),
                time(s.latency_s),
                pct(s.latency_s, p.fwd_s),
                rate(s.flops as f64, s.latency_s),
            );
        }
    }
    let _ = writeln!(
        o,
        "------------------------------------------------------------------------------"
    );
    o
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn totals_roll_up_to_every_parent_and_print_per_depth() {
        let mut counts = BTreeMap::new();
        let c = |macs, flops, ms| Counts {
            macs,
            flops,
            latency: Duration::from_millis(ms),
            calls: 1,
        };
        counts.insert((Phase::Forward, "".to_string()), c(1, 2, 0));
        counts.insert((Phase::Forward, "a".to_string()), c(10, 25, 5));
        counts.insert((Phase::Forward, "a.x".to_string()), c(100, 200, 3));
        counts.insert((Phase::Backward, "".to_string()), c(222, 444, 0));
        let params = BTreeMap::from([("a.x".to_string(), 6u64), ("b".to_string(), 4u64)]);
        let p = Profile::new(&counts, &params);
        assert_eq!(
            p.model(),
            ModuleStats {
                params: 10,
                macs: 111,
                flops: 227,
                latency_s: 0.0
            }
        );
        assert_eq!(
            (
                p.modules["a"].params,
                p.modules["a"].macs,
                p.modules["a"].flops
            ),
            (6, 110, 225)
        );
        assert_eq!((p.modules["b"].params, p.modules["b"].macs), (4, 0));
        assert_eq!((p.bwd_macs, p.bwd_flops), (222, 444));
        let text = format_report(&p, 1, 1, true);
        assert!(
            text.contains("depth 1:") && !text.contains("depth 2:"),
            "{text}"
        );
        assert!(text.contains("'a': '110.00 MACs'"), "{text}");
        assert!(text.contains("bwd MACs per GPU (measured):"), "{text}");
    }
}
