//! `initialize`: an engine from a model, a config and a communicator.

use std::sync::{Arc, Mutex};

use burn::module::Module;
use burn::tensor::backend::Backend;

use super::collective::FlatComm;
use super::grads::{EngineHook, GradCore};
use super::host_grads::HostGradLayout;
use super::optim_state::Optim;
use super::precision::Precision;
#[cfg(feature = "zero1")]
use super::stage::Partitioned;
#[cfg(feature = "zero3")]
use super::stage::Sharded;
use super::stage::{Master, Replicated, Setup, Strategy};
use super::step_ahead::StepAheadPlan;
use super::{
    Engine, EngineError, FlatLayout, Timings, ZeroAutodiff, flatten_params, unflatten_params,
};
use crate::backend::hooks;
use crate::backend::settings::{self, OpSettings, SettingsGuard};
use crate::comm::Communicator;
use crate::config::{DeepSpeedConfig, ZeroStage};
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
    let mut resolved = config.resolve(comm.world_size())?;
    // Read once, here: from now on the resolved config is the run's whole truth.
    let overrides = resolved.apply_env_overrides(|var| std::env::var(var).ok())?;
    if let Some(seconds) = resolved.config.burn_zero.comm_timeout_s {
        comm.set_timeout(std::time::Duration::from_secs_f64(seconds));
    }
    let device = model_device(&model);
    if comm.rank() == 0 {
        resolved.warnings.iter().for_each(|w| crate::log::warn(w));
        overrides.iter().for_each(|o| crate::log::info(o));
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
    cubecl::device_handle::set_eager_fetch(resolved.config.burn_zero.eager_host_queue);
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
    if let Some(sparse) = &resolved.config.sparse_attention {
        sparse.sparsity(1).map_err(EngineError::Usage)?;
    }
    // This engine's choices for the ops its model runs, on its thread while it lives.
    let op_settings = settings::set(OpSettings::of(&resolved));
    let zero = &resolved.config.zero_optimization;
    let layout = Arc::new(FlatLayout::of(&model));
    if layout.numel() == 0 {
        return Err(EngineError::Usage(
            "the model has no trainable parameters (every parameter has require_grad off)".into(),
        ));
    }
    super::device_failure::watch();
    let precision = Precision::new::<I>(&resolved.config, &device);
    let host_only = resolved.config.burn_zero.host_collectives;
    let mut flat = FlatComm::new(comm.clone(), device.clone(), zero.overlap_comm(), host_only);
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
    let grads = GradCore::new(
        layout.clone(),
        flat,
        (precision.compute, precision.accum),
        zero.reduce_bucket_size.get(),
        resolved.config.burn_zero.max_buffer_elements,
    );
    let setup = Setup {
        resolved: &resolved,
        compute: precision.compute,
        comm: &comm,
    };
    let parts = Parts {
        model,
        op_settings,
        precision,
        frozen_params,
        layout,
        device,
    };
    // The stage's strategy, chosen once.
    match zero.stage {
        ZeroStage::Disabled => build(Replicated::new(grads), parts, &setup),
        #[cfg(feature = "zero1")]
        ZeroStage::OptimizerStates => {
            let gather = zero.allgather_bucket_size.get();
            build(Partitioned::new(grads, false, gather), parts, &setup)
        }
        #[cfg(feature = "zero2")]
        ZeroStage::Gradients => {
            let gather = zero.allgather_bucket_size.get();
            build(Partitioned::new(grads, true, gather), parts, &setup)
        }
        #[cfg(feature = "zero3")]
        ZeroStage::Parameters => build(Sharded::new(grads, &setup)?, parts, &setup),
        #[allow(unreachable_patterns)]
        stage => unreachable!("the config refuses stage {stage}, not compiled in"),
    }
}

/// What `initialize` hands the strategy's set-up.
struct Parts<I: Backend, M> {
    model: M,
    op_settings: SettingsGuard,
    precision: Precision,
    frozen_params: usize,
    layout: Arc<FlatLayout>,
    device: I::Device,
}

