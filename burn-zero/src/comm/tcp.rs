//! `TcpComm`: ranks as separate processes (or hosts) talking over TCP. The CPU multi-process
//! path, exercised in CI through the launcher; GPUs use NCCL.
//!
//! Every pair of ranks has one connection per direction. A reader thread per incoming
//! connection files frames into a mailbox; collectives send this rank's input to every peer
//! and read every peer's (O(N²) traffic: meant for CPU runs and tests, not for speed). A peer
//! that disconnects fails the waiting call at once, naming it.

use std::collections::{HashMap, VecDeque};
use std::io::{BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::base::*;
use super::exchange::{Exchange, next_seq};
use super::flight::FlightRecorder;
use super::reduce::Payload;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Channel {
    Collective = 0,
    PointToPoint = 1,
}

struct Frame {
    channel: Channel,
    seq: u64,
    call: OpSignature,
    payload: Payload,
}

const HELLO: &[u8; 4] = b"BZ02";
/// How long an accepted connection has to say which rank it is.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

fn encode_call(call: &OpSignature, out: &mut Vec<u8>) {
    let (kind, op, root) = match call.kind {
        OpKind::AllReduce(op) => (0u8, op as u8, 0u32),
        OpKind::ReduceScatter(op) => (1, op as u8, 0),
        OpKind::AllGather => (2, 0, 0),
        OpKind::Broadcast { root } => (3, 0, root as u32),
        OpKind::Barrier => (4, 0, 0),
        OpKind::PointToPoint => (5, 0, 0),
    };
    out.extend_from_slice(&[kind, op]);
    out.extend_from_slice(&root.to_le_bytes());
    out.push(call.dtype as u8);
    out.extend_from_slice(&(call.count as u64).to_le_bytes());
    out.push(0); // pad to 16 bytes
    out.extend_from_slice(&call.label.to_le_bytes());
}

/// Bytes of an encoded [`OpSignature`].
const CALL_BYTES: usize = 24;

fn decode_call(b: &[u8; CALL_BYTES]) -> Option<OpSignature> {
    let op = match b[1] {
        0 => ReduceOp::Sum,
        1 => ReduceOp::Avg,
        2 => ReduceOp::Max,
        _ => return None,
    };
    let root = u32::from_le_bytes([b[2], b[3], b[4], b[5]]) as usize;
    let kind = match b[0] {
        0 => OpKind::AllReduce(op),
        1 => OpKind::ReduceScatter(op),
        2 => OpKind::AllGather,
        3 => OpKind::Broadcast { root },
        4 => OpKind::Barrier,
        5 => OpKind::PointToPoint,
        _ => return None,
    };
    let dtype = match b[6] {
        0 => DType::F32,
        1 => DType::Bf16,
        2 => DType::F16,
        _ => return None,
    };
    let count = u64::from_le_bytes(b[7..15].try_into().ok()?) as usize;
    let label = u64::from_le_bytes(b[16..24].try_into().ok()?);
    Some(OpSignature {
        kind,
        dtype,
        count,
        label,
    })
}

fn write_frame(stream: &mut TcpStream, frame: &Frame) -> std::io::Result<()> {
    let mut bytes = Vec::with_capacity(64 + frame.call.count * 4);
    bytes.push(frame.channel as u8);
    bytes.extend_from_slice(&frame.seq.to_le_bytes());
    encode_call(&frame.call, &mut bytes);
    let mut payload = Vec::new();
    frame.payload.write_le(&mut payload);
    bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&payload);
    stream.write_all(&bytes)
}

fn read_frame(reader: &mut impl Read) -> std::io::Result<Frame> {
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
    let mut head = [0u8; 1 + 8 + CALL_BYTES + 8];
    reader.read_exact(&mut head)?;
    let channel = match head[0] {
        0 => Channel::Collective,
        1 => Channel::PointToPoint,
        _ => return Err(bad("unknown channel")),
    };
    let seq = u64::from_le_bytes(head[1..9].try_into().expect("8 bytes"));
    let call = decode_call(head[9..9 + CALL_BYTES].try_into().expect("a call"))
        .ok_or_else(|| bad("unknown call"))?;
    let at = 9 + CALL_BYTES;
    let len = u64::from_le_bytes(head[at..at + 8].try_into().expect("8 bytes")) as usize;
    let mut payload = vec![0u8; len];
    reader.read_exact(&mut payload)?;
    Ok(Frame {
        channel,
        seq,
        call,
        payload: Payload::read_le(call.dtype, &payload),
    })
}

#[derive(Default)]
struct Mail {
    queues: HashMap<(usize, Channel), VecDeque<Frame>>,
    gone: HashMap<usize, String>,
    aborted: Option<String>,
}

/// Frames received from peers, filed by sender and channel.
#[derive(Default)]
struct Mailbox {
    mail: Mutex<Mail>,
    changed: Condvar,
}

