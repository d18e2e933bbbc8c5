//! burn's `DistributedBackend` for `ZeroBackend`: autodiff's gradient events go to the hook.

use burn_backend::{
    Backend, DeviceId,
    distributed::{
        CollectiveTensor, DistributedBackend, DistributedParams, ReduceOperation, TensorRef,
        get_distributed_sync_client,
    },
    tensor::{Device, FloatTensor},
};

use super::{ZeroBackend, hooks};

impl<B: Backend> DistributedBackend for ZeroBackend<B> {
    fn register_sync_parameters(device: &Device<Self>, distributed_params: Vec<DistributedParams>) {
        let ids: Vec<_> = distributed_params.iter().map(|p| p.param_id).collect();
        if hooks::with_hook::<B, _>(|hook| hook.on_backward_start(&ids)).is_none()
            && let Some(client) = get_distributed_sync_client::<Self>()
        {
            let _ = device;
            client.register_sync_parameters(distributed_params);
        }
    }

    fn submit_gradient_sync(tensor: TensorRef<Self>, distributed_params: DistributedParams) {
        let handled = hooks::with_hook::<B, _>(|hook| {
            // SAFETY: autodiff hands us the only reference to this gradient for the duration
            // of the call (burn's contract for `TensorRef`, which allows in-place replacement).
            let grad = unsafe { &mut *tensor.0 };
            hook.on_gradient_final(distributed_params.param_id, grad);
        });
        if handled.is_none()
            && let Some(client) = get_distributed_sync_client::<Self>()
        {
            client.submit_gradient_sync(tensor, distributed_params);
        }
    }

    fn submit_sync_collective(device: &Device<Self>) {
        if hooks::with_hook::<B, _>(|hook| hook.on_backward_end()).is_none()
            && let Some(client) = get_distributed_sync_client::<Self>()
        {
            client.submit_sync_collective(device.clone());
        }
    }

    fn sync_collective(_device: &Device<Self>) {
        // Hooks complete their collectives before `on_backward_end` returns: nothing pends.
    }

    fn all_reduce(
        _tensor: FloatTensor<Self>,
        _op: ReduceOperation,
        _device_ids: Vec<DeviceId>,
    ) -> CollectiveTensor<Self> {
        panic!(
            "ZeroBackend does not take part in burn's own collective server; \
             reduce through a burn_zero::comm::Communicator instead"
        )
    }
}
