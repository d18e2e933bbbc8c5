//! `initialize`: an engine from a model, a config and a communicator.

use std::sync::{Arc, Mutex};

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Shape, Tensor, TensorData};

use super::collective::FlatComm;
use super::grads::{EngineHook, GradState};
use super::optim_state::Optim;
use super::optim_state::swap_config;
use super::params::{params_to_host, rebuild_params};
use super::precision::Precision;
use super::stage3::{EngineGatherer, ParamPlace, Stage3, sharded_handles};
use super::{
    Engine, EngineError, FlatLayout, PARTITION_ALIGN, Timings, ZeroAutodiff, flatten_params,
    owned_range, unflatten_params,
};
use crate::ZeroTensor;
use crate::backend::hooks;
use crate::backend::install_gatherer;
use crate::backend::matmul::{MatmulPolicy, set_matmul_policy};
use crate::comm::{BufMut, Communicator};
use crate::config::DeepSpeedConfig;
use crate::config::OffloadDevice;
use crate::optim::TensorBounds;
use crate::partition::PartitionPlan;
use crate::schedule::Scheduler;

/// Builds an engine for `model` from `config` over `comm` (DeepSpeed's `deepspeed.initialize`).
///
/// Every rank must call it with the same model structure; rank 0's parameter values are
/// broadcast to all. Only parameters with `require_grad` are reduced, partitioned and
/// optimized; frozen ones (a LoRA base) take rank 0's values and are never changed. Must be called on the thread that will run `backward` (the gradient hook
/// is per thread).
pub fn initialize<I: Backend, M: Module<ZeroAutodiff<I>>>(
    model: M,
    config: &DeepSpeedConfig,
    comm: Arc<dyn Communicator>,
) -> Result<Engine<I, M>, EngineError> {
    if hooks::is_installed::<I>() {
        return Err(EngineError::Usage(
            "another engine (or gradient hook) is active on this thread for this backend; \
             drop it before initializing a new one"
                .into(),
        ));
    }
    let resolved = config.resolve(comm.world_size())?;
    let device = model_device(&model);
    if comm.rank() == 0 {
        resolved.warnings.iter().for_each(|w| crate::log::warn(w));
        // A few lines; the whole resolved config is `engine.config()` (JSON with serde).
        let summary = resolved.summary().replace('\n', "\n  ");
        crate::log::info(&format!("{summary}\n  model on {device:?}"));
    }
    #[cfg(feature = "cuda")]
    if let Err(e) = crate::backend::memory_pool::ensure_memory_pool(
        &device,
        resolved.config.burn_zero.memory_pool,
    ) && comm.rank() == 0
    {
        crate::log::warn(&e.to_string());
    }
    #[cfg(feature = "cuda")]
    if resolved.config.burn_zero.release_cached_memory
        && let Some(index) = crate::backend::memory_pool::cuda_index(&device)
        && let Err(e) = crate::backend::memory_pool::keep_released_memory(index)
    {
        crate::log::warn(&format!(
            "release_cached_memory: CUDA's allocator could not be told to keep released memory \
             ({e}); released pages go back to the driver"
        ));
    }
    let matmul = &resolved.config.burn_zero.matmul;
    set_matmul_policy(MatmulPolicy {
        cublaslt: matmul.cublaslt && MatmulPolicy::default().cublaslt,
        allow_tf32: matmul.allow_tf32,
        min_macs: matmul.min_macs,
    });
    crate::attention::set_flash_attention(resolved.config.burn_zero.flash_attention);
    if let Some(sparse) = &resolved.config.sparse_attention {
        sparse.sparsity(1).map_err(EngineError::Usage)?;
    }
    crate::attention::set_sparse_attention(resolved.config.sparse_attention.clone());
    let zero = &resolved.config.zero_optimization;
    let stage = zero.stage;
    let layout = Arc::new(FlatLayout::of(&model));
    if layout.numel() == 0 {
        return Err(EngineError::Usage(
            "the model has no trainable parameters (every parameter has require_grad off)".into(),
        ));
    }
    let world = comm.world_size();
    let plan = if stage == 0 {
        PartitionPlan::new(layout.numel(), 1)
    } else {
        PartitionPlan::aligned(layout.numel(), world, PARTITION_ALIGN)
    };
    let stage3 = (stage == 3).then(|| {
        let trace = crate::trace::TraceConfig {
            prefetch_bucket_size: zero.prefetch_bucket_size.get(),
            max_live_parameters: zero.max_live_parameters.get(),
            max_reuse_distance: zero.max_reuse_distance.get(),
        };
        Stage3::<I>::new(
            &layout,
            world,
            PARTITION_ALIGN,
            zero.param_persistence_threshold.get(),
            trace,
            param_place(&resolved, comm.rank()),
            zero.optimizer_offload() == OffloadDevice::None,
        )
    });
    let mut stage3 = stage3.transpose()?;

    super::device_failure::watch();
    #[cfg(feature = "cuda")]
    let big_buffers = {
        let max_piece = resolved.config.burn_zero.max_buffer_elements;
        let sizes = big_buffer_bytes(&plan, stage, comm.rank(), max_piece);
        crate::backend::cuda::exact_size_allocations::<I>(&device, &sizes);
        sizes
    };
    let precision = Precision::new::<I>(&resolved.config, &device);
    let mut flat = FlatComm::new(comm.clone(), device.clone(), zero.overlap_comm());
    // Frozen parameters (a LoRA base) are neither reduced nor optimized, but every rank must
    // compute with rank 0's values too.
    let frozen = FlatLayout::of_frozen(&model);
    let frozen_params = frozen.numel();
    let model = if frozen_params == 0 {
        model
    } else {
        let values = flat.broadcast(flatten_params(&model, &frozen), 0)?;
        flat.wait()?;
        unflatten_params(model, &frozen, values)
    };
    let (model, master) = match stage3.as_mut() {
        Some(s3) => {
            let master = match sharded_master(&model, &layout, s3)? {
                // Built sharded (every rank its own partitions, from the same seed).
                Some(master) => master,
                None => {
                    let params = flat.broadcast(flatten_params(&model, &layout), 0)?;
                    flat.wait()?;
                    s3.partition_of(&params, comm.rank())
                }
            };
            let master = master.cast(FloatDType::F32);
            // With the optimizer and the parameters on the device, the partitions are chunks of
            // the fp32 master itself (each gather narrows its chunk to the compute format);
            // else a copy in the compute format.
            let source = match s3.master_backed() {
                true => [master.clone()],
                false => [precision.compute.convert(master.clone())],
            };
            s3.set_partitions(&mut flat, &source, precision.compute)?;
            let full = s3.gather_persistent(&mut flat, &source)?;
            let model = rebuild_params(model, &layout, |p| s3.handle(p, full.get(&p)));
            (hooks::mark_distributed(model), Initial::Device(master))
        }
        None if zero.optimizer_offload() != OffloadDevice::None => {
            // ZeRO-Offload: the values go to the host one parameter at a time and come back
            // in the compute format, so the device never holds a second fp32 copy.
            let mut values = params_to_host(&model, &layout);
            broadcast_on_host(comm.as_ref(), &mut values)?;
            let compute = precision.compute;
            let model = rebuild_params(model, &layout, |p| {
                let slot = &layout.slots()[p];
                let part = values[slot.offset..slot.offset + slot.numel()].to_vec();
                let t = Tensor::<I, 1>::from_data(TensorData::new(part, [slot.numel()]), &device);
                let shape = Shape::from(slot.shape.clone());
                ZeroTensor::local(I::float_reshape(
                    compute.convert(t).into_primitive().tensor(),
                    shape,
                ))
            });
            let owned = owned_range(&plan, stage, comm.rank());
            let master = if owned == (0..values.len()) {
                values
            } else {
                values[owned].to_vec()
            };
            (hooks::mark_distributed(model), Initial::Host(master))
        }
        None => {
            let params = flat.broadcast(flatten_params(&model, &layout), 0)?;
            flat.wait()?;
            let params = params.cast(FloatDType::F32);
            let owned = owned_range(&plan, stage, comm.rank());
            let master = params.clone().slice(owned);
            let model = unflatten_params(model, &layout, precision.compute.convert(params));
            (hooks::mark_distributed(model), Initial::Device(master))
        }
    };

    // The user's fp32 parameters are gone: hand their memory back to the device before the
    // engine's own buffers are allocated (a caching allocator keeps freed pages otherwise,
    // and a large model's gradient buffer would not fit beside them).
    I::sync(&device).map_err(|e| EngineError::Usage(format!("the device failed: {e:?}")))?;
    I::memory_cleanup(&device);
    // The cleanup forgets exact sizes without a live buffer: the optimizer's come next.
    #[cfg(feature = "cuda")]
    crate::backend::cuda::exact_size_allocations::<I>(&device, &big_buffers);
    let optim = match master {
        Initial::Device(master) => Optim::new(&resolved, master, comm.rank())?,
        Initial::Host(master) => Optim::on_host(&resolved, master, device.clone(), comm.rank())?,
    };
    let bounds = tensor_bounds(&layout, &plan, stage3.as_ref(), stage, &comm);
    let optim = optim.with_segments(bounds, comm.clone());
    let with_gatherer = stage3.is_some();
    let grads = Arc::new(Mutex::new(GradState::new(
        layout.clone(),
        plan,
        flat,
        stage,
        zero.reduce_bucket_size.get(),
        stage3,
        (precision.compute, precision.accum),
        resolved.config.burn_zero.max_buffer_elements,
        optim.offloaded().then(|| {
            let threads = resolved.config.burn_zero.cpu_adam.threads;
            threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        }),
    )));
    let hook = hooks::install::<I>(Box::new(EngineHook {
        state: grads.clone(),
    }));
    let gatherer = with_gatherer.then(|| {
        install_gatherer::<I>(Box::new(EngineGatherer {
            state: grads.clone(),
        }))
    });
    // What building the optimizer state freed (copies, casts) goes back too.
    I::memory_cleanup(&device);
    let mut engine = Engine {
        model: Some(model),
        scheduler: Scheduler::new(resolved.schedule.clone()),
        comm,
        resolved,
        layout,
        plan,
        grads,
        optim,
        frozen_params,
        micro_steps: 0,
        global_steps: 0,
        last_grad_norm: None,
        timings: Timings::default(),
        precision,
        _hook: hook,
        _gatherer: gatherer,
        profile: None,
        last_profile: None,
        last_step_end: std::time::Instant::now(),
        device,
    };
    engine.profile_maybe_start();
    Ok(engine)
}

