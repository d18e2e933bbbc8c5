//! The CUDA side of `ZeroBackend::float_matmul`: eligible products run through cuBLASLt on
//! burn's device buffers.
//!
//! Host cost is the whole game for the GEMMs of a small model (a 2048×576×1536 bf16 GEMM takes
//! ~15 µs on an H200), and every blocking call into burn's fusion or cubecl threads costs a
//! cross-thread round trip. Behind fusion a product is an operation of fusion's stream
//! (`fused_op.rs`): the caller only registers it, and fusion's thread, running it in stream
//! order, makes one visit to cubecl's thread for the rest (output allocation, addresses, the
//! cuBLASLt call on burn's stream, or between `raise` and `await_done` under
//! `order: handshake`), where cubecl runs each request at once instead of queueing it. Plain
//! cubecl tensors make that visit from the caller.

use core::any::Any;

use burn_backend::ops::FloatTensorOps;
use burn_backend::{Backend, TensorMetadata, tensor::FloatTensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cubecl::device::Device;
use cubecl::device_handle::DeviceHandle;
use cubecl::stream_id::StreamId;

use super::matmul::{MatmulPolicy, PROFILE};
use crate::backend::cublaslt::{self, Gemm, Operand};

use crate::backend::cuda::{
    CudaServer, CudaView, cube_tensor, from_cube, layout_of, view_of, view_on,
};
use crate::backend::fused_op::{Fused, run_fused, run_fused_taking, writable};
use crate::backend::stream_order::{self, Handshake};
use crate::config::GemmOrder;

/// A matrix `rows × cols` with strides `(rs, cs)` as the column-major operand that yields
/// its transpose (`cols × rows`) in cuBLASLt, or `None` if neither dim is unit-stride.
fn transposed_operand(view: &CudaView, rows: usize, cols: usize) -> Option<(i64, bool)> {
    let r = view.shape.len();
    let (rs, cs) = (view.strides[r - 2], view.strides[r - 1]);
    if cs == 1 || cols == 1 {
        // Row-major: stored column-major as its transpose, leading dimension = row stride.
        let ld = if rows == 1 { cols } else { rs };
        (ld >= cols.max(1)).then_some((ld as i64, false))
    } else if rs == 1 || rows == 1 {
        let ld = if cols == 1 { rows } else { cs };
        (ld >= rows.max(1)).then_some((ld as i64, true))
    } else {
        None
    }
}

/// The stride between consecutive matrices of `view` over the output's batch dims `out`,
/// if its batch dims are all 1 (stride 0) or equal to `out` and flatten to one stride.
fn batch_stride(view: &CudaView, out: &[usize]) -> Option<i64> {
    let dims = &view.shape[..view.shape.len() - 2];
    let strides = &view.strides[..dims.len()];
    if dims.iter().all(|d| *d == 1) {
        return Some(0);
    }
    if dims != out {
        return None;
    }
    let kept: Vec<(usize, usize)> = dims
        .iter()
        .zip(strides)
        .filter(|(d, _)| **d > 1)
        .map(|(d, s)| (*d, *s))
        .collect();
    let inner = kept.last()?.1;
    kept.windows(2)
        .all(|w| w[0].1 == w[1].1 * w[1].0)
        .then_some(inner as i64)
}

/// The sizes of `lhs · rhs` (row-major `[.., m, k] · [.., k, n]`), from metadata only.
#[derive(Clone, Debug)]
struct Product {
    m: usize,
    k: usize,
    n: usize,
    /// The output's batch dims (broadcast).
    batch_dims: Vec<usize>,
}

impl Product {
    /// The cheap checks: equal dtypes and ranks, matching inner dims, broadcastable batch dims,
    /// at least `policy.min_macs` multiply-adds.
    fn of<B: Backend>(
        lhs: &FloatTensor<B>,
        rhs: &FloatTensor<B>,
        policy: MatmulPolicy,
    ) -> Option<Self> {
        let (ls, rs) = (lhs.shape(), rhs.shape());
        let rank = ls.num_dims();
        if rank < 2 || rs.num_dims() != rank || lhs.dtype() != rhs.dtype() {
            return None;
        }
        let (m, k, n) = (ls[rank - 2], ls[rank - 1], rs[rank - 1]);
        if rs[rank - 2] != k || m == 0 || n == 0 || k == 0 {
            return None;
        }
        let mut batch_dims = Vec::with_capacity(rank - 2);
        for i in 0..rank - 2 {
            match (ls[i], rs[i]) {
                (a, b) if a == b => batch_dims.push(a),
                (1, b) => batch_dims.push(b),
                (a, 1) => batch_dims.push(a),
                _ => return None,
            }
        }
        let batch: usize = batch_dims.iter().product();
        // burn-cuda multiplies f32 in TF32 (10-bit mantissa): where TF32 is not allowed, every
        // f32 product comes here, however small (bench/README, "Numerics on GPUs").
        let full_f32 = lhs.dtype() == burn_backend::DType::F32 && !policy.allow_tf32;
        let enough = full_f32 || (batch * m * n * k) as u64 >= policy.min_macs;
        (enough && batch <= i32::MAX as usize).then_some(Self {
            m,
            k,
            n,
            batch_dims,
        })
    }

    /// The GEMM on the operands' memory, or `None` for layouts cuBLASLt cannot take.
    fn gemm(
        &self,
        a: &CudaView,
        b: &CudaView,
        d: &CudaView,
        policy: &MatmulPolicy,
    ) -> Option<Gemm> {
        let Self { m, k, n, .. } = *self;
        let batch: usize = self.batch_dims.iter().product();
        // C = A·B row-major is Cᵀ = Bᵀ·Aᵀ column-major: cuBLASLt's A is our rhs.
        let (b_ld, b_trans) = transposed_operand(b, k, n)?;
        let (a_ld, a_trans) = transposed_operand(a, m, k)?;
        let a_stride = batch_stride(a, &self.batch_dims)?;
        let b_stride = batch_stride(b, &self.batch_dims)?;
        // cubecl pitches the rows of 2-D+ allocations: the output's real strides count.
        let (d_ld, d_trans) = transposed_operand(d, m, n)?;
        let d_batch_stride = batch_stride(d, &self.batch_dims)?;
        if d_trans {
            return None;
        }
        // A row-major lhs whose matrices follow each other times a shared rhs (a Linear's
        // `[batch, tokens, in]·[in, out]`) is one GEMM of batch·m rows, not a batched one.
        let fold = batch > 1
            && b_stride == 0
            && !a_trans
            && a_stride == m as i64 * a_ld
            && d_batch_stride == m as i64 * d_ld;
        let (rows, batch) = if fold { (batch * m, 1) } else { (m, batch) };
        Some(Gemm {
            m: n as u64,
            n: rows as u64,
            k: k as u64,
            batch: batch as i32,
            a: Operand {
                ptr: b.ptr,
                ld: b_ld,
                trans: b_trans,
                batch_stride: b_stride,
            },
            b: Operand {
                ptr: a.ptr,
                ld: a_ld,
                trans: a_trans,
                batch_stride: a_stride,
            },
            d: d.ptr,
            d_ld,
            d_batch_stride: if batch > 1 { d_batch_stride } else { 0 },
            dtype: a.dtype,
            tf32: policy.allow_tf32,
            // Only a GEMM beside burn's spinning block leaves SMs free.
            sm_margin: match policy.order {
                GemmOrder::Stream => 0,
                GemmOrder::Handshake => policy.sm_margin,
            },
            tune: policy.tune,
            profile: policy.profile,
            accumulate: false,
        })
    }
}

/// `lhs · rhs` through cuBLASLt, or `None` when it cannot take them (the caller then uses the
/// inner backend's matmul). Tensors behind burn's fusion get an operation in fusion's stream
/// and the caller does not wait; plain cubecl tensors run here.
pub(crate) fn try_cublaslt<B: Backend>(
    lhs: &FloatTensor<B>,
    rhs: &FloatTensor<B>,
    policy: MatmulPolicy,
) -> Option<FloatTensor<B>> {
    if !policy.cublaslt {
        return None;
    }
    let product = Product::of::<B>(lhs, rhs, policy)?;
    if let Some(out) = register_in_stream::<B>(lhs, rhs, &product, policy) {
        return Some(out);
    }
    let mut clock = PhaseClock::start();
    let (a, b) = (cube_tensor::<B>(lhs)?, cube_tensor::<B>(rhs)?);
    clock.lap(0);
    match gemm_on_cube(a, b, &product, policy, &mut clock, None) {
        Ok(out) => {
            let out = from_cube::<B>(lhs, out)?;
            clock.finish();
            Some(out)
        }
        Err(declined) => {
            declined.warn();
            None
        }
    }
}

/// Why a product did not run through cuBLASLt.
enum Declined {
    /// A layout it cannot take (no unit stride, batch dims that do not flatten): quietly.
    Layout,
    /// cuBLASLt or the stream ordering failed: said once per call.
    Failed(String),
}

impl Declined {
    fn warn(&self) {
        if let Self::Failed(e) = self {
            crate::log::warn(&format!(
                "cuBLASLt failed, using the inner backend's matmul: {e}"
            ));
        }
    }
}

/// cuBLASLt's `a · b` (added into `into` when given, a contiguous tensor of the output's
/// shape, and returned as the output): queued on cubecl's thread ([`gemm_queued`]) on burn's
/// stream, or between handshake flags when those are available, else one blocking visit there
/// after a device sync ([`gemm_synchronized`]).
fn gemm_on_cube(
    a: CubeTensor<CudaRuntime>,
    b: CubeTensor<CudaRuntime>,
    product: &Product,
    policy: MatmulPolicy,
    clock: &mut PhaseClock,
    into: Option<CubeTensor<CudaRuntime>>,
) -> Result<CubeTensor<CudaRuntime>, Declined> {
    let ordinal = a.device.index;
    match policy.order {
        GemmOrder::Stream => gemm_queued(a, b, product, policy, clock, into),
        GemmOrder::Handshake => match cublaslt::supports_handshake(ordinal).unwrap_or(false) {
            true => gemm_queued(a, b, product, policy, clock, into),
            false => gemm_synchronized(a, b, product, policy, clock, into),
        },
    }
}

/// The contiguous output of `product` on `a`'s device, allocated through cubecl's client (no
/// wait: the reservation is queued on cubecl's thread like a kernel).
fn output_of(a: &CubeTensor<CudaRuntime>, product: &Product) -> CubeTensor<CudaRuntime> {
    let mut shape = product.batch_dims.clone();
    shape.extend([product.m, product.n]);
    let bytes = shape.iter().product::<usize>() * a.dtype.size();
    let client = a.client.clone();
    let handle = client.empty(bytes);
    CubeTensor::new_contiguous(client, a.device.clone(), shape.into(), handle, a.dtype)
}

/// cuBLASLt's `a · b` without waiting for cubecl's thread. Here: the layout is checked, the
/// cuBLASLt plan made, the output allocated, and a task queued on cubecl's thread in burn's
/// stream order that takes the addresses from cubecl's server and issues the GEMM
/// ([`run_queued`]): on burn's stream itself (`order: stream`), or on our stream between
/// `raise` and `await_done`, two more items on burn's stream (`order: handshake`). None of
/// them waits for the GPU; the GEMM is issued before anything on burn's stream spins for it.
///
/// Waiting for cubecl's thread stalls the caller behind every launch queued there (and behind
/// the GPU whenever cubecl waits for it to recycle upload buffers); one step of a 1B model
/// makes 339 products.
fn gemm_queued(
    a: CubeTensor<CudaRuntime>,
    b: CubeTensor<CudaRuntime>,
    product: &Product,
    policy: MatmulPolicy,
    clock: &mut PhaseClock,
    into: Option<CubeTensor<CudaRuntime>>,
) -> Result<CubeTensor<CudaRuntime>, Declined> {
    if let Some(e) = queued_failure().as_ref() {
        panic!(
            "an earlier cuBLASLt product queued on cubecl's thread failed, so a tensor was not \
             computed: {e} (`\"burn_zero\": {{\"matmul\": {{\"cublaslt\": false}}}}` runs \
             burn's own kernel)"
        );
    }
    let ordinal = a.device.index;
    let (Some(la), Some(lb)) = (layout_of(&a), layout_of(&b)) else {
        return Err(Declined::Layout);
    };
    let accumulate = into.is_some();
    let out = into.unwrap_or_else(|| output_of(&a, product));
    let ld = layout_of(&out).ok_or(Declined::Layout)?;
    let shape = product
        .gemm(&la, &lb, &ld, &policy)
        .ok_or(Declined::Layout)?;
    cublaslt::prepare(ordinal, &shape).map_err(Declined::Failed)?;
    clock.lap(1);
    let client = a.client.clone();
    let handshake = match policy.order {
        GemmOrder::Stream => None,
        GemmOrder::Handshake => Some(
            stream_order::begin(&client, ordinal, stream_order::GEMM_CHANNEL)
                .ok_or_else(|| Declined::Failed("the ordering flags".into()))?,
        ),
    };
    clock.lap(2);
    let (product, result) = (product.clone(), out.clone());
    DeviceHandle::<CudaServer>::new(a.device.to_id()).submit(move |server| {
        let run = run_queued(
            server,
            [a, b, result],
            &product,
            policy,
            handshake,
            accumulate,
        );
        if let Err(e) = run {
            crate::log::warn(&format!("a queued cuBLASLt product failed: {e}"));
            queued_failure().get_or_insert(e);
        }
    });
    if let Some(handshake) = handshake {
        stream_order::end(&client, ordinal, handshake);
    }
    clock.lap(3);
    Ok(out)
}

/// The first failure of a queued product: the next product panics with it (the failed one's
/// output was never written, and its caller has long returned).
fn queued_failure() -> std::sync::MutexGuard<'static, Option<String>> {
    static FAILURE: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);
    FAILURE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The queued task of [`gemm_queued`], on cubecl's thread holding its `server` (so cubecl is