/// The engine around `strategy`: the model's parameters and this rank's master as the stage
/// makes them, the optimizer, the gradients, the hook (and the gatherer).
fn build<I: Backend, M: Module<ZeroAutodiff<I>>, S: Strategy<I> + 'static>(
    mut strategy: S,
    parts: Parts<I, M>,
    setup: &Setup<'_>,
) -> Result<Engine<I, M>, EngineError> {
    let Parts {
        model,
        op_settings,
        precision,
        frozen_params,
        layout,
        device,
    } = parts;
    let (resolved, comm) = (setup.resolved, setup.comm);
    #[cfg(feature = "cuda")]
    let big_buffers = {
        let max_piece = resolved.config.burn_zero.max_buffer_elements;
        let sizes = big_buffer_bytes(&strategy.big_buffer_lens(), max_piece);
        crate::backend::cuda::exact_size_allocations::<I>(&device, &sizes);
        sizes
    };
    let (model, master) = strategy.setup(model, setup)?;

    // The user's fp32 parameters are gone: hand their memory back to the device before the
    // engine's own buffers are allocated (a caching allocator keeps freed pages otherwise,
    // and a large model's gradient buffer would not fit beside them).
    I::sync(&device).map_err(|e| EngineError::Usage(format!("the device failed: {e:?}")))?;
    I::memory_cleanup(&device);
    // The cleanup forgets exact sizes without a live buffer: the optimizer's come next.
    #[cfg(feature = "cuda")]
    crate::backend::cuda::exact_size_allocations::<I>(&device, &big_buffers);
    let optim = match master {
        Master::Device(master) => Optim::new(resolved, master, comm.rank())?,
        Master::Host(master) => Optim::on_host(resolved, master, device.clone(), comm.rank())?,
    };
    let optim = optim.with_segments(strategy.tensor_bounds(comm), comm.clone());
    strategy.allocate(optim.offloaded().then(|| {
        let threads = resolved.config.burn_zero.cpu_adam.threads;
        HostGradLayout {
            threads: threads
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
            chunk: resolved.config.zero_optimization.sub_group_size.get(),
            // Without clipping or a loss scale the norm only finds non-finite gradients and
            // is reported.
            squares_on_device: resolved.config.gradient_clipping <= 0.0
                && !resolved.config.fp16.enabled
                && !resolved.config.burn_zero.deterministic,
        }
    }));
    let strategy = Arc::new(Mutex::new(strategy));
    #[cfg(feature = "zero3")]
    let gatherer = S::install_gatherer(&strategy);
    let strategy: Arc<Mutex<dyn Strategy<I>>> = strategy;
    let hook = hooks::install::<I>(Box::new(EngineHook {
        strategy: strategy.clone(),
    }));
    // What building the optimizer state freed (copies, casts) goes back too.
    I::memory_cleanup(&device);
    let step_ahead = StepAheadPlan::of(resolved);
    if comm.rank() == 0
        && let Some(line) = step_ahead.describe()
    {
        crate::log::info(&line);
    }
    let mut engine = Engine {
        model: Some(model),
        scheduler: Scheduler::new(resolved.schedule.clone()),
        comm: comm.clone(),
        resolved: resolved.clone(),
        layout,
        strategy,
        optim,
        frozen_params,
        micro_steps: 0,
        global_steps: 0,
        last_grad_norm: None,
        timings: Timings::default(),
        precision,
        _hook: hook,
        #[cfg(feature = "zero3")]
        _gatherer: gatherer,
        _op_settings: op_settings,
        profile: None,
        last_profile: None,
        last_step_end: std::time::Instant::now(),
        device,
        step_ahead,
        graphs: None,
    };
    engine.profile_maybe_start();
    Ok(engine)
}

/// The device of the model's parameters (of the first trainable one).
fn model_device<I: Backend, M: Module<ZeroAutodiff<I>>>(model: &M) -> I::Device {
    model.devices().into_iter().next().unwrap_or_default()
}

/// The byte sizes of the strategy's largest flat buffers (`lens`, in elements) in f32 and in
/// 16 bits, and of the gradient buffer's pieces of each. Only sizes of at least 64 MiB: the
/// pools serve smaller ones well.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn big_buffer_bytes(lens: &[usize], max_piece: usize) -> Vec<usize> {
    let mut elements = Vec::new();
    for &len in lens {
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
    #[cfg(feature = "zero3")]
    fn stage_3_registers_no_whole_model_buffer() {
        use crate::engine::PARTITION_ALIGN;
        use crate::partition::PartitionPlan;
        let numel = 300 << 20;
        let plan = PartitionPlan::aligned(numel, 4, PARTITION_ALIGN);
        let largest = |lens: Vec<usize>| *big_buffer_bytes(&lens, 1 << 30).last().unwrap();
        let stage3 = largest(Sharded::<burn::backend::NdArray>::buffer_lens(numel, 4, 1));
        assert!(stage3 <= 4 * plan.chunk(), "stage 3: {stage3}");
        let stage2 = largest(Partitioned::<burn::backend::NdArray>::buffer_lens(&plan, 1));
        assert!(stage2 >= 4 * numel, "stage 2 gathers the whole model");
    }
}