/// Where `offload_param` keeps the sharded parameters' partitions of rank `rank`.
fn param_place(config: &crate::config::ResolvedConfig, rank: usize) -> ParamPlace {
    let zero = &config.config.zero_optimization;
    match (zero.param_offload(), &zero.offload_param) {
        (OffloadDevice::Cpu, _) => ParamPlace::Host,
        (OffloadDevice::Nvme, Some(o)) => {
            let root = o.nvme_path.as_deref().expect("validated");
            ParamPlace::Nvme(swap_config(
                config,
                root,
                o.buffer_count.get(),
                rank,
                "params",
            ))
        }
        _ => ParamPlace::Device,
    }
}

/// Where this rank's fp32 partition was made.
enum Initial<I: Backend> {
    Device(Tensor<I, 1>),
    Host(Vec<f32>),
}

/// Rank 0's `values` on every rank, through host buffers in pieces (so a device path holds
/// one piece at a time).
fn broadcast_on_host(comm: &dyn Communicator, values: &mut [f32]) -> Result<(), EngineError> {
    const PIECE: usize = 1 << 26;
    if comm.world_size() > 1 {
        for piece in values.chunks_mut(PIECE) {
            comm.broadcast(BufMut::from(piece), 0)?;
        }
    }
    Ok(())
}