/// reached through the server, never the client): the operands' and output's addresses, then
/// the GEMM on burn's stream (no handshake), or on our stream between `ready` and `done`, or,
/// failing, `done` alone.
fn run_queued(
    server: &mut CudaServer,
    [a, b, out]: [CubeTensor<CudaRuntime>; 3],
    product: &Product,
    policy: MatmulPolicy,
    handshake: Option<Handshake>,
    accumulate: bool,
) -> Result<(), String> {
    let ordinal = a.device.index;
    let views = (
        view_on(server, &a),
        view_on(server, &b),
        view_on(server, &out),
    );
    let gemm = match views {
        (Some(va), Some(vb), Some(vd)) => product
            .gemm(&va, &vb, &vd, &policy)
            .map(|g| Gemm { accumulate, ..g }),
        _ => None,
    };
    let Some(gemm) = gemm else {
        if let Some(handshake) = handshake {
            // SAFETY: no call was issued; `done` belongs to the handshake's live flags.
            unsafe { cublaslt::release(ordinal, handshake) }?;
        }
        return Err("no address for an operand, or its layout changed".into());
    };
    match handshake {
        None => {
            // The stream of the thread that queued this task (cubecl runs a task under its
            // submitter's stream id): the one its operands were written on.
            let on = server
                .cuda_stream(StreamId::current())
                .map_err(|e| format!("burn's stream: {e:?}"))?;
            // SAFETY: this is cubecl's thread, after the launches that wrote the operands and
            // before any later one: a kernel that reads the output, or one that reuses the
            // operands' memory once the views drop, runs after the GEMM on the same stream.
            // (An operand written on another cubecl stream is guarded by the event cubecl
            // records when `view_on`'s command ends, before the GEMM: a reuse of its memory on
            // that stream is not ordered after the GEMM. The handshake order shares the gap;
            // closing it needs the resources and the launch in one cubecl command.)
            unsafe { cublaslt::run(ordinal, &gemm, cublaslt::Order::OnStream(on as _)) }
        }
        // SAFETY: the views hold their memory until this task ends, by when `await_done` is
        // the next item of burn's stream; the operands are complete once `ready` is raised
        // (their kernels were launched before this task ran); the output has the extents
        // described.
        Some(handshake) => unsafe { cublaslt::run_or_release(ordinal, &gemm, handshake) },
    }
}

