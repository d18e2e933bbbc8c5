//! How a pipeline stage applies its gradients at the end of a step: any burn optimizer with
//! gradients averaged over the data axis (every data rank holds the whole optimizer state),
//! [`Zero1`]: ZeRO stage 1 across the data axis, where each data rank holds the fp32 master
//! and optimizer state of one partition of the stage's parameters only, or [`Zero2`], which
//! also keeps only its partition of the gradients, reduce-scattered after every backward.

use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsAccumulator, GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use burn_zero::comm::{CommError, Communicator, ReduceOp};
use burn_zero::config::{OptimizerKind, OptimizerParams};
use burn_zero::optim::{FlatOptimizer, StepParams};
use burn_zero::partition::PartitionPlan;

/// A stage's optimizer, in the executor's instructions.
pub trait StageOptimizer<B: AutodiffBackend, M: AutodiffModule<B>> {
    /// After each backward (or each half of a split one): one micro-batch's gradients join
    /// the step's. The default keeps them whole in `whole`, which `ReduceGrads` hands to
    /// [`StageOptimizer::reduce`]; `tied` is the stage's tied matrix, whose gradient must
    /// stay whole (the executor sums it across the pipeline's ends at `ReduceGrads`).
    fn accumulate(
        &mut self,
        module: &M,
        grads: GradientsParams,
        tied: Option<ParamId>,
        whole: &mut GradientsAccumulator<M>,
        data: Option<&dyn Communicator>,
    ) -> Result<(), CommError> {
        let _ = (tied, data);
        whole.accumulate(module, grads);
        Ok(())
    }

    /// `ReduceGrads`: the step's accumulated gradients reduced over `data` (when given).
    fn reduce(
        &mut self,
        module: &M,
        grads: GradientsParams,
        data: Option<&dyn Communicator>,
    ) -> Result<GradientsParams, CommError>;

    /// `OptimizerStep`: `module` updated at learning rate `lr` from the reduced gradients.
    fn step(
        &mut self,
        lr: f64,
        module: M,
        grads: GradientsParams,
        data: Option<&dyn Communicator>,
    ) -> Result<M, CommError>;
}

/// A boxed stage optimizer (chunks of one rank may step differently).
impl<B, M, O> StageOptimizer<B, M> for Box<O>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: StageOptimizer<B, M> + ?Sized,
{
    fn accumulate(
        &mut self,
        module: &M,
        grads: GradientsParams,
        tied: Option<ParamId>,
        whole: &mut GradientsAccumulator<M>,
        data: Option<&dyn Communicator>,
    ) -> Result<(), CommError> {
        (**self).accumulate(module, grads, tied, whole, data)
    }

    fn reduce(
        &mut self,
        module: &M,
        grads: GradientsParams,
        data: Option<&dyn Communicator>,
    ) -> Result<GradientsParams, CommError> {
        (**self).reduce(module, grads, data)
    }

    fn step(
        &mut self,
        lr: f64,
        module: M,
        grads: GradientsParams,
        data: Option<&dyn Communicator>,
    ) -> Result<M, CommError> {
        (**self).step(lr, module, grads, data)
    }
}

/// A burn optimizer on every data rank: gradients averaged over the data axis (one flat
/// all-reduce), then the optimizer's own step.
#[derive(Clone, Debug)]
pub struct Replicated<O>(pub O);

impl<B, M, O> StageOptimizer<B, M> for Replicated<O>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
{
    fn reduce(
        &mut self,
        module: &M,
        grads: GradientsParams,
        data: Option<&dyn Communicator>,
    ) -> Result<GradientsParams, CommError> {
        match data {
            Some(data) if data.world_size() > 1 => average_grads(module, grads, data),
            _ => Ok(grads),
        }
    }

    fn step(
        &mut self,
        lr: f64,
        module: M,
        grads: GradientsParams,
        _: Option<&dyn Communicator>,
    ) -> Result<M, CommError> {
        Ok(self.0.step(lr, module, grads))
    }
}

/// Each parameter's gradient averaged over `data`, one collective per parameter in visiting
/// order (in device memory on NCCL, [`burn_zero::collective`]); a parameter without a
/// gradient takes part with zeros, so every rank makes the same calls, and stays without one.
fn average_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: GradientsParams,
    data: &dyn Communicator,
) -> Result<GradientsParams, CommError> {
    struct Average<'a> {
        grads: GradientsParams,
        data: &'a dyn Communicator,
        failed: Option<CommError>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Average<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if self.failed.is_some() {
                return;
            }
            let (grad, had) = match self.grads.remove::<B::InnerBackend, D>(param.id) {
                Some(g) => (g, true),
                None => (param.val().inner().zeros_like(), false),
            };
            match burn_zero::collective::all_reduce(self.data, grad, ReduceOp::Avg) {
                Ok(g) if had => self.grads.register(param.id, g),
                Ok(_) => {}
                Err(e) => self.failed = Some(e),
            }
        }
    }
    let mut average = Average {
        grads,
        data,
        failed: None,
    };
    module.visit(&mut average);
    match average.failed {
        Some(e) => Err(e),
        None => Ok(average.grads),
    }
}

