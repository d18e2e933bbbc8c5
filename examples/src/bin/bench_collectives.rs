//! Collective bus bandwidth through burn-zero's `NcclComm`, one process per GPU (start it with
//! `burn-zero run --nproc-per-node N`). Rank 0 prints one JSON line per (op, size), in the
//! format of `bench/collectives_torch.py`, the peer measured in the same run.
//!
//! Sizes follow nccl-tests: `bytes` is the larger buffer (all-gather output, reduce-scatter
//! input); bus bandwidth = bytes / time × (n − 1) / n, × 2 for all-reduce.

use std::time::Instant;

use burn_zero::comm::{Communicator, ReduceOp};
use burn_zero::dist::init_nccl;

const SIZES_MIB: [usize; 6] = [1, 4, 16, 64, 256, 1024];

fn main() {
    let (env, nccl) = init_nccl().unwrap_or_else(|e| panic!("{e}"));
    let (rank, world) = (env.rank, env.world_size);
    let stream = nccl.stream().clone();

    // Correctness first, through both paths: device buffers and the checked host interface.
    let n = 1 << 20;
    let host: Vec<f32> = (0..n).map(|i| (i % 7) as f32 + rank as f32).collect();
    let mut device = stream.clone_htod(&host).expect("copy to the GPU");
    nccl.all_reduce_device(&mut device, ReduceOp::Sum)
        .expect("all-reduce");
    let back = stream.clone_dtoh(&device).expect("copy back");
    let offset: f32 = (0..world).map(|r| r as f32).sum();
    assert!(
        back.iter()
            .enumerate()
            .all(|(i, v)| *v == (i % 7) as f32 * world as f32 + offset),
        "device all-reduce is wrong"
    );
    let mut small = vec![rank as f32 + 1.0; 1000003];
    nccl.all_reduce(small.as_mut_slice().into(), ReduceOp::Avg)
        .expect("host all-reduce");
    assert!(
        small
            .iter()
            .all(|v| (*v - (world as f32 + 1.0) / 2.0).abs() < 1e-6),
        "host all-reduce is wrong"
    );
    if rank == 0 {
        eprintln!("correctness: device and host all-reduce verified on {world} GPU(s)");
    }

    for op in ["all_gather", "reduce_scatter", "all_reduce"] {
        for mib in SIZES_MIB {
            let bytes = mib << 20;
            let elements = bytes / 4;
            let part = elements / world;
            let ones = vec![1.0f32; elements];
            let mut big = stream.clone_htod(&ones).expect("alloc");
            let mut small = stream.clone_htod(&ones[..part]).expect("alloc");
            let mut once = || {
                match op {
                    "all_gather" => nccl.all_gather_device(&small, &mut big),
                    "reduce_scatter" => nccl.reduce_scatter_device(&big, &mut small, ReduceOp::Sum),
                    _ => nccl.all_reduce_device(&mut big, ReduceOp::Sum),
                }
                .expect("collective")
            };
            for _ in 0..3 {
                once();
            }
            nccl.synchronize().expect("sync");
            let iters = if mib <= 64 { 20 } else { 10 };
            let start = Instant::now();
            for _ in 0..iters {
                once();
            }
            nccl.synchronize().expect("sync");
            let seconds = start.elapsed().as_secs_f64() / iters as f64;
            let algbw = bytes as f64 / seconds / 1e9;
            let factor =
                if op == "all_reduce" { 2.0 } else { 1.0 } * (world as f64 - 1.0) / world as f64;
            if rank == 0 {
                println!(
                    "{{\"system\": \"burn-zero\", \"op\": \"{op}\", \"bytes\": {bytes}, \"time_us\": {:.2}, \"algbw_GBps\": {algbw:.2}, \"busbw_GBps\": {:.2}}}",
                    seconds * 1e6,
                    algbw * factor
                );
            }
        }
    }
    if rank == 0 {
        eprintln!(
            "nccl version {}",
            burn_zero::comm::nccl_version().unwrap_or(-1)
        );
    }
}
