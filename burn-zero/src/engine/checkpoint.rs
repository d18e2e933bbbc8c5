//! `save_checkpoint` / `load_checkpoint`: every rank writes its flat partitions (fp32 master,
//! optimizer state, and the compute-dtype copy under bf16/fp16) to one safetensors file; rank 0
//! writes the manifest and commits the directory atomically (see [`crate::checkpoint`]).
//! Loading reads this rank's partition out of whatever pieces the writing ranks held, so a
//! checkpoint of any world size and stage loads at any other.

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::tensor::FloatDType;
use burn::tensor::backend::Backend;
use serde_json::json;

use super::{Engine, EngineError, ZeroAutodiff};
use crate::checkpoint::{
    Dtype, FORMAT, MASTER, Manifest, ParamEntry, PartitionFiles, Span, Staging, StoreError,
    VERSION, open_manifest, partition_file, resolve, safetensors::Writer, verify,
};
use crate::comm::ReduceOp;
use crate::config::ZeroStage;
use crate::precision::LossScaler;
use crate::progress::Progress;

/// The engine's counters a checkpoint's manifest holds (`engine`, as `save_checkpoint` writes
/// it). Each is required: a missing one would silently restart the step count, the schedule
/// or the loss scale.
struct EngineState {
    global_steps: usize,
    micro_steps: usize,
    skipped_steps: usize,
    optimizer_step: u64,
    last_grad_norm: Option<f64>,
    last_batch_iteration: i64,
    loss_scaler: LossScaler,
}

impl EngineState {
    fn read(engine: &serde_json::Value, dir: &Path) -> Result<Self, EngineError> {
        let bad = |key: &str, what: &str| {
            EngineError::Usage(format!(
                "{}: engine field `{key}` is {what}",
                dir.join(crate::checkpoint::MANIFEST).display()
            ))
        };
        let count = |key: &str, value: &serde_json::Value| {
            value
                .as_u64()
                .ok_or_else(|| bad(key, "missing or not a whole number"))
        };
        let last_grad_norm = match &engine["last_grad_norm"] {
            serde_json::Value::Null => None,
            v => Some(
                v.as_f64()
                    .ok_or_else(|| bad("last_grad_norm", "not a number"))?,
            ),
        };
        Ok(Self {
            global_steps: count("global_steps", &engine["global_steps"])? as usize,
            micro_steps: count("micro_steps", &engine["micro_steps"])? as usize,
            skipped_steps: count("skipped_steps", &engine["skipped_steps"])? as usize,
            optimizer_step: count("optimizer.step", &engine["optimizer"]["step"])?,
            last_grad_norm,
            last_batch_iteration: engine["scheduler"]["last_batch_iteration"]
                .as_i64()
                .ok_or_else(|| {
                    bad(
                        "scheduler.last_batch_iteration",
                        "missing or not a whole number",
                    )
                })?,
            loss_scaler: serde_json::from_value(engine["loss_scaler"].clone())
                .map_err(|e| bad("loss_scaler", &format!("unreadable ({e})")))?,
        })
    }
}

/// What a rank's partition file holds (tensor names and dtypes), the optimizer's step count,
/// and rank 0's progress bar (finished once the checkpoint is committed).
type Written = (
    BTreeMap<String, Dtype>,
    u64,
    Option<Progress<std::io::Stderr>>,
);

/// The compute-dtype copy of the parameters in bf16/fp16 runs (the master is the copy in fp32).
const PARAMS: &str = "params";

thread_local! {
    static FAIL_NEXT_SAVE: Cell<bool> = const { Cell::new(false) };
}

/// Makes this thread's next `save_checkpoint` fail after its rank wrote its file, before the
/// commit, as a crash there would (for tests of atomicity).
#[doc(hidden)]
pub fn inject_save_failure() {
    FAIL_NEXT_SAVE.with(|f| f.set(true));
}

/// What [`Engine::load_checkpoint`] restored.
#[derive(Clone, Debug)]
pub struct LoadedCheckpoint {
    /// The checkpoint's directory.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    /// The `client_state` given to `save_checkpoint` (data-loader position, RNG seeds, ...).
    pub client_state: serde_json::Value,
}

