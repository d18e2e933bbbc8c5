//! The schedules' streams written out by hand for small pipelines, and their properties for
//! more: every micro-batch forwarded then backwarded once per stage, messages matched in
//! order without deadlock, and 1F1B's bound on live micro-batches.

use crate::schedule::{Instr, Schedule, peak_in_flight, simulate, simulate_timed, unit_cost};
use crate::schedule::{StageCosts, simulate_ranked};

/// `L0 RA0 F0 SA0 RG0 B0 SG0 R S`, space-separated; chunk `c > 0` as a suffix `.c`, the halves
/// of a split backward as `Bi` and `W`.
fn text(stream: &[Instr]) -> String {
    let token = |i: &Instr| {
        let name = match i {
            Instr::Load { .. } => "L",
            Instr::RecvActivation { .. } => "RA",
            Instr::Forward { .. } => "F",
            Instr::SendActivation { .. } => "SA",
            Instr::RecvGrad { .. } => "RG",
            Instr::Backward { .. } => "B",
            Instr::BackwardInput { .. } => "Bi",
            Instr::BackwardWeight { .. } => "W",
            Instr::SendGrad { .. } => "SG",
            Instr::ReduceGrads => return "R".to_string(),
            Instr::OptimizerStep => return "S".to_string(),
        };
        match i.at().expect("a micro-batch") {
            (mb, 0) => format!("{name}{mb}"),
            (mb, chunk) => format!("{name}{mb}.{chunk}"),
        }
    };
    stream.iter().map(token).collect::<Vec<_>>().join(" ")
}

fn check_exact(schedule: Schedule, stages: usize, mbs: usize, expected: &[&str]) {
    for (s, want) in expected.iter().enumerate() {
        let want = want.split_whitespace().collect::<Vec<_>>().join(" ");
        assert_eq!(
            text(&schedule.stream(stages, mbs, s)),
            want,
            "{schedule:?} ({stages}, {mbs}) stage {s}"
        );
    }
}

#[test]
fn one_f_one_b_streams_written_out() {
    check_exact(
        Schedule::OneFOneB,
        2,
        4,
        &[
            "L0 F0 SA0  L1 F1 SA1 RG0 B0  L2 F2 SA2 RG1 B1  L3 F3 SA3 RG2 B2  RG3 B3  R S",
            "L0 RA0 F0 B0 SG0  L1 RA1 F1 B1 SG1  L2 RA2 F2 B2 SG2  L3 RA3 F3 B3 SG3  R S",
        ],
    );
    check_exact(
        Schedule::OneFOneB,
        3,
        5,
        &[
            "L0 F0 SA0 L1 F1 SA1  L2 F2 SA2 RG0 B0  L3 F3 SA3 RG1 B1  L4 F4 SA4 RG2 B2
             RG3 B3 RG4 B4  R S",
            "RA0 F0 SA0  RA1 F1 SA1 RG0 B0 SG0  RA2 F2 SA2 RG1 B1 SG1  RA3 F3 SA3 RG2 B2 SG2
             RA4 F4 SA4 RG3 B3 SG3  RG4 B4 SG4  R S",
            "L0 RA0 F0 B0 SG0  L1 RA1 F1 B1 SG1  L2 RA2 F2 B2 SG2  L3 RA3 F3 B3 SG3
             L4 RA4 F4 B4 SG4  R S",
        ],
    );
    let four_eight = Schedule::OneFOneB.streams(4, 8);
    assert_eq!(
        text(&four_eight[0]),
        "L0 F0 SA0 L1 F1 SA1 L2 F2 SA2 L3 F3 SA3 RG0 B0 L4 F4 SA4 RG1 B1 L5 F5 SA5 RG2 B2 \
         L6 F6 SA6 RG3 B3 L7 F7 SA7 RG4 B4 RG5 B5 RG6 B6 RG7 B7 R S"
    );
    assert_eq!(
        text(&four_eight[2]),
        "RA0 F0 SA0 RA1 F1 SA1 RG0 B0 SG0 RA2 F2 SA2 RG1 B1 SG1 RA3 F3 SA3 RG2 B2 SG2 \
         RA4 F4 SA4 RG3 B3 SG3 RA5 F5 SA5 RG4 B4 SG4 RA6 F6 SA6 RG5 B5 SG5 \
         RA7 F7 SA7 RG6 B6 SG6 RG7 B7 SG7 R S"
    );
}