/// Every float parameter of `module` (visiting order) with its gradient in `grads`, laid end
/// to end in f32, then `pad` zeros; a parameter without a gradient contributes zeros.
fn flatten_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &GradientsParams,
    pad: usize,
) -> Vec<f32> {
    struct Collect<'a> {
        grads: &'a GradientsParams,
        flat: Vec<f32>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let n = param.shape().num_elements();
            match self.grads.get::<B::InnerBackend, D>(param.id) {
                Some(g) => self
                    .flat
                    .extend(g.into_data().convert::<f32>().iter::<f32>()),
                None => self.flat.extend(std::iter::repeat_n(0.0, n)),
            }
        }
    }
    let mut collect = Collect {
        grads,
        flat: Vec::new(),
    };
    module.visit(&mut collect);
    collect.flat.extend(std::iter::repeat_n(0.0, pad));
    collect.flat
}

/// `module` with every float parameter replaced by its piece of `flat`, in visiting order
/// (new leaves, same ids and `require_grad`): what [`flatten_params`] wrote.
pub fn unflatten_params<B: Backend, M: Module<B>>(module: M, flat: &[f32]) -> M {
    struct Write<'a> {
        flat: &'a [f32],
        offset: usize,
    }
    impl<B: Backend> ModuleMapper<B> for Write<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            let shape = tensor.shape();
            let n = shape.num_elements();
            let values = self.flat[self.offset..self.offset + n].to_vec();
            self.offset += n;
            let t = Tensor::<B, D>::from_data(TensorData::new(values, shape), &tensor.device())
                .set_require_grad(tensor.is_require_grad());
            Param::from_mapped_value(id, t, mapper)
        }
    }
    module.map(&mut Write { flat, offset: 0 })
}

/// Every float parameter of `module` laid end to end in f32, in visiting order, then `pad`
/// zeros.
pub fn flatten_params<B: Backend, M: Module<B>>(module: &M, pad: usize) -> Vec<f32> {
    struct Collect(Vec<f32>);
    impl<B: Backend> ModuleVisitor<B> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0
                .extend(param.val().into_data().convert::<f32>().iter::<f32>());
        }
    }
    let mut collect = Collect(Vec::new());
    module.visit(&mut collect);
    collect.0.extend(std::iter::repeat_n(0.0, pad));
    collect.0
}

/// ZeRO stage 1 across the data axis: the stage's parameters are flattened and partitioned
/// over the data ranks; each keeps the fp32 master and the optimizer state of its partition
/// only. `ReduceGrads` reduce-scatters the gradients (each rank receives its partition's
/// average), `OptimizerStep` steps the partition and all-gathers the new parameters.
pub struct Zero1 {
    kind: OptimizerKind,
    params: OptimizerParams,
    /// Made at the first step, when the stage's size and the data axis are known.
    state: Option<Zero1State>,
    /// This rank's partition of the step's reduced gradient.
    grad: Vec<f32>,
}

struct Zero1State {
    plan: PartitionPlan,
    master: Vec<f32>,
    opt: FlatOptimizer,
}

impl Zero1 {
    /// An optimizer of `kind` with `params` (`lr` and `betas` per step come from the
    /// executor's learning rate and `params.betas`).
    pub fn new(kind: OptimizerKind, params: OptimizerParams) -> Self {
        Self {
            kind,
            params,
            state: None,
            grad: Vec::new(),
        }
    }

    /// Bytes of master and optimizer state this rank holds.
    pub fn state_bytes(&self) -> usize {
        self.state
            .as_ref()
            .map_or(0, |s| 4 * s.master.len() + s.opt.state_bytes())
    }

