//! Orders work on a stream of our own (cuBLASLt's) against burn's CUDA stream, which cubecl
//! 0.10 does not expose, without a host round trip: two flags in device memory.
//!
//! For one foreign call with sequence number `s`:
//! 1. burn's stream runs [`raise`]: `flags[READY] = s` once everything before it is done;
//! 2. our stream waits for `flags[READY] == s` (a one-thread spin kernel), runs the call, then
//!    a one-thread kernel writes `flags[DONE] = s` (see `cublaslt.rs`);
//! 3. burn's stream runs [`await_done`], one thread spinning until `flags[DONE] == s`, so every
//!    later kernel of burn sees the call's output, and memory the call read is not reused early.
//!
//! Every kernel a spinner waits for is launched before the spinner (see `cublaslt.rs`): under
//! CUDA's lazy loading, a first launch may wait for the running kernels.
//!
//! Equality (not `≥`) keeps it correct across `u32` wraparound: each flag keeps its value until
//! the other side has seen it. Flags are per burn stream (cubecl gives each thread its own, and
//! fusion runs an operation on the stream of the thread that registered it): two streams
//! sharing flags could overwrite a `ready` before our stream saw it. One call's steps 1 and 3
//! land on the same stream.

use std::cell::RefCell;
use std::collections::HashMap;

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
        if flags[DONE].load() == seq {
            break;
        }
    }
}

/// The device addresses of one handshake: our stream waits for `ready == seq`, then writes
/// `done = seq`. Free of burn types, for `cublaslt.rs`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Handshake {
    pub(crate) ready: u64,
    pub(crate) done: u64,
    pub(crate) seq: u32,
}

struct Flags {
    /// Keeps the two `u32`s allocated for the thread's lifetime.
    handle: Handle,
    /// Device address of `flags[0]`.
    ptr: u64,
    seq: u32,
}

thread_local! {
    /// Per GPU ordinal and burn stream, the flags. Only cubecl's thread touches them (inside
    /// `ComputeClient::exclusive`), so a thread-local holds them all.
    static FLAGS: RefCell<HashMap<(usize, StreamId), Flags>> = RefCell::new(HashMap::new());
}

/// Step 1 on burn's stream of `client` (GPU `ordinal`): returns the handshake for our stream.
///
/// Call it on cubecl's thread (inside `ComputeClient::exclusive`), where the launch of `raise`
/// reaches CUDA before this returns: queued in cubecl instead, it might reach CUDA after our
/// stream's spinner started, and loading it could then wait for that spinner, which waits for
/// it.
pub(crate) fn begin(client: &ComputeClient<CudaRuntime>, ordinal: usize) -> Option<Handshake> {
    FLAGS.with(|flags| {
        let mut flags = flags.borrow_mut();
        let entry = match flags.entry((ordinal, StreamId::current())) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let handle = client.create_from_slice(u32::as_bytes(&[0, 0]));
                let ptr = client.get_resource(handle.clone()).ok()?.resource().ptr;
                // Load `await_done` before anything spins (see `cublaslt.rs` on lazy
                // loading): `done` is 0, so this returns at once.
                await_done::launch::<CudaRuntime>(
                    client,
                    CubeCount::Static(1, 1, 1),
                    CubeDim::new_1d(1),
                    // SAFETY: the handle holds exactly two u32.
                    unsafe { ArrayArg::from_raw_parts(handle.clone(), 2) },
                    0,
                );
                v.insert(Flags {
                    handle,
                    ptr,
                    seq: 0,
                })
            }
        };
        // Skip 0, the flags' initial value.
        entry.seq = entry.seq.wrapping_add(1).max(1);
        raise::launch::<CudaRuntime>(
            client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(1),
            // SAFETY: the handle holds exactly two u32.
            unsafe { ArrayArg::from_raw_parts(entry.handle.clone(), 2) },
            entry.seq,
        );
        Some(Handshake {
            ready: entry.ptr + (READY * 4) as u64,
            done: entry.ptr + (DONE * 4) as u64,
            seq: entry.seq,
        })
    })
}

/// Step 3 on burn's stream: later work waits until our stream wrote `done`.
pub(crate) fn end(client: &ComputeClient<CudaRuntime>, ordinal: usize, handshake: Handshake) {
    FLAGS.with(|flags| {
        let flags = flags.borrow();
        let entry = flags
            .get(&(ordinal, StreamId::current()))
            .expect("begin ran on this stream");
        await_done::launch::<CudaRuntime>(
            client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(1),
            // SAFETY: the handle holds exactly two u32.
            unsafe { ArrayArg::from_raw_parts(entry.handle.clone(), 2) },
            handshake.seq,
        );
    })
}
