//! The top level of `ds_config.json` and its small sections.

use serde::{Deserialize, Serialize};

use super::values::Count;
use super::zero::ZeroConfig;

/// A parsed `ds_config.json`, with DeepSpeed's key names and (0.19) defaults.
///
/// Load it with [`DeepSpeedConfig::from_json`] or [`DeepSpeedConfig::from_file`], which also
/// report unknown keys; resolve it for a world size with [`DeepSpeedConfig::resolve`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DeepSpeedConfig {
    /// `train_batch_size`: samples per optimizer step over all ranks.
    pub train_batch_size: Option<Count>,
    /// `train_micro_batch_size_per_gpu`: samples per rank per forward/backward.
    pub train_micro_batch_size_per_gpu: Option<Count>,
    /// `gradient_accumulation_steps`: micro-steps per optimizer step.
    pub gradient_accumulation_steps: Option<Count>,
    /// `optimizer`.
    pub optimizer: Option<OptimizerConfig>,
    /// `scheduler`.
    pub scheduler: Option<SchedulerConfig>,
    /// `gradient_clipping`: global-norm clipping threshold; 0 disables it.
    pub gradient_clipping: f64,
    /// `zero_optimization`.
    pub zero_optimization: ZeroConfig,
    /// `fp16`.
    pub fp16: Fp16Config,
    /// `bf16` (alias `bfloat16`).
    #[serde(alias = "bfloat16")]
    pub bf16: Bf16Config,
    /// `data_types`.
    pub data_types: DataTypesConfig,
    /// `steps_per_print`: log progress every this many optimizer steps (none: never).
    pub steps_per_print: Option<Count>,
    /// `wall_clock_breakdown`: time forward/backward/step.
    pub wall_clock_breakdown: bool,
    /// `prescale_gradients`: divide gradients by the world size before reducing.
    pub prescale_gradients: bool,
    /// `gradient_predivide_factor`.
    pub gradient_predivide_factor: f64,
    /// `zero_allow_untested_optimizer`.
    pub zero_allow_untested_optimizer: bool,
    /// `communication_data_type`: "fp32", "fp16" or "bf16".
    pub communication_data_type: Option<String>,
    /// `aio`: the NVMe swap's I/O (`offload_optimizer {"device": "nvme"}`).
    pub aio: AioConfig,
    /// `progressive_layer_drop`: DeepSpeed's θ(t) schedule of layers kept
    /// ([`crate::schedule::ProgressiveLayerDrop`]).
    pub progressive_layer_drop: crate::schedule::PldConfig,
    /// `activation_checkpointing`: present, burn-pipeline's stages checkpoint their inputs
    /// and recompute the forward in backward.
    pub activation_checkpointing: Option<ActivationCheckpointingConfig>,
    /// `flops_profiler`: count and time one step ([`crate::profile`]).
    pub flops_profiler: FlopsProfilerConfig,
    /// `sparse_attention`: block-sparse attention in `burn_zero::attention::flash_attention`
    /// (CUDA), with DeepSpeed's layouts.
    pub sparse_attention: Option<super::SparseAttentionConfig>,
    /// `burn_zero`: settings of burn-zero's own (not DeepSpeed keys).
    pub burn_zero: BurnZeroConfig,
}

/// `flops_profiler` (DeepSpeed's keys and defaults).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct FlopsProfilerConfig {
    /// `enabled`.
    pub enabled: bool,
    /// `profile_step`: the step profiled, counted in completed steps (DeepSpeed's: 1 is the
    /// second step, after the first has compiled and tuned).
    pub profile_step: u64,
    /// `module_depth`: the deepest module level listed (-1: all).
    pub module_depth: i64,
    /// `top_modules`: modules listed per depth in the aggregated profile.
    pub top_modules: usize,
    /// `detailed`: list every module with its shares.
    pub detailed: bool,
    /// `output_file`: write the report there instead of printing it (rank 0).
    pub output_file: Option<std::path::PathBuf>,
}

impl Default for FlopsProfilerConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            profile_step: 1,
            module_depth: -1,
            top_modules: 1,
            detailed: true,
            output_file: None,
        }
    }
}

/// `activation_checkpointing` (DeepSpeed's keys).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ActivationCheckpointingConfig {
    /// `partition_activations`: each model-parallel rank keeps only its slice of a checkpoint.
    pub partition_activations: bool,
    /// `cpu_checkpointing`: checkpoints wait in host memory.
    pub cpu_checkpointing: bool,
    /// `contiguous_memory_optimization` (accepted; checkpoints are one buffer each already).
    pub contiguous_memory_optimization: bool,
    /// `number_checkpoints` (accepted; one checkpoint per stage and micro-batch).
    pub number_checkpoints: Option<usize>,
    /// `synchronize_checkpoint_boundary` (accepted).
    pub synchronize_checkpoint_boundary: bool,
    /// `profile` (accepted).
    pub profile: bool,
}