#[test]
fn gpipe_streams_written_out() {
    check_exact(
        Schedule::GPipe,
        2,
        4,
        &[
            "L0 F0 SA0 L1 F1 SA1 L2 F2 SA2 L3 F3 SA3  RG0 B0 RG1 B1 RG2 B2 RG3 B3  R S",
            "L0 RA0 F0 L1 RA1 F1 L2 RA2 F2 L3 RA3 F3  B0 SG0 B1 SG1 B2 SG2 B3 SG3  R S",
        ],
    );
    for (stages, mbs) in [(4, 8), (3, 5)] {
        for s in 0..stages {
            let (first, last) = (s == 0, s == stages - 1);
            let mut want = Vec::new();
            for m in 0..mbs {
                if first || last {
                    want.push(format!("L{m}"));
                }
                if !first {
                    want.push(format!("RA{m}"));
                }
                want.push(format!("F{m}"));
                if !last {
                    want.push(format!("SA{m}"));
                }
            }
            for m in 0..mbs {
                if !last {
                    want.push(format!("RG{m}"));
                }
                want.push(format!("B{m}"));
                if !first {
                    want.push(format!("SG{m}"));
                }
            }
            want.extend(["R".to_string(), "S".to_string()]);
            assert_eq!(
                text(&Schedule::GPipe.stream(stages, mbs, s)),
                want.join(" ")
            );
        }
    }
}

#[test]
fn every_schedule_runs_matched_and_bounded() {
    for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
        for (stages, mbs) in [(2, 4), (4, 8), (3, 5), (1, 3), (5, 2), (4, 1)] {
            let what = format!("{schedule:?} ({stages}, {mbs})");
            let streams = schedule.streams(stages, mbs);
            let order = simulate(&streams).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(order.len(), streams.iter().map(Vec::len).sum::<usize>());
            for (s, stream) in streams.iter().enumerate() {
                let pos = |i: Instr| stream.iter().position(|x| *x == i);
                for mb in 0..mbs {
                    let (f, b) = (
                        pos(Instr::Forward { mb, chunk: 0 }),
                        pos(Instr::Backward { mb, chunk: 0 }),
                    );
                    assert!(
                        f.is_some() && b.is_some() && f < b,
                        "{what} stage {s} mb {mb}"
                    );
                    let count = |i: Instr| stream.iter().filter(|x| **x == i).count();
                    assert_eq!(count(Instr::Forward { mb, chunk: 0 }), 1, "{what}");
                    assert_eq!(count(Instr::Backward { mb, chunk: 0 }), 1, "{what}");
                }
                assert_eq!(
                    &stream[stream.len() - 2..],
                    &[Instr::ReduceGrads, Instr::OptimizerStep]
                );
                let peak = peak_in_flight(stream);
                match schedule {
                    Schedule::GPipe => assert_eq!(peak, mbs, "{what} stage {s}"),
                    Schedule::OneFOneB => {
                        assert_eq!(peak, (stages - s).min(mbs), "{what} stage {s}");
                        assert!(peak <= stages);
                    }
                    _ => unreachable!(),
                }
            }
        }
    }
}

#[test]
fn the_simulator_finds_deadlocks_and_disorder() {
    // Stage 1 waits for micro-batch 1 first while stage 0 sends 0 first.
    let streams = vec![
        vec![
            Instr::SendActivation { mb: 0, chunk: 0 },
            Instr::SendActivation { mb: 1, chunk: 0 },
        ],
        vec![
            Instr::RecvActivation { mb: 1, chunk: 0 },
            Instr::RecvActivation { mb: 0, chunk: 0 },
        ],
    ];
    assert!(
        simulate(&streams)
            .unwrap_err()
            .contains("expects RecvActivation { mb: 1, chunk: 0 }")
    );
    // Both stages receive first.
    let streams = vec![
        vec![
            Instr::RecvGrad { mb: 0, chunk: 0 },
            Instr::SendActivation { mb: 0, chunk: 0 },
        ],
        vec![
            Instr::RecvActivation { mb: 0, chunk: 0 },
            Instr::SendGrad { mb: 0, chunk: 0 },
        ],
    ];
    assert!(simulate(&streams).unwrap_err().contains("deadlock"));
    // A send nobody receives.
    let streams = vec![vec![Instr::SendActivation { mb: 0, chunk: 0 }], vec![]];
    assert!(simulate(&streams).unwrap_err().contains("nobody received"));
}