impl LoadedCheckpoint {
    /// Whether it was written by a run of another world size or stage.
    pub fn resharded(&self, world_size: usize, stage: ZeroStage) -> bool {
        self.manifest.world_size != world_size || self.manifest.stage != stage
    }
}

/// This rank's partition as read from a checkpoint, before anything is changed.
struct Restored {
    manifest: Manifest,
    dir: PathBuf,
    master: Vec<f32>,
    /// Optimizer state partitions by name.
    state: Vec<(String, Vec<f32>)>,
}

fn storage_dtype(dtype: FloatDType) -> Option<Dtype> {
    match dtype {
        FloatDType::BF16 => Some(Dtype::BF16),
        FloatDType::F16 => Some(Dtype::F16),
        _ => None,
    }
}

impl<I: Backend, M: Module<ZeroAutodiff<I>>> Engine<I, M> {
    /// Saves the training state under `root/tag` (`global_step{N}` when `tag` is `None`) and
    /// points `root/latest` at it; every rank must call it, between optimizer steps.
    /// `client_state` is stored as is and returned by [`Engine::load_checkpoint`] (the
    /// data-loader position, RNG seeds, anything the training loop needs to resume).
    pub fn save_checkpoint(
        &self,
        root: &Path,
        tag: Option<&str>,
        client_state: serde_json::Value,
    ) -> Result<PathBuf, EngineError> {
        let gas = self.resolved.batch.gradient_accumulation_steps;
        if !self.micro_steps.is_multiple_of(gas) {
            return Err(EngineError::Usage(format!(
                "save_checkpoint in the middle of a gradient-accumulation window (micro-step {} \
                 of {gas}): save after the `step` that ends a window",
                self.micro_steps % gas
            )));
        }
        self.refuse_while_ahead("save_checkpoint")?;
        let tag = tag.map_or_else(|| format!("global_step{}", self.global_steps), String::from);
        if tag.is_empty() || tag.starts_with('.') || tag.contains(['/', '\\']) || tag == "latest" {
            return Err(EngineError::Usage(format!(
                "checkpoint tag `{tag}` must be a plain, non-hidden directory name other than `latest`"
            )));
        }
        let rank = self.comm.rank();
        let created = match rank {
            0 => Staging::open(root, &tag, true).map(Some),
            _ => Ok(None),
        };
        let staging = match self.agree("create the staging directory", created)? {
            Some(staging) => staging,
            None => Staging::open(root, &tag, false)?,
        };
        let started = std::time::Instant::now();
        let written = self.write_partition(&staging).and_then(|wrote| {
            if FAIL_NEXT_SAVE.with(|f| f.replace(false)) {
                return Err(EngineError::Usage(format!(
                    "rank {rank}: injected failure during save (after its partition file)"
                )));
            }
            Ok(wrote)
        });
        let (tensors, optimizer_step, mut bar) = self.agree("write its partition file", written)?;
        let committed = if rank == 0 {
            self.manifest(
                &staging,
                tag.clone(),
                (tensors, optimizer_step),
                client_state,
            )
            .and_then(|m| Ok(staging.commit(&m)?))
        } else {
            Ok(root.join(&tag))
        };
        let dir = self.agree("commit the checkpoint", committed)?;
        if let Some(bar) = bar.as_mut() {
            let summary = format!("saved {}", dir.display());
            let _ = bar.finish(started.elapsed().as_secs_f64(), &summary);
        }
        Ok(dir)
    }

    /// Every rank's outcome of one phase of a save or load: `local` if every rank succeeded,
    /// else this rank's error, or one saying which phase failed elsewhere. Keeps the ranks
    /// together, so one failing rank never leaves the others waiting in a collective.
    pub(super) fn agree<T, E: Into<EngineError>>(
        &self,
        phase: &str,
        local: Result<T, E>,
    ) -> Result<T, EngineError> {
        let mut failed = [f32::from(u8::from(local.is_err()))];
        self.comm
            .all_reduce(failed.as_mut_slice().into(), ReduceOp::Max)?;
        match local {
            Err(e) => Err(e.into()),
            Ok(_) if failed[0] > 0.0 => Err(EngineError::Usage(format!(
                "another rank failed to {phase} (its error says why)"
            ))),
            Ok(value) => Ok(value),
        }
    }

