//! Collectives over thread ranks: world sizes 1–4, element counts that do not divide evenly,
//! every dtype, and the failure modes (mismatch, missing rank) that must never hang.

use std::time::{Duration, Instant};

use half::{bf16, f16};

use super::*;
use crate::partition::PartitionPlan;
use crate::testing::{for_world_sizes, run_ranks, run_ranks_with_timeout, try_run_ranks};

const COUNTS: [usize; 3] = [1, 7, 1000003];
const WORLDS: [usize; 4] = [1, 2, 3, 4];

fn input(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 31 + rank * 17) % 101) as f32 * 0.25 - 7.5 + rank as f32)
        .collect()
}

/// The reduction computed the plain way: f32 accumulation in rank order.
fn expected(world: usize, n: usize, op: ReduceOp) -> Vec<f32> {
    let inputs: Vec<Vec<f32>> = (0..world).map(|r| input(r, n)).collect();
    (0..n)
        .map(|i| {
            let mut acc = inputs[0][i];
            for inp in &inputs[1..] {
                acc = match op {
                    ReduceOp::Sum | ReduceOp::Avg => acc + inp[i],
                    ReduceOp::Max => acc.max(inp[i]),
                };
            }
            if op == ReduceOp::Avg {
                acc / world as f32
            } else {
                acc
            }
        })
        .collect()
}

#[test]
fn all_reduce_sum_avg_max() {
    for_world_sizes(&WORLDS, |world| {
        for n in COUNTS {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                let results = run_ranks(world, |ctx| {
                    let mut buf = input(ctx.rank, n);
                    ctx.comm.all_reduce(buf.as_mut_slice().into(), op).unwrap();
                    buf
                });
                let want = expected(world, n, op);
                for (rank, got) in results.iter().enumerate() {
                    assert!(got == &want, "rank {rank}, n {n}, {op:?}");
                }
            }
        }
    });
}

#[test]
fn all_reduce_half_types_accumulate_in_f32() {
    for_world_sizes(&WORLDS, |world| {
        let results = run_ranks(world, |ctx| {
            let mut b: Vec<bf16> = input(ctx.rank, 7).into_iter().map(bf16::from_f32).collect();
            let mut h: Vec<f16> = input(ctx.rank, 7).into_iter().map(f16::from_f32).collect();
            ctx.comm
                .all_reduce(b.as_mut_slice().into(), ReduceOp::Sum)
                .unwrap();
            ctx.comm
                .all_reduce(h.as_mut_slice().into(), ReduceOp::Sum)
                .unwrap();
            (b, h)
        });
        for i in 0..7 {
            let sum_b: f32 = (0..world)
                .map(|r| bf16::from_f32(input(r, 7)[i]).to_f32())
                .sum();
            let sum_h: f32 = (0..world)
                .map(|r| f16::from_f32(input(r, 7)[i]).to_f32())
                .sum();
            for (b, h) in &results {
                assert_eq!(b[i], bf16::from_f32(sum_b));
                assert_eq!(h[i], f16::from_f32(sum_h));
            }
        }
    });
}

#[test]
fn padded_reduce_scatter_and_all_gather() {
    for_world_sizes(&WORLDS, |world| {
        for n in COUNTS {
            let plan = PartitionPlan::new(n, world);
            let results = run_ranks(world, |ctx| {
                let mut owned = vec![0.0f32; plan.owned(ctx.rank).len()];
                ctx.comm
                    .reduce_scatter_padded(&plan, &input(ctx.rank, n), &mut owned, ReduceOp::Sum)
                    .unwrap();
                let mut full = vec![0.0f32; n];
                ctx.comm
                    .all_gather_padded(&plan, &owned, &mut full)
                    .unwrap();
                (owned, full)
            });
            let want = expected(world, n, ReduceOp::Sum);
            for (rank, (owned, full)) in results.iter().enumerate() {
                assert!(
                    owned[..] == want[plan.owned(rank)],
                    "reduce_scatter rank {rank} n {n}"
                );
                assert!(full == &want, "all_gather rank {rank} n {n}");
            }
        }
    });
}

