//! `SubComm`: a communicator over some ranks of another (the groups of a process grid's axis,
//! DeepSpeed's sub-groups), built from the parent's point-to-point messages, so any transport
//! (in-process threads, TCP, NCCL's side channel) gets sub-communicators without a connection
//! of its own. A collective sends this rank's call and input to every other member and reads
//! theirs, so a call made differently on two members fails naming both; meant for the small
//! groups of model and pipeline parallelism.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::base::*;
use super::exchange::Exchange;
use super::flight::FlightRecorder;
use super::reduce::Payload;

/// The members `members` (ranks of `parent`, in the sub-group's rank order) of a group this
/// rank belongs to.
pub struct SubComm {
    parent: Arc<dyn Communicator>,
    members: Vec<usize>,
    rank: usize,
    seq: AtomicU64,
    flight: FlightRecorder,
}

impl SubComm {
    /// The sub-group of `parent` made of `members` (its ranks, distinct, this rank among
    /// them); every member must create it with the same list.
    pub fn new(parent: Arc<dyn Communicator>, members: Vec<usize>) -> Result<Self, String> {
        let me = parent.rank();
        let world = parent.world_size();
        if let Some(m) = members.iter().find(|m| **m >= world) {
            return Err(format!(
                "sub-group member {m} is not a rank of a group of {world}"
            ));
        }
        let mut sorted = members.clone();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != members.len() {
            return Err(format!("sub-group {members:?} names a rank twice"));
        }
        let rank = members
            .iter()
            .position(|m| *m == me)
            .ok_or_else(|| format!("rank {me} is not in the sub-group {members:?}"))?;
        Ok(Self {
            parent,
            members,
            rank,
            seq: AtomicU64::new(0),
            flight: FlightRecorder::default(),
        })
    }

    /// The parent's ranks of the members, in this group's rank order.
    pub fn members(&self) -> &[usize] {
        &self.members
    }
}

/// Elements of a call's header: kind, operand, dtype, then the count and the label in 16-bit
/// digits (exact in f32).
const HEADER: usize = 3 + 4 + 4;

fn digits(v: u64) -> [f32; 4] {
    [0, 16, 32, 48].map(|s| ((v >> s) & 0xffff) as f32)
}

fn undigits(d: &[f32]) -> u64 {
    d.iter()
        .enumerate()
        .map(|(i, v)| (*v as u64) << (16 * i))
        .sum()
}

fn encode(call: &OpSignature) -> [f32; HEADER] {
    let (kind, operand) = match call.kind {
        OpKind::AllReduce(op) => (0, op as u64),
        OpKind::ReduceScatter(op) => (1, op as u64),
        OpKind::AllGather => (2, 0),
        OpKind::Broadcast { root } => (3, root as u64),
        OpKind::Barrier => (4, 0),
        OpKind::PointToPoint => (5, 0),
    };
    let dtype = match call.dtype {
        DType::F32 => 0.0,
        DType::Bf16 => 1.0,
        DType::F16 => 2.0,
    };
    let mut out = [0.0; HEADER];
    out[0] = kind as f32;
    out[1] = operand as f32;
    out[2] = dtype;
    out[3..7].copy_from_slice(&digits(call.count as u64));
    out[7..].copy_from_slice(&digits(call.label));
    out
}

fn decode(h: &[f32]) -> Option<OpSignature> {
    let operand = h[1] as u64;
    let op = |o: u64| {
        [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max]
            .into_iter()
            .find(|r| *r as u64 == o)
    };
    let kind = match h[0] as u8 {
        0 => OpKind::AllReduce(op(operand)?),
        1 => OpKind::ReduceScatter(op(operand)?),
        2 => OpKind::AllGather,
        3 => OpKind::Broadcast {
            root: operand as usize,
        },
        4 => OpKind::Barrier,
        5 => OpKind::PointToPoint,
        _ => return None,
    };
    let dtype = [DType::F32, DType::Bf16, DType::F16]
        .get(h[2] as usize)
        .copied()?;
    Some(OpSignature {
        kind,
        dtype,
        count: undigits(&h[3..7]) as usize,
        label: undigits(&h[7..]),
    })
}

