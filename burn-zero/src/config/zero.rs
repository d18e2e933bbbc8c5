//! `zero_optimization`: DeepSpeed's ZeRO keys, aliases and defaults (DeepSpeed 0.19).

use serde::{Deserialize, Serialize};

use super::stage::ZeroStage;
use super::values::Count;

/// Where offloaded state lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OffloadDevice {
    /// Not offloaded.
    #[default]
    None,
    /// Host memory.
    Cpu,
    /// Files on a fast disk.
    Nvme,
}

/// `zero_optimization.offload_optimizer`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct OffloadOptimizerConfig {
    /// `device`.
    pub device: OffloadDevice,
    /// `nvme_path`.
    pub nvme_path: Option<String>,
    /// `buffer_count`.
    pub buffer_count: Count,
    /// `pin_memory`.
    pub pin_memory: bool,
    /// `pipeline_read`.
    pub pipeline_read: bool,
    /// `pipeline_write`.
    pub pipeline_write: bool,
    /// `fast_init`.
    pub fast_init: bool,
    /// `ratio`: the fraction offloaded (below 1 only with stage 3).
    pub ratio: f64,
}

impl Default for OffloadOptimizerConfig {
    fn default() -> Self {
        Self {
            device: OffloadDevice::None,
            nvme_path: None,
            buffer_count: Count(4),
            pin_memory: true,
            pipeline_read: false,
            pipeline_write: false,
            fast_init: false,
            ratio: 1.0,
        }
    }
}

/// `zero_optimization.offload_param` (stage 3).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct OffloadParamConfig {
    /// `device`.
    pub device: OffloadDevice,
    /// `nvme_path`.
    pub nvme_path: Option<String>,
    /// `buffer_count`.
    pub buffer_count: Count,
    /// `buffer_size` (elements).
    pub buffer_size: Count,
    /// `max_in_cpu` (elements).
    pub max_in_cpu: Count,
    /// `pin_memory`.
    pub pin_memory: bool,
}

impl Default for OffloadParamConfig {
    fn default() -> Self {
        Self {
            device: OffloadDevice::None,
            nvme_path: None,
            buffer_count: Count(5),
            buffer_size: Count(100_000_000),
            max_in_cpu: Count(1_000_000_000),
            pin_memory: true,
        }
    }
}

