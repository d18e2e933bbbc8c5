//! The flat layout of a module's parameters, and moving them between the module and one flat
//! tensor of the inner backend (the engine's buffers).

use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::{Shape, Tensor, TensorPrimitive};

use super::ZeroAutodiff;
use crate::{ZeroBackend, ZeroTensor};

/// Where one parameter lives in the flat buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSlot {
    /// burn's id of the parameter.
    pub id: ParamId,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Offset of its first element.
    pub offset: usize,
    /// Its path in the module, dotted (`blocks.3.attn.q_proj.weight`).
    pub name: String,
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
    /// The layout of `module`'s trainable float parameters (`require_grad`, on an autodiff
    /// backend): the ones the engine reduces, partitions and optimizes.
    pub fn of<B: Backend, M: Module<B>>(module: &M) -> Self {
        Self::select(module, true)
    }

    /// The layout of `module`'s frozen float parameters (no `require_grad`, e.g. a LoRA base).
    pub fn of_frozen<B: Backend, M: Module<B>>(module: &M) -> Self {
        Self::select(module, false)
    }

    fn select<B: Backend, M: Module<B>>(module: &M, trainable: bool) -> Self {
        struct Collect {
            found: Vec<(ParamId, Vec<usize>, String)>,
            trainable: bool,
            path: Vec<String>,
        }
        impl<B: Backend> ModuleVisitor<B> for Collect {
            fn enter_module(&mut self, name: &str, _container_type: &str) {
                self.path.push(name.to_string());
            }
            fn exit_module(&mut self, _name: &str, _container_type: &str) {
                self.path.pop();
            }
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let value = param.val();
                if value.is_require_grad() == self.trainable {
                    let name = self.path.join(".");
                    self.found.push((param.id, value.dims().to_vec(), name));
                }
            }
        }
        let mut collect = Collect {
            found: Vec::new(),
            trainable,
            path: Vec::new(),
        };
        module.visit(&mut collect);
        let mut offset = 0;
        let slots: Vec<ParamSlot> = collect
            .found
            .into_iter()
            .map(|(id, shape, name)| {
                let slot = ParamSlot {
                    id,
                    shape,
                    offset,
                    name,
                };
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

    /// The index in [`FlatLayout::slots`] of parameter `id`.
    pub fn index(&self, id: u64) -> Option<usize> {
        self.by_id.get(&id).copied()
    }
}

/// The float parameters of `module` laid end to end in one flat tensor of the inner backend.
pub fn flatten_params<I: Backend, M: Module<ZeroAutodiff<I>>>(
    module: &M,
    layout: &FlatLayout,
) -> Tensor<I, 1> {
    struct Collect<'a, I: Backend> {
        layout: &'a FlatLayout,
        parts: Vec<Option<Tensor<I, 1>>>,
    }
    impl<I: Backend> ModuleVisitor<ZeroAutodiff<I>> for Collect<'_, I> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<ZeroAutodiff<I>, D>>) {
            let Some(index) = self.layout.index(param.id.val()) else {
                return;
            };
            let n = self.layout.slots()[index].numel();
            let zero = param.val().inner().into_primitive().tensor();
            let flat = Tensor::<I, 1>::from_primitive(TensorPrimitive::Float(zero.into_inner()));
            self.parts[index] = Some(flat.reshape([n]));
        }
    }
    let mut collect = Collect {
        layout,
        parts: vec![None; layout.slots().len()],
    };
    module.visit(&mut collect);
    let parts: Vec<Tensor<I, 1>> = collect
        .parts
        .into_iter()
        .map(|p| p.expect("every parameter of the layout is in the module"))
        .collect();
    if parts.is_empty() {
        return Tensor::zeros([0], &Default::default());
    }
    Tensor::cat(parts, 0)
}

