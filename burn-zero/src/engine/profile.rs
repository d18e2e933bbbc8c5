//! `flops_profiler` in the engine: recording starts when the step before `profile_step` ends,
//! so the user's next forward is counted (and timed per module where the model opens
//! [`crate::profile::scope`]s); `backward` switches to the backward phase and stops the
//! counting; the step's end times the optimizer and prints DeepSpeed's report on rank 0.

use std::collections::BTreeMap;
use std::time::Instant;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use super::{Engine, ZeroAutodiff};
use crate::profile::{self, Counts, Phase, Profile, format_report};

/// Parameters per module path: burn's field names joined by `.`, `Vec` items by index, as
/// [`crate::profile::scope`] names should be.
pub fn params_by_module<B: Backend, M: Module<B>>(module: &M) -> BTreeMap<String, u64> {
    struct Count {
        path: Vec<String>,
        params: BTreeMap<String, u64>,
    }
    impl<B: Backend> ModuleVisitor<B> for Count {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            // The path ends in the parameter's own field name; the module is what holds it.
            let module = &self.path[..self.path.len().saturating_sub(1)];
            let n = param.shape().num_elements() as u64;
            *self.params.entry(module.join(".")).or_default() += n;
        }
    }
    let mut count = Count {
        path: Vec::new(),
        params: BTreeMap::new(),
    };
    module.visit(&mut count);
    count.params
}

/// A profile being taken.
pub(crate) struct ProfileRun {
    start: Instant,
    fwd_s: f64,
    bwd_s: f64,
    /// Set when backward ends.
    counts: Option<BTreeMap<(Phase, String), Counts>>,
}

impl<I: Backend, M: Module<ZeroAutodiff<I>>> Engine<I, M> {
    fn sync_device(&self) {
        let device = self.device.clone();
        let _ = I::sync(&device);
    }

    /// Starts recording when `profile_step` steps are done (at initialization for step 0).
    pub(crate) fn profile_maybe_start(&mut self) {
        let cfg = &self.resolved.config.flops_profiler;
        if !cfg.enabled || self.profile.is_some() || self.global_steps as u64 != cfg.profile_step {
            return;
        }
        self.sync_device();
        let device = self.device.clone();
        profile::start(Some(Box::new(move || {
            let _ = I::sync(&device);
        })));
        self.profile = Some(ProfileRun {
            start: Instant::now(),
            fwd_s: 0.0,
            bwd_s: 0.0,
            counts: None,
        });
    }

    /// At backward's start: the forward's time; backward's ops count as backward.
    pub(crate) fn profile_backward_start(&mut self) -> Option<Instant> {
        let recording = self.profile.as_ref().is_some_and(|r| r.counts.is_none());
        if !recording {
            return None;
        }
        self.sync_device();
        let run = self.profile.as_mut().expect("checked");
        run.fwd_s = run.start.elapsed().as_secs_f64();
        profile::set_phase(Phase::Backward);
        Some(Instant::now())
    }

    /// At backward's end: its time; counting stops.
    pub(crate) fn profile_backward_end(&mut self, started: Option<Instant>) {
        let Some(started) = started else { return };
        self.sync_device();
        let run = self.profile.as_mut().expect("a profile is running");
        run.bwd_s = started.elapsed().as_secs_f64();
        run.counts = Some(profile::stop());
    }

    /// At the end of a boundary step that began at `started`: the report, printed on rank 0
    /// (or written to `output_file`).
    pub(crate) fn profile_step_end(&mut self, started: Instant) {
        if self.profile.as_ref().is_none_or(|r| r.counts.is_none()) {
            return;
        }
        self.sync_device();
        let run = self.profile.take().expect("checked");
        let params = params_by_module(self.model());
        let mut p = Profile::new(run.counts.as_ref().expect("checked"), &params);
        p.step = self.global_steps as u64;
        p.world_size = self.comm.world_size();
        p.batch_size = self.resolved.batch.micro_batch_per_gpu;
        (p.fwd_s, p.bwd_s) = (run.fwd_s, run.bwd_s);
        p.fill_latencies();
        p.step_s = started.elapsed().as_secs_f64();
        let peak_tflops = self.resolved.config.burn_zero.peak_tflops;
        p.peak_flops = peak_tflops.map_or(0.0, |t| t * 1e12);
        if self.comm.rank() == 0 {
            let cfg = &self.resolved.config.flops_profiler;
            let text = format_report(&p, cfg.module_depth, cfg.top_modules.max(1), cfg.detailed);
            match &cfg.output_file {
                Some(path) => {
                    if let Err(e) = std::fs::write(path, &text) {
                        crate::log::warn(&format!(
                            "flops_profiler.output_file {}: {e}",
                            path.display()
                        ));
                    }
                }
                None => println!("{text}"),
            }
        }
        self.last_profile = Some(p);
    }

    /// The last profile taken (`flops_profiler`), with its per-module figures.
    pub fn flops_profile(&self) -> Option<&Profile> {
        self.last_profile.as_ref()
    }
}