/// The device of the model's parameters (of the first trainable one).
fn model_device<I: Backend, M: Module<ZeroAutodiff<I>>>(model: &M) -> I::Device {
    model.devices().into_iter().next().unwrap_or_default()
}

/// This rank's partition when `model` was built sharded ([`super::construct_sharded`]): its handles'
/// partitions and its full parameters' chunks, in layout order; `None` for a full model.
fn sharded_master<I: Backend, M: Module<ZeroAutodiff<I>>>(
    model: &M,
    layout: &FlatLayout,
    s3: &Stage3<I>,
) -> Result<Option<Tensor<I, 1>>, EngineError> {
    let handles = sharded_handles(model, layout);
    if handles.iter().all(Option::is_none) {
        return Ok(None);
    }
    let plan = s3.plan();
    let mut parts = Vec::new();
    for (p, handle) in handles.into_iter().enumerate() {
        let part = match handle {
            Some(h) => {
                let t = Tensor::<I, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(
                    h.partition.clone(),
                ));
                if t.dims()[0] != plan.chunk(p) {
                    return Err(EngineError::Usage(format!(
                        "parameter `{}` was built sharded for another world size: its partition \
                         holds {} elements, {} ranks need {}",
                        layout.slots()[p].name,
                        t.dims()[0],
                        plan.world_size(),
                        plan.chunk(p)
                    )));
                }
                t
            }
            None => {
                return Err(EngineError::Usage(format!(
                    "parameter `{}` is full while others were built sharded: build the whole \
                     model with `burn_zero::engine::construct_sharded`",
                    layout.slots()[p].name
                )));
            }
        };
        parts.push(part);
    }
    Ok(Some(Tensor::cat(parts, 0)))
}

