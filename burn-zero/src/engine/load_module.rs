//! Loading trained parameters into a plain burn module, without an engine or a communicator:
//! from a consolidated safetensors file (`burn-zero consolidate`) or straight from a
//! checkpoint directory (its partitions assembled on the fly). Parameters are matched by
//! module path; shapes must agree.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Shape, Tensor, TensorData};

use super::EngineError;
use crate::checkpoint::safetensors::Reader;
use crate::checkpoint::{MANIFEST, MASTER, PartitionFiles, StoreError, open_verified, resolve};

/// `module` with every float parameter found in `path` replaced by the stored values (in the
/// parameter's dtype, on its device, keeping its `require_grad`). `path` is a safetensors
/// file, a checkpoint directory, or a checkpoint root (its `latest`). Parameters of the
/// module absent from the source (a frozen LoRA base) keep their values and are returned by
/// name; a stored tensor with no parameter, or of another shape, is an error naming it.
pub fn load_params<B: Backend, M: Module<B>>(
    module: M,
    path: &Path,
) -> Result<(M, Vec<String>), EngineError> {
    if path.is_dir() {
        let dir = if path.join(MANIFEST).exists() {
            path.to_path_buf()
        } else {
            resolve(path, None)?
        };
        let manifest = open_verified(&dir)?;
        let shapes = manifest
            .params
            .iter()
            .map(|p| (p.name.clone(), p.shape.clone()))
            .collect();
        let index: HashMap<&str, usize> = manifest
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| (p.name.as_str(), i))
            .collect();
        let mut files = PartitionFiles::new(&dir, &manifest);
        load_named(module, path, shapes, |name| {
            files.read_param(MASTER, index[name])
        })
    } else {
        let reader = Reader::open(path)?;
        let shapes = reader
            .tensors()
            .iter()
            .map(|(n, t)| (n.clone(), t.shape.clone()))
            .collect();
        load_named(module, path, shapes, |name| reader.read_all(name))
    }
}

fn load_named<B: Backend, M: Module<B>>(
    module: M,
    source: &Path,
    shapes: HashMap<String, Vec<usize>>,
    read: impl FnMut(&str) -> Result<Vec<f32>, StoreError>,
) -> Result<(M, Vec<String>), EngineError> {
    struct Load<'a, F> {
        path: Vec<String>,
        shapes: &'a HashMap<String, Vec<usize>>,
        read: F,
        loaded: HashSet<String>,
        missing: Vec<String>,
        error: Option<EngineError>,
        source: &'a Path,
    }
    impl<B: Backend, F: FnMut(&str) -> Result<Vec<f32>, StoreError>> ModuleMapper<B> for Load<'_, F> {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            let name = self.path.join(".");
            let keep = |t| Param::from_mapped_value(id, t, mapper);
            if self.error.is_some() {
                return keep(tensor);
            }
            let Some(shape) = self.shapes.get(&name) else {
                self.missing.push(name);
                return keep(tensor);
            };
            if shape.as_slice() != tensor.dims().as_slice() {
                self.error = Some(EngineError::Usage(format!(
                    "{}: parameter `{name}` has shape {shape:?} there but {:?} in the model",
                    self.source.display(),
                    tensor.dims()
                )));
                return keep(tensor);
            }
            match (self.read)(&name) {
                Ok(values) => {
                    self.loaded.insert(name);
                    let data = TensorData::new(values, Shape::from(shape.clone()));
                    let loaded =
                        Tensor::<B, D>::from_data(data, (&tensor.device(), tensor.dtype()))
                            .set_require_grad(tensor.is_require_grad());
                    keep(loaded)
                }
                Err(e) => {
                    self.error = Some(e.into());
                    keep(tensor)
                }
            }
        }
    }
    let mut load = Load {
        path: Vec::new(),
        shapes: &shapes,
        read,
        loaded: HashSet::new(),
        missing: Vec::new(),
        error: None,
        source,
    };
    let module = module.map(&mut load);
    if let Some(e) = load.error {
        return Err(e);
    }
    let mut unused: Vec<&String> = shapes
        .keys()
        .filter(|n| !load.loaded.contains(*n))
        .collect();
    unused.sort();
    if let Some(name) = unused.first() {
        return Err(EngineError::Usage(format!(
            "{}: `{name}` is not a float parameter of the model ({} stored tensors unused)",
            source.display(),
            unused.len()
        )));
    }
    Ok((module, load.missing))
}