/// cuBLASLt's `a · b` where the stream ordering's flag kernels are not available: after a
/// device sync, on cubecl's thread (one blocking visit: output allocation, addresses, the GEMM
/// to completion). Runs where cubecl's stream for the current
/// [`StreamId`](cubecl::stream_id::StreamId) is the operands' (the caller's thread, or fusion's
/// thread running an operation of that stream).
fn gemm_synchronized(
    a: CubeTensor<CudaRuntime>,
    b: CubeTensor<CudaRuntime>,
    product: &Product,
    policy: MatmulPolicy,
    clock: &mut PhaseClock,
    into: Option<CubeTensor<CudaRuntime>>,
) -> Result<CubeTensor<CudaRuntime>, Declined> {
    let ordinal = a.device.index;
    let client = a.client.clone();
    cubecl::future::block_on(client.sync()).map_err(|e| Declined::Failed(format!("{e:?}")))?;
    let outcome = client.exclusive(|| {
        // Allocated here, not through fusion: contiguous, and no extra round trip.
        let accumulate = into.is_some();
        let out = into.unwrap_or_else(|| output_of(&a, product));
        let views = (view_of(a), view_of(b), view_of(out.clone()));
        let (Some(a), Some(b), Some(d)) = views else {
            return Err(Declined::Layout);
        };
        let gemm = product.gemm(&a, &b, &d, &policy).ok_or(Declined::Layout)?;
        let gemm = Gemm { accumulate, ..gemm };
        clock.lap(1);
        clock.lap(2);
        // SAFETY: the three views hold their memory until the synchronization inside `run`;
        // the inputs are complete after the sync above; the output has the extents described.
        let ran = unsafe { cublaslt::run(ordinal, &gemm, cublaslt::Order::Synchronized) };
        clock.lap(3);
        ran.map(|()| out)
            .map_err(|e| Declined::Failed(e.to_string()))
    });
    outcome.map_err(|e| Declined::Failed(format!("{e:?}")))?
}