    /// Writes this rank's partition file, if it holds a partition; returns the tensors' names
    /// and dtypes, and the optimizer's step count.
    fn write_partition(&self, staging: &Staging) -> Result<Written, EngineError> {
        let layout = self.strategy().checkpoint_layout();
        let rank = self.comm.rank();
        if rank >= layout.writers {
            return Ok((BTreeMap::new(), 0, None));
        }
        let pad = |mut v: Vec<f32>| {
            if let Some(len) = layout.pad_to {
                v.resize(len, 0.0);
            }
            v
        };
        let super::optim_state::Exported {
            master,
            step,
            state,
        } = self.optim.export()?;
        let mut tensors: Vec<(String, Dtype, Vec<f32>)> =
            vec![(MASTER.into(), Dtype::F32, pad(master))];
        for (name, v) in state {
            tensors.push((name.into(), Dtype::F32, pad(v)));
        }
        if let Some(dtype) = storage_dtype(self.precision.compute.dtype) {
            let master = tensors[0].2.clone();
            tensors.push((PARAMS.into(), dtype, master));
        }
        let names = tensors.iter().map(|(n, d, _)| (n.clone(), *d)).collect();
        let specs: Vec<_> = tensors
            .iter()
            .map(|(n, d, v)| (n.clone(), *d, vec![v.len()]))
            .collect();
        let metadata = BTreeMap::from([
            ("rank".to_string(), rank.to_string()),
            ("optimizer_step".to_string(), step.to_string()),
        ]);
        let mut writer = Writer::create(&staging.path(&partition_file(rank)), &specs, &metadata)?;
        // Rank 0 shows the save's progress (on a terminal; one line at the end otherwise).
        let started = std::time::Instant::now();
        let mut bar = (rank == 0).then(|| {
            let redraw = std::io::stderr().is_terminal();
            let total = tensors.len() as u64;
            Progress::new(std::io::stderr(), "save checkpoint", total, redraw).max_lines(1)
        });
        for (i, (name, dtype, values)) in tensors.iter().enumerate() {
            writer.write_next(&dtype.encode(values))?;
            if let Some(bar) = bar.as_mut() {
                let _ = bar.update(i as u64 + 1, started.elapsed().as_secs_f64(), name);
            }
        }
        writer.finish()?;
        Ok((names, step, bar))
    }

    /// Rank 0: the manifest of the files every rank wrote into `staging`.
    fn manifest(
        &self,
        staging: &Staging,
        tag: String,
        (tensors, optimizer_step): (BTreeMap<String, Dtype>, u64),
        client_state: serde_json::Value,
    ) -> Result<Manifest, EngineError> {
        let world = self.comm.world_size();
        let (stage, layout) = {
            let strategy = self.strategy();
            (strategy.stage(), strategy.checkpoint_layout())
        };
        let chunks = layout.chunks;
        let params = self
            .layout
            .slots()
            .iter()
            .zip(chunks)
            .map(|(s, chunk)| ParamEntry {
                name: s.name.clone(),
                shape: s.shape.clone(),
                chunk,
            })
            .collect();
        let files = (0..layout.writers)
            .map(|r| staging.describe(&partition_file(r), Some(r)))
            .collect::<Result<Vec<_>, StoreError>>()?;
        let engine = json!({
            "global_steps": self.global_steps,
            "micro_steps": self.micro_steps,
            "skipped_steps": self.precision.skipped,
            "last_grad_norm": self.last_grad_norm,
            "scheduler": {"last_batch_iteration": self.scheduler.last_batch_iteration()},
            "loss_scaler": self.precision.scaler,
            "optimizer": {"kind": self.resolved.optimizer, "step": optimizer_step},
            "compute_dtype": format!("{:?}", self.precision.compute.dtype),
            "gradient_accumulation_steps": self.resolved.batch.gradient_accumulation_steps,
            "client": client_state,
        });
        let manifest = Manifest {
            format: FORMAT.into(),
            version: VERSION,
            tag,
            stage,
            world_size: world,
            partitioning: layout.partitioning,
            params,
            tensors,
            files,
            engine,
        };
        manifest
            .validate()
            .map_err(|e| EngineError::Usage(format!("internal: an invalid manifest: {e}")))?;
        Ok(manifest)
    }

