//! Collective semantics shared by every host transport.
//!
//! A transport ([`Exchange`]) only moves payloads: it deposits this rank's input of a collective
//! and returns every rank's input, checked against this rank's call, and it posts and takes
//! point-to-point messages. Everything else — argument checks, reductions in rank order (so every
//! rank gets the same bits), chunking — is written once here for all of them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::base::*;
use super::flight::FlightRecorder;
use super::flight_report::with_record;
use super::reduce::{Payload, reduce_chunk};

/// A way for host buffers to travel between ranks.
pub(crate) trait Exchange: Send + Sync {
    /// This rank.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world_size(&self) -> usize;
    /// Contributes `input` to the next collective, whose signature every rank must agree on,
    /// and returns every rank's input in rank order.
    fn exchange(&self, call: OpSignature, input: Payload) -> Result<Vec<Arc<Payload>>, CommError>;
    /// Sends a point-to-point message to `peer`.
    fn post(&self, peer: usize, call: OpSignature, payload: Payload) -> Result<(), CommError>;
    /// Receives the next point-to-point message from `peer`, which must match `call`.
    fn take(&self, peer: usize, call: OpSignature) -> Result<Payload, CommError>;
    /// This rank's record of its last calls on this communicator.
    fn flight(&self) -> &FlightRecorder;
    /// Changes how long this rank's calls wait for the others.
    fn set_timeout(&self, timeout: Duration);
    /// How long this rank's calls wait for the others.
    fn timeout(&self) -> Duration;
    /// Whether a timeout prints this rank's `FlightReport` line (one process per rank, where
    /// the launcher reads them; thread ranks keep it in the error only).
    fn reports_timeouts(&self) -> bool {
        false
    }
}

/// `run` (one call of signature `call`) recorded in `t`'s flight recorder; a timeout carries
/// the record out.
fn recorded<T: Exchange + ?Sized, R>(
    t: &T,
    call: OpSignature,
    run: impl FnOnce() -> Result<R, CommError>,
) -> Result<R, CommError> {
    let seq = t.flight().start(call);
    match run() {
        Ok(out) => {
            t.flight().end(seq);
            Ok(out)
        }
        Err(e) => Err(with_record(e, t.flight().record(), t.reports_timeouts())),
    }
}

/// The next point-to-point sequence number for `peer` (each direction of a pair counts its own).
pub(crate) fn next_seq(counters: &Mutex<HashMap<usize, u64>>, peer: usize) -> u64 {
    let mut counters = counters.lock().unwrap_or_else(|e| e.into_inner());
    let seq = counters.entry(peer).or_insert(0);
    *seq += 1;
    *seq - 1
}

fn signature(kind: OpKind, input: &Buf<'_>) -> OpSignature {
    OpSignature::new(kind, input.dtype(), input.len())
}

fn invalid(rank: usize, call: OpSignature, reason: String) -> CommError {
    CommError::Invalid { rank, call, reason }
}

fn check_peer<T: Exchange + ?Sized>(
    t: &T,
    call: OpSignature,
    peer: usize,
) -> Result<(), CommError> {
    if peer >= t.world_size() {
        return Err(invalid(
            t.rank(),
            call,
            format!("peer {peer} is outside a group of {}", t.world_size()),
        ));
    }
    Ok(())
}

fn check_pair<T: Exchange + ?Sized>(
    t: &T,
    call: OpSignature,
    input: &Buf<'_>,
    output: &BufMut<'_>,
    expected_total: usize,
) -> Result<(), CommError> {
    if input.dtype() != output.dtype() {
        return Err(invalid(
            t.rank(),
            call,
            format!("output is {}, input {}", output.dtype(), input.dtype()),
        ));
    }
    let total = if matches!(call.kind, OpKind::AllGather) {
        output.len()
    } else {
        input.len()
    };
    if total != expected_total {
        return Err(invalid(
            t.rank(),
            call,
            format!(
                "input has {} and output {} elements; with {} ranks the full buffer must be \
                 world_size x the chunk (pad it, see burn_zero::partition)",
                input.len(),
                output.len(),
                t.world_size()
            ),
        ));
    }
    Ok(())
}

impl<T: Exchange> Communicator for T {
    fn rank(&self) -> usize {
        Exchange::rank(self)
    }

    fn set_timeout(&self, timeout: Duration) {
        Exchange::set_timeout(self, timeout)
    }

    fn timeout(&self) -> Duration {
        Exchange::timeout(self)
    }

    fn world_size(&self) -> usize {
        Exchange::world_size(self)
    }

    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<(), CommError> {
        let call = signature(OpKind::AllReduce(op), &buf.as_buf());
        let inputs = recorded(self, call, || {
            self.exchange(call, Payload::copy_of(buf.as_buf()))
        })?;
        reduce_chunk(&inputs, 0, op, buf);
        Ok(())
    }

    fn reduce_scatter(
        &self,
        input: Buf<'_>,
        output: BufMut<'_>,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let call = signature(OpKind::ReduceScatter(op), &input);
        check_pair(
            self,
            call,
            &input,
            &output,
            output.len() * Exchange::world_size(self),
        )?;
        let inputs = recorded(self, call, || self.exchange(call, Payload::copy_of(input)))?;
        let chunk = output.len();
        reduce_chunk(&inputs, Exchange::rank(self) * chunk, op, output);
        Ok(())
    }

    fn all_gather(&self, input: Buf<'_>, mut output: BufMut<'_>) -> Result<(), CommError> {
        let call = signature(OpKind::AllGather, &input);
        check_pair(
            self,
            call,
            &input,
            &output,
            input.len() * Exchange::world_size(self),
        )?;
        let inputs = recorded(self, call, || self.exchange(call, Payload::copy_of(input)))?;
        let chunk = input.len();
        for (rank, part) in inputs.iter().enumerate() {
            part.copy_range_into(0..chunk, &mut output, rank * chunk);
        }
        Ok(())
    }

    fn broadcast(&self, mut buf: BufMut<'_>, root: usize) -> Result<(), CommError> {
        let call = signature(OpKind::Broadcast { root }, &buf.as_buf());
        check_peer(self, call, root)?;
        let inputs = recorded(self, call, || {
            self.exchange(call, Payload::copy_of(buf.as_buf()))
        })?;
        if root != Exchange::rank(self) {
            inputs[root].copy_range_into(0..buf.len(), &mut buf, 0);
        }
        Ok(())
    }

    fn barrier(&self) -> Result<(), CommError> {
        let call = signature(OpKind::Barrier, &Buf::F32(&[]));
        recorded(self, call, || self.exchange(call, Payload::F32(Vec::new()))).map(|_| ())
    }

    fn send(&self, buf: Buf<'_>, peer: usize) -> Result<(), CommError> {
        let call = signature(OpKind::PointToPoint, &buf);
        check_peer(self, call, peer)?;
        recorded(self, call, || self.post(peer, call, Payload::copy_of(buf)))
    }

    fn recv(&self, mut buf: BufMut<'_>, peer: usize) -> Result<(), CommError> {
        let call = signature(OpKind::PointToPoint, &buf.as_buf());
        check_peer(self, call, peer)?;
        let payload = recorded(self, call, || self.take(peer, call))?;
        payload.copy_range_into(0..buf.len(), &mut buf, 0);
        Ok(())
    }
}
