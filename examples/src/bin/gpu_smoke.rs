//! GPU smoke: a forward/backward through `Autodiff<ZeroBackend<Cuda>>` on the device, checked
//! against the same computation through plain `Autodiff<ZeroBackend<NdArray>>` on the CPU, with
//! the gradient hook counting final gradients.

use std::sync::{Arc, Mutex};

use burn::backend::{Autodiff, Cuda, NdArray};
use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_backend::distributed::DistributedParamId;
use burn_zero::ZeroBackend;
use burn_zero::ZeroTensor;
use burn_zero::backend::hooks::{self, GradientHook};
use burn_zero_examples::{Mlp, batch};

struct Count(Arc<Mutex<usize>>);
impl<B: Backend> GradientHook<B> for Count {
    fn on_gradient_final(&mut self, _param: DistributedParamId, _grad: &mut ZeroTensor<B>) {
        *self.0.lock().unwrap() += 1;
    }
}

/// Loss and first-layer gradient of one step; parameters come from `weights` for equal inputs.
fn step<I: Backend>(
    weights: Vec<TensorData>,
    device: &I::Device,
) -> (f32, Vec<f32>, usize, String) {
    type A<I> = Autodiff<ZeroBackend<I>>;
    let model = load::<A<I>>(Mlp::new(64, device), weights, device);
    let model = hooks::mark_distributed(model);
    let count = Arc::new(Mutex::new(0));
    let _guard = hooks::install::<I>(Box::new(Count(count.clone())));
    let (x, y) = batch::<A<I>>(0, 0..512, device);
    let loss = (model.forward(x) - y).powf_scalar(2.0).mean();
    let grads = loss.backward();
    let first = model
        .first_weight()
        .grad(&grads)
        .expect("gradient of the first weight");
    let n = *count.lock().unwrap();
    (
        loss.into_data().convert::<f32>().to_vec::<f32>().unwrap()[0],
        first.into_data().convert::<f32>().to_vec::<f32>().unwrap(),
        n,
        A::<I>::name(device),
    )
}

fn load<B: Backend>(model: Mlp<B>, weights: Vec<TensorData>, device: &B::Device) -> Mlp<B> {
    struct Load<'a, B: Backend>(std::vec::IntoIter<TensorData>, &'a B::Device);
    impl<B: Backend> burn::module::ModuleMapper<B> for Load<'_, B> {
        fn map_float<const D: usize>(
            &mut self,
            p: burn::module::Param<Tensor<B, D>>,
        ) -> burn::module::Param<Tensor<B, D>> {
            let (id, old, mapper) = p.consume();
            let t = Tensor::from_data(self.0.next().expect("a weight"), self.1)
                .set_require_grad(old.is_require_grad());
            burn::module::Param::from_mapped_value(id, t, mapper)
        }
    }
    model.map(&mut Load::<B>(weights.into_iter(), device))
}

fn main() {
    let cpu = Default::default();
    let weights: Vec<TensorData> = {
        struct Collect(Vec<TensorData>);
        impl<B: Backend> burn::module::ModuleVisitor<B> for Collect {
            fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<B, D>>) {
                self.0.push(p.val().into_data());
            }
        }
        let mut c = Collect(Vec::new());
        Mlp::<NdArray>::new(64, &cpu).visit(&mut c);
        c.0
    };
    let (cpu_loss, cpu_grad, cpu_hooks, cpu_name) = step::<NdArray>(weights.clone(), &cpu);
    let gpu = burn::backend::cuda::CudaDevice::default();
    let (gpu_loss, gpu_grad, gpu_hooks, gpu_name) = step::<Cuda>(weights, &gpu);
    let rel = |a: f32, b: f32| (a - b).abs() / b.abs().max(1e-6);
    let grad_err = gpu_grad
        .iter()
        .zip(&cpu_grad)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let grad_scale = cpu_grad.iter().map(|v| v.abs()).fold(0.0f32, f32::max);
    println!("cpu  {cpu_name}: loss {cpu_loss:.6}, hook calls {cpu_hooks}");
    println!("gpu  {gpu_name}: loss {gpu_loss:.6}, hook calls {gpu_hooks}");
    println!(
        "loss rel err {:.2e}, first-layer grad max abs err {grad_err:.2e} (max |grad| {grad_scale:.2e})",
        rel(gpu_loss, cpu_loss)
    );
    // TF32 matmuls on the GPU: ~1e-3 relative is expected (see shared/GPU.md).
    let ok = rel(gpu_loss, cpu_loss) < 1e-2
        && grad_err <= 1e-2 * grad_scale
        && gpu_hooks == 6
        && cpu_hooks == 6;
    println!("GPU smoke {}", if ok { "OK" } else { "FAILED" });
    if !ok {
        std::process::exit(1);
    }
}
