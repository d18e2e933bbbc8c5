//! Each rank's computations in order, before any message: forwards and backwards (split
//! into input and weight halves for zero-bubble schedules), by micro-batch and chunk.

use super::{Instr, Schedule};

/// Every rank's computations for `schedule` (already [`Schedule::check`]ed).
pub(super) fn orders(schedule: Schedule, ranks: usize, micro_batches: usize) -> Vec<Vec<Instr>> {
    match schedule {
        Schedule::GPipe => (0..ranks).map(|_| gpipe(micro_batches)).collect(),
        Schedule::OneFOneB => (0..ranks)
            .map(|r| one_f_one_b(ranks, micro_batches, r))
            .collect(),
        Schedule::Interleaved { chunks } => (0..ranks)
            .map(|r| interleaved(ranks, chunks, micro_batches, r))
            .collect(),
        Schedule::ZeroBubbleH1 => (0..ranks)
            .map(|r| zero_bubble_h1(ranks, micro_batches, r))
            .collect(),
    }
}

fn f(mb: usize) -> Instr {
    Instr::Forward { mb, chunk: 0 }
}

fn b(mb: usize) -> Instr {
    Instr::Backward { mb, chunk: 0 }
}

fn gpipe(m: usize) -> Vec<Instr> {
    (0..m).map(f).chain((0..m).map(b)).collect()
}

/// A warm-up of `ranks - rank - 1` forwards, then a forward and a backward in turn, then the
/// remaining backwards.
fn one_f_one_b(ranks: usize, m: usize, rank: usize) -> Vec<Instr> {
    let warmup = (ranks - rank - 1).min(m);
    let mut out: Vec<Instr> = (0..warmup).map(f).collect();
    for i in 0..m - warmup {
        out.extend([f(warmup + i), b(i)]);
    }
    out.extend((m - warmup..m).map(b));
    out
}

/// Megatron-LM's interleaved order: the `k`-th forward runs micro-batch
/// `(k / (p·v))·p + k mod p` on chunk `(k mod p·v) / p`, so each group of `p` micro-batches
/// goes through chunk 0, then chunk 1, ...; backwards walk the chunks in reverse. Rank `r`
/// warms up with `2(p − r − 1) + (v − 1)p` forwards, then alternates.
fn interleaved(p: usize, v: usize, m: usize, rank: usize) -> Vec<Instr> {
    let total = m * v;
    let group = p * v;
    let mb = |k: usize| (k / group) * p + k % p;
    let forward = |k: usize| Instr::Forward {
        mb: mb(k),
        chunk: (k % group) / p,
    };
    let backward = |k: usize| Instr::Backward {
        mb: mb(k),
        chunk: v - 1 - (k % group) / p,
    };
    let warmup = (2 * (p - rank - 1) + (v - 1) * p).min(total);
    let mut out: Vec<Instr> = (0..warmup).map(forward).collect();
    for i in 0..total - warmup {
        out.extend([forward(warmup + i), backward(i)]);
    }
    out.extend((total - warmup..total).map(backward));
    out
}

/// ZB-H1 (Qi et al., 2023): 1F1B's order of forwards and input gradients, each input
/// gradient `k` followed by the weight gradient of micro-batch `k − rank`; the last
/// `rank` weight gradients close the step. Rank `r` thus holds at most `p` micro-batches
/// (1F1B's peak, reached on its first rank), and with unit-time halves its weight gradients
/// fill all but `p − 1` of the units 1F1B waits: the bubble falls from `3(p − 1)` units per rank
/// to `p − 1`.
fn zero_bubble_h1(p: usize, m: usize, rank: usize) -> Vec<Instr> {
    let warmup = (p - rank - 1).min(m);
    let mut out: Vec<Instr> = (0..warmup).map(f).collect();
    let mut next_w = 0;
    let mut input_half = |out: &mut Vec<Instr>, mb: usize| {
        out.push(Instr::BackwardInput { mb, chunk: 0 });
        if mb >= rank {
            out.push(Instr::BackwardWeight {
                mb: mb - rank,
                chunk: 0,
            });
            next_w = mb - rank + 1;
        }
    };
    for i in 0..m - warmup {
        out.push(f(warmup + i));
        input_half(&mut out, i);
    }
    (m - warmup..m).for_each(|mb| input_half(&mut out, mb));
    out.extend((next_w..m).map(|mb| Instr::BackwardWeight { mb, chunk: 0 }));
    out
}