/// `aio`: how the NVMe swap reads and writes (through io_uring).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AioConfig {
    /// `block_size`: bytes per request.
    pub block_size: usize,
    /// `queue_depth`: requests in flight.
    pub queue_depth: u32,
    /// `thread_count` (DeepSpeed's; one I/O thread per rank here).
    pub thread_count: usize,
    /// `single_submit` (accepted; requests are always batched).
    pub single_submit: bool,
    /// `overlap_events` (accepted; I/O always overlaps the step).
    pub overlap_events: bool,
}

impl Default for AioConfig {
    fn default() -> Self {
        Self {
            block_size: 1 << 20,
            queue_depth: 8,
            thread_count: 1,
            single_submit: false,
            overlap_events: true,
        }
    }
}

/// `burn_zero`: settings DeepSpeed does not have.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BurnZeroConfig {
    /// `matmul`: how `ZeroBackend` multiplies matrices.
    pub matmul: MatmulConfig,
    /// `cpu_adam`: the CPU optimizer of `offload_optimizer {"device": "cpu"}`.
    pub cpu_adam: CpuAdamConfig,
    /// `max_buffer_elements`: the gradient buffer is held in pieces of at most this many
    /// elements. cubecl-cuda refuses a single buffer over a quarter of the device's memory;
    /// the default (2^30, 4 GiB in fp32) stays below that on any GPU of 16 GiB or more.
    pub max_buffer_elements: usize,
    /// `fused_adam`: the device optimizer runs Adam/AdamW as one fused CubeCL kernel on CUDA
    /// (default true; false keeps burn's tensor ops, the reference).
    pub fused_adam: bool,
    /// `flash_attention`: when `burn_zero::attention::flash_attention` runs the CubeCL flash
    /// kernels on CUDA: true always, false never (the model runs its materialized attention),
    /// absent or null where measured faster (`burn_zero::attention::flash_chosen`).
    pub flash_attention: Option<bool>,
    /// `memory_pool`: how the CUDA device's memory pools are laid out (default `fitted`);
    /// fixed when the device is first used, so set before the model is built (see
    /// `burn_zero::backend::configure_memory_pool`).
    pub memory_pool: MemoryPoolLayout,
    /// `release_cached_memory`: between forward, backward and the step the engine hands the
    /// device pools' free pages back (`Backend::memory_cleanup`), so a phase's freed
    /// temporaries do not stay reserved for sizes the next phase does not ask for.
    pub release_cached_memory: bool,
    /// `attention_tensor_cores`: the flash-attention kernels on tensor cores where they apply
    /// (half-precision heads of 16–128 in steps of 16; default true); false keeps the CUDA-core
    /// kernels.
    pub attention_tensor_cores: bool,
    /// `attention_register_scores`: the tensor-core kernels (forward, `dq`, `dkdv`) keep the
    /// scores, probabilities and their gradients in registers (FlashAttention-2's layout,
    /// m16n8k16 `mma`) where they apply (dense attention on a device with the `mma`). Default
    /// true: 1.14-1.41x the kernels that stage them in shared memory, forward and backward, on
    /// an H100 (bench/README, issue 36); false keeps those.
    pub attention_register_scores: bool,
    /// `host_collectives`: collectives go through host memory even where the communicator
    /// could run them on device memory (NCCL), as on CPU backends (default false).
    pub host_collectives: bool,
    /// `peak_tflops`: the device's peak TFLOPS, for the FLOPs profiler's utilization (absent:
    /// not reported).
    pub peak_tflops: Option<f64>,
    /// `fused_kernels`: which of `burn_zero::nn`'s fused ops run their CubeCL kernels on CUDA.
    pub fused_kernels: FusedKernelsConfig,
    /// `comm_timeout_s`: seconds a collective waits for the other ranks before it fails,
    /// naming them, with this rank's flight record of its last calls; on GPUs also how long
    /// an enqueued NCCL collective may stay incomplete before the watchdog aborts NCCL and ends
    /// the process (exit status 124). Absent: the communicator's own (`BURN_ZERO_TIMEOUT`, else
    /// 300 s).
    pub comm_timeout_s: Option<f64>,
    /// `deterministic`: a run repeats its bits when repeated or resumed on the same machine
    /// (default false). Whole-tensor sums (the gradient norm, losses) reduce along dimensions
    /// in a fixed order instead of burn-cuda's autotuned sum, whose fastest kernel adds with
    /// atomics; cuBLASLt takes its heuristic's first algorithm per shape (`matmul.tune` is
    /// ignored: the tuned one is timed per process), which costs the tuning's gain where the
    /// first algorithm is not the fastest.
    pub deterministic: bool,
    /// `eager_host_queue`: the runner threads between the training thread and the GPU (burn's
    /// fusion, cubecl's launches) take each queued operation as soon as they are idle, and the
    /// next operation wakes a parked one (default true; patched cubecl-common, patches/README.md).
    /// False keeps cubecl's own policy: a thread waits for 32 queued operations (or a
    /// synchronization) and, idle, sleeps in steps of 150 µs. One policy per process: the
    /// threads serve every engine on the device.
    pub eager_host_queue: bool,
    /// `cuda_graphs`: `Engine::forward_backward` captures a step's forward and backward as a
    /// CUDA graph and replays it (issue 37; `burn_zero::graph`).
    pub cuda_graphs: CudaGraphsConfig,
}

