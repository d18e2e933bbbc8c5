//! ZeRO-3's parameters: sharded handles ([`ShardedParam`]) holding this rank's chunk of each
//! parameter ([`ShardPlan`]), and their gathers: a parameter is all-gathered when an op reads
//! it, replaying the recorded order to prefetch ([`GatherTracer`]); after the optimizer step
//! the new partitions are the new handles, with no all-gather.
//!
//! Parameters smaller than `param_persistence_threshold` stay replicated (full, local): they
//! are partitioned in the optimizer like the others and all-gathered after each step.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape, Tensor, TensorPrimitive};
use burn_offload::{OutDtype, SwapConfig, SwapError};

use crate::ZeroTensor;
use crate::backend::{PartitionSource, ShardedParam};
use crate::comm::{CommError, with_label};
use crate::engine::collective::{FlatComm, Ticket};
use crate::engine::construct::chunk_of;
use crate::engine::flat_pieces::slice_pieces;
use crate::engine::offload_io::{DirectOuts, tensor_of};
use crate::engine::params::FlatLayout;
use crate::engine::precision::Format;
use crate::engine::stage::{GatherEvent, GatherStats};
use crate::engine::{EngineError, ZeroAutodiff};
use crate::partition::ShardPlan;
use crate::trace::{GatherTracer, TraceConfig};

use super::param_host::{HostParams, HostPartition};
use super::param_swap::ParamSwap;

/// How much of the new partitions goes down to host memory at a time
/// (`offload_param {"device": "cpu"}`): their copies in the compute format are device memory.
const HOST_BATCH_BYTES: usize = 256 << 20;

/// Waits until nothing reads the parameters' host buffer: every upload from it went on NCCL's
/// stream before a collective whose fence burn's stream waits for, so once burn's stream is
/// done, they are.
fn settle_uploads<I: Backend>(flat: &mut FlatComm<I>) -> Result<(), EngineError> {
    flat.wait()?;
    I::sync(flat.device())
        .map_err(|e| EngineError::Usage(format!("the compute stream failed: {e:?}")))
}

/// This rank's partition of one sharded parameter.
enum Partition<I: Backend> {
    /// On the device.
    Device(Tensor<I, 1>),
    /// In host memory (`offload_param {"device": "cpu"}`), page-locked on CUDA.
    Host(Arc<HostPartition>, I::Device, DType),
    /// In a swap file (`offload_param {"device": "nvme"}`), read and uploaded at each gather.
    Off(Arc<dyn PartitionSource>, I::Device, DType),
}

impl<I: Backend> Partition<I> {
    fn on_device(&self) -> Tensor<I, 1> {
        let (source, device, dtype): (&dyn PartitionSource, _, _) = match self {
            Partition::Device(t) => return t.clone(),
            Partition::Host(source, device, dtype) => (&**source, device, dtype),
            Partition::Off(source, device, dtype) => (&**source, device, dtype),
        };
        let data = source
            .fetch()
            .unwrap_or_else(|e| panic!("an offloaded parameter partition could not be read: {e}"));
        Tensor::from_data(data, (device, *dtype))
    }

    /// The page-locked bytes of a partition in host memory ([`HostPartition::pinned`]).
    #[cfg(feature = "cuda")]
    fn pinned(&self) -> Option<&[u8]> {
        match self {
            Partition::Host(source, ..) => source.pinned(),
            _ => None,
        }
    }
}

/// Where the sharded parameters' partitions live between gathers (`offload_param`).
pub(crate) enum ParamPlace {
    /// On the device.
    Device,
    /// In host memory.
    Host,
    /// In a swap file under this configuration (ZeRO-Infinity).
    Nvme(SwapConfig),
}

/// A gathered parameter held for a later use.
enum Gathered<I: Backend> {
    /// A prefetch whose collective may still be writing: the output of the batch's grouped
    /// all-gather, untouched (any op on it, even a slice, could run on the compute stream
    /// before NCCL is done), this parameter's range in it, and the collective's ticket (what
    /// to wait for before reading it).
    InFlight(Tensor<I, 1>, Range<usize>, Option<Ticket>),
    /// Complete, in the parameter's shape.
    Ready(I::FloatTensorPrimitive),
}

