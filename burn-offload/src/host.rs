//! An optimizer whose fp32 master weights and state live off the device (ZeRO-Offload in host
//! memory, ZeRO-Infinity in swap files on NVMe): one rank's flat partition, stepped by
//! [`CpuAdam`] one sub-group at a time; each sub-group's new weights are handed out as soon
//! as it is done, so they can travel to the device while the next one steps.

use core::ops::Range;

use crate::cpu_adam::{AdamStep, CpuAdam, Grad, GradScale, Out, SgdStep};
use crate::memory::zeroed_f32;
use crate::nvme::{NvmeStore, SwapConfig, SwapError};
use crate::stream::{self, Download, OutSlot, StepBuffers, StreamError, StreamTimings, Upload};

/// The optimizer's fixed settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum HostSettings {
    /// Adam / AdamW.
    Adam {
        /// ε.
        eps: f32,
        /// Weight decay.
        weight_decay: f32,
        /// AdamW's decoupled decay.
        decoupled: bool,
        /// Bias correction.
        bias_correction: bool,
    },
    /// SGD (PyTorch semantics).
    Sgd {
        /// Momentum (0: none).
        momentum: f32,
        /// Dampening.
        dampening: f32,
        /// Nesterov.
        nesterov: bool,
        /// L2 weight decay.
        weight_decay: f32,
    },
}

impl HostSettings {
    /// The state tensors' names (PyTorch's), which checkpoints use too.
    pub fn state_names(&self) -> &'static [&'static str] {
        match self {
            HostSettings::Adam { .. } => &["exp_avg", "exp_avg_sq"],
            HostSettings::Sgd { momentum, .. } if *momentum > 0.0 => &["momentum_buffer"],
            HostSettings::Sgd { .. } => &[],
        }
    }
}

/// The dtype a step hands the new weights out in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutDtype {
    /// fp32 (a copy of the master).
    F32,
    /// bf16, rounded in the fused pass.
    Bf16,
    /// f16, rounded in the fused pass.
    F16,
}

enum Storage {
    /// Master first, then the state tensors.
    Memory(Vec<Vec<f32>>),
    /// The same tensors in swap files.
    Nvme(NvmeStore),
}

/// A partition's master weights and optimizer state off the device.
pub struct HostOptimizer {
    len: usize,
    settings: HostSettings,
    storage: Storage,
    /// Steps taken (Adam's t; SGD's buffer holds a value once it is > 0).
    step: u64,
    cpu: CpuAdam,
    /// The step of sub-groups stepped ahead, while backward runs beside it.
    cpu_ahead: CpuAdam,
    sub_group: usize,
    /// A step begun ahead of its whole gradient ([`HostOptimizer::begin_ahead`]).
    ahead: Option<Ahead>,
}

/// A step whose sub-groups are stepped one by one as backward finishes their gradients.
#[derive(Debug)]
struct Ahead {
    k: StepConstants,
    /// What it was begun with: the step that completes it must be given the same.
    with: (f32, (f32, f32), GradScale),
    done: Vec<bool>,
    /// Sub-groups whose new weights went out as they were stepped ([`HostOptimizer::sent_ahead`]).
    sent: Vec<bool>,
    /// Abandoned after some sub-groups were stepped: the rest keep their values.
    rest_skipped: bool,
}

/// Why a sub-group could not be stepped ahead, or a step begun ahead not completed.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum AheadError {
    /// Only a partition in host memory steps ahead (swap files are visited in order).
    #[error("an optimizer in swap files does not step sub-groups ahead")]
    Swapped,
    /// [`HostOptimizer::begin_ahead`] twice without a step between.
    #[error("a step begun ahead is still open")]
    Open,
    /// No step was begun ahead.
    #[error("no step was begun ahead")]
    NotBegun,
    /// A sub-group stepped twice, or one that does not exist.
    #[error("sub-group {index} cannot be stepped ahead (stepped already, or not one of {count})")]
    Index {
        /// The sub-group.
        index: usize,
        /// Sub-groups of the partition.
        count: usize,
    },
    /// The gradient handed over is not the sub-group's length.
    #[error("sub-group {index} has {expected} elements, its gradient {got}")]
    Length {
        /// The sub-group.
        index: usize,
        /// Its elements.
        expected: usize,
        /// The gradient's.
        got: usize,
    },
    /// The gradient partition's chunks are not the optimizer's sub-groups.
    #[error("gradient chunks of {chunk} elements are not sub-groups of {sub_group}")]
    Chunks {
        /// Elements per gradient chunk.
        chunk: usize,
        /// Elements per sub-group.
        sub_group: usize,
    },
    /// The step completing it was given another learning rate, betas or scale.
    #[error(
        "the step begun ahead with lr {begun:?} is completed with {completed:?} \
         (learning rate, betas, gradient scale)"
    )]
    Changed {
        /// What it was begun with.
        begun: (f32, (f32, f32), GradScale),
        /// What completes it.
        completed: (f32, (f32, f32), GradScale),
    },
}