/// `burn_zero.cuda_graphs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct CudaGraphsConfig {
    /// `enabled` (default false): on CUDA, steps given to `Engine::forward_backward` are
    /// captured after `warmup` eager runs and replayed; elsewhere they run eagerly.
    pub enabled: bool,
    /// `warmup`: eager runs of a step shape before it is captured (at least 1).
    pub warmup: usize,
    /// `max_graphs`: graphs kept (one per input shape and micro-step of an accumulation
    /// window); the least recently used is dropped beyond it.
    pub max_graphs: usize,
}

impl Default for CudaGraphsConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            warmup: 1,
            max_graphs: 8,
        }
    }
}

/// `burn_zero.fused_kernels`: each fused op of `burn_zero::nn` runs its kernels on CUDA when
/// true (the default); false runs the op's reference formula in burn ops (for A/B runs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct FusedKernelsConfig {
    /// `rms_norm`: `burn_zero::nn::rms_norm`.
    pub rms_norm: bool,
    /// `rope`: `burn_zero::nn::rope`.
    pub rope: bool,
    /// `swiglu`: `burn_zero::nn::swiglu`.
    pub swiglu: bool,
    /// `cross_entropy`: each chunk's loss and logits' gradient in
    /// `burn_zero::nn::linear_cross_entropy`.
    pub cross_entropy: bool,
}

impl Default for FusedKernelsConfig {
    fn default() -> Self {
        Self {
            rms_norm: true,
            rope: true,
            swiglu: true,
            cross_entropy: true,
        }
    }
}

/// `burn_zero.memory_pool`: the pools cubecl's CUDA runtime reserves device memory through.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemoryPoolLayout {
    /// Small tensors share pages; every tensor over 4 MiB gets a page of its own, at most an
    /// eighth larger than itself, reused by tensors of its size class: reserved stays near live.
    #[default]
    Fitted,
    /// cubecl's default (`SubSlices`): slices of pages up to a quarter of the device, never
    /// returned (a 3 GiB tensor holds a 20 GiB page on an 80 GB card).
    Sliced,
    /// cubecl's `ExclusivePages`: one page per tensor in 24 size classes from 32 KiB.
    Exclusive,
}

impl Default for BurnZeroConfig {
    fn default() -> Self {
        Self {
            matmul: MatmulConfig::default(),
            cpu_adam: CpuAdamConfig::default(),
            max_buffer_elements: 1 << 30,
            fused_adam: true,
            flash_attention: None,
            memory_pool: MemoryPoolLayout::default(),
            release_cached_memory: false,
            attention_tensor_cores: true,
            attention_register_scores: true,
            host_collectives: false,
            peak_tflops: None,
            fused_kernels: FusedKernelsConfig::default(),
            comm_timeout_s: None,
            deterministic: false,
            eager_host_queue: true,
            cuda_graphs: CudaGraphsConfig::default(),
        }
    }
}