#[test]
fn equal_chunk_collectives_and_broadcast() {
    for_world_sizes(&WORLDS, |world| {
        let results = run_ranks(world, |ctx| {
            let mine = input(ctx.rank, 5);
            let mut gathered = vec![0.0f32; 5 * world];
            ctx.comm
                .all_gather(mine.as_slice().into(), gathered.as_mut_slice().into())
                .unwrap();
            let mut chunk = vec![0.0f32; 3];
            let full = input(ctx.rank, 3 * world);
            ctx.comm
                .reduce_scatter(
                    full.as_slice().into(),
                    chunk.as_mut_slice().into(),
                    ReduceOp::Max,
                )
                .unwrap();
            let mut b = input(ctx.rank, 7);
            ctx.comm
                .broadcast(b.as_mut_slice().into(), world - 1)
                .unwrap();
            ctx.comm.barrier().unwrap();
            (gathered, chunk, b)
        });
        let all_max = expected(world, 3 * world, ReduceOp::Max);
        for (rank, (gathered, chunk, b)) in results.iter().enumerate() {
            let want: Vec<f32> = (0..world).flat_map(|r| input(r, 5)).collect();
            assert_eq!(gathered, &want);
            assert_eq!(chunk[..], all_max[rank * 3..rank * 3 + 3]);
            assert_eq!(b, &input(world - 1, 7));
        }
    });
}

#[test]
fn send_recv_around_a_ring() {
    for_world_sizes(&[2, 3, 4], |world| {
        let results = run_ranks(world, |ctx| {
            let next = (ctx.rank + 1) % world;
            let prev = (ctx.rank + world - 1) % world;
            let mut got = vec![0.0f32; 1000003];
            for _ in 0..2 {
                ctx.comm
                    .send(input(ctx.rank, 1000003).as_slice().into(), next)
                    .unwrap();
                ctx.comm.recv(got.as_mut_slice().into(), prev).unwrap();
            }
            (prev, got)
        });
        for (prev, got) in results {
            assert!(got == input(prev, 1000003));
        }
    });
}

#[test]
fn mismatched_collectives_fail_fast_naming_both_ranks() {
    let start = Instant::now();
    let failures = try_run_ranks(2, Duration::from_secs(20), |ctx| {
        let result = if ctx.rank == 0 {
            let mut out = vec![0.0f32; 14];
            ctx.comm
                .all_gather(input(0, 7).as_slice().into(), out.as_mut_slice().into())
        } else {
            let mut out = vec![0.0f32; 7];
            ctx.comm.reduce_scatter(
                input(1, 14).as_slice().into(),
                out.as_mut_slice().into(),
                ReduceOp::Sum,
            )
        };
        let err = result.expect_err("a mismatch must be an error").to_string();
        panic!("{err}");
    })
    .expect_err("both ranks fail");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "no waiting for the timeout"
    );
    assert_eq!(failures.len(), 2);
    for failure in failures {
        let m = &failure.message;
        assert!(m.contains("collective #0 mismatch"), "{m}");
        assert!(m.contains("rank 0 called all_gather(f32 x 7)"), "{m}");
        assert!(
            m.contains("rank 1 called reduce_scatter[Sum](f32 x 14)"),
            "{m}"
        );
    }
}

#[test]
fn a_missing_rank_times_out_with_a_message() {
    let timeout = Duration::from_millis(300);
    let start = Instant::now();
    let failures = try_run_ranks(3, timeout, |ctx| {
        if ctx.rank == 2 {
            return; // never joins the collective
        }
        let mut buf = input(ctx.rank, 7);
        let err = ctx
            .comm
            .all_reduce(buf.as_mut_slice().into(), ReduceOp::Sum)
            .unwrap_err();
        panic!("{err}");
    })
    .expect_err("the waiting ranks fail");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "bounded by the timeout"
    );
    let m = &failures[0].message;
    assert!(
        m.contains("timed out") && m.contains("[2]") && m.contains("all_reduce"),
        "{m}"
    );
}