impl std::fmt::Debug for HostOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostOptimizer")
            .field("len", &self.len)
            .field("settings", &self.settings)
            .field("step", &self.step)
            .field("nvme", &matches!(self.storage, Storage::Nvme(_)))
            .finish()
    }
}

/// One sub-group of the step: CPU-Adam or CPU-SGD over `w` (and the state slices), the new
/// weights written to `target` (none: the master alone).
fn step_into(
    cpu: &CpuAdam,
    k: &StepConstants,
    w: &mut [f32],
    state: &mut [&mut [f32]],
    grad: Grad<'_>,
    target: Out<'_>,
) {
    match (k, state) {
        (StepConstants::Adam(k), [m, v]) => cpu.adam(k, w, grad, m, v, target),
        (StepConstants::Sgd(k), [buf]) => cpu.sgd(k, w, grad, buf, target),
        (StepConstants::Sgd(k), []) => cpu.sgd(k, w, grad, &mut [], target),
        _ => unreachable!("the state matches the settings"),
    }
}

/// One sub-group of the step, the new weights written to `out`; with `stepped` (a sub-group
/// stepped ahead, or one an abandoned step leaves as it is) only its weights are written.
fn step_slices(
    cpu: &CpuAdam,
    k: &StepConstants,
    w: &mut [f32],
    state: &mut [&mut [f32]],
    grad: Grad<'_>,
    out: &mut OutSlot<'_>,
    stepped: bool,
) {
    let n = w.len();
    match stepped {
        true => cpu.narrow(w, out.target(n)),
        false => step_into(cpu, k, w, state, grad, out.target(n)),
    }
    out.finish(w);
}

/// The constants of the step in progress, shared by its sub-groups.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum StepConstants {
    /// Adam's.
    Adam(AdamStep),
    /// SGD's.
    Sgd(SgdStep),
}

impl HostOptimizer {
    /// Zeroed state for `master` in host memory, stepped by `cpu` in sub-groups of
    /// `sub_group` elements.
    pub fn new(master: Vec<f32>, settings: HostSettings, cpu: CpuAdam, sub_group: usize) -> Self {
        let len = master.len();
        let mut tensors = vec![master];
        let huge = cpu.huge_pages();
        tensors.extend(settings.state_names().iter().map(|_| zeroed_f32(len, huge)));
        Self {
            len,
            settings,
            storage: Storage::Memory(tensors),
            step: 0,
            cpu_ahead: cpu.clone(),
            cpu,
            sub_group: sub_group.max(1),
            ahead: None,
        }
    }

    /// The same with master and state in swap files under `swap.dir` (ZeRO-Infinity).
    pub fn on_nvme(
        master: Vec<f32>,
        settings: HostSettings,
        cpu: CpuAdam,
        sub_group: usize,
        swap: &SwapConfig,
    ) -> Result<Self, SwapError> {
        let len = master.len();
        let mut names = vec!["master"];
        names.extend(settings.state_names());
        let store = NvmeStore::create(swap, &names, len, sub_group, &|t, range| {
            (t == 0).then(|| master[range].to_vec())
        })?;
        Ok(Self {
            len,
            settings,
            storage: Storage::Nvme(store),
            step: 0,
            cpu_ahead: cpu.clone(),
            cpu,
            sub_group: sub_group.max(1),
            ahead: None,
        })
    }

    /// Sub-groups stepped ahead run on `threads` threads (the same arithmetic per element:
    /// the bits do not depend on it), leaving the rest of the cores to the backward beside.
    pub fn with_ahead_threads(mut self, threads: usize) -> Self {
        self.cpu_ahead = self.cpu.clone().with_threads(threads);
        self
    }

    /// Elements of the partition.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the partition is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Host memory held for master and state (swap buffers only, on NVMe).
    pub fn bytes(&self) -> usize {
        match &self.storage {
            Storage::Memory(t) => 4 * t.iter().map(Vec::len).sum::<usize>(),
            Storage::Nvme(_) => 0,
        }
    }

    /// The swap files (empty in host memory).
    pub fn swap_files(&self) -> Vec<std::path::PathBuf> {
        match &self.storage {
            Storage::Memory(_) => Vec::new(),
            Storage::Nvme(s) => s.paths().to_vec(),
        }
    }