    /// Restores the state saved under `root/tag` (the `latest` one when `tag` is `None`),
    /// written at any world size and stage; every rank must call it, between optimizer steps.
    /// The files this rank reads are checked against their checksums first; a model whose
    /// parameters differ from the checkpoint's is refused, naming the first that differs.
    pub fn load_checkpoint(
        &mut self,
        root: &Path,
        tag: Option<&str>,
    ) -> Result<LoadedCheckpoint, EngineError> {
        let loaded = self.read_checkpoint(root, tag);
        let loaded = self.agree("load the checkpoint", loaded)?;
        let Restored {
            manifest,
            dir,
            master,
            state,
        } = loaded;
        // Every rank reads the same counters; a rank whose optimizer refuses the state makes
        // every rank return an error (none waits in a collective for it).
        let restored = EngineState::read(&manifest.engine, &dir).and_then(|counters| {
            self.optim
                .import(master, counters.optimizer_step, state)
                .map_err(EngineError::Usage)?;
            Ok(counters)
        });
        let counters = self.agree("restore the checkpoint's engine state", restored)?;
        self.global_steps = counters.global_steps;
        self.micro_steps = counters.micro_steps;
        self.precision.skipped = counters.skipped_steps;
        self.last_grad_norm = counters.last_grad_norm;
        self.scheduler
            .set_last_batch_iteration(counters.last_batch_iteration);
        self.precision.scaler = counters.loss_scaler;
        let engine = &manifest.engine;
        let strategy = self.strategy.clone();
        let mut strategy = strategy.lock().expect("strategy");
        strategy.grads_mut().clear();
        let working = self.precision.compute.convert(self.optim.master()?);
        let stage = strategy.stage();
        self.release_params(&mut *strategy)?;
        self.publish(&mut *strategy, vec![working])?;
        drop(strategy);
        let loaded = LoadedCheckpoint {
            client_state: engine.get("client").cloned().unwrap_or_default(),
            dir,
            manifest,
        };
        if self.comm.rank() == 0 {
            let how = if loaded.resharded(self.comm.world_size(), stage) {
                format!(
                    ", resharded from {} ranks at stage {} to {} at stage {stage}",
                    loaded.manifest.world_size,
                    loaded.manifest.stage,
                    self.comm.world_size()
                )
            } else {
                String::new()
            };
            crate::log::info(&format!(
                "loaded checkpoint {} (step {}){how}",
                loaded.dir.display(),
                self.global_steps
            ));
        }
        Ok(loaded)
    }

    /// This rank's side of a load: the manifest, the directory, the master partition and the
    /// optimizer state partitions, checked and read (nothing changed yet).
    fn read_checkpoint(&self, root: &Path, tag: Option<&str>) -> Result<Restored, EngineError> {
        // The optimizer's import closes a step begun ahead: its thread must be done.
        self.settle_step_ahead();
        // Mid-window (micro-steps accumulated, or a step that failed): the load replaces the
        // parameters those gradients belong to, so they go (the load clears them), said aloud.
        let gas = self.resolved.batch.gradient_accumulation_steps;
        let pending = self.micro_steps % gas;
        if pending != 0 && self.comm.rank() == 0 {
            crate::log::warn(&format!(
                "load_checkpoint discards the gradients of {pending} micro-step(s) of an \
                 unfinished accumulation window"
            ));
        }
        let dir = resolve(root, tag)?;
        let manifest = open_manifest(&dir)?;
        let optimizer = serde_json::to_value(self.resolved.optimizer).unwrap_or_default();
        let saved = &manifest.engine["optimizer"]["kind"];
        if *saved != optimizer {
            return Err(EngineError::Usage(format!(
                "{}: the checkpoint's optimizer is {saved}, this run's {optimizer}",
                dir.display()
            )));
        }
        let (spans, len) = self.spans(&manifest, &dir)?;
        // Only the files this rank reads: every rank hashing every file would read the whole
        // checkpoint once per rank.
        let ranks: std::collections::HashSet<usize> = spans
            .iter()
            .flat_map(|s| {
                let wanted = s.elements.clone();
                manifest
                    .pieces(s.param)
                    .into_iter()
                    .filter(move |p| p.elements.start < wanted.end && wanted.start < p.elements.end)
            })
            .map(|p| p.rank)
            .collect();
        verify(&dir, &manifest, |f| {
            f.rank.is_none_or(|r| ranks.contains(&r))
        })?;
        let mut files = PartitionFiles::new(&dir, &manifest);
        let mut read = |name: &str| -> Result<Vec<f32>, StoreError> {
            let mut out = vec![0.0; len];
            files.read_spans(name, &spans, &mut out)?;
            Ok(out)
        };
        let master = read(MASTER)?;
        let mut state = Vec::new();
        for name in ["exp_avg", "exp_avg_sq", "momentum_buffer"] {
            let required = self.optim.required().contains(&name);
            if manifest.tensors.contains_key(name) {
                state.push((name.to_string(), read(name)?));
            } else if required {
                return Err(EngineError::Usage(format!(
                    "{}: the checkpoint has no `{name}`, which this run's optimizer needs",
                    dir.display()
                )));
            }
        }
        Ok(Restored {
            manifest,
            dir,
            master,
            state,
        })
    }

