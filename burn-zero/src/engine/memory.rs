//! Memory accounting: what a rank holds, and DeepSpeed's model-state estimator.

use core::fmt;

use serde::Serialize;

use crate::config::ZeroStage;

/// Bytes one rank holds for model states, as allocated by the engine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MemoryReport {
    /// The model's parameters, trainable and frozen (full on every rank in stages 0–2).
    pub parameters: usize,
    /// Gradient storage: the full gradient (stages 0–1) or this rank's partition (stage 2).
    pub gradients: usize,
    /// Optimizer state for this rank's partition: the fp32 master copy and (Adam) two moments.
    pub optimizer_state: usize,
    /// Peak communication buffers (one bucket and its copies).
    pub communication_buffers: usize,
    /// Host memory of an offloaded optimizer (`offload_optimizer`): master and state, counted
    /// here instead of in `optimizer_state`.
    pub host_optimizer_state: usize,
    /// Host memory of offloaded parameter partitions (`offload_param`, ZeRO-3), counted here
    /// instead of in `parameters`.
    pub host_parameters: usize,
    /// Host memory of the gradient partition (ZeRO-Offload at stages 2 and 3), counted here
    /// instead of in `gradients`.
    pub host_gradients: usize,
}

impl MemoryReport {
    /// Model states: parameters + gradients + optimizer state.
    pub fn model_states(&self) -> usize {
        self.parameters + self.gradients + self.optimizer_state
    }

    /// Everything, communication buffers included.
    pub fn total(&self) -> usize {
        self.model_states() + self.communication_buffers
    }
}

/// Bytes in the largest binary unit that keeps the number at or above 1.
fn human(bytes: usize) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < units.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", units[unit])
}

impl fmt::Display for MemoryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "parameters {} | gradients {} | optimizer state {} | communication buffers {} | total {}",
            human(self.parameters),
            human(self.gradients),
            human(self.optimizer_state),
            human(self.communication_buffers),
            human(self.total())
        )?;
        let host = [
            ("optimizer state", self.host_optimizer_state),
            ("gradients", self.host_gradients),
            ("parameters", self.host_parameters),
        ];
        let host: Vec<String> = host
            .iter()
            .filter(|(_, bytes)| *bytes > 0)
            .map(|(what, bytes)| format!("{what} {}", human(*bytes)))
            .collect();
        if !host.is_empty() {
            write!(f, " | in host memory: {}", host.join(", "))?;
        }
        Ok(())
    }
}

/// One row of DeepSpeed's model-state estimate (mixed-precision training with Adam).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Estimate {
    /// Bytes per CPU (host) for model states.
    pub per_cpu: u64,
    /// Bytes per GPU for model states.
    pub per_gpu: u64,
    /// The options of this row, as DeepSpeed prints them.
    pub options: String,
}

/// DeepSpeed's `estimate_zero2/zero3_model_states_mem_needs` for every option row of `stage`:
/// `params` in total, the largest layer's `largest_layer` (stage 3), `gpus_per_node` × `nodes`
/// GPUs, and `buffer_factor` headroom on CPU memory (DeepSpeed uses 1.5).
///
/// Stage 0 (no ZeRO) keeps 16 bytes per parameter on every GPU: 2 (bf16 weights) + 2 (bf16
/// gradients) + 12 (fp32 master, momentum, variance). Stages 1–2 use DeepSpeed's ZeRO-2
/// formula (18 bytes/param partitioned: fp32 grads, master, moments, plus bf16 grads).
pub fn estimate_model_states(
    stage: u8,
    params: u64,
    largest_layer: u64,
    gpus_per_node: u64,
    nodes: u64,
    buffer_factor: f64,
) -> Vec<Estimate> {
    let p = params as f64;
    let total_gpus = (gpus_per_node * nodes) as f64;
    let row = |cpu: f64, gpu: f64, options: String| Estimate {
        per_cpu: cpu as u64,
        per_gpu: gpu as u64,
        options,
    };
    match estimated_stage(stage) {
        ZeroStage::Disabled => vec![row(
            p * 4.0 * gpus_per_node as f64 * buffer_factor,
            16.0 * p,
            "no ZeRO".into(),
        )],
        ZeroStage::OptimizerStates | ZeroStage::Gradients => vec![
            row(
                p * (4.0 * total_gpus).max(16.0) * buffer_factor,
                2.0 * p,
                "offload_optimizer=cpu ".into(),
            ),
            row(
                p * 4.0 * gpus_per_node as f64 * buffer_factor,
                2.0 * p + (18.0 * p / total_gpus).floor(),
                "offload_optimizer=none".into(),
            ),
        ],
        ZeroStage::Parameters => {
            let largest = 4.0 * largest_layer as f64;
            let per_node = 1.0 / nodes as f64;
            let gpn = gpus_per_node as f64;
            let mut rows = Vec::new();
            for (offload_optimizer, offload_params) in [(true, true), (true, false), (false, false)]
            {
                for zero_init in [true, false] {
                    let (cpu, gpu) = match (offload_optimizer, offload_params) {
                        (true, true) => {
                            let per_param = if zero_init {
                                18.0 * per_node
                            } else {
                                (4.0 * gpn).max(18.0 * per_node)
                            };
                            (p * per_param * buffer_factor, largest)
                        }
                        (true, false) => {
                            let per_param = if zero_init {
                                16.0 * per_node
                            } else {
                                (4.0 * gpn).max(16.0 * per_node)
                            };
                            (
                                p * per_param * buffer_factor,
                                largest + (2.0 * p / total_gpus).floor(),
                            )
                        }
                        _ => {
                            let cpu = if zero_init { largest_layer as f64 } else { p }
                                * 4.0
                                * gpn
                                * buffer_factor;
                            (cpu, largest + (18.0 * p / total_gpus).floor())
                        }
                    };
                    let device = |on: bool| if on { "cpu " } else { "none" };
                    let options = format!(
                        "offload_param={}, offload_optimizer={}, zero_init={}",
                        device(offload_params),
                        device(offload_optimizer),
                        u8::from(zero_init)
                    );
                    rows.push(row(cpu, gpu, options));
                }
            }
            rows
        }
    }
}