type Cube = CubeBackend<CudaRuntime, f32, i32, u8>;

/// A product in fusion's stream: cuBLASLt, or burn's own matmul for a layout cuBLASLt cannot
/// take or a failed call.
fn gemm_or_inner(
    a: CubeTensor<CudaRuntime>,
    b: CubeTensor<CudaRuntime>,
    product: &Product,
    policy: MatmulPolicy,
) -> CubeTensor<CudaRuntime> {
    let mut clock = PhaseClock::start();
    match gemm_on_cube(a.clone(), b.clone(), product, policy, &mut clock, None) {
        Ok(out) => {
            clock.finish();
            out
        }
        Err(declined) => {
            declined.warn();
            <Cube as FloatTensorOps<Cube>>::float_matmul(a, b)
        }
    }
}

/// The product as an operation of fusion's stream (see `fused_op.rs`) when `lhs` and `rhs` are
/// burn-cuda's fused tensors; `None` otherwise.
fn register_in_stream<B: Backend>(
    lhs: &FloatTensor<B>,
    rhs: &FloatTensor<B>,
    product: &Product,
    policy: MatmulPolicy,
) -> Option<FloatTensor<B>> {
    let fused = |t: &FloatTensor<B>| (t as &dyn Any).downcast_ref::<Fused>().cloned();
    let (a, b) = (fused(lhs)?, fused(rhs)?);
    let mut shape = product.batch_dims.clone();
    shape.extend([product.m, product.n]);
    let product = product.clone();
    let [out] = run_fused(
        "burn_zero_cublaslt_matmul",
        [&a, &b],
        [(shape.into(), a.dtype)],
        move |[a, b]| [gemm_or_inner(a, b, &product, policy)],
    );
    let boxed: Box<dyn Any> = Box::new(out);
    boxed.downcast::<FloatTensor<B>>().ok().map(|b| *b)
}