fn zeros(dtype: DType, n: usize) -> Payload {
    match dtype {
        DType::F32 => Payload::F32(vec![0.0; n]),
        DType::Bf16 => Payload::Bf16(vec![half::bf16::ZERO; n]),
        DType::F16 => Payload::F16(vec![half::f16::ZERO; n]),
    }
}

impl SubComm {
    fn send_payload(&self, peer: usize, payload: &Payload) -> Result<(), CommError> {
        self.parent.send(payload.as_buf(), self.members[peer])
    }

    fn recv_payload(&self, peer: usize, call: OpSignature) -> Result<Payload, CommError> {
        let mut payload = zeros(call.dtype, call.count);
        let buf: BufMut<'_> = match &mut payload {
            Payload::F32(v) => v.as_mut_slice().into(),
            Payload::Bf16(v) => v.as_mut_slice().into(),
            Payload::F16(v) => v.as_mut_slice().into(),
        };
        self.parent.recv(buf, self.members[peer])?;
        Ok(payload)
    }

    /// Sends `call`'s header to `peer`; reads `peer`'s and checks it against `call`.
    fn headers(&self, peers: &[usize], call: OpSignature, seq: u64) -> Result<(), CommError> {
        let header = encode(&call);
        for &p in peers {
            self.parent
                .send(header.as_slice().into(), self.members[p])?;
        }
        for &p in peers {
            let mut theirs = [0.0f32; HEADER];
            self.parent
                .recv(theirs.as_mut_slice().into(), self.members[p])?;
            let theirs = decode(&theirs).ok_or_else(|| {
                CommError::Aborted(format!("rank {p} sent an unreadable call header"))
            })?;
            let same = theirs.kind == call.kind
                && theirs.dtype == call.dtype
                && theirs.label == call.label
                && theirs.count == call.count;
            if !same {
                return Err(CommError::Mismatch {
                    seq,
                    rank_a: self.rank,
                    call_a: call,
                    rank_b: p,
                    call_b: theirs,
                });
            }
        }
        Ok(())
    }
}

impl Exchange for SubComm {
    fn flight(&self) -> &FlightRecorder {
        &self.flight
    }

    /// A sub-group's calls wait in its parent's messages: the parent's timeout holds them.
    fn set_timeout(&self, timeout: Duration) {
        self.parent.set_timeout(timeout)
    }

    fn timeout(&self) -> Duration {
        self.parent.timeout()
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.members.len()
    }

    fn exchange(&self, call: OpSignature, input: Payload) -> Result<Vec<Arc<Payload>>, CommError> {
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let peers: Vec<usize> = (0..self.members.len())
            .filter(|p| *p != self.rank)
            .collect();
        self.headers(&peers, call, seq)?;
        // A broadcast only needs the root's values.
        let root = match call.kind {
            OpKind::Broadcast { root } => Some(root),
            _ => None,
        };
        if root.is_none_or(|r| r == self.rank) {
            for &p in &peers {
                self.send_payload(p, &input)?;
            }
        }
        let input = Arc::new(input);
        let mut inputs = vec![input.clone(); self.members.len()];
        for &p in &peers {
            if root.is_none_or(|r| r == p) {
                inputs[p] = Arc::new(self.recv_payload(p, call)?);
            }
        }
        Ok(inputs)
    }

    fn post(&self, peer: usize, _call: OpSignature, payload: Payload) -> Result<(), CommError> {
        self.send_payload(peer, &payload)
    }