/// The sharded parameters of one rank and their gathers.
pub(crate) struct ShardedParams<I: Backend> {
    plan: ShardPlan,
    names: Vec<String>,
    shapes: Vec<Shape>,
    persistent: Vec<bool>,
    tracer: GatherTracer,
    /// Full gathered parameters kept or prefetched.
    live: HashMap<usize, Gathered<I>>,
    /// The current partitions of the sharded parameters (what prefetches gather), on the
    /// device or, with `offload_param`, in host memory.
    partitions: Vec<Option<Partition<I>>>,
    /// Where the partitions live (`offload_param`).
    place: ParamPlace,
    /// Whether the partitions are chunks of the fp32 master: parameters and optimizer both on
    /// the device (no second copy in the compute format).
    master_backed: bool,
    /// The compute format: what a gather narrows a (wider, fp32 master) partition to.
    format: Format,
    /// `offload_param {"device": "nvme"}`: the swap files of this rank's partitions.
    swap: Option<ParamSwap>,
    /// `offload_param {"device": "cpu"}`: the host buffer of this rank's partitions.
    host: HostParams,
    /// An offloaded step wrote the new parameters into `host` ([`ShardedParams::direct_outs`]).
    host_written: bool,
    /// Bumped at each parameter update.
    version: u64,
    events: Vec<GatherEvent>,
    stats: GatherStats,
}

impl<I: Backend> ShardedParams<I> {
    pub(crate) fn new(
        layout: &FlatLayout,
        world: usize,
        align: usize,
        persistence_threshold: usize,
        trace: TraceConfig,
        place: ParamPlace,
        optimizer_on_device: bool,
    ) -> Result<Self, SwapError> {
        let master_backed = optimizer_on_device && matches!(place, ParamPlace::Device);
        let numels: Vec<usize> = layout.slots().iter().map(|s| s.numel()).collect();
        let plan = ShardPlan::new(&numels, world, align);
        let persistent: Vec<bool> = numels.iter().map(|n| *n < persistence_threshold).collect();
        let swap = match &place {
            ParamPlace::Nvme(cfg) => {
                let len = (0..plan.params())
                    .filter(|p| !persistent[*p])
                    .map(|p| plan.chunk(p))
                    .sum::<usize>();
                Some(ParamSwap::create(cfg, len)?)
            }
            _ => None,
        };
        Ok(Self {
            plan,
            names: layout.slots().iter().map(|s| s.name.clone()).collect(),
            shapes: layout
                .slots()
                .iter()
                .map(|s| Shape::from(s.shape.clone()))
                .collect(),
            persistent,
            tracer: GatherTracer::new(trace),
            live: HashMap::new(),
            partitions: (0..numels.len()).map(|_| None).collect(),
            place,
            master_backed,
            format: Format::F32,
            swap,
            host: HostParams::default(),
            host_written: false,
            version: 0,
            events: Vec::new(),
            stats: GatherStats::default(),
        })
    }

    pub(crate) fn plan(&self) -> &ShardPlan {
        &self.plan
    }

    pub(crate) fn stats(&self) -> GatherStats {
        GatherStats {
            peak_live_numel: self.tracer.peak_live_numel(),
            invalidations: self.tracer.invalidations(),
            copied_out: self.host.copied_out(),
            ..self.stats.clone()
        }
    }

    /// Elements of the parameters held on the device, and in host memory: the sharded
    /// parameters' partitions (on the host with `offload_param {"device": "cpu"}`, in neither
    /// with `"nvme"`) and the persistent ones (full).
    pub(crate) fn param_numel(&self) -> (usize, usize) {
        let (mut device, mut host) = (0, 0);
        for p in 0..self.plan.params() {
            match (self.persistent[p], &self.place) {
                // The host buffer holds its chunk too, laid out as the optimizer's partition.
                (true, ParamPlace::Host) => {
                    device += self.plan.numel(p);
                    host += self.plan.chunk(p);
                }
                (true, _) => device += self.plan.numel(p),
                (false, ParamPlace::Device) => device += self.plan.chunk(p),
                (false, ParamPlace::Host) => host += self.plan.chunk(p),
                (false, ParamPlace::Nvme(_)) => {}
            }
        }
        (device, host)
    }

