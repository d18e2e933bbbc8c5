//! Activation checkpointing at stage granularity (DeepSpeed's `activation_checkpointing`):
//! a micro-batch's forward keeps only the stage's input (the checkpoint) and lets the graph of
//! its activations go; its backward recomputes the forward from the checkpoint first. With
//! `partition_activations` each model-parallel rank keeps only its slice of the (replicated)
//! checkpoint and the slices are all-gathered before the recompute; with `cpu_checkpointing`
//! checkpoints wait in host memory.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_zero::comm::CommError;
use burn_zero::config::ActivationCheckpointingConfig;
use burn_zero::partition::PartitionPlan;

use crate::tensor_parallel::ModelGroup;

/// How a stage checkpoints its micro-batches' activations.
#[derive(Clone, Debug, Default)]
pub struct Checkpointing {
    /// Keep only this model-parallel rank's slice of each checkpoint.
    pub partition: Option<ModelGroup>,
    /// Keep checkpoints in host memory.
    pub on_host: bool,
}

/// A checkpointed stage input.
pub(crate) enum Saved<B: Backend> {
    /// Whole, on the device.
    Device(Tensor<B, 2>),
    /// Whole, or this rank's padded slice, in host memory.
    Host { values: Vec<f32>, dims: [usize; 2] },
    /// This rank's padded slice, on the device.
    Slice {
        part: Tensor<B, 1>,
        dims: [usize; 2],
    },
}

impl Checkpointing {
    /// The checkpointing `config` asks for; `model` is the stage's model-parallel group (for
    /// `partition_activations`; without one, checkpoints stay whole).
    pub fn from_config(config: &ActivationCheckpointingConfig, model: Option<&ModelGroup>) -> Self {
        Self {
            partition: model.filter(|_| config.partition_activations).cloned(),
            on_host: config.cpu_checkpointing,
        }
    }

    /// The plan splitting a `dims` checkpoint over the model group, if partitioned.
    fn plan(&self, dims: [usize; 2]) -> Option<(PartitionPlan, usize)> {
        let group = self.partition.as_ref()?;
        let plan = PartitionPlan::new(dims[0] * dims[1], group.size());
        Some((plan, group.rank()))
    }

    /// `x` (detached) as this rank keeps it.
    pub(crate) fn save<B: Backend>(&self, x: Tensor<B, 2>) -> Saved<B> {
        let x = x.detach();
        let dims = x.dims();
        let host = |t: Tensor<B, 1>| t.into_data().convert::<f32>().into_vec().expect("f32");
        match (self.plan(dims), self.on_host) {
            (None, false) => Saved::Device(x),
            (None, true) => Saved::Host {
                values: host(x.reshape([dims[0] * dims[1]])),
                dims,
            },
            (Some((plan, rank)), on_host) => {
                let padded = pad(x.reshape([plan.numel()]), plan.padded_numel());
                let part = padded.slice(rank * plan.chunk()..(rank + 1) * plan.chunk());
                match on_host {
                    true => Saved::Host {
                        values: host(part),
                        dims,
                    },
                    false => Saved::Slice { part, dims },
                }
            }
        }
    }

    /// The whole checkpoint back on `device` (slices all-gathered over the model group).
    pub(crate) fn restore<B: Backend>(
        &self,
        saved: Saved<B>,
        device: &B::Device,
    ) -> Result<Tensor<B, 2>, CommError> {
        let (values, dims) = match saved {
            Saved::Device(x) => return Ok(x),
            Saved::Host { values, dims } => (values, dims),
            Saved::Slice { part, dims } => {
                let values = part.into_data().convert::<f32>().into_vec().expect("f32");
                (values, dims)
            }
        };
        let values = match (self.plan(dims), &self.partition) {
            (Some((plan, _)), Some(group)) => {
                let mut full = vec![0.0f32; plan.padded_numel()];
                group
                    .comm()
                    .all_gather(values.as_slice().into(), full.as_mut_slice().into())?;
                full.truncate(plan.numel());
                full
            }
            _ => values,
        };
        Ok(Tensor::from_data(TensorData::new(values, dims), device))
    }
}

/// `t` followed by zeros up to `len` elements.
fn pad<B: Backend>(t: Tensor<B, 1>, len: usize) -> Tensor<B, 1> {
    let n = t.dims()[0];
    if n == len {
        return t;
    }
    let zeros = Tensor::zeros([len - n], &t.device());
    Tensor::cat(vec![t, zeros], 0)
}

#[cfg(test)]
impl<B: Backend> Saved<B> {
    /// Elements this rank holds.
    pub(crate) fn len(&self) -> usize {
        match self {
            Saved::Device(x) => x.dims().iter().product(),
            Saved::Host { values, .. } => values.len(),
            Saved::Slice { part, .. } => part.dims()[0],
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use burn::backend::NdArray;
    use burn::tensor::{Tensor, TensorData};
    use burn_zero::testing::run_ranks;

    use super::Checkpointing;
    use crate::tensor_parallel::ModelGroup;

    /// Over 3 model ranks a 5×7 checkpoint keeps 12 of its 35 values per rank (the last
    /// rank's padded), and every rank restores all of them.
    #[test]
    fn partitioned_checkpoints_keep_a_slice_and_restore_the_whole() {
        let values: Vec<f32> = (0..35).map(|i| i as f32 * 0.5 - 3.0).collect();
        let results = run_ranks(3, |ctx| {
            let device = Default::default();
            let group = ModelGroup::new(Arc::new(ctx.comm));
            let x =
                Tensor::<NdArray, 2>::from_data(TensorData::new(values.clone(), [5, 7]), &device);
            [false, true].map(|on_host| {
                let ckpt = Checkpointing {
                    partition: Some(group.clone()),
                    on_host,
                };
                let saved = ckpt.save(x.clone());
                let kept = saved.len();
                let back = ckpt.restore(saved, &device).unwrap();
                (kept, back.dims(), back.into_data().to_vec::<f32>().unwrap())
            })
        });
        for per_rank in results {
            for (kept, dims, back) in per_rank {
                assert_eq!(kept, 12);
                assert_eq!(dims, [5, 7]);
                assert_eq!(back, values);
            }
        }
    }
}