/// The parameters of `module` in `layout`, copied to host memory as f32 one at a time, so the
/// device never holds a second copy of the model (ZeRO-Offload's largest models fit only so).
pub(crate) fn params_to_host<I: Backend, M: Module<ZeroAutodiff<I>>>(
    module: &M,
    layout: &FlatLayout,
) -> Vec<f32> {
    struct Copy<'a> {
        layout: &'a FlatLayout,
        values: Vec<f32>,
    }
    impl<I: Backend> ModuleVisitor<ZeroAutodiff<I>> for Copy<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<ZeroAutodiff<I>, D>>) {
            let Some(slot) = self.layout.slot(param.id.val()) else {
                return;
            };
            let zero = param.val().inner().into_primitive().tensor();
            let t = Tensor::<I, D>::from_primitive(TensorPrimitive::Float(zero.into_inner()));
            let data = t.cast(burn::tensor::FloatDType::F32).into_data();
            let values = data.as_slice::<f32>().expect("f32 after the cast");
            self.values[slot.offset..slot.offset + slot.numel()].copy_from_slice(values);
        }
    }
    let mut copy = Copy {
        layout,
        values: vec![0.0; layout.numel()],
    };
    module.visit(&mut copy);
    copy.values
}

/// Rebuilds every parameter of `module` from `flat` (at least `layout.numel()` elements), as
/// new leaves that keep their `require_grad` flag (what burn's own optimizer step does), in
/// the flat tensor's dtype (the engine's working copy: bf16 under mixed precision).
pub fn unflatten_params<I: Backend, M: Module<ZeroAutodiff<I>>>(
    module: M,
    layout: &FlatLayout,
    flat: Tensor<I, 1>,
) -> M {
    rebuild_params(module, layout, |p| {
        let slot = &layout.slots()[p];
        let values = flat.clone().slice(slot.offset..slot.offset + slot.numel());
        ZeroTensor::local(I::float_reshape(
            values.into_primitive().tensor(),
            Shape::from(slot.shape.clone()),
        ))
    })
}

/// Rebuilds every trainable parameter of `module` from `make(slot)`, as new leaves that keep
/// their `require_grad` flag.
pub(crate) fn rebuild_params<I: Backend, M: Module<ZeroAutodiff<I>>>(
    module: M,
    layout: &FlatLayout,
    make: impl FnMut(usize) -> ZeroTensor<I>,
) -> M {
    rebuild_params_as(module, layout, make, |_, was| was)
}

/// [`rebuild_params`] with each new leaf's `require_grad` flag from `grad(slot, the old
/// leaf's flag)`. A leaf that needs no gradient is registered nowhere in burn's autodiff graph.
pub(crate) fn rebuild_params_as<I: Backend, M: Module<ZeroAutodiff<I>>>(
    module: M,
    layout: &FlatLayout,
    make: impl FnMut(usize) -> ZeroTensor<I>,
    grad: impl FnMut(usize, bool) -> bool,
) -> M {
    struct Rebuild<'a, F, G> {
        layout: &'a FlatLayout,
        make: F,
        grad: G,
    }
    impl<I: Backend, F: FnMut(usize) -> ZeroTensor<I>, G: FnMut(usize, bool) -> bool>
        ModuleMapper<ZeroAutodiff<I>> for Rebuild<'_, F, G>
    {
        fn map_float<const D: usize>(
            &mut self,
            param: Param<Tensor<ZeroAutodiff<I>, D>>,
        ) -> Param<Tensor<ZeroAutodiff<I>, D>> {
            let (id, tensor, mapper) = param.consume();
            let Some(slot) = self.layout.index(id.val()) else {
                return Param::from_mapped_value(id, tensor, mapper);
            };
            let made = (self.make)(slot);
            let inner = Tensor::<ZeroBackend<I>, D>::from_primitive(TensorPrimitive::Float(made));
            let rebuilt = Tensor::from_inner(inner);
            let rebuilt = match (self.grad)(slot, tensor.is_require_grad()) {
                true => rebuilt.require_grad(),
                false => rebuilt,
            };
            Param::from_mapped_value(id, rebuilt, mapper)
        }
    }
    module.map(&mut Rebuild { layout, make, grad })
}