    /// Whether the swap files bypass the page cache (O_DIRECT); `None` in host memory.
    pub fn swap_direct(&self) -> Option<bool> {
        match &self.storage {
            Storage::Memory(_) => None,
            Storage::Nvme(s) => Some(s.direct),
        }
    }

    /// The fp32 master weights.
    pub fn master(&mut self) -> Result<Vec<f32>, SwapError> {
        match &mut self.storage {
            Storage::Memory(t) => Ok(t[0].clone()),
            Storage::Nvme(s) => s.read_all(0),
        }
    }

    /// The state names [`HostOptimizer::import`] needs.
    pub fn required(&self) -> &'static [&'static str] {
        match self.settings {
            HostSettings::Adam { .. } => &["exp_avg", "exp_avg_sq"],
            HostSettings::Sgd { .. } => &[],
        }
    }

    fn constants(&mut self, lr: f32, betas: (f32, f32), grad_scale: GradScale) -> StepConstants {
        self.step += 1;
        match self.settings {
            HostSettings::Adam {
                eps,
                weight_decay,
                decoupled,
                bias_correction,
            } => StepConstants::Adam(
                AdamStep::at(
                    self.step,
                    lr,
                    betas,
                    eps,
                    weight_decay,
                    decoupled,
                    bias_correction,
                )
                .with_grad_scale(grad_scale),
            ),
            HostSettings::Sgd {
                momentum,
                dampening,
                nesterov,
                weight_decay,
            } => StepConstants::Sgd(SgdStep {
                lr,
                momentum,
                dampening,
                nesterov,
                weight_decay,
                started: self.step > 1,
                grad_scale,
            }),
        }
    }

    /// The sub-groups' ranges, in the order a step visits them.
    pub fn sub_groups(&self) -> Vec<Range<usize>> {
        (0..self.len)
            .step_by(self.sub_group)
            .map(|start| start..(start + self.sub_group).min(self.len))
            .collect()
    }

    /// Elements of the longest sub-group (what a step's buffers must hold).
    pub fn sub_group_len(&self) -> usize {
        self.sub_group.min(self.len)
    }

    /// One optimizer step with learning rate `lr` and `betas`, streamed sub-group by
    /// sub-group: `download` fills a buffer with a sub-group's fp32 gradient (on a thread of
    /// its own), CPU-Adam steps it (multiplied by `grad_scale` first), and `upload` takes its
    /// new weights (on this thread), the three overlapping across sub-groups. The buffers'
    /// output dtype is the weights' dtype. Completing a step begun ahead, only the sub-groups
    /// of [`Self::to_hand_out`] pass through the stages (gradient buffers given in place are
    /// theirs, in that order).
    pub fn step(
        &mut self,
        lr: f32,
        betas: (f32, f32),
        grad_scale: GradScale,
        buffers: StepBuffers<'_>,
        download: &Download<'_>,
        upload: &mut Upload<'_>,
    ) -> Result<StreamTimings, StreamError> {
        let keep = self.to_hand_out();
        let ranges: Vec<Range<usize>> = {
            let all = self.sub_groups();
            keep.iter().map(|&i| all[i].clone()).collect()
        };
        let (k, skip) = match self.ahead.take() {
            None => (
                self.constants(lr, betas, grad_scale),
                vec![false; ranges.len()],
            ),
            Some(ahead) if ahead.with != (lr, betas, grad_scale) => {
                // Closed: the sub-groups stepped keep their update (see `abandon_ahead`).
                let begun = ahead.with;
                return Err(AheadError::Changed {
                    begun,
                    completed: (lr, betas, grad_scale),
                }
                .into());
            }
            Some(ahead) => {
                let skip = keep.iter().map(|&i| ahead.done[i] || ahead.rest_skipped);
                (ahead.k, skip.collect())
            }
        };
        if ranges.is_empty() {
            return Ok(StreamTimings::default());
        }
        let cpu = &self.cpu;
        let storage = &mut self.storage;
        stream::run(
            ranges.clone(),
            buffers,
            download,
            upload,
            move |stage| match storage {
                Storage::Memory(tensors) => {
                    let (master, state) = tensors.split_first_mut().expect("the master");
                    for (range, stepped) in ranges.into_iter().zip(skip) {
                        let Some((grad, mut out)) = stage.next(&range) else {
                            return Ok(false);
                        };
                        let mut slices: Vec<&mut [f32]> =
                            state.iter_mut().map(|s| &mut s[range.clone()]).collect();
                        let w = &mut master[range.clone()];
                        let g = grad.grad(range.len());
                        step_slices(cpu, &k, w, &mut slices, g, &mut out, stepped);
                        stage.done(range, grad, out);
                    }
                    Ok(true)
                }
                Storage::Nvme(store) => {
                    let mut gave_up = false;
                    let visited = store.visit(true, true, &mut |_, range, bufs| {
                        let Some((grad, mut out)) = stage.next(&range) else {
                            gave_up = true;
                            return Err(SwapError::Abandoned);
                        };
                        let n = range.len();
                        let (master, state) = bufs.split_first_mut().expect("the master");
                        let mut slices: Vec<&mut [f32]> = state
                            .iter_mut()
                            .map(|s| &mut s.as_mut_slice()[..n])
                            .collect();
                        let w = &mut master.as_mut_slice()[..n];
                        step_slices(cpu, &k, w, &mut slices, grad.grad(n), &mut out, false);
                        stage.done(range, grad, out);
                        Ok(())
                    });
                    match visited {
                        Err(SwapError::Abandoned) if gave_up => Ok(false),
                        other => other.map(|()| true),
                    }
                }
            },
        )
    }

    /// Begins a step with learning rate `lr`, `betas` and `grad_scale` whose sub-groups are
    /// then stepped one at a time as their gradients become final ([`Self::step_ahead`], in
    /// any order, while backward goes on); the [`Self::step`] given the same values completes
    /// it, stepping the rest and handing out the new weights of every sub-group not sent on
    /// already ([`Self::sent_ahead`]). The arithmetic is the serial step's, so are the bits.
    /// Host memory only.
    pub fn begin_ahead(
        &mut self,
        lr: f32,
        betas: (f32, f32),
        grad_scale: GradScale,
    ) -> Result<(), AheadError> {
        if matches!(self.storage, Storage::Nvme(_)) {
            return Err(AheadError::Swapped);
        }
        if self.ahead.is_some() {
            return Err(AheadError::Open);
        }
        let k = self.constants(lr, betas, grad_scale);
        self.ahead = Some(Ahead {
            k,
            with: (lr, betas, grad_scale),
            done: vec![false; self.sub_groups().len()],
            sent: vec![false; self.sub_groups().len()],
            rest_skipped: false,
        });
        Ok(())
    }

    /// Steps sub-group `index` of the step begun ahead with its final gradient `grad`: the
    /// master and state, and the new weights into `out` when given (the caller sends them on
    /// and says so with [`Self::sent_ahead`]; otherwise [`Self::step`] hands them out).
    pub fn step_ahead(
        &mut self,
        index: usize,
        grad: Grad<'_>,
        out: Option<&mut OutSlot<'_>>,
    ) -> Result<(), AheadError> {
        let range = self.sub_groups().get(index).cloned();
        let ahead = self.ahead.as_mut().ok_or(AheadError::NotBegun)?;
        let count = ahead.done.len();
        let range = match range {
            Some(r) if !ahead.done[index] => r,
            _ => return Err(AheadError::Index { index, count }),
        };
        let n = range.len();
        if grad.len() != n {
            return Err(AheadError::Length {
                index,
                expected: n,
                got: grad.len(),
            });
        }
        let Storage::Memory(tensors) = &mut self.storage else {
            unreachable!("begin_ahead refuses swap files")
        };
        let (master, state) = tensors.split_first_mut().expect("the master");
        let mut slices: Vec<&mut [f32]> = state.iter_mut().map(|s| &mut s[range.clone()]).collect();
        let w = &mut master[range];
        match out {
            None => step_into(&self.cpu_ahead, &ahead.k, w, &mut slices, grad, Out::None),
            Some(slot) => {
                step_into(
                    &self.cpu_ahead,
                    &ahead.k,
                    w,
                    &mut slices,
                    grad,
                    slot.target(n),
                );
                slot.finish(w);
            }
        }
        ahead.done[index] = true;
        Ok(())
    }

    /// Sub-group `index`, stepped ahead, has had its new weights sent on: the step that
    /// completes it hands out only the others.
    pub fn sent_ahead(&mut self, index: usize) {
        if let Some(a) = self.ahead.as_mut()
            && a.done.get(index) == Some(&true)
        {
            a.sent[index] = true;
        }
    }

    /// Forgets which sub-groups' weights were sent (the sending failed, and what arrived is
    /// not known): the step that completes the one begun ahead hands them all out.
    pub fn unsend_ahead(&mut self) {
        if let Some(a) = self.ahead.as_mut() {
            a.sent.fill(false);
        }
    }

    /// The sub-groups whose new weights the next [`Self::step`] hands out, in order: all but
    /// those sent on as they were stepped ahead.
    pub fn to_hand_out(&self) -> Vec<usize> {
        let count = self.sub_groups().len();
        match &self.ahead {
            Some(a) => (0..count).filter(|&i| !a.sent[i]).collect(),
            None => (0..count).collect(),
        }
    }

    /// Sub-groups of the step begun ahead stepped so far.
    pub fn stepped_ahead(&self) -> usize {
        self.ahead
            .as_ref()
            .map_or(0, |a| a.done.iter().filter(|&&d| d).count())
    }

    /// Whether a step begun ahead is open (not completed by [`Self::step`] nor abandoned).
    pub fn has_ahead(&self) -> bool {
        self.ahead.is_some()
    }

    /// Closes the step begun ahead without completing it (its backward failed, or its
    /// gradients overflowed everywhere before any sub-group was stepped): with no sub-group
    /// stepped it never happened; otherwise those keep their update and the step count, and
    /// their new weights go out with the next step's. Returns how many were stepped.
    pub fn abandon_ahead(&mut self) -> usize {
        let stepped = self.stepped_ahead();
        if self.ahead.take().is_some() && stepped == 0 {
            self.step -= 1;
        }
        stepped
    }

    /// The step (begun ahead with these values, or now) steps nothing more: the next
    /// [`Self::step`] with the same values hands the weights of every sub-group not sent on
    /// already out, those stepped ahead with their update, the others as they are (gradients
    /// that overflowed, where some
    /// sub-group somewhere was stepped ahead already). Host memory only.
    pub fn skip_rest_ahead(
        &mut self,
        lr: f32,
        betas: (f32, f32),
        grad_scale: GradScale,
    ) -> Result<(), AheadError> {
        if self.ahead.is_none() {
            self.begin_ahead(lr, betas, grad_scale)?;
        }
        if let Some(a) = self.ahead.as_mut() {
            a.rest_skipped = true;
        }
        Ok(())
    }

    /// The master, step count and the state as named partitions (PyTorch's names).
    #[allow(clippy::type_complexity)]
    pub fn export(&mut self) -> Result<(Vec<f32>, u64, Vec<(&'static str, Vec<f32>)>), SwapError> {
        let names = self.settings.state_names();
        let tensors: Vec<Vec<f32>> = match &mut self.storage {
            Storage::Memory(t) => t.clone(),
            Storage::Nvme(s) => (0..=names.len())
                .map(|i| s.read_all(i))
                .collect::<Result<_, _>>()?,
        };
        let mut tensors = tensors.into_iter();
        let master = tensors.next().expect("the master");
        // SGD's buffer means nothing before the first step.
        let state = if self.step == 0 && matches!(self.settings, HostSettings::Sgd { .. }) {
            Vec::new()
        } else {
            names.iter().copied().zip(tensors).collect()
        };
        Ok((master, self.step, state))
    }

    /// Replaces the master, step count and state (named as [`HostOptimizer::export`] names
    /// them); an error names what is missing or mis-sized.
    pub fn import(
        &mut self,
        master: Vec<f32>,
        step: u64,
        mut tensors: Vec<(String, Vec<f32>)>,
    ) -> Result<(), String> {
        let n = self.len;
        if let Some((name, t)) = std::iter::once(("master".to_string(), &master))
            .chain(tensors.iter().map(|(n, t)| (n.clone(), t)))
            .find(|(_, t)| t.len() != n)
        {
            return Err(format!(
                "optimizer state `{name}` has {} elements, the partition {n}",
                t.len()
            ));
        }
        let mut take = |name: &str| {
            let i = tensors.iter().position(|(t, _)| t == name)?;
            Some(tensors.swap_remove(i).1)
        };
        let mut values = vec![master];
        let mut resumed = false;
        for name in self.settings.state_names() {
            match take(name) {
                Some(t) => {
                    values.push(t);
                    resumed = true;
                }
                None if self.required().contains(name) => {
                    return Err(format!("the checkpoint has no `{name}` (Adam's state)"));
                }
                // SGD without a saved buffer starts it at the next step.
                None => values.push(vec![0.0; n]),
            }
        }
        let sgd = matches!(self.settings, HostSettings::Sgd { .. });
        self.step = if sgd && resumed {
            step.max(1)
        } else if sgd {
            0
        } else {
            step
        };
        match &mut self.storage {
            Storage::Memory(t) => *t = values,
            Storage::Nvme(s) => s.write_all(&values).map_err(|e| e.to_string())?,
        }
        // A step begun ahead belonged to the state replaced.
        self.ahead = None;
        Ok(())
    }
}
