//! The schedules' streams written out by hand for small pipelines, and their properties for
//! more: every micro-batch forwarded then backwarded once per stage, messages matched in
//! order without deadlock, and 1F1B's bound on live micro-batches.

use crate::schedule::{Instr, Schedule, peak_in_flight, simulate};

/// `L0 RA0 F0 SA0 RG0 B0 SG0 R S`, space-separated.
fn text(stream: &[Instr]) -> String {
    let token = |i: &Instr| match i {
        Instr::Load { mb } => format!("L{mb}"),
        Instr::RecvActivation { mb } => format!("RA{mb}"),
        Instr::Forward { mb } => format!("F{mb}"),
        Instr::SendActivation { mb } => format!("SA{mb}"),
        Instr::RecvGrad { mb } => format!("RG{mb}"),
        Instr::Backward { mb } => format!("B{mb}"),
        Instr::SendGrad { mb } => format!("SG{mb}"),
        Instr::ReduceGrads => "R".into(),
        Instr::OptimizerStep => "S".into(),
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
                    let (f, b) = (pos(Instr::Forward { mb }), pos(Instr::Backward { mb }));
                    assert!(
                        f.is_some() && b.is_some() && f < b,
                        "{what} stage {s} mb {mb}"
                    );
                    let count = |i: Instr| stream.iter().filter(|x| **x == i).count();
                    assert_eq!(count(Instr::Forward { mb }), 1, "{what}");
                    assert_eq!(count(Instr::Backward { mb }), 1, "{what}");
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
            Instr::SendActivation { mb: 0 },
            Instr::SendActivation { mb: 1 },
        ],
        vec![
            Instr::RecvActivation { mb: 1 },
            Instr::RecvActivation { mb: 0 },
        ],
    ];
    assert!(
        simulate(&streams)
            .unwrap_err()
            .contains("expects micro-batch 1")
    );
    // Both stages receive first.
    let streams = vec![
        vec![Instr::RecvGrad { mb: 0 }, Instr::SendActivation { mb: 0 }],
        vec![Instr::RecvActivation { mb: 0 }, Instr::SendGrad { mb: 0 }],
    ];
    assert!(simulate(&streams).unwrap_err().contains("deadlock"));
    // A send nobody receives.
    let streams = vec![vec![Instr::SendActivation { mb: 0 }], vec![]];
    assert!(simulate(&streams).unwrap_err().contains("nobody received"));
}