    fn state<B: AutodiffBackend, M: AutodiffModule<B>>(
        &mut self,
        module: &M,
        data: Option<&dyn Communicator>,
    ) -> &mut Zero1State {
        let (rank, world) = data.map_or((0, 1), |d| (d.rank(), d.world_size()));
        self.state.get_or_insert_with(|| {
            let numel = module.num_params();
            let plan = PartitionPlan::new(numel, world);
            let full = flatten_params(module, plan.padding());
            let mine = rank * plan.chunk()..(rank + 1) * plan.chunk();
            Zero1State {
                master: full[mine].to_vec(),
                opt: FlatOptimizer::new(self.kind, &self.params, plan.chunk()),
                plan,
            }
        })
    }
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> StageOptimizer<B, M> for Zero1 {
    fn reduce(
        &mut self,
        module: &M,
        grads: GradientsParams,
        data: Option<&dyn Communicator>,
    ) -> Result<GradientsParams, CommError> {
        let state = self.state(module, data);
        let (padding, chunk) = (state.plan.padding(), state.plan.chunk());
        let flat = flatten_grads(module, &grads, padding);
        self.grad = vec![0.0; chunk];
        match data {
            Some(data) => data.reduce_scatter(
                flat.as_slice().into(),
                self.grad.as_mut_slice().into(),
                ReduceOp::Avg,
            )?,
            None => self.grad.copy_from_slice(&flat),
        }
        Ok(grads)
    }

    fn step(
        &mut self,
        lr: f64,
        module: M,
        _: GradientsParams,
        data: Option<&dyn Communicator>,
    ) -> Result<M, CommError> {
        let betas = (self.params.betas[0], self.params.betas[1]);
        let grad = std::mem::take(&mut self.grad);
        let state = self.state(&module, data);
        state
            .opt
            .step(&mut state.master, &grad, StepParams { lr, betas });
        let mut full = vec![0.0f32; state.plan.padded_numel()];
        match data {
            Some(data) => {
                data.all_gather(state.master.as_slice().into(), full.as_mut_slice().into())?
            }
            None => full.copy_from_slice(&state.master),
        }
        full.truncate(state.plan.numel());
        Ok(unflatten_params(module, &full))
    }
}

/// ZeRO stage 2 across the data axis: [`Zero1`]'s partitioned master and optimizer state, and
/// the gradients partitioned too. Each micro-batch's gradients are reduce-scattered (summed)
/// into this rank's partition as soon as its backward ends, so no data rank holds a whole
/// accumulated gradient across the step (DeepSpeed's pipeline engine allows ZeRO-1 only).
/// The cost is one reduce-scatter per backward instead of one per step. A tied matrix's
/// gradient is kept whole until `ReduceGrads`, where it joins the partition after the
/// executor summed it across the pipeline's ends.
pub struct Zero2 {
    inner: Zero1,
    /// The step's summed gradient, this rank's partition (empty before the first backward).
    sum: Vec<f32>,
}

impl Zero2 {
    /// An optimizer of `kind` with `params` (as [`Zero1::new`]).
    pub fn new(kind: OptimizerKind, params: OptimizerParams) -> Self {
        Self {
            inner: Zero1::new(kind, params),
            sum: Vec::new(),
        }
    }

    /// Bytes of master, optimizer state and gradient partition this rank holds.
    pub fn state_bytes(&self) -> usize {
        self.inner.state_bytes() + 4 * self.sum.len()
    }

    /// `grads`, flattened over `module`, reduce-scattered (summed) into the partition.
    fn scatter_in<B: AutodiffBackend, M: AutodiffModule<B>>(
        &mut self,
        module: &M,
        grads: &GradientsParams,
        data: Option<&dyn Communicator>,
    ) -> Result<(), CommError> {
        let state = self.inner.state(module, data);
        let (padding, chunk) = (state.plan.padding(), state.plan.chunk());
        let flat = flatten_grads(module, grads, padding);
        let mut mine = vec![0.0f32; chunk];
        match data {
            Some(data) => data.reduce_scatter(
                flat.as_slice().into(),
                mine.as_mut_slice().into(),
                ReduceOp::Sum,
            )?,
            None => mine.copy_from_slice(&flat),
        }
        if self.sum.is_empty() {
            self.sum = mine;
        } else {
            self.sum.iter_mut().zip(&mine).for_each(|(s, g)| *s += g);
        }
        Ok(())
    }
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> StageOptimizer<B, M> for Zero2 {
    fn accumulate(
        &mut self,
        module: &M,
        mut grads: GradientsParams,
        tied: Option<ParamId>,
        whole: &mut GradientsAccumulator<M>,
        data: Option<&dyn Communicator>,
    ) -> Result<(), CommError> {
        if let Some(id) = tied {
            let mut kept = GradientsParams::new();
            if let Some(g) = grads.remove::<B::InnerBackend, 2>(id) {
                kept.register(id, g);
            }
            whole.accumulate(module, kept);
        }
        self.scatter_in(module, &grads, data)
    }

    /// What stayed whole (a tied matrix's gradient, or everything from a caller that did not
    /// go through [`StageOptimizer::accumulate`]) joins the partition; the sum becomes the
    /// data ranks' mean.
    fn reduce(
        &mut self,
        module: &M,
        grads: GradientsParams,
        data: Option<&dyn Communicator>,
    ) -> Result<GradientsParams, CommError> {
        if !grads.is_empty() || self.sum.is_empty() {
            self.scatter_in(module, &grads, data)?;
        }
        let world = data.map_or(1, |d| d.world_size()) as f32;
        self.inner.grad = std::mem::take(&mut self.sum)
            .into_iter()
            .map(|g| g / world)
            .collect();
        Ok(GradientsParams::new())
    }

    fn step(
        &mut self,
        lr: f64,
        module: M,
        grads: GradientsParams,
        data: Option<&dyn Communicator>,
    ) -> Result<M, CommError> {
        StageOptimizer::<B, M>::step(&mut self.inner, lr, module, grads, data)
    }
}