    /// Elements of the persistent parameters (full on every rank).
    pub(crate) fn persistent_numel(&self) -> usize {
        (0..self.plan.params())
            .filter(|p| self.persistent[*p])
            .map(|p| self.plan.numel(p))
            .sum()
    }

    /// This rank's partition built from the full flat parameters (the layout's order).
    pub(crate) fn partition_of(&self, full: &Tensor<I, 1>, rank: usize) -> Tensor<I, 1> {
        let mut parts = Vec::new();
        let mut start = 0;
        for p in 0..self.plan.params() {
            parts.push(chunk_of(&self.plan, p, rank, full, start));
            start += self.plan.numel(p);
        }
        if parts.is_empty() {
            return Tensor::zeros([0], &full.device());
        }
        Tensor::cat(parts, 0)
    }

    /// Whether the partitions are chunks of the fp32 master (optimizer and parameters on the
    /// device) rather than a copy in the compute format ([`ShardedParams::set_partitions`]).
    pub(crate) fn master_backed(&self) -> bool {
        self.master_backed
    }

    /// Takes `master` as the new parameters, computed in `format`: the sharded handles'
    /// partitions are its chunks; every full parameter gathered for the old values is dropped.
    /// On the device the chunks stay in `master`'s dtype (the fp32 master itself, when the
    /// optimizer is on the device: no second copy) and each gather narrows its chunk to
    /// `format`; off the device they are stored in `format`.
    pub(crate) fn set_partitions(
        &mut self,
        flat: &mut FlatComm<I>,
        master: &[Tensor<I, 1>],
        format: Format,
    ) -> Result<(), EngineError> {
        self.version += 1;
        self.format = format;
        self.tracer.drop_live();
        self.drop_live(flat)?;
        if matches!(self.place, ParamPlace::Host) {
            return self.set_host_partitions(flat, master);
        }
        let (device, dtype) = (master[0].device(), format.storage());
        // A swap file holds the sharded partitions end to end, widened to f32.
        let (mut swapped, mut slots, mut spans) = (Vec::new(), Vec::new(), Vec::new());
        for p in 0..self.plan.params() {
            self.partitions[p] = if self.persistent[p] {
                None
            } else {
                let chunk = slice_pieces(master, self.plan.span(p));
                match &self.place {
                    ParamPlace::Device => Some(Partition::Device(chunk)),
                    ParamPlace::Host => unreachable!("set_host_partitions"),
                    // Set below, once the swap file is written.
                    ParamPlace::Nvme(_) => {
                        let at = swapped.len();
                        let values = format.convert(chunk).into_data().convert::<f32>();
                        swapped.extend(values.iter::<f32>());
                        slots.push(p);
                        spans.push(at..swapped.len());
                        None
                    }
                }
            };
        }
        if let Some(swap) = &mut self.swap {
            let sources = swap.write(self.version, swapped, &spans, dtype)?;
            for (p, source) in slots.into_iter().zip(sources) {
                self.partitions[p] = Some(Partition::Off(source, device.clone(), dtype));
            }
        }
        Ok(())
    }

    /// [`ShardedParams::set_partitions`] into host memory: every parameter's chunk in the
    /// compute format, laid out as the optimizer's partition (the persistent ones' too, so a
    /// step may write the buffer directly: [`ShardedParams::direct_outs`]),
    /// [`HOST_BATCH_BYTES`] at a time (their converted copies are device memory); or, after such
    /// a step, what it wrote.
    fn set_host_partitions(
        &mut self,
        flat: &mut FlatComm<I>,
        master: &[Tensor<I, 1>],
    ) -> Result<(), EngineError> {
        let (device, format) = (flat.device().clone(), self.format);
        let dtype = format.storage();
        let failed =
            |e: String| EngineError::Usage(format!("parameters offloaded to the host: {e}"));
        // The source says which: an empty one follows a step that wrote the buffer (a flag
        // left by a step that failed before publishing must not keep a load's values out).
        let written = std::mem::take(&mut self.host_written);
        if master.is_empty() && !written {
            return Err(failed("no new parameters, and no step wrote them".into()));
        }
        if !master.is_empty() {
            let chunk = |p: usize| slice_pieces(master, self.plan.span(p));
            settle_uploads(flat)?;
            let probe = (self.plan.params() > 0).then(|| chunk(0));
            self.host
                .begin(self.plan.len(), dtype, probe.as_ref())
                .map_err(failed)?;
            let (mut batch, mut bytes) = (Vec::new(), 0);
            for p in 0..self.plan.params() {
                batch.push(format.convert(chunk(p)));
                bytes += self.plan.chunk(p) * dtype.size();
                if bytes >= HOST_BATCH_BYTES {
                    self.host
                        .write(std::mem::take(&mut batch), &device)
                        .map_err(failed)?;
                    bytes = 0;
                }
            }
            if !batch.is_empty() {
                self.host.write(batch, &device).map_err(failed)?;
            }
        }
        let sharded: Vec<usize> = (0..self.plan.params())
            .filter(|p| !self.persistent[*p])
            .collect();
        let ranges: Vec<Range<usize>> = sharded.iter().map(|&p| self.plan.span(p)).collect();
        self.partitions.iter_mut().for_each(|p| *p = None);
        for (&p, source) in sharded.iter().zip(self.host.partitions(&ranges)) {
            self.partitions[p] = Some(Partition::Host(source, device.clone(), dtype));
        }
        Ok(())
    }