/// `burn_zero.cpu_adam`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CpuAdamConfig {
    /// `threads`: threads of one step (default: every core).
    pub threads: Option<usize>,
    /// `pin_cores`: pin step thread `i` to core `i` (Linux).
    pub pin_cores: bool,
    /// `huge_pages`: advise the host partitions for transparent huge pages (Linux; off by
    /// default until measured faster on the machine at hand: `bench/run_cpu_adam.sh`).
    pub huge_pages: bool,
    /// `step_ahead`: at stages 2 and 3, each sub-group is stepped as soon as the boundary
    /// backward has finished its gradient in host memory, while backward goes on (default
    /// true). Only where a sub-group's step needs nothing else: no `gradient_clipping` (the
    /// global norm), no fp16 loss scale, master and state in host memory (not NVMe).
    pub step_ahead: bool,
    /// `ahead_threads`: threads of the sub-groups stepped ahead, while backward (its launches,
    /// the gradient copies) runs beside them (default: `threads`).
    pub ahead_threads: Option<usize>,
}

impl Default for CpuAdamConfig {
    fn default() -> Self {
        Self {
            threads: None,
            pin_cores: false,
            huge_pages: false,
            step_ahead: true,
            ahead_threads: None,
        }
    }
}

/// `burn_zero.matmul`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct MatmulConfig {
    /// `cublaslt`: run eligible CUDA matmuls through cuBLASLt (default true).
    pub cublaslt: bool,
    /// `allow_tf32`: let f32 matmuls use TF32 tensor cores in cuBLASLt (default false).
    pub allow_tf32: bool,
    /// `min_macs`: smaller products (batch·m·n·k) stay on the inner backend; f32 ones only
    /// with `allow_tf32` (burn-cuda multiplies f32 in TF32).
    pub min_macs: u64,
    /// `order`: how a cuBLASLt GEMM is ordered against burn's kernels (default `stream`).
    pub order: GemmOrder,
    /// `sm_margin`: GEMMs ordered by a handshake (`order: "handshake"`) are planned for this
    /// many SMs fewer than the GPU has (default 1: burn's stream holds one spinning block
    /// meanwhile, and a persistent GEMM with a block waiting for that SM took twice as long); 0
    /// plans for all.
    pub sm_margin: u32,
    /// `tune`: a new GEMM shape times cuBLASLt's top 8 heuristic choices on its first call and
    /// keeps the fastest (default true; false takes the first untimed).
    pub tune: bool,
    /// `profile`: record each GEMM's GPU time (`burn_zero::backend::matmul::take_matmul_profile`).
    pub profile: bool,
}

impl Default for MatmulConfig {
    fn default() -> Self {
        Self {
            cublaslt: true,
            allow_tf32: false,
            min_macs: 1 << 24,
            order: GemmOrder::default(),
            sm_margin: 1,
            tune: true,
            profile: false,
        }
    }
}

/// `burn_zero.matmul.order`: where cuBLASLt's GEMMs run and what orders them against burn's
/// kernels.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GemmOrder {
    /// On burn's own CUDA stream, issued by cubecl's thread between the kernels before and
    /// after it: no launch besides the GEMM, nothing spinning, the GEMM planned for every SM.
    #[default]
    Stream,
    /// On a stream of cuBLASLt's own, between two flags in device memory (`raise` and
    /// `await_done` on burn's stream, `bz_wait` and `bz_signal` on ours): four launches more
    /// per GEMM, and a block of burn's stream spinning while it runs.
    Handshake,
}

impl Default for DeepSpeedConfig {
    fn default() -> Self {
        Self {
            train_batch_size: None,
            train_micro_batch_size_per_gpu: None,
            gradient_accumulation_steps: None,
            optimizer: None,
            scheduler: None,
            gradient_clipping: 1.0,
            zero_optimization: ZeroConfig::default(),
            fp16: Fp16Config::default(),
            bf16: Bf16Config::default(),
            data_types: DataTypesConfig::default(),
            steps_per_print: None,
            wall_clock_breakdown: false,
            prescale_gradients: false,
            gradient_predivide_factor: 1.0,
            zero_allow_untested_optimizer: false,
            communication_data_type: None,
            aio: AioConfig::default(),
            progressive_layer_drop: Default::default(),
            activation_checkpointing: None,
            flops_profiler: FlopsProfilerConfig::default(),
            sparse_attention: None,
            burn_zero: BurnZeroConfig::default(),
        }
    }
}

/// `optimizer`: `{ "type": ..., "params": {...} }`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimizerConfig {
    /// `type`: `Adam`, `AdamW`, `Lamb`, `OneBitAdam` or `SGD`.
    #[serde(rename = "type")]
    pub kind: String,
    /// `params`.
    #[serde(default)]
    pub params: OptimizerParams,
}