/// A rank that never joins the third collective: the waiting ranks' errors carry their flight
/// record, the two completed calls with their durations and the pending one, oldest first.
#[test]
fn a_timeout_carries_the_last_calls_of_the_rank() {
    let failures = try_run_ranks(3, Duration::from_millis(300), |ctx| {
        let mut buf = input(ctx.rank, 7);
        ctx.comm
            .all_reduce(buf.as_mut_slice().into(), ReduceOp::Sum)
            .unwrap();
        ctx.comm.barrier().unwrap();
        if ctx.rank == 2 {
            return; // never joins the third call
        }
        let err = ctx
            .comm
            .all_reduce(buf.as_mut_slice().into(), ReduceOp::Max)
            .unwrap_err();
        // The first waiting rank to time out stops the group: the other may find it aborted
        // (naming the timeout) before its own deadline is checked.
        let recent = match &err {
            CommError::Timeout { recent, .. } => recent,
            CommError::Aborted(reason) => {
                assert!(reason.contains("timed out"), "{reason}");
                panic!("{err}");
            }
            other => panic!("neither a timeout nor the abort it causes: {other}"),
        };
        let calls: Vec<(u64, String, bool)> = recent
            .0
            .iter()
            .map(|e| (e.seq, e.call.to_string(), e.took.is_some()))
            .collect();
        assert_eq!(
            calls,
            [
                (0, "all_reduce[Sum](f32 x 7)".to_string(), true),
                (1, "barrier".to_string(), true),
                (2, "all_reduce[Max](f32 x 7)".to_string(), false),
            ]
        );
        assert_eq!(recent.0[0].bytes, 28);
        panic!("{err}");
    })
    .expect_err("the waiting ranks fail");
    assert_eq!(failures.len(), 2);
    let timed_out = failures.iter().find(|f| !f.message.contains("aborted"));
    let m = &timed_out.expect("one waiting rank timed out").message;
    assert!(
        m.contains("its last 3 calls, oldest first")
            && m.contains("#1 barrier")
            && m.contains("#2 all_reduce[Max](f32 x 7) (28 bytes)")
            && m.contains("did not complete"),
        "{m}"
    );
}

/// The record keeps the last [`FLIGHT_RECORD_LEN`] calls.
#[test]
fn the_flight_record_keeps_the_last_calls() {
    let recorder = FlightRecorder::default();
    let call = OpSignature::new(OpKind::Barrier, DType::F32, 0);
    for _ in 0..FLIGHT_RECORD_LEN + 5 {
        let seq = recorder.start(call);
        recorder.end(seq);
    }
    let record = recorder.record();
    assert_eq!(record.0.len(), FLIGHT_RECORD_LEN);
    assert_eq!(record.0[0].seq, 5);
    assert!(record.0.iter().all(|e| e.took.is_some()));
}

#[test]
fn a_missing_sender_times_out() {
    let failures = try_run_ranks(2, Duration::from_millis(200), |ctx| {
        if ctx.rank == 1 {
            let mut buf = vec![0.0f32; 3];
            panic!(
                "{}",
                ctx.comm.recv(buf.as_mut_slice().into(), 0).unwrap_err()
            );
        }
    })
    .expect_err("rank 1 fails");
    assert_eq!(failures[0].rank, 1);
    assert!(
        failures[0].message.contains("waiting for rank(s) [0]"),
        "{}",
        failures[0].message
    );
}

#[test]
fn a_panicking_rank_is_named_and_releases_the_others() {
    let start = Instant::now();
    let result = std::panic::catch_unwind(|| {
        run_ranks_with_timeout(3, Duration::from_secs(60), |ctx| {
            if ctx.rank == 1 {
                panic!("boom on purpose");
            }
            ctx.comm.barrier().unwrap();
        })
    });
    let message = result.expect_err("the harness re-raises");
    let message = message
        .downcast_ref::<String>()
        .cloned()
        .unwrap_or_default();
    assert!(
        message.starts_with("rank 1 panicked: boom on purpose"),
        "{message}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "others were released, not timed out"
    );
}

#[test]
fn invalid_lengths_are_named() {
    let failures = try_run_ranks(2, Duration::from_secs(5), |ctx| {
        let mut out = vec![0.0f32; 3];
        panic!(
            "{}",
            ctx.comm
                .all_gather(input(0, 2).as_slice().into(), out.as_mut_slice().into())
                .unwrap_err()
        );
    })
    .expect_err("bad lengths");
    assert!(
        failures[0].message.contains("invalid all_gather(f32 x 2)"),
        "{}",
        failures[0].message
    );
}

#[test]
fn labels_must_agree_like_the_rest_of_the_signature() {
    let result = try_run_ranks(2, Duration::from_secs(20), |ctx| {
        let input = [1.0f32; 3];
        let mut out = [0.0f32; 6];
        let label = 10 + ctx.rank as u64;
        with_label(label, || {
            ctx.comm
                .all_gather(input.as_slice().into(), out.as_mut_slice().into())
        })
        .map_err(|e| e.to_string())
    });
    let messages: Vec<String> = result
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap_err())
        .collect();
    assert!(
        messages
            .iter()
            .any(|m| m.contains("[label 10]") && m.contains("[label 11]")),
        "{messages:?}"
    );
    assert_eq!(current_label(), 0, "the label is scoped to the call");
}