    /// The host buffer of the parameters, lent to an offloaded step that writes the new ones
    /// into it in `out`'s dtype (ZeRO-Infinity: no weights go up and come back down), when
    /// they wait there in that dtype; the next [`ShardedParams::set_partitions`] takes what
    /// the step wrote. Called once the model holds placeholders
    /// ([`ShardedParams::release_partitions`]): every upload from the buffer is waited for and
    /// a partition still held elsewhere is copied out first.
    pub(crate) fn direct_outs(
        &mut self,
        flat: &mut FlatComm<I>,
        out: OutDtype,
    ) -> Result<Option<DirectOuts>, EngineError> {
        let dtype = self.format.storage();
        let same = matches!(
            (out, dtype),
            (OutDtype::F32, DType::F32)
                | (OutDtype::Bf16, DType::BF16)
                | (OutDtype::F16, DType::F16)
        );
        let len = self.plan.len();
        if !matches!(self.place, ParamPlace::Host) || !same || !self.host.fits(len, dtype) {
            return Ok(None);
        }
        settle_uploads(flat)?;
        self.host
            .begin::<I>(len, dtype, None)
            .map_err(|e| EngineError::Usage(format!("parameters offloaded to the host: {e}")))?;
        let ptr = self
            .host
            .raw(len, dtype)
            .expect("the buffer fits, checked above");
        self.host_written = true;
        // SAFETY: the buffer holds `len` elements of the dtype, aligned (page-locked memory, or
        // words); nothing reads it until `set_partitions` (the model holds placeholders, every
        // partition was dropped or copied out, every upload waited for).
        Ok(Some(unsafe { DirectOuts::new(ptr, len, out) }))
    }

    /// Whether the model must hold placeholders while the optimizer steps: the partitions are
    /// chunks of the master it updates in place, or the host buffer it rewrites.
    pub(crate) fn released_for_step(&self) -> bool {
        self.master_backed || matches!(self.place, ParamPlace::Host)
    }

    /// Lets go of every partition and gather, so that the fp32 master the partitions are
    /// chunks of has one reference left and the optimizer may update it in place (or, with
    /// `offload_param {"device": "cpu"}`, the host buffer may be rewritten without copying
    /// anything out). Until the
    /// next [`ShardedParams::set_partitions`] nothing can be gathered: the model must hold
    /// [`ShardedParams::placeholder`]s meanwhile.
    pub(crate) fn release_partitions(&mut self, flat: &mut FlatComm<I>) -> Result<(), CommError> {
        self.tracer.drop_live();
        self.drop_live(flat)?;
        self.partitions.iter_mut().for_each(|p| *p = None);
        self.host_written = false;
        Ok(())
    }

    /// A handle of parameter `p` holding only `stub` (one element): what the model holds while
    /// the partitions are released for the optimizer's step; never gathered.
    pub(crate) fn placeholder(&self, p: usize, stub: &Tensor<I, 1>) -> ZeroTensor<I> {
        ZeroTensor::sharded(Arc::new(ShardedParam {
            slot: p,
            version: u64::MAX,
            shape: self.shapes[p].clone(),
            dtype: self.format.storage(),
            partition: stub.clone().into_primitive().tensor(),
            offloaded: None,
        }))
    }