    fn take(&self, peer: usize, call: OpSignature) -> Result<Payload, CommError> {
        self.recv_payload(peer, call)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::run_ranks;

    /// Ranks 0..7 split in groups {6, 1, 3} (out of order), {0, 5} and {2, 4}: each group's
    /// collectives see only its members, in the group's order, with uneven sizes.
    #[test]
    fn sub_groups_reduce_gather_and_message_among_their_members_only() {
        let groups = [vec![6, 1, 3], vec![0, 5], vec![2, 4]];
        let results = run_ranks(7, |ctx| {
            let me = ctx.rank;
            let parent: Arc<dyn Communicator> = Arc::new(ctx.comm);
            let members = groups.iter().find(|g| g.contains(&me)).unwrap().clone();
            let sub = SubComm::new(parent, members.clone()).unwrap();
            let mut sum = [me as f32, 1.0, 0.5];
            sub.all_reduce(sum.as_mut_slice().into(), ReduceOp::Sum)
                .unwrap();
            let mut gathered = vec![0.0f32; 2 * members.len()];
            sub.all_gather(
                [me as f32, -(me as f32)].as_slice().into(),
                gathered.as_mut_slice().into(),
            )
            .unwrap();
            let mut root = [me as f32; 4];
            sub.broadcast(root.as_mut_slice().into(), members.len() - 1)
                .unwrap();
            let mut mine = vec![0.0f32; 1];
            let full: Vec<f32> = (0..members.len()).map(|i| (i * 10 + me) as f32).collect();
            sub.reduce_scatter(
                full.as_slice().into(),
                mine.as_mut_slice().into(),
                ReduceOp::Max,
            )
            .unwrap();
            // A ring of messages within the group.
            let (r, n) = (Communicator::rank(&sub), members.len());
            sub.send([r as f32; 5].as_slice().into(), (r + 1) % n)
                .unwrap();
            let mut from = [0.0f32; 5];
            sub.recv(from.as_mut_slice().into(), (r + n - 1) % n)
                .unwrap();
            sub.barrier().unwrap();
            (members, sum, gathered, root, mine[0], from[0])
        });
        for (me, (members, sum, gathered, root, mine, from)) in results.into_iter().enumerate() {
            let total: f32 = members.iter().map(|m| *m as f32).sum();
            let n = members.len();
            assert_eq!(sum, [total, n as f32, 0.5 * n as f32], "rank {me}");
            let want: Vec<f32> = members
                .iter()
                .flat_map(|m| [*m as f32, -(*m as f32)])
                .collect();
            assert_eq!(gathered, want, "rank {me}");
            assert_eq!(root, [*members.last().unwrap() as f32; 4], "rank {me}");
            let r = members.iter().position(|m| *m == me).unwrap();
            let max = members
                .iter()
                .map(|m| (r * 10 + m) as f32)
                .fold(f32::MIN, f32::max);
            assert_eq!(mine, max, "rank {me}");
            assert_eq!(from, ((r + n - 1) % n) as f32, "rank {me}");
        }
    }

    #[test]
    fn different_calls_in_one_sub_group_fail_naming_both() {
        let results = run_ranks(2, |ctx| {
            let rank = ctx.rank;
            let sub = SubComm::new(Arc::new(ctx.comm), vec![1, 0]).unwrap();
            let mut buf = [1.0f32; 3];
            if rank == 0 {
                sub.all_reduce(buf.as_mut_slice().into(), ReduceOp::Sum)
            } else {
                sub.broadcast(buf.as_mut_slice().into(), 0)
            }
            .unwrap_err()
            .to_string()
        });
        for e in results {
            assert!(e.contains("mismatch") && e.contains("broadcast"), "{e}");
        }
    }

    #[test]
    fn bad_member_lists_are_refused() {
        run_ranks(3, |ctx| {
            let parent: Arc<dyn Communicator> = Arc::new(ctx.comm);
            let outside = SubComm::new(parent.clone(), vec![0, 3]).err().unwrap();
            assert!(outside.contains("member 3"), "{outside}");
            let twice = SubComm::new(parent.clone(), vec![0, 1, 2, 1])
                .err()
                .unwrap();
            assert!(twice.contains("twice"), "{twice}");
            let me = parent.rank();
            let others: Vec<usize> = (0..3).filter(|r| *r != me).collect();
            let absent = SubComm::new(parent, others).err().unwrap();
            assert!(absent.contains("not in the sub-group"), "{absent}");
        });
    }
}