/// `acc + lhs · rhs` on burn-cuda's fused tensors as one operation of fusion's stream: the
/// product added by cuBLASLt into `acc`'s buffer (`beta = 1`; into a copy when `acc` is not its
/// buffer's last reference), so no tensor of the product exists and the sum is rounded once;
/// burn's matmul and an add where cuBLASLt declines the layout. `acc` back where the
/// operands are not a product cuBLASLt takes (shapes, dtypes, size, the policy).
// `acc` goes back by value where cuBLASLt does not take it: boxing it would allocate per call.
#[allow(clippy::result_large_err)]
pub(crate) fn try_accumulate(
    acc: Fused,
    lhs: &Fused,
    rhs: &Fused,
    policy: MatmulPolicy,
) -> Result<Fused, Fused> {
    let product = match Product::of::<burn::backend::Cuda>(lhs, rhs, policy) {
        Some(product) if policy.cublaslt => product,
        _ => return Err(acc),
    };
    let mut shape = product.batch_dims.clone();
    shape.extend([product.m, product.n]);
    if acc.shape.iter().ne(shape.iter()) || acc.dtype != lhs.dtype {
        return Err(acc);
    }
    let dtype = acc.dtype;
    let [out] = run_fused_taking(
        "burn_zero_cublaslt_matmul_add",
        [acc, lhs.clone(), rhs.clone()],
        [(shape.into(), dtype)],
        move |[acc, a, b]| {
            let acc = writable(acc);
            let mut clock = PhaseClock::start();
            let ran = gemm_on_cube(
                a.clone(),
                b.clone(),
                &product,
                policy,
                &mut clock,
                Some(acc.clone()),
            );
            match ran {
                Ok(out) => {
                    clock.finish();
                    [out]
                }
                Err(declined) => {
                    declined.warn();
                    let p = <Cube as FloatTensorOps<Cube>>::float_matmul(a, b);
                    [<Cube as FloatTensorOps<Cube>>::float_add(acc, p)]
                }
            }
        },
    );
    Ok(out)
}

/// Host time per phase of one cuBLASLt call, added to [`PROFILE`] when it succeeds.
struct PhaseClock {
    last: std::time::Instant,
    us: [f64; 5],
}

impl PhaseClock {
    fn start() -> Self {
        Self {
            last: std::time::Instant::now(),
            us: [0.0; 5],
        }
    }

    fn lap(&mut self, phase: usize) {
        let now = std::time::Instant::now();
        self.us[phase] += (now - self.last).as_secs_f64() * 1e6;
        self.last = now;
    }

    /// Closes the last phase and counts the call as one that ran through cuBLASLt.
    fn finish(&mut self) {
        self.lap(4);
        self.record();
        super::matmul::count_cublaslt_call();
    }

    fn record(&self) {
        let mut p = PROFILE.lock().unwrap_or_else(|e| e.into_inner());
        p.calls += 1;
        for (total, us) in p.host_us.iter_mut().zip(self.us) {
            *total += us;
        }
    }
}