    /// Where this rank's partition comes from in the checkpoint: spans of its parameters
    /// (matched by name, shapes checked) and the partition's length.
    fn spans(&self, manifest: &Manifest, dir: &Path) -> Result<(Vec<Span>, usize), EngineError> {
        let by_name: HashMap<&str, usize> = manifest
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| (p.name.as_str(), i))
            .collect();
        let mut index = Vec::new();
        for slot in self.layout.slots() {
            let Some(&i) = by_name.get(slot.name.as_str()) else {
                return Err(EngineError::Usage(format!(
                    "{}: the model's parameter `{}` is not in the checkpoint",
                    dir.display(),
                    slot.name
                )));
            };
            if manifest.params[i].shape != slot.shape {
                return Err(EngineError::Usage(format!(
                    "{}: parameter `{}` has shape {:?} in the checkpoint but {:?} in the model",
                    dir.display(),
                    slot.name,
                    manifest.params[i].shape,
                    slot.shape
                )));
            }
            index.push(i);
        }
        if manifest.params.len() != index.len() {
            let ours: std::collections::HashSet<_> = self
                .layout
                .slots()
                .iter()
                .map(|s| s.name.as_str())
                .collect();
            let extra = manifest
                .params
                .iter()
                .find(|p| !ours.contains(p.name.as_str()))
                .map_or("?", |p| p.name.as_str());
            return Err(EngineError::Usage(format!(
                "{}: the checkpoint's parameter `{extra}` is not a trainable parameter of the model",
                dir.display()
            )));
        }
        Ok(self.strategy().load_spans(&index))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manifest_missing_an_engine_counter_is_refused_by_name() {
        let dir = Path::new("ckpt/global_step4");
        let full = json!({
            "global_steps": 4, "micro_steps": 8, "skipped_steps": 0, "last_grad_norm": 0.5,
            "scheduler": {"last_batch_iteration": 3}, "loss_scaler": LossScaler::fixed(1.0),
            "optimizer": {"step": 4},
        });
        let state = EngineState::read(&full, dir).unwrap();
        assert_eq!(
            (state.global_steps, state.micro_steps, state.optimizer_step),
            (4, 8, 4)
        );
        assert_eq!(state.last_batch_iteration, 3);
        for (key, pointer) in [
            ("global_steps", "/global_steps"),
            ("optimizer.step", "/optimizer/step"),
            (
                "scheduler.last_batch_iteration",
                "/scheduler/last_batch_iteration",
            ),
            ("loss_scaler", "/loss_scaler"),
        ] {
            let mut engine = full.clone();
            *engine.pointer_mut(pointer).unwrap() = json!("?");
            let err = EngineState::read(&engine, dir).err().unwrap().to_string();
            assert!(
                err.contains(&format!("`{key}`")) && err.contains("manifest.json"),
                "{key}: {err}"
            );
        }
    }
}
