//! Orders work on a stream of our own (cuBLASLt's, NCCL's) against burn's CUDA stream, which
//! cubecl 0.10 does not expose, without a host round trip: two flags in device memory.
//!
//! For one foreign call with sequence number `s`:
//! 1. burn's stream runs [`raise`]: `flags[READY] = s` once everything before it is done;
//! 2. our stream waits until `flags[READY]` has reached `s` (`flag_kernels.rs`), runs the
//!    call, then writes `flags[DONE] = s`;
//! 3. burn's stream runs [`await_done`], one thread spinning until `flags[DONE]` has reached
//!    `s`, so every later kernel of burn sees the call's output, and memory the call used is
//!    not reused early. A GEMM takes this step at once; a collective when its output is first
//!    needed ([`end`] with the last call's handshake covers every earlier one).
//!
//! "Reached" is serial-number order (`flag - s` as a signed 32-bit number is not negative):
//! several collectives may be in flight, so burn's stream may have raised later numbers before
//! our stream looks, and it stays right across `u32` wraparound.
//!
//! Every kernel a spinner waits for is launched before the spinner: under CUDA's lazy loading,
//! a first launch may wait for the running kernels.
//!
//! Flags are per burn stream (cubecl gives each thread its own, and fusion runs an operation
//! on the stream of the thread that registered it) and per channel (one per foreign stream:
//! [`GEMM_CHANNEL`] for cuBLASLt, [`new_channel`] for each collective stream), so each pair's
//! numbers grow in the order both streams see them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex, MutexGuard};

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::Handle;
use cubecl::stream_id::StreamId;

const READY: usize = 0;
const DONE: usize = 1;

#[cube(launch)]
fn raise(flags: &mut Array<Atomic<u32>>, seq: u32) {
    flags[READY].store(seq);
}

#[cube(launch)]
fn await_done(flags: &mut Array<Atomic<u32>>, seq: u32) {
    loop {
        // Serial-number order: `done - seq` (wrapping) below 2^31 means `done` reached `seq`.
        let ahead = flags[DONE].load() - seq;
        if ahead < 2147483648u32 {
            break;
        }
    }
}

/// The channel of cuBLASLt's stream.
pub(crate) const GEMM_CHANNEL: u64 = 0;

/// A channel of its own for one more foreign stream.
pub(crate) fn new_channel() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(GEMM_CHANNEL + 1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The device addresses of one handshake: our stream waits until `ready` reached `seq`, then
/// writes `done = seq`. Free of burn types, for `cublaslt.rs` and the collectives.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Handshake {
    pub(crate) ready: u64,
    pub(crate) done: u64,
    pub(crate) seq: u32,
    channel: u64,
}

struct Flags {
    /// Keeps the two `u32`s allocated for the thread's lifetime.
    handle: Handle,
    /// Device address of `flags[0]`.
    ptr: u64,
    seq: u32,
}

/// Per GPU ordinal, burn stream and channel, the flags. Shared by every thread: a product may
/// take its handshake on cubecl's thread (a visit) or on the thread queueing it there.
fn flags() -> MutexGuard<'static, HashMap<(usize, StreamId, u64), Flags>> {
    type All = HashMap<(usize, StreamId, u64), Flags>;
    static FLAGS: LazyLock<Mutex<All>> = LazyLock::new(Default::default);
    FLAGS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Step 1 on burn's stream of `client` (GPU `ordinal`) for the foreign stream of `channel`:
/// returns the handshake for that stream.
///
/// The launch of `raise` must reach CUDA before our stream's spinner for it starts: loading it
/// lazily could otherwise wait for that spinner, which waits for it. So call it on cubecl's
/// thread (inside `ComputeClient::exclusive`), where the launch happens before this returns,
/// or queue the spinner's work on cubecl's thread after it (as a queued product does).
///
/// The flags' lock is never held across a call into cubecl: cubecl's thread may be running a
/// visit that takes it.
pub(crate) fn begin(
    client: &ComputeClient<CudaRuntime>,
    ordinal: usize,
    channel: u64,
) -> Option<Handshake> {
    let key = (ordinal, StreamId::current(), channel);
    if !flags().contains_key(&key) {
        let handle = client.create_from_slice(u32::as_bytes(&[0, 0]));
        let ptr = client.get_resource(handle.clone()).ok()?.resource().ptr;
        // Load `await_done` before anything spins (see `cublaslt.rs` on lazy loading): `done`
        // is 0, so this returns at once.
        launch_await_done(client, &handle, 0);
        flags().entry(key).or_insert(Flags {
            handle,
            ptr,
            seq: 0,
        });
    }
    let (handle, handshake) = {
        let mut all = flags();
        let entry = all.get_mut(&key)?;
        // Skip 0, the flags' initial value.
        entry.seq = entry.seq.wrapping_add(1).max(1);
        let handshake = Handshake {
            ready: entry.ptr + (READY * 4) as u64,
            done: entry.ptr + (DONE * 4) as u64,
            seq: entry.seq,
            channel,
        };
        (entry.handle.clone(), handshake)
    };
    raise::launch::<CudaRuntime>(
        client,
        CubeCount::Static(1, 1, 1),
        CubeDim::new_1d(1),
        // SAFETY: the handle holds exactly two u32.
        unsafe { ArrayArg::from_raw_parts(handle, 2) },
        handshake.seq,
    );
    crate::log::trace_order(|| {
        format!(
            "raise gpu {ordinal} stream {} channel {channel:#x} seq {} (flags {:#x})",
            StreamId::current(),
            handshake.seq,
            handshake.ready
        )
    });
    Some(handshake)
}

/// Step 3 on burn's stream: later work waits until our stream's `done` reached the
/// handshake's number. Call it on the stream `begin` ran on, after our stream's work for the
/// handshake was issued.
pub(crate) fn end(client: &ComputeClient<CudaRuntime>, ordinal: usize, handshake: Handshake) {
    let handle = flags()
        .get(&(ordinal, StreamId::current(), handshake.channel))
        .expect("begin ran on this stream")
        .handle
        .clone();
    launch_await_done(client, &handle, handshake.seq);
    crate::log::trace_order(|| {
        format!(
            "await gpu {ordinal} stream {} channel {:#x} seq {}",
            StreamId::current(),
            handshake.channel,
            handshake.seq
        )
    });
}

fn launch_await_done(client: &ComputeClient<CudaRuntime>, flags: &Handle, seq: u32) {
    await_done::launch::<CudaRuntime>(
        client,
        CubeCount::Static(1, 1, 1),
        CubeDim::new_1d(1),
        // SAFETY: the handle holds exactly two u32.
        unsafe { ArrayArg::from_raw_parts(flags.clone(), 2) },
        seq,
    );
}