    /// Frees every held gather; one still in flight is waited for first, so that its memory
    /// is not reused while NCCL writes it.
    fn drop_live(&mut self, flat: &mut FlatComm<I>) -> Result<(), CommError> {
        if self
            .live
            .values()
            .any(|g| matches!(g, Gathered::InFlight(..)))
        {
            flat.wait()?;
        }
        self.live.clear();
        Ok(())
    }

    /// Frees the held gather of `p` (waiting first if it is in flight).
    fn forget(&mut self, flat: &mut FlatComm<I>, p: usize) -> Result<(), CommError> {
        if let Some(Gathered::InFlight(_, _, ticket)) = self.live.get(&p) {
            flat.wait_for(*ticket)?;
        }
        self.live.remove(&p);
        Ok(())
    }

    /// The full values of the persistent parameters, all-gathered from every rank's
    /// partition in one collective: from `master`, or, empty after a step that wrote the new
    /// parameters into the host buffer, from there.
    pub(crate) fn gather_persistent(
        &self,
        flat: &mut FlatComm<I>,
        master: &[Tensor<I, 1>],
    ) -> Result<HashMap<usize, Tensor<I, 1>>, CommError> {
        let slots: Vec<usize> = (0..self.plan.params())
            .filter(|p| self.persistent[*p])
            .collect();
        if slots.is_empty() {
            return Ok(HashMap::new());
        }
        let pieces: Vec<Tensor<I, 1>> = slots
            .iter()
            .map(|&p| {
                let range = self.plan.span(p);
                match master.is_empty() {
                    true => tensor_of(self.host.read(range), flat.device()),
                    false => slice_pieces(master, range),
                }
            })
            .collect();
        let mine = self.format.convert(Tensor::cat(pieces, 0));
        let len = mine.dims()[0];
        let world = self.plan.world_size();
        let gathered = flat.all_gather(mine)?;
        flat.wait()?;
        let table = gathered.clone().reshape([world, len]);
        let mut column = 0;
        let mut values = HashMap::new();
        for p in slots {
            let (c, n) = (self.plan.chunk(p), self.plan.numel(p));
            // Each parameter's columns of every rank's row: a copy, but for one rank, whose
            // row is a view (a `[1, c]` slice of a wider table is not contiguous to burn).
            let full = match world {
                1 => gathered.clone().slice(column..column + n),
                _ => table
                    .clone()
                    .slice([0..world, column..column + c])
                    .reshape([world * c])
                    .slice(0..n),
            };
            values.insert(p, full);
            column += c;
        }
        Ok(values)
    }

    /// The handle of parameter `p` for the current version: a sharded handle, or the full
    /// value of a persistent parameter from `full`.
    pub(crate) fn handle(&self, p: usize, full: Option<&Tensor<I, 1>>) -> ZeroTensor<I> {
        if self.persistent[p] {
            let full = full.expect("persistent parameters come with their full value");
            let flat = full.clone().into_primitive().tensor();
            return ZeroTensor::local(I::float_reshape(flat, self.shapes[p].clone()));
        }
        // One element of the dtype, on the device: for metadata queries only.
        let stub = |device, dtype: &DType| Tensor::<I, 1>::zeros([1], (device, *dtype));
        let (partition, offloaded) = match &self.partitions[p] {
            Some(Partition::Device(t)) => (t.clone().into_primitive().tensor(), None),
            Some(Partition::Host(source, device, dtype)) => {
                let source: Arc<dyn PartitionSource> = source.clone();
                (stub(device, dtype).into_primitive().tensor(), Some(source))
            }
            Some(Partition::Off(source, device, dtype)) => (
                stub(device, dtype).into_primitive().tensor(),
                Some(source.clone()),
            ),
            None => panic!("sharded parameters have a partition"),
        };
        ZeroTensor::sharded(Arc::new(ShardedParam {
            slot: p,
            version: self.version,
            shape: self.shapes[p].clone(),
            dtype: self.format.storage(),
            partition,
            offloaded,
        }))
    }

