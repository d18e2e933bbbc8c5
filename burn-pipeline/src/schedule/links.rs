//! The messages around each rank's computations: a forward sends its activation to the next
//! virtual stage's rank and a backward (or its input half) sends the input's gradient to the
//! previous one; each computation first receives what it needs. A rank receives from a
//! neighbour in exactly the order the neighbour sends (one ordered link per pair of ranks,
//! whatever the messages carry), so before the message it needs it takes the ones sent ahead
//! of it, which its executor keeps until their computation.

use std::collections::VecDeque;

use super::Instr;

/// The send that goes with computation `op`, if it has a peer to send to.
fn send_of(op: Instr, rank: usize, ranks: usize, chunks: usize) -> Option<Instr> {
    let send = match op {
        Instr::Forward { mb, chunk } => Instr::SendActivation { mb, chunk },
        Instr::Backward { mb, chunk } | Instr::BackwardInput { mb, chunk } => {
            Instr::SendGrad { mb, chunk }
        }
        _ => return None,
    };
    send.peer(rank, ranks, chunks).map(|_| send)
}

/// The message computation `op` of `rank` needs, as `(from rank, the receive)`.
fn needed(op: Instr, rank: usize, ranks: usize, chunks: usize) -> Option<(usize, Instr)> {
    let recv = match op {
        Instr::Forward { mb, chunk } => Instr::RecvActivation { mb, chunk },
        Instr::Backward { mb, chunk } | Instr::BackwardInput { mb, chunk } => {
            Instr::RecvGrad { mb, chunk }
        }
        _ => return None,
    };
    recv.peer(rank, ranks, chunks)
}

/// Every rank's stream from every rank's computations (`orders[rank]`) over `chunks` chunks.
pub(super) fn with_messages(orders: &[Vec<Instr>], chunks: usize) -> Vec<Vec<Instr>> {
    let ranks = orders.len();
    let last = ranks * chunks - 1;
    // incoming[to][from]: the receives `to` must post for `from`, in `from`'s send order.
    let mut incoming = vec![vec![VecDeque::new(); ranks]; ranks];
    for (from, order) in orders.iter().enumerate() {
        for &op in order {
            let sent = send_of(op, from, ranks, chunks).and_then(|s| s.peer(from, ranks, chunks));
            if let Some((to, recv)) = sent {
                incoming[to][from].push_back(recv);
            }
        }
    }
    let mut streams = Vec::with_capacity(ranks);
    for (rank, order) in orders.iter().enumerate() {
        let mut out = Vec::new();
        // Receives already posted ahead of their computation.
        let mut posted = std::collections::HashSet::new();
        for &op in order {
            if let Instr::Forward { mb, chunk } = op {
                let vs = chunk * ranks + rank;
                if vs == 0 || vs == last {
                    out.push(Instr::Load { mb, chunk });
                }
            }
            if let Some((from, want)) = needed(op, rank, ranks, chunks)
                && !posted.remove(&want)
            {
                loop {
                    let recv = incoming[rank][from].pop_front().unwrap_or_else(|| {
                        panic!("rank {rank}: {want:?} from rank {from} is never sent")
                    });
                    out.push(recv);
                    if recv == want {
                        break;
                    }
                    posted.insert(recv);
                }
            }
            out.push(op);
            out.extend(send_of(op, rank, ranks, chunks));
        }
        streams.push(out);
    }
    streams
}

#[cfg(test)]
mod tests {
    use super::super::simulate;
    use super::*;

    /// A rank that computes in another order than its neighbour sends receives the message it
    /// does not need yet first, and keeps it: no schedule here does that today, a custom one
    /// may.
    #[test]
    fn a_message_sent_ahead_is_received_ahead_and_not_again() {
        let f = |mb| Instr::Forward { mb, chunk: 0 };
        let b = |mb| Instr::Backward { mb, chunk: 0 };
        let orders = vec![vec![f(0), f(1), b(1), b(0)], vec![f(1), b(1), f(0), b(0)]];
        let streams = with_messages(&orders, 1);
        let ra = |mb| Instr::RecvActivation { mb, chunk: 0 };
        let sg = |mb| Instr::SendGrad { mb, chunk: 0 };
        let load = |mb| Instr::Load { mb, chunk: 0 };
        assert_eq!(
            streams[1],
            [
                load(1),
                ra(0),
                ra(1),
                f(1),
                b(1),
                sg(1),
                load(0),
                f(0),
                b(0),
                sg(0)
            ]
        );
        simulate(&streams).unwrap();
    }
}