/// Interleaved 1F1B over 2 ranks × 2 chunks (virtual stages: rank 0 chunk 0, rank 1 chunk 0,
/// rank 0 chunk 1, rank 1 chunk 1), 2 and 4 micro-batches, written out by hand from Megatron's
/// order. Rank 1 sends rank 0 both activations (into chunk 1) and gradients (out of chunk 1
/// and out of chunk 0) over one link: rank 0 receives them in the order they were sent.
#[test]
fn interleaved_streams_written_out() {
    let two_by_two = Schedule::Interleaved { chunks: 2 };
    check_exact(
        two_by_two,
        2,
        2,
        &[
            "L0 F0 SA0  L1 F1 SA1  RA0.1 F0.1 SA0.1  RA1.1 F1.1 SA1.1
             RG0.1 B0.1 SG0.1  RG1.1 B1.1 SG1.1  RG0 B0  RG1 B1  R S",
            "RA0 F0 SA0  RA1 F1 SA1  L0.1 RA0.1 F0.1  B0.1 SG0.1  L1.1 RA1.1 F1.1  B1.1 SG1.1
             RG0 B0 SG0  RG1 B1 SG1  R S",
        ],
    );
    // Rank 0 warms up with 2(2 − 0 − 1) + (2 − 1)·2 = 4 forwards, rank 1 with 2; micro-batches
    // go through the chunks in groups of 2.
    check_exact(
        two_by_two,
        2,
        4,
        &[
            "L0 F0 SA0  L1 F1 SA1  RA0.1 F0.1 SA0.1  RA1.1 F1.1 SA1.1
             L2 F2 SA2  RG0.1 B0.1 SG0.1  L3 F3 SA3  RG1.1 B1.1 SG1.1
             RA2.1 F2.1 SA2.1  RG0 B0  RA3.1 F3.1 SA3.1  RG1 B1
             RG2.1 B2.1 SG2.1  RG3.1 B3.1 SG3.1  RG2 B2  RG3 B3  R S",
            "RA0 F0 SA0  RA1 F1 SA1  L0.1 RA0.1 F0.1  B0.1 SG0.1  L1.1 RA1.1 F1.1  B1.1 SG1.1
             RA2 F2 SA2  RG0 B0 SG0  RA3 F3 SA3  RG1 B1 SG1
             L2.1 RA2.1 F2.1  B2.1 SG2.1  L3.1 RA3.1 F3.1  B3.1 SG3.1
             RG2 B2 SG2  RG3 B3 SG3  R S",
        ],
    );
}

/// ZB-H1 over 2 and 4 ranks: 1F1B's order with each backward's input half, and rank `r`'s
/// weight halves `r` micro-batches behind.
#[test]
fn zero_bubble_streams_written_out() {
    check_exact(
        Schedule::ZeroBubbleH1,
        2,
        3,
        &[
            "L0 F0 SA0  L1 F1 SA1  RG0 Bi0 W0  L2 F2 SA2  RG1 Bi1 W1  RG2 Bi2 W2  R S",
            "L0 RA0 F0  Bi0 SG0  L1 RA1 F1  Bi1 SG1 W0  L2 RA2 F2  Bi2 SG2 W1  W2  R S",
        ],
    );
    let four = Schedule::ZeroBubbleH1.streams(4, 6);
    assert_eq!(
        text(&four[3]),
        "L0 RA0 F0 Bi0 SG0  L1 RA1 F1 Bi1 SG1  L2 RA2 F2 Bi2 SG2  L3 RA3 F3 Bi3 SG3 W0 \
         L4 RA4 F4 Bi4 SG4 W1  L5 RA5 F5 Bi5 SG5 W2  W3 W4 W5  R S"
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    );
    assert_eq!(
        text(&four[1]),
        "RA0 F0 SA0  RA1 F1 SA1  RA2 F2 SA2 RG0 Bi0 SG0  RA3 F3 SA3 RG1 Bi1 SG1 W0 \
         RA4 F4 SA4 RG2 Bi2 SG2 W1  RA5 F5 SA5 RG3 Bi3 SG3 W2  RG4 Bi4 SG4 W3  RG5 Bi5 SG5 W4 \
         W5  R S"
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    );
}

