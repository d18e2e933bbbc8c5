//! The flat layout of a module's parameters, and moving them between the module and flat
//! host buffers (the engine's partitions).

use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};

/// Where one parameter lives in the flat buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSlot {
    /// burn's id of the parameter.
    pub id: ParamId,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Offset of its first element.
    pub offset: usize,
}

impl ParamSlot {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Every float parameter of a module, in visiting order, laid end to end.
#[derive(Clone, Debug, PartialEq)]
pub struct FlatLayout {
    slots: Vec<ParamSlot>,
    by_id: HashMap<u64, usize>,
    numel: usize,
}

impl FlatLayout {
    /// The layout of `module`'s float parameters.
    pub fn of<B: Backend, M: Module<B>>(module: &M) -> Self {
        struct Collect(Vec<(ParamId, Vec<usize>)>);
        impl<B: Backend> ModuleVisitor<B> for Collect {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                self.0.push((param.id, param.val().dims().to_vec()));
            }
        }
        let mut collect = Collect(Vec::new());
        module.visit(&mut collect);
        let mut offset = 0;
        let slots: Vec<ParamSlot> = collect
            .0
            .into_iter()
            .map(|(id, shape)| {
                let slot = ParamSlot { id, shape, offset };
                offset += slot.numel();
                slot
            })
            .collect();
        let by_id = slots
            .iter()
            .enumerate()
            .map(|(i, s)| (s.id.val(), i))
            .collect();
        Self {
            slots,
            by_id,
            numel: offset,
        }
    }

    /// Total elements.
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// The slots in order.
    pub fn slots(&self) -> &[ParamSlot] {
        &self.slots
    }

    /// The slot of parameter `id` (burn's `ParamId::val`).
    pub fn slot(&self, id: u64) -> Option<&ParamSlot> {
        self.by_id.get(&id).map(|i| &self.slots[*i])
    }
}

/// Copies the elements `start..start + out.len()` of the flattened parameters into `out`
/// (elements past the end stay as they are: the padding).
pub fn read_params<B: Backend, M: Module<B>>(
    module: &M,
    layout: &FlatLayout,
    start: usize,
    out: &mut [f32],
) {
    struct Read<'a> {
        layout: &'a FlatLayout,
        start: usize,
        out: &'a mut [f32],
    }
    impl<B: Backend> ModuleVisitor<B> for Read<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let Some(slot) = self.layout.slot(param.id.val()) else {
                return;
            };
            let end = self.start + self.out.len();
            let (lo, hi) = (
                slot.offset.max(self.start),
                (slot.offset + slot.numel()).min(end),
            );
            if lo >= hi {
                return;
            }
            let values = host_values(param.val());
            self.out[lo - self.start..hi - self.start]
                .copy_from_slice(&values[lo - slot.offset..hi - slot.offset]);
        }
    }
    module.visit(&mut Read { layout, start, out });
}

/// Rebuilds every parameter of `module` from the full flat buffer `flat`, as new leaves that
/// keep their `require_grad` flag (what burn's own optimizer step does).
pub fn write_params<B: AutodiffBackend, M: Module<B>>(
    module: M,
    layout: &FlatLayout,
    flat: &[f32],
) -> M {
    struct Write<'a> {
        layout: &'a FlatLayout,
        flat: &'a [f32],
    }
    impl<B: AutodiffBackend> ModuleMapper<B> for Write<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            let Some(slot) = self.layout.slot(id.val()) else {
                return Param::from_mapped_value(id, tensor, mapper);
            };
            let values = self.flat[slot.offset..slot.offset + slot.numel()].to_vec();
            let require_grad = tensor.is_require_grad();
            let device = tensor.device();
            let data = TensorData::new(values, slot.shape.clone()).convert_dtype(tensor.dtype());
            let rebuilt = Tensor::<B, D>::from_data(data, &device).set_require_grad(require_grad);
            Param::from_mapped_value(id, rebuilt, mapper)
        }
    }
    module.map(&mut Write { layout, flat })
}

/// The values of a tensor as f32 on the host.
pub fn host_values<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Vec<f32> {
    tensor
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 data")
}
