//! `submit_gradient_sync` reaches the installed hook exactly once per trainable parameter per
//! backward, when that parameter's gradient is final, and the hook may replace the gradient.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use burn::backend::{Autodiff, NdArray};
use burn::module::{AutodiffModule, Module};
use burn::tensor::{Tensor, backend::Backend};
use burn_backend::distributed::DistributedParamId;
use burn_zero::backend::hooks::{self, GradientHook};
use burn_zero::{ZeroBackend, ZeroTensor};
use burn_zero_tests::cases::{self, Mlp};

type Inner = NdArray;
type B = Autodiff<ZeroBackend<Inner>>;

#[derive(Default)]
struct Log {
    starts: Vec<usize>,
    finals: Vec<(DistributedParamId, Vec<usize>)>,
    ends: usize,
}

struct Recorder {
    log: Arc<Mutex<Log>>,
    scale: Option<f32>,
}

impl GradientHook<Inner> for Recorder {
    fn on_backward_start(&mut self, params: &[DistributedParamId]) {
        self.log.lock().unwrap().starts.push(params.len());
    }

    fn on_gradient_final(&mut self, param: DistributedParamId, grad: &mut ZeroTensor<Inner>) {
        use burn_backend::TensorMetadata;
        self.log
            .lock()
            .unwrap()
            .finals
            .push((param, grad.shape().to_vec()));
        if let Some(scale) = self.scale {
            let scaled = <Inner as burn_backend::ops::FloatTensorOps<Inner>>::float_mul_scalar(
                grad.inner().clone(),
                scale.into(),
            );
            *grad.inner_mut() = scaled;
        }
    }

    fn on_backward_end(&mut self) {
        self.log.lock().unwrap().ends += 1;
    }
}

fn loss(model: &Mlp<B>, step: usize) -> Tensor<B, 1> {
    let (x, y) = cases::batch::<B>(step, 0..cases::BATCH, &Default::default());
    (model.forward(x) - y).powf_scalar(2.0).mean()
}

#[test]
fn hook_sees_each_parameter_once_per_backward() {
    let device = Default::default();
    let mut model = Mlp::<B>::new(&device);
    let log = Arc::new(Mutex::new(Log::default()));
    let _guard = hooks::install::<Inner>(Box::new(Recorder {
        log: log.clone(),
        scale: None,
    }));
    let n_params = model.num_params();
    assert_eq!(n_params, 7 * 15 + 15 + 15 * 9 + 9 + 9 * 3 + 3);

    // Gradient accumulation: three backwards on the same parameters, re-marked before each.
    for step in 0..3 {
        model = hooks::mark_distributed(model);
        loss(&model, step).backward();
    }
    let log = log.lock().unwrap();
    assert_eq!(
        log.starts,
        vec![6, 6, 6],
        "six parameter tensors announced per backward"
    );
    assert_eq!(log.ends, 3);
    assert_eq!(log.finals.len(), 18);
    for pass in log.finals.chunks(6) {
        let mut seen: HashMap<DistributedParamId, usize> = HashMap::new();
        for (id, _) in pass {
            *seen.entry(*id).or_default() += 1;
        }
        assert_eq!(seen.len(), 6, "every parameter once: {pass:?}");
        let elems: usize = pass.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
        assert_eq!(
            elems, n_params,
            "the gradients cover every parameter element"
        );
    }
}

#[test]
fn a_parameter_used_twice_is_reported_once_with_its_summed_gradient() {
    let device = Default::default();
    let w = Tensor::<B, 2>::from_data([[1.0, 2.0], [3.0, 4.0]], &device)
        .require_grad()
        .set_distributed(DistributedParamId::from(7));
    let log = Arc::new(Mutex::new(Log::default()));
    let _guard = hooks::install::<Inner>(Box::new(Recorder {
        log: log.clone(),
        scale: None,
    }));
    let y = (w.clone() * 3.0).sum() + (w.clone() * w.clone()).sum();
    let grads = y.backward();
    let log = log.lock().unwrap();
    assert_eq!(log.finals.len(), 1, "one final gradient for one parameter");
    assert_eq!(log.finals[0].0, DistributedParamId::from(7));
    let grad = w.grad(&grads).unwrap().into_data().to_vec::<f32>().unwrap();
    assert_eq!(grad, vec![5.0, 7.0, 9.0, 11.0], "3 + 2w");
}

#[test]
fn the_hook_may_replace_the_gradient() {
    let device = Default::default();
    let model = hooks::mark_distributed(Mlp::<B>::new(&device));
    let plain = {
        let grads = loss(&model, 0).backward();
        model.l1_weight().grad(&grads).unwrap()
    };
    let model = hooks::mark_distributed(model);
    let log = Arc::new(Mutex::new(Log::default()));
    let _guard = hooks::install::<Inner>(Box::new(Recorder {
        log,
        scale: Some(2.0),
    }));
    let grads = loss(&model, 0).backward();
    let doubled = model.l1_weight().grad(&grads).unwrap();
    assert_eq!(
        doubled.into_data().to_vec::<f32>().unwrap(),
        (plain * 2.0).into_data().to_vec::<f32>().unwrap()
    );
}

#[test]
fn without_a_hook_backward_is_unchanged() {
    assert!(!hooks::is_installed::<Inner>());
    let device = Default::default();
    let model = hooks::mark_distributed(Mlp::<B>::new(&device));
    let grads = loss(&model, 0).backward();
    assert!(model.l1_weight().grad(&grads).is_some());
    let _ = <B as Backend>::name(&device);
    let _ = model.valid();
}

#[test]
fn optimizer_steps_keep_parameters_marked() {
    use burn::optim::{GradientsParams, Optimizer, SgdConfig};
    let device = Default::default();
    let mut model = hooks::mark_distributed(Mlp::<B>::new(&device));
    let mut optim = SgdConfig::new().init::<B, Mlp<B>>();
    let log = Arc::new(Mutex::new(Log::default()));
    let _guard = hooks::install::<Inner>(Box::new(Recorder {
        log: log.clone(),
        scale: None,
    }));
    for step in 0..4 {
        let grads = GradientsParams::from_grads(loss(&model, step).backward(), &model);
        model = optim.step(0.1, model, grads);
    }
    let log = log.lock().unwrap();
    assert_eq!(
        log.starts,
        vec![6; 4],
        "marked once, reported on every step"
    );
    assert_eq!(log.finals.len(), 24);
}

#[test]
fn marks_are_consumed_by_backward() {
    // burn 0.21 behaviour that `mark_distributed`'s documentation relies on: without an
    // optimizer step or a new mark, a second backward reports nothing.
    let device = Default::default();
    let model = hooks::mark_distributed(Mlp::<B>::new(&device));
    let log = Arc::new(Mutex::new(Log::default()));
    let _guard = hooks::install::<Inner>(Box::new(Recorder {
        log: log.clone(),
        scale: None,
    }));
    loss(&model, 0).backward();
    loss(&model, 1).backward();
    let log = log.lock().unwrap();
    assert_eq!((log.starts.len(), log.finals.len()), (1, 6));
}