/// Every chunk of every micro-batch is forwarded, then backwarded (whole, or input half then
/// weight half) exactly once on each rank; the streams run without deadlock or disorder.
fn check_complete(schedule: Schedule, ranks: usize, mbs: usize) -> Vec<Vec<Instr>> {
    let what = format!("{schedule:?} ({ranks} ranks, {mbs} micro-batches)");
    let streams = schedule.streams(ranks, mbs);
    simulate(&streams).unwrap_or_else(|e| panic!("{what}: {e}"));
    for (r, stream) in streams.iter().enumerate() {
        for chunk in 0..schedule.chunks() {
            for mb in 0..mbs {
                let pos = |i: Instr| {
                    let at: Vec<usize> = (0..stream.len()).filter(|&k| stream[k] == i).collect();
                    assert!(at.len() <= 1, "{what} rank {r}: {i:?} twice");
                    at.first().copied()
                };
                let f = pos(Instr::Forward { mb, chunk }).expect("forwarded");
                match schedule {
                    Schedule::ZeroBubbleH1 => {
                        let b = pos(Instr::BackwardInput { mb, chunk }).expect("input half");
                        let w = pos(Instr::BackwardWeight { mb, chunk }).expect("weight half");
                        assert!(f < b && b < w, "{what} rank {r} mb {mb}");
                    }
                    _ => {
                        let b = pos(Instr::Backward { mb, chunk }).expect("backwarded");
                        assert!(f < b, "{what} rank {r} mb {mb} chunk {chunk}");
                    }
                }
            }
        }
    }
    streams
}

#[test]
fn interleaved_and_zero_bubble_run_matched_and_bounded() {
    for (ranks, mbs) in [(2, 2), (2, 6), (4, 8), (3, 9), (4, 4)] {
        for chunks in [1, 2, 3] {
            let streams = check_complete(Schedule::Interleaved { chunks }, ranks, mbs);
            for (r, s) in streams.iter().enumerate() {
                // Megatron's warm-up bounds what a rank holds: its warm-up forwards plus one.
                let warmup = 2 * (ranks - r - 1) + (chunks - 1) * ranks;
                assert_eq!(
                    peak_in_flight(s),
                    (warmup + 1).min(mbs * chunks),
                    "rank {r}"
                );
            }
        }
    }
    for (ranks, mbs) in [(2, 3), (4, 8), (3, 5), (1, 3), (5, 2), (4, 1), (4, 16)] {
        let streams = check_complete(Schedule::ZeroBubbleH1, ranks, mbs);
        let one_f_one_b = Schedule::OneFOneB.streams(ranks, mbs);
        for s in &streams {
            // No rank holds more than 1F1B's first rank.
            assert_eq!(
                peak_in_flight(s),
                peak_in_flight(&one_f_one_b[0]),
                "{ranks}, {mbs}"
            );
        }
    }
}