/// `zero_optimization`. Field names are DeepSpeed's; the `stage3_*` spellings are aliases.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ZeroConfig {
    /// `stage`: 0 (data parallel), 1 (optimizer state), 2 (+ gradients), 3 (+ parameters).
    pub stage: ZeroStage,
    /// `contiguous_gradients`.
    pub contiguous_gradients: bool,
    /// `reduce_scatter`.
    pub reduce_scatter: bool,
    /// `reduce_bucket_size` (elements).
    pub reduce_bucket_size: Count,
    /// `allgather_partitions`.
    pub allgather_partitions: bool,
    /// `allgather_bucket_size` (elements).
    pub allgather_bucket_size: Count,
    /// `overlap_comm`; when absent, true for stage 3 and false otherwise.
    pub overlap_comm: Option<bool>,
    /// `load_from_fp32_weights`.
    pub load_from_fp32_weights: bool,
    /// `elastic_checkpoint`.
    pub elastic_checkpoint: bool,
    /// `offload_optimizer`.
    pub offload_optimizer: Option<OffloadOptimizerConfig>,
    /// `offload_param`.
    pub offload_param: Option<OffloadParamConfig>,
    /// `sub_group_size` (elements).
    pub sub_group_size: Count,
    /// Deprecated `cpu_offload`: `offload_optimizer.device = cpu`.
    pub cpu_offload: Option<bool>,
    /// Deprecated `cpu_offload_param`: `offload_param.device = cpu`.
    pub cpu_offload_param: Option<bool>,
    /// `prefetch_bucket_size` (alias `stage3_prefetch_bucket_size`).
    #[serde(alias = "stage3_prefetch_bucket_size")]
    pub prefetch_bucket_size: Count,
    /// `param_persistence_threshold` (alias `stage3_param_persistence_threshold`).
    #[serde(alias = "stage3_param_persistence_threshold")]
    pub param_persistence_threshold: Count,
    /// `model_persistence_threshold` (alias `stage3_model_persistence_threshold`).
    #[serde(alias = "stage3_model_persistence_threshold")]
    pub model_persistence_threshold: Count,
    /// `max_live_parameters` (alias `stage3_max_live_parameters`).
    #[serde(alias = "stage3_max_live_parameters")]
    pub max_live_parameters: Count,
    /// `max_reuse_distance` (alias `stage3_max_reuse_distance`).
    #[serde(alias = "stage3_max_reuse_distance")]
    pub max_reuse_distance: Count,
    /// `gather_16bit_weights_on_model_save` (aliases `stage3_gather_16bit_weights_on_model_save`,
    /// `stage3_gather_fp16_weights_on_model_save`).
    #[serde(
        alias = "stage3_gather_16bit_weights_on_model_save",
        alias = "stage3_gather_fp16_weights_on_model_save"
    )]
    pub gather_16bit_weights_on_model_save: bool,
    /// `ignore_unused_parameters`.
    pub ignore_unused_parameters: bool,
    /// `legacy_stage1` (unsupported when true, as in DeepSpeed).
    pub legacy_stage1: bool,
    /// `round_robin_gradients`.
    pub round_robin_gradients: bool,
    /// `zero_hpz_partition_size`.
    pub zero_hpz_partition_size: Count,
    /// `zero_quantized_weights`.
    pub zero_quantized_weights: bool,
    /// `zero_quantized_gradients`.
    pub zero_quantized_gradients: bool,
    /// `memory_efficient_linear`.
    pub memory_efficient_linear: bool,
}

impl Default for ZeroConfig {
    fn default() -> Self {
        Self {
            stage: ZeroStage::Disabled,
            contiguous_gradients: true,
            reduce_scatter: true,
            reduce_bucket_size: Count(500_000_000),
            allgather_partitions: true,
            allgather_bucket_size: Count(500_000_000),
            overlap_comm: None,
            load_from_fp32_weights: true,
            elastic_checkpoint: false,
            offload_optimizer: None,
            offload_param: None,
            sub_group_size: Count(1_000_000_000),
            cpu_offload: None,
            cpu_offload_param: None,
            prefetch_bucket_size: Count(50_000_000),
            param_persistence_threshold: Count(100_000),
            model_persistence_threshold: Count(i64::MAX as u64),
            max_live_parameters: Count(1_000_000_000),
            max_reuse_distance: Count(1_000_000_000),
            gather_16bit_weights_on_model_save: false,
            ignore_unused_parameters: true,
            legacy_stage1: false,
            round_robin_gradients: false,
            zero_hpz_partition_size: Count(1),
            zero_quantized_weights: false,
            zero_quantized_gradients: false,
            memory_efficient_linear: true,
        }
    }
}

impl ZeroConfig {
    /// `overlap_comm` as DeepSpeed resolves it: given, or true for stage 3 only.
    pub fn overlap_comm(&self) -> bool {
        self.overlap_comm
            .unwrap_or(self.stage == ZeroStage::Parameters)
    }

    /// Where optimizer state is offloaded, deprecated `cpu_offload` included.
    pub fn optimizer_offload(&self) -> OffloadDevice {
        match (&self.offload_optimizer, self.cpu_offload) {
            (Some(o), _) => o.device,
            (None, Some(true)) => OffloadDevice::Cpu,
            _ => OffloadDevice::None,
        }
    }

    /// Where parameters are offloaded, deprecated `cpu_offload_param` included.
    pub fn param_offload(&self) -> OffloadDevice {
        match (&self.offload_param, self.cpu_offload_param) {
            (Some(o), _) => o.device,
            (None, Some(true)) => OffloadDevice::Cpu,
            _ => OffloadDevice::None,
        }
    }
}