/// The stage of DeepSpeed's estimators' number: any above 3 estimates as 3.
fn estimated_stage(stage: u8) -> ZeroStage {
    ZeroStage::try_from(u64::from(stage)).unwrap_or(ZeroStage::Parameters)
}

/// The estimate as DeepSpeed prints it.
pub fn format_estimates(
    stage: u8,
    params: u64,
    largest_layer: u64,
    gpus_per_node: u64,
    nodes: u64,
    rows: &[Estimate],
) -> String {
    let plural = |n: u64, word: &str, many: &str| {
        if n > 1 {
            many.to_string()
        } else {
            word.to_string()
        }
    };
    let mut out =
        String::from("Estimated memory needed for params, optim states and gradients for a:\n");
    out += &format!(
        "HW: Setup with {nodes} {}, {gpus_per_node} {} per node.\n",
        plural(nodes, "node", "nodes"),
        plural(gpus_per_node, "GPU", "GPUs")
    );
    out += &format!("SW: Model with {}M total params", params / 1_000_000);
    if let ZeroStage::Parameters = estimated_stage(stage) {
        out += &format!(", {}M largest layer params", largest_layer / 1_000_000);
    }
    out += ".\n  per CPU  |  per GPU |   Options\n";
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    for r in rows {
        out += &format!(
            " {:7.2}GB | {:6.2}GB | {}\n",
            gib(r.per_cpu),
            gib(r.per_gpu),
            r.options
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero2_matches_deepspeeds_formula() {
        // P = 1e6 on 4 GPUs of one node. Offload: CPU max(4·4, 16)·1.5·P, GPU 2P.
        // None: CPU 4·(GPUs per node)·1.5·P, GPU 2P + 18P/4.
        let rows = estimate_model_states(2, 1_000_000, 0, 4, 1, 1.5);
        assert_eq!((rows[0].per_cpu, rows[0].per_gpu), (24_000_000, 2_000_000));
        assert_eq!((rows[1].per_cpu, rows[1].per_gpu), (24_000_000, 6_500_000));
    }

    #[test]
    fn zero3_matches_deepspeeds_formula() {
        let rows = estimate_model_states(3, 1_000_000, 100_000, 4, 1, 1.5);
        let got: Vec<(u64, u64)> = rows.iter().map(|r| (r.per_cpu, r.per_gpu)).collect();
        assert_eq!(
            got,
            vec![
                (27_000_000, 400_000),
                (27_000_000, 400_000),
                (24_000_000, 900_000),
                (24_000_000, 900_000),
                (2_400_000, 4_900_000),
                (24_000_000, 4_900_000)
            ]
        );
    }

    #[test]
    fn printed_like_deepspeed() {
        let rows = estimate_model_states(2, 2_000_000_000, 0, 1, 1, 1.5);
        let text = format_estimates(2, 2_000_000_000, 0, 1, 1, &rows);
        assert_eq!(
            text,
            "Estimated memory needed for params, optim states and gradients for a:\n\
             HW: Setup with 1 node, 1 GPU per node.\n\
             SW: Model with 2000M total params.\n  per CPU  |  per GPU |   Options\n   \
             44.70GB |   3.73GB | offload_optimizer=cpu \n   11.18GB |  37.25GB | offload_optimizer=none\n"
        );
        let rows = estimate_model_states(3, 2_000_000_000, 100_000_000, 1, 1, 1.5);
        let text = format_estimates(3, 2_000_000_000, 100_000_000, 1, 1, &rows);
        assert!(text.contains("SW: Model with 2000M total params, 100M largest layer params."));
        assert!(text.contains(
            "   50.29GB |   0.37GB | offload_param=cpu , offload_optimizer=cpu , zero_init=1\n"
        ));
        assert!(text.contains(
            "    0.56GB |  33.90GB | offload_param=none, offload_optimizer=none, zero_init=1\n"
        ));
    }
}