    /// Every rank's chunk of `p`, from `partition` (`None`: the current one, from page-locked
    /// host memory where it waits there), as the flat full parameter, and the collective's
    /// ticket: a gather on demand.
    fn all_gather(
        &mut self,
        flat: &mut FlatComm<I>,
        p: usize,
        partition: Option<Tensor<I, 1>>,
    ) -> Result<(Tensor<I, 1>, Option<Ticket>), CommError> {
        self.stats.gathers += 1;
        self.events.push(GatherEvent::Gather {
            slot: p,
            ahead: false,
        });
        match partition {
            Some(partition) => {
                let full = with_label(p as u64 + 1, || flat.all_gather(partition))?;
                Ok((full, flat.last_ticket()))
            }
            None => self.gather_batch(flat, &[p]),
        }
    }

    /// Gathers the parameters of `batch` ahead of use, as one grouped all-gather of their
    /// partitions (one collective and one output buffer for the batch: a layer's parameters
    /// go together, and the host visits cubecl a few times per batch, not per parameter).
    fn prefetch(&mut self, flat: &mut FlatComm<I>, batch: &[usize]) -> Result<(), CommError> {
        let (output, ticket) = self.gather_batch(flat, batch)?;
        self.stats.gathers += batch.len();
        self.stats.prefetched += batch.len();
        self.events.extend(
            batch
                .iter()
                .map(|&slot| GatherEvent::Gather { slot, ahead: true }),
        );
        let world = self.plan.world_size();
        let mut at = 0;
        for &p in batch {
            let chunk = self.plan.chunk(p);
            let range = at..at + self.plan.numel(p);
            self.live
                .insert(p, Gathered::InFlight(output.clone(), range, ticket));
            at += world * chunk;
        }
        Ok(())
    }

    /// The current partitions of `batch` all-gathered as one collective, and its ticket:
    /// uploaded on the communication stream from page-locked host memory where they wait
    /// there, else on burn's stream.
    fn gather_batch(
        &self,
        flat: &mut FlatComm<I>,
        batch: &[usize],
    ) -> Result<(Tensor<I, 1>, Option<Ticket>), CommError> {
        let partition = |p: usize| {
            self.partitions[p]
                .as_ref()
                .expect("the trace holds sharded parameters only")
        };
        let chunks: Vec<usize> = batch.iter().map(|&p| self.plan.chunk(p)).collect();
        let first = batch.first().map_or(0, |p| *p as u64 + 1);
        #[cfg(feature = "cuda")]
        if let Some(host) = batch
            .iter()
            .map(|&p| partition(p).pinned())
            .collect::<Option<Vec<&[u8]>>>()
        {
            let dtype = self.format.storage();
            // SAFETY: `HostPartition::pinned`'s bytes are not written before
            // `set_host_partitions`, which first waits for every collective's fence.
            let output = with_label(first, || unsafe {
                flat.all_gather_group_from_host(&host, &chunks, dtype)
            })?;
            if let Some(output) = output {
                return Ok((output, flat.last_ticket()));
            }
        }
        let parts: Vec<Tensor<I, 1>> = batch
            .iter()
            .map(|&p| self.format.convert(partition(p).on_device()))
            .collect();
        let input = match parts.len() {
            1 => parts.into_iter().next().expect("one part"),
            _ => Tensor::cat(parts, 0),
        };
        let output = with_label(first, || flat.all_gather_group(input, &chunks))?;
        Ok((output, flat.last_ticket()))
    }

    fn shaped(&self, p: usize, flat_full: Tensor<I, 1>) -> I::FloatTensorPrimitive {
        let flat = flat_full
            .slice(0..self.plan.numel(p))
            .into_primitive()
            .tensor();
        I::float_reshape(flat, self.shapes[p].clone())
    }