/// `optimizer.params`. Which keys apply depends on the type; defaults are DeepSpeed's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct OptimizerParams {
    /// `lr`.
    pub lr: f64,
    /// `betas` (Adam).
    pub betas: [f64; 2],
    /// `eps` (Adam).
    pub eps: f64,
    /// `weight_decay`.
    pub weight_decay: f64,
    /// `bias_correction` (Adam).
    pub bias_correction: bool,
    /// `torch_adam` (Adam): use the framework's Adam rather than a fused one (same math here).
    pub torch_adam: bool,
    /// `adam_w_mode` (Adam): decoupled weight decay; `AdamW` forces it on.
    pub adam_w_mode: bool,
    /// `amsgrad` (Adam; unsupported, as in DeepSpeed's FusedAdam).
    pub amsgrad: bool,
    /// `momentum` (SGD).
    pub momentum: f64,
    /// `dampening` (SGD).
    pub dampening: f64,
    /// `nesterov` (SGD).
    pub nesterov: bool,
    /// `max_grad_norm`: rejected, as DeepSpeed does; use `gradient_clipping`.
    pub max_grad_norm: Option<f64>,
    /// `max_coeff` (LAMB): the largest trust ratio.
    pub max_coeff: f64,
    /// `min_coeff` (LAMB): the smallest trust ratio.
    pub min_coeff: f64,
    /// `freeze_step` (1-bit Adam): steps of full Adam before the variance freezes and the
    /// momentum travels 1-bit compressed.
    pub freeze_step: u64,
    /// `cuda_aware` (1-bit Adam): accepted; the compressed exchange goes through host buffers.
    pub cuda_aware: bool,
    /// `comm_backend_name` (1-bit Adam): accepted; the engine's communicator is used.
    pub comm_backend_name: Option<String>,
}

impl Default for OptimizerParams {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.0,
            bias_correction: true,
            torch_adam: false,
            adam_w_mode: true,
            amsgrad: false,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            max_grad_norm: None,
            max_coeff: 10.0,
            min_coeff: 0.01,
            freeze_step: 100_000,
            cuda_aware: false,
            comm_backend_name: None,
        }
    }
}

/// `scheduler`: `{ "type": ..., "params": {...} }`; the params are typed by
/// [`crate::schedule::Schedule::from_config`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SchedulerConfig {
    /// `type`: `WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR`, `OneCycle`, `LRRangeTest`.
    #[serde(rename = "type")]
    pub kind: String,
    /// `params`.
    #[serde(default)]
    pub params: serde_json::Value,
}

/// `fp16`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Fp16Config {
    /// `enabled`.
    pub enabled: bool,
    /// `auto_cast`.
    pub auto_cast: bool,
    /// `loss_scale`: 0 for dynamic scaling, else a fixed scale.
    pub loss_scale: f64,
    /// `initial_scale_power`: the dynamic scale starts at 2^this.
    pub initial_scale_power: u32,
    /// `loss_scale_window`: clean steps before the scale doubles.
    pub loss_scale_window: Count,
    /// `hysteresis`: overflows tolerated before the scale halves.
    pub hysteresis: Count,
    /// `consecutive_hysteresis`: refill hysteresis on every clean step.
    pub consecutive_hysteresis: bool,
    /// `min_loss_scale`.
    pub min_loss_scale: f64,
}

impl Default for Fp16Config {
    fn default() -> Self {
        Self {
            enabled: false,
            auto_cast: false,
            loss_scale: 0.0,
            initial_scale_power: 16,
            loss_scale_window: Count(1000),
            hysteresis: Count(2),
            consecutive_hysteresis: false,
            min_loss_scale: 1.0,
        }
    }
}

/// `bf16`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Bf16Config {
    /// `enabled`.
    pub enabled: bool,
    /// `immediate_grad_update`.
    pub immediate_grad_update: bool,
    /// `check_grad_overflow`.
    pub check_grad_overflow: bool,
}

impl Default for Bf16Config {
    fn default() -> Self {
        Self {
            enabled: false,
            immediate_grad_update: false,
            check_grad_overflow: true,
        }
    }
}

/// `data_types`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DataTypesConfig {
    /// `grad_accum_dtype`: "fp32", "fp16" or "bf16".
    pub grad_accum_dtype: Option<String>,
}

/// Top-level DeepSpeed sections that later burn-zero features read; accepted and reported as
/// not implemented yet rather than as unknown.
pub(crate) const SECTIONS_NOT_YET_IMPLEMENTED: &[&str] = &[
    "amp",
    "autotuning",
    "checkpoint",
    "comms_logger",
    "compression_training",
    "csv_monitor",
    "data_efficiency",
    "elasticity",
    "monitor_config",
    "pipeline",
    "tensorboard",
    "wandb",
];