/// The bubbles the simulator measures, with a forward and each half of a backward costing
/// one unit (a whole backward two): GPipe's and 1F1B's `(p − 1)/(m + p − 1)`, interleaved
/// 1F1B's `(p − 1)/(v·m + p − 1)` with each chunk a `v`-th of the work, and ZB-H1's
/// `(p − 1)/(3m + p − 1)`, a third of 1F1B's idle time.
#[test]
fn the_simulated_bubbles_are_the_schedules_own() {
    for (p, m) in [(2usize, 4usize), (4, 8), (4, 16), (3, 6)] {
        let (pf, mf) = (p as f64, m as f64);
        let want = (pf - 1.0) / (mf + pf - 1.0);
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            let t = simulate_timed(&schedule.streams(p, m), unit_cost(1)).unwrap();
            assert!(
                (t.bubble() - want).abs() < 1e-9,
                "{schedule:?} {p} {m}: {}",
                t.bubble()
            );
        }
        for v in [2usize, 3] {
            let s = Schedule::Interleaved { chunks: v };
            let t = simulate_timed(&s.streams(p, m), unit_cost(v)).unwrap();
            let want = (pf - 1.0) / (v as f64 * mf + pf - 1.0);
            assert!(
                (t.bubble() - want).abs() < 1e-9,
                "{s:?} {p} {m}: {} vs {want}",
                t.bubble()
            );
        }
        let zb = simulate_timed(&Schedule::ZeroBubbleH1.streams(p, m), unit_cost(1)).unwrap();
        let want = (pf - 1.0) / (3.0 * mf + pf - 1.0);
        assert!(
            (zb.bubble() - want).abs() < 1e-9,
            "ZB-H1 {p} {m}: {} vs {want}",
            zb.bubble()
        );
    }
}

/// Measured costs: equal ones give the unit-cost bubble back, and a last stage twice as slow
/// under 1F1B over 2 ranks and 2 micro-batches gives the timeline worked out by hand: rank 0
/// runs F0 [0,1], F1 [1,2], B0 [7,9], B1 [13,15]; rank 1 F0 [1,3], B0 [3,7], F1 [7,9],
/// B1 [9,13]; busy 6 + 12 of 2 × 15, a bubble of 0.4.
#[test]
fn bubbles_from_measured_costs() {
    let unit: StageCosts = [1.0, 2.0, 1.0, 1.0];
    for schedule in [Schedule::OneFOneB, Schedule::ZeroBubbleH1, Schedule::GPipe] {
        for (p, m) in [(2usize, 4usize), (4, 8), (3, 6)] {
            let measured = schedule.bubble_with(m, &vec![unit; p]);
            assert!(
                (measured - schedule.bubble(p, m)).abs() < 1e-9,
                "{schedule:?} {p} {m}: {measured}"
            );
        }
    }
    let slow_last: Vec<StageCosts> = vec![[1.0, 2.0, 0.0, 0.0], [2.0, 4.0, 0.0, 0.0]];
    let t = simulate_ranked(
        &Schedule::OneFOneB.streams(2, 2),
        crate::schedule::measured_cost(&slow_last),
    )
    .unwrap();
    assert_eq!(t.end, vec![15.0, 13.0]);
    assert_eq!(t.busy, vec![6.0, 12.0]);
    assert!((Schedule::OneFOneB.bubble_with(2, &slow_last) - 0.4).abs() < 1e-12);
}

#[test]
fn bad_shapes_are_refused_by_name() {
    let interleaved = Schedule::Interleaved { chunks: 2 };
    assert!(
        interleaved
            .check(2, 3)
            .unwrap_err()
            .contains("not a multiple of 2")
    );
    assert!(
        interleaved
            .check(1, 4)
            .unwrap_err()
            .contains("at least 2 pipeline ranks")
    );
    assert!(Schedule::Interleaved { chunks: 0 }.check(2, 4).is_err());
    assert!(Schedule::OneFOneB.check(0, 4).is_err());
    assert!(Schedule::ZeroBubbleH1.check(2, 0).is_err());
}

#[test]
fn schedules_parse_by_name() {
    assert_eq!("1F1B".parse(), Ok(Schedule::OneFOneB));
    assert_eq!("gpipe".parse(), Ok(Schedule::GPipe));
    assert_eq!("zb-h1".parse(), Ok(Schedule::ZeroBubbleH1));
    assert_eq!(
        "interleaved:3".parse(),
        Ok(Schedule::Interleaved { chunks: 3 })
    );
    let bad = "interleaved:0".parse::<Schedule>().unwrap_err();
    assert!(bad.contains("positive integer"), "{bad}");
    let bad = "pipedream".parse::<Schedule>().unwrap_err();
    assert!(
        bad.contains("\"pipedream\"") && bad.contains("zb-h1"),
        "{bad}"
    );
}