    /// The full tensor of `param` for an op: live already, or gathered now; prefetches what
    /// the trace says comes next, and frees what the trace says is done.
    pub(crate) fn gather(
        &mut self,
        flat: &mut FlatComm<I>,
        param: &ShardedParam<I>,
    ) -> Result<I::FloatTensorPrimitive, CommError> {
        let p = param.slot;
        let format = self.format;
        let own = || {
            let partition = param.partition_on_device();
            format.convert(Tensor::<I, 1>::from_primitive(TensorPrimitive::Float(
                partition,
            )))
        };
        if param.version != self.version || p >= self.plan.params() {
            // A handle kept from an older step: its own values, outside the trace.
            let (full, ticket) = self.all_gather(flat, p, Some(own()))?;
            flat.wait_for(ticket)?;
            return Ok(self.shaped(p, full));
        }
        let answer = self.tracer.on_use(p as u64, self.plan.numel(p));
        for id in &answer.evict {
            self.forget(flat, *id as usize)?;
        }
        self.events.push(GatherEvent::Use {
            slot: p,
            ready: answer.prefetched,
        });
        // Burn's stream waits for this parameter's gather only: the prefetches issued after it
        // (and the reduce-scatters of backward) go on while it computes.
        let full = match self.live.remove(&p) {
            Some(Gathered::Ready(full)) if answer.prefetched => full,
            Some(Gathered::InFlight(batch, range, ticket)) if answer.prefetched => {
                flat.wait_for(ticket)?;
                self.shaped(p, batch.slice(range))
            }
            stale => {
                if let Some(Gathered::InFlight(_, _, ticket)) = stale {
                    // Its memory may be reused only once NCCL is done writing it.
                    flat.wait_for(ticket)?;
                }
                // The current partition, from page-locked host memory where it waits there
                // (the handle's own after an error left the partitions released).
                let partition = self.partitions[p].is_none().then(own);
                let (gathered, ticket) = self.all_gather(flat, p, partition)?;
                flat.wait_for(ticket)?;
                self.shaped(p, gathered)
            }
        };
        self.live.insert(p, Gathered::Ready(full.clone()));
        if !answer.prefetch.is_empty() {
            let batch: Vec<usize> = answer.prefetch.iter().map(|id| *id as usize).collect();
            self.prefetch(flat, &batch)?;
        }
        if self.tracer.release(p as u64) {
            self.live.remove(&p);
        }
        Ok(full)
    }

    /// A forward and backward pass ended: the next uses start a new pass of the trace.
    pub(crate) fn end_pass(&mut self) {
        self.stats.last_pass = std::mem::take(&mut self.events);
        self.tracer.begin_step();
    }

    /// A gather failure explained with the parameters' names: which parameter each rank
    /// gathered when they disagree (labels carry the parameter index).
    pub(crate) fn explain(&self, p: usize, error: &CommError) -> String {
        let name = |label: u64| match label.checked_sub(1).map(|i| i as usize) {
            Some(i) if i < self.names.len() => format!("`{}`", self.names[i]),
            _ => "no parameter (a collective outside the gathers)".to_string(),
        };
        match error {
            CommError::Mismatch {
                seq,
                rank_a,
                call_a,
                rank_b,
                call_b,
            } => format!(
                "ZeRO-3 ranks diverged at collective #{seq}: rank {rank_a} gathered {} but rank \
                 {rank_b} gathered {} (every rank must run the same ops on the same parameters \
                 in the same order)",
                name(call_a.label),
                name(call_b.label)
            ),
            other => format!(
                "gathering ZeRO-3 parameter `{}` failed: {other}",
                self.names.get(p).map(String::as_str).unwrap_or("?")
            ),
        }
    }
}

/// The sharded handles of `module`'s trainable parameters, by slot, when it was built sharded
/// ([`crate::engine::construct_sharded`]); `None` when any trainable parameter is full.
pub(crate) fn sharded_handles<I: Backend, M: Module<ZeroAutodiff<I>>>(
    module: &M,
    layout: &FlatLayout,
) -> Vec<Option<Arc<ShardedParam<I>>>> {
    struct Collect<'a, I: Backend> {
        layout: &'a FlatLayout,
        found: Vec<Option<Arc<ShardedParam<I>>>>,
    }
    impl<I: Backend> ModuleVisitor<ZeroAutodiff<I>> for Collect<'_, I> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<ZeroAutodiff<I>, D>>) {
            if let Some(slot) = self.layout.index(param.id.val()) {
                let zero = param.val().inner().into_primitive().tensor();
                self.found[slot] = zero.as_sharded().cloned();
            }
        }
    }
    let mut collect = Collect {
        layout,
        found: vec![None; layout.slots().len()],
    };
    module.visit(&mut collect);
    collect.found
}