/// Where each parameter tensor lies in this rank's partition (LAMB's trust ratios): whole
/// tensors at stage 0; the owned part of the flat buffer at stages 1–2; each tensor's shard at
/// stage 3.
fn tensor_bounds<I: Backend>(
    layout: &FlatLayout,
    plan: &PartitionPlan,
    stage3: Option<&Stage3<I>>,
    stage: u8,
    comm: &Arc<dyn Communicator>,
) -> TensorBounds {
    let segments = match stage3 {
        Some(s3) => {
            let shards = s3.plan();
            (0..shards.params())
                .map(|p| (p, shards.offset(p)..shards.offset(p) + shards.chunk(p)))
                .collect()
        }
        None => {
            let owned = owned_range(plan, stage, comm.rank());
            layout
                .slots()
                .iter()
                .enumerate()
                .filter_map(|(p, s)| {
                    let start = s.offset.max(owned.start);
                    let end = (s.offset + s.numel()).min(owned.end);
                    (start < end).then(|| (p, start - owned.start..end - owned.start))
                })
                .collect()
        }
    };
    TensorBounds {
        segments,
        params: layout.slots().len(),
        comm: (stage > 0 && comm.world_size() > 1).then(|| comm.clone()),
    }
}

/// The byte sizes of the engine's largest flat buffers, in f32 and in 16 bits: the whole
/// model (stages 0–2, whose gradients or gathered parameters span it), this rank's partition
/// and a chunk, and the gradient buffer's pieces of each. Only sizes of at least 64 MiB: the
/// pools serve smaller ones well. Stage 3 never holds the whole model in one buffer: at 8B
/// on 4 GPUs its 32 GB was one allocation too many.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn big_buffer_bytes(plan: &PartitionPlan, stage: u8, rank: usize, max_piece: usize) -> Vec<usize> {
    let owned = owned_range(plan, stage, rank).len();
    let whole: &[usize] = if stage < 3 {
        &[plan.numel(), plan.padded_numel()]
    } else {
        &[]
    };
    let mut elements = Vec::new();
    for &len in whole.iter().chain([owned, plan.chunk()].iter()) {
        elements.extend([len, len.min(max_piece), len % max_piece.max(1)]);
    }
    let mut bytes: Vec<usize> = elements
        .into_iter()
        .flat_map(|n| [4 * n, 2 * n])
        .filter(|b| *b >= 64 << 20)
        .collect();
    bytes.sort_unstable();
    bytes.dedup();
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stage_3_registers_no_whole_model_buffer() {
        let numel = 300 << 20;
        let plan = PartitionPlan::aligned(numel, 4, PARTITION_ALIGN);
        let largest = |stage| *big_buffer_bytes(&plan, stage, 1, 1 << 30).last().unwrap();
        assert!(largest(3) <= 4 * plan.chunk(), "stage 3: {}", largest(3));
        assert!(largest(2) >= 4 * numel, "stage 2 gathers the whole model");
    }
}