impl Mailbox {
    fn lock(&self) -> MutexGuard<'_, Mail> {
        self.mail.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads frames from `peer` until it disconnects.
    fn serve(self: Arc<Self>, peer: usize, stream: TcpStream) {
        let mut reader = BufReader::with_capacity(1 << 20, stream);
        loop {
            match read_frame(&mut reader) {
                Ok(frame) => {
                    self.lock()
                        .queues
                        .entry((peer, frame.channel))
                        .or_default()
                        .push_back(frame);
                    self.changed.notify_all();
                }
                Err(e) => {
                    let why = if e.kind() == std::io::ErrorKind::UnexpectedEof {
                        "disconnected (exited or crashed)".to_string()
                    } else {
                        format!("connection failed: {e}")
                    };
                    self.lock().gone.insert(peer, why);
                    self.changed.notify_all();
                    return;
                }
            }
        }
    }

    fn next(
        &self,
        me: usize,
        peer: usize,
        channel: Channel,
        call: OpSignature,
        seq: u64,
        timeout: Duration,
    ) -> Result<Frame, CommError> {
        let deadline = Instant::now() + timeout;
        let mut mail = self.lock();
        loop {
            if let Some(reason) = &mail.aborted {
                return Err(CommError::Aborted(reason.clone()));
            }
            if let Some(frame) = mail
                .queues
                .get_mut(&(peer, channel))
                .and_then(VecDeque::pop_front)
            {
                return Ok(frame);
            }
            if let Some(why) = mail.gone.get(&peer) {
                let reason =
                    format!("rank {peer} {why}, while rank {me} waited in {call} (#{seq})");
                mail.aborted.get_or_insert(reason.clone());
                return Err(CommError::Aborted(reason));
            }
            let now = Instant::now();
            if now >= deadline {
                let failure = CommError::Timeout {
                    rank: me,
                    call,
                    seq,
                    missing: vec![peer],
                    timeout,
                    recent: Default::default(),
                };
                mail.aborted.get_or_insert(failure.to_string());
                return Err(failure);
            }
            mail = self
                .changed
                .wait_timeout(mail, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn abort(&self, reason: String) -> CommError {
        self.lock().aborted.get_or_insert(reason.clone());
        self.changed.notify_all();
        CommError::Aborted(reason)
    }
}

/// One rank's communicator over TCP.
pub struct TcpComm {
    rank: usize,
    world_size: usize,
    timeout: TimeoutCell,
    outgoing: Vec<Option<Mutex<TcpStream>>>,
    mailbox: Arc<Mailbox>,
    seq: AtomicU64,
    sent: Mutex<HashMap<usize, u64>>,
    received: Mutex<HashMap<usize, u64>>,
    flight: FlightRecorder,
}

impl TcpComm {
    /// Connects to every peer. `listener` is this rank's bound data socket and `peers[r]` the
    /// address of rank `r`'s (from a rendezvous); waits at most `timeout` for everyone.
    pub fn connect(
        rank: usize,
        listener: TcpListener,
        peers: &[SocketAddr],
        timeout: Duration,
    ) -> std::io::Result<Self> {
        let world_size = peers.len();
        let mailbox = Arc::new(Mailbox::default());
        let deadline = Instant::now() + timeout;
        // Accept the incoming half of every pair in the background.
        let inbox = mailbox.clone();
        std::thread::Builder::new()
            .name(format!("burn-zero-tcp-accept-{rank}"))
            .spawn(move || {
                // Only a rank's hello counts: a stranger that reaches this port (a job whose
                // rendezvous port collided with it) is dropped without taking a peer's place.
                let mut arrived = vec![false; world_size];
                arrived[rank] = true;
                while arrived.iter().any(|a| !a) {
                    let Ok((mut stream, from)) = listener.accept() else {
                        return;
                    };
                    let mut hello = [0u8; 8];
                    let read = stream
                        .set_read_timeout(Some(HELLO_TIMEOUT))
                        .and_then(|_| stream.read_exact(&mut hello))
                        .and_then(|_| stream.set_read_timeout(None));
                    let peer =
                        u32::from_le_bytes(hello[4..8].try_into().expect("4 bytes")) as usize;
                    if read.is_err() || &hello[..4] != HELLO || peer >= world_size || arrived[peer]
                    {
                        crate::log::warn(&format!(
                            "rank {rank}: dropped a connection from {from} that is not a new \
                             rank of this job"
                        ));
                        continue;
                    }
                    arrived[peer] = true;
                    let mailbox = inbox.clone();
                    let _ = std::thread::Builder::new()
                        .name(format!("burn-zero-tcp-{rank}<-{peer}"))
                        .spawn(move || mailbox.serve(peer, stream));
                }
            })?;
        let mut outgoing = Vec::with_capacity(world_size);
        for (peer, addr) in peers.iter().enumerate() {
            if peer == rank {
                outgoing.push(None);
                continue;
            }
            let mut stream = loop {
                match TcpStream::connect_timeout(addr, Duration::from_secs(2)) {
                    Ok(s) => break s,
                    Err(e) if Instant::now() >= deadline => {
                        return Err(std::io::Error::new(
                            e.kind(),
                            format!("rank {rank} cannot reach rank {peer} at {addr}: {e}"),
                        ));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            };
            stream.set_nodelay(true)?;
            let mut hello = HELLO.to_vec();
            hello.extend_from_slice(&(rank as u32).to_le_bytes());
            stream.write_all(&hello)?;
            outgoing.push(Some(Mutex::new(stream)));
        }
        Ok(Self {
            rank,
            world_size,
            timeout: TimeoutCell::new(timeout),
            outgoing,
            mailbox,
            seq: AtomicU64::new(0),
            sent: Mutex::new(HashMap::new()),
            received: Mutex::new(HashMap::new()),
            flight: FlightRecorder::default(),
        })
    }

    fn send_frame(&self, peer: usize, frame: &Frame) -> Result<(), CommError> {
        let stream = self.outgoing[peer]
            .as_ref()
            .expect("a peer other than this rank");
        let mut stream = stream.lock().unwrap_or_else(|e| e.into_inner());
        write_frame(&mut stream, frame).map_err(|e| {
            self.mailbox.abort(format!(
                "rank {} cannot send to rank {peer}: {e}",
                self.rank
            ))
        })
    }

    fn checked(
        &self,
        frame: Frame,
        peer: usize,
        seq: u64,
        call: OpSignature,
    ) -> Result<Payload, CommError> {
        if frame.seq != seq || frame.call != call {
            let failure = CommError::Mismatch {
                seq,
                rank_a: peer,
                call_a: frame.call,
                rank_b: self.rank,
                call_b: call,
            };
            self.mailbox.abort(failure.to_string());
            return Err(failure);
        }
        Ok(frame.payload)
    }
}

impl Exchange for TcpComm {
    fn flight(&self) -> &FlightRecorder {
        &self.flight
    }

    fn set_timeout(&self, timeout: Duration) {
        self.timeout.set(timeout)
    }

    fn timeout(&self) -> Duration {
        self.timeout.get()
    }

    fn reports_timeouts(&self) -> bool {
        true
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn exchange(&self, call: OpSignature, input: Payload) -> Result<Vec<Arc<Payload>>, CommError> {
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let frame = Frame {
            channel: Channel::Collective,
            seq,
            call,
            payload: input,
        };
        for peer in (0..self.world_size).filter(|p| *p != self.rank) {
            self.send_frame(peer, &frame)?;
        }
        let mut inputs = Vec::with_capacity(self.world_size);
        let mut own = Some(frame.payload);
        for peer in 0..self.world_size {
            if peer == self.rank {
                inputs.push(Arc::new(own.take().expect("own input")));
                continue;
            }
            let frame = self.mailbox.next(
                self.rank,
                peer,
                Channel::Collective,
                call,
                seq,
                self.timeout.get(),
            )?;
            inputs.push(Arc::new(self.checked(frame, peer, seq, call)?));
        }
        Ok(inputs)
    }

    fn post(&self, peer: usize, call: OpSignature, payload: Payload) -> Result<(), CommError> {
        let seq = next_seq(&self.sent, peer);
        if peer == self.rank {
            let frame = Frame {
                channel: Channel::PointToPoint,
                seq,
                call,
                payload,
            };
            self.mailbox
                .lock()
                .queues
                .entry((peer, Channel::PointToPoint))
                .or_default()
                .push_back(frame);
            self.mailbox.changed.notify_all();
            return Ok(());
        }
        self.send_frame(
            peer,
            &Frame {
                channel: Channel::PointToPoint,
                seq,
                call,
                payload,
            },
        )
    }

    fn take(&self, peer: usize, call: OpSignature) -> Result<Payload, CommError> {
        let seq = next_seq(&self.received, peer);
        let frame = self.mailbox.next(
            self.rank,
            peer,
            Channel::PointToPoint,
            call,
            seq,
            self.timeout.get(),
        )?;
        self.checked(frame, peer, seq, call)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ranks as threads, but connected through real sockets on loopback.
    fn group(world: usize, timeout: Duration) -> Vec<TcpComm> {
        group_after(world, timeout, |_| {})
    }

    /// `group`, with `before` run on the data addresses once they listen and before any rank
    /// connects.
    fn group_after(
        world: usize,
        timeout: Duration,
        before: impl FnOnce(&[SocketAddr]),
    ) -> Vec<TcpComm> {
        let listeners: Vec<TcpListener> = (0..world)
            .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
            .collect();
        let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        before(&addrs);
        let handles: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(rank, l)| {
                let addrs = addrs.clone();
                std::thread::spawn(move || TcpComm::connect(rank, l, &addrs, timeout).unwrap())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    /// Another job's rank whose rendezvous port collided with a data port (the CI failure
    /// that motivated this), a silent connection and a rank number out of range reach every
    /// rank's data port first: each is dropped, and the job's own ranks still all connect.
    #[test]
    fn strangers_on_a_data_port_do_not_take_a_peer_s_place() {
        let mut strangers = Vec::new();
        let comms = group_after(3, Duration::from_secs(20), |addrs| {
            for addr in addrs {
                let mut other_job = TcpStream::connect(addr).unwrap();
                other_job.write_all(b"BZRV\x01\0\0\0\x06\0\0\0").unwrap();
                strangers.push(other_job);
                drop(TcpStream::connect(addr).unwrap());
                let mut out_of_range = TcpStream::connect(addr).unwrap();
                let mut hello = HELLO.to_vec();
                hello.extend_from_slice(&7u32.to_le_bytes());
                out_of_range.write_all(&hello).unwrap();
                strangers.push(out_of_range);
            }
        });
        std::thread::scope(|s| {
            for c in &comms {
                s.spawn(move || {
                    let mut v = [c.rank as f32 + 1.0; 5];
                    c.all_reduce(v.as_mut_slice().into(), ReduceOp::Sum)
                        .unwrap();
                    assert_eq!(v, [6.0; 5]);
                });
            }
        });
    }

    #[test]
    fn collectives_over_sockets_match_the_plain_sums() {
        for world in [1, 2, 3] {
            let comms = group(world, Duration::from_secs(20));
            let results: Vec<_> = std::thread::scope(|s| {
                let handles: Vec<_> = comms
                    .iter()
                    .map(|c| {
                        s.spawn(move || {
                            let mut v: Vec<f32> = (0..1000003)
                                .map(|i| (i % 97) as f32 + c.rank as f32)
                                .collect();
                            c.all_reduce(v.as_mut_slice().into(), ReduceOp::Sum)
                                .unwrap();
                            let mut h: Vec<half::bf16> =
                                vec![half::bf16::from_f32(c.rank as f32 + 0.5); 7];
                            c.all_reduce(h.as_mut_slice().into(), ReduceOp::Max)
                                .unwrap();
                            let mine = [c.rank as f32; 3];
                            let mut all = vec![0.0f32; 3 * world];
                            c.all_gather(mine.as_slice().into(), all.as_mut_slice().into())
                                .unwrap();
                            if world > 1 {
                                let next = (c.rank + 1) % world;
                                c.send([c.rank as f32].as_slice().into(), next).unwrap();
                                let mut got = [0.0f32];
                                c.recv(got.as_mut_slice().into(), (c.rank + world - 1) % world)
                                    .unwrap();
                                assert_eq!(got[0], ((c.rank + world - 1) % world) as f32);
                            }
                            c.barrier().unwrap();
                            (v[5], h[0].to_f32(), all)
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let sum5: f32 = (0..world).map(|r| 5.0 + r as f32).sum();
            let gathered: Vec<f32> = (0..world).flat_map(|r| [r as f32; 3]).collect();
            for (v5, h, all) in results {
                assert_eq!(v5, sum5);
                assert_eq!(h, world as f32 - 0.5);
                assert_eq!(all, gathered);
            }
        }
    }

    #[test]
    fn a_mismatch_and_a_vanished_peer_are_named() {
        let mut comms = group(2, Duration::from_secs(20));
        let c1 = comms.pop().unwrap();
        let c0 = comms.pop().unwrap();
        let t = std::thread::spawn(move || {
            let mut out = vec![0.0f32; 14];
            c0.all_gather([1.0f32; 7].as_slice().into(), out.as_mut_slice().into())
                .unwrap_err()
                .to_string()
        });
        let mut out = vec![0.0f32; 7];
        let e1 = c1
            .reduce_scatter(
                [1.0f32; 14].as_slice().into(),
                out.as_mut_slice().into(),
                ReduceOp::Sum,
            )
            .unwrap_err()
            .to_string();
        let e0 = t.join().unwrap();
        for e in [&e0, &e1] {
            assert!(
                e.contains("rank 0 called all_gather(f32 x 7)")
                    && e.contains("rank 1 called reduce_scatter[Sum](f32 x 14)"),
                "{e}"
            );
        }

        let mut comms = group(2, Duration::from_secs(20));
        drop(comms.pop()); // rank 1 goes away
        let start = Instant::now();
        let e = comms[0].barrier().unwrap_err().to_string();
        assert!(e.contains("rank 1 disconnected"), "{e}");
        assert!(start.elapsed() < Duration::from_secs(5));
    }
}
