//! Rendezvous over TCP: rank 0 listens on `MASTER_ADDR:MASTER_PORT`, every rank reports its
//! data address, rank 0 answers with every rank's address and a blob it shares (the NCCL
//! unique id on GPUs). Checks that every rank agrees on the world size and that no rank is
//! claimed twice, and names the offender.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::env::{DistEnv, EnvError};

const MAGIC: &[u8; 4] = b"BZRV";
/// How long a connection to rank 0 has to say it is a rank.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// What the rendezvous gives every rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rendezvous {
    /// The data address of every rank, by rank.
    pub peers: Vec<SocketAddr>,
    /// The blob rank 0 shared.
    pub shared: Vec<u8>,
}

fn io(context: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> EnvError {
    move |e| EnvError(format!("rendezvous: {context}: {e}"))
}

/// The run id as the hello carries it (FNV-1a).
fn run_hash(run_id: &str) -> u64 {
    run_id.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

fn read_u32(stream: &mut TcpStream) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    stream.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

/// Meets the other ranks. `data_port` is this rank's data listener; `shared` is what rank 0
/// hands everyone (ignored on other ranks). Waits at most `timeout` for all ranks.
pub fn rendezvous(
    env: &DistEnv,
    data_port: u16,
    shared: &[u8],
    timeout: Duration,
) -> Result<Rendezvous, EnvError> {
    let master = format!("{}:{}", env.master_addr, env.master_port);
    let deadline = Instant::now() + timeout;
    if env.rank == 0 {
        let addr = master
            .to_socket_addrs()
            .map_err(io(format!("MASTER_ADDR:MASTER_PORT = {master}")))?
            .next();
        let addr =
            addr.ok_or_else(|| EnvError(format!("rendezvous: {master} does not resolve")))?;
        let listener = TcpListener::bind(addr).map_err(io(format!(
            "rank 0 cannot listen on {master} (MASTER_PORT in use?)"
        )))?;
        listener.set_nonblocking(true).map_err(io("listener"))?;
        let mut peers: Vec<Option<SocketAddr>> = vec![None; env.world_size];
        peers[0] = Some(SocketAddr::new(addr.ip(), data_port));
        let mut streams = Vec::new();
        while streams.len() + 1 < env.world_size {
            let (mut stream, from) = match listener.accept() {
                Ok(pair) => pair,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> = (0..env.world_size)
                            .filter(|r| peers[*r].is_none())
                            .collect();
                        return Err(EnvError(format!(
                            "rendezvous: timed out after {timeout:?} waiting for rank(s) {missing:?} at {master}"
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
                Err(e) => return Err(io("accept")(e)),
            };
            stream.set_nonblocking(false).map_err(io("stream"))?;
            stream
                .set_read_timeout(Some(timeout))
                .map_err(io("stream"))?;
            // Something other than a rank (a port scan, a job whose data port collided with
            // this one) is dropped; a rank's own inconsistency below fails the job.
            let mut magic = [0u8; 4];
            let said = stream
                .set_read_timeout(Some(timeout.min(HELLO_TIMEOUT)))
                .and_then(|_| stream.read_exact(&mut magic))
                .and_then(|_| stream.set_read_timeout(Some(timeout)));
            if said.is_err() || &magic != MAGIC {
                crate::log::warn(&format!(
                    "rendezvous: dropped a connection from {from} that is not a burn-zero rank"
                ));
                continue;
            }
            let rank = read_u32(&mut stream).map_err(io("hello"))? as usize;
            let world = read_u32(&mut stream).map_err(io("hello"))? as usize;
            let port = read_u32(&mut stream).map_err(io("hello"))? as u16;
            let mut job = [0u8; 8];
            stream.read_exact(&mut job).map_err(io("hello"))?;
            if u64::from_le_bytes(job) != run_hash(&env.run_id) {
                crate::log::warn(&format!(
                    "rendezvous: dropped rank {rank} of another job (from {from}; this job's run \
                     id is {:?})",
                    env.run_id
                ));
                continue;
            }
            if world != env.world_size {
                return Err(EnvError(format!(
                    "rendezvous: rank {rank} has WORLD_SIZE {world} but rank 0 has {}",
                    env.world_size
                )));
            }
            if rank == 0 || rank >= world || peers[rank].is_some() {
                return Err(EnvError(format!(
                    "rendezvous: rank {rank} (from {from}) is claimed twice or out of range"
                )));
            }
            let ip: IpAddr = from.ip();
            peers[rank] = Some(SocketAddr::new(ip, port));
            streams.push(stream);
        }
        let peers: Vec<SocketAddr> = peers
            .into_iter()
            .map(|p| p.expect("every rank arrived"))
            .collect();
        let mut answer = Vec::new();
        answer.extend_from_slice(&(shared.len() as u32).to_le_bytes());
        answer.extend_from_slice(shared);
        for p in &peers {
            let text = p.to_string();
            answer.extend_from_slice(&(text.len() as u32).to_le_bytes());
            answer.extend_from_slice(text.as_bytes());
        }
        for mut s in streams {
            s.write_all(&answer).map_err(io("answer"))?;
        }
        return Ok(Rendezvous {
            peers,
            shared: shared.to_vec(),
        });
    }

    let mut stream = loop {
        let attempt = master
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .map(|a| TcpStream::connect_timeout(&a, Duration::from_secs(2)));
        match attempt {
            Some(Ok(s)) => break s,
            _ if Instant::now() >= deadline => {
                return Err(EnvError(format!(
                    "rendezvous: rank {} could not reach rank 0 at {master} within {timeout:?}",
                    env.rank
                )));
            }
            _ => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    stream
        .set_read_timeout(Some(timeout))
        .map_err(io("stream"))?;
    let mut hello = MAGIC.to_vec();
    for v in [env.rank as u32, env.world_size as u32, u32::from(data_port)] {
        hello.extend_from_slice(&v.to_le_bytes());
    }
    hello.extend_from_slice(&run_hash(&env.run_id).to_le_bytes());
    stream.write_all(&hello).map_err(io("hello"))?;
    let context = || {
        format!(
            "rank {} waiting for rank 0's answer (did rank 0 fail?)",
            env.rank
        )
    };
    let len = read_u32(&mut stream).map_err(io(context()))? as usize;
    let mut shared = vec![0u8; len];
    stream.read_exact(&mut shared).map_err(io(context()))?;
    let mut peers = Vec::with_capacity(env.world_size);
    for _ in 0..env.world_size {
        let len = read_u32(&mut stream).map_err(io(context()))? as usize;
        let mut text = vec![0u8; len];
        stream.read_exact(&mut text).map_err(io(context()))?;
        let text = String::from_utf8_lossy(&text).to_string();
        peers.push(
            text.parse()
                .map_err(|_| EnvError(format!("rendezvous: bad address {text:?}")))?,
        );
    }
    Ok(Rendezvous { peers, shared })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::EnvSource;

    fn env(rank: usize, world_size: usize, master_port: u16) -> DistEnv {
        DistEnv {
            rank,
            local_rank: rank,
            world_size,
            local_world_size: world_size,
            master_addr: "127.0.0.1".into(),
            master_port,
            source: EnvSource::Torchrun,
            run_id: "job-a".into(),
        }
    }

    /// A connection that is not a rank (silent, or speaking another protocol) and a rank of
    /// another job of the same size reach rank 0 before the ranks do: they are dropped, and
    /// the three ranks still meet and agree.
    #[test]
    fn a_stranger_at_the_master_port_is_dropped() {
        let port = crate::dist::free_port();
        let timeout = Duration::from_secs(20);
        let zero = std::thread::spawn(move || rendezvous(&env(0, 3, port), 1000, b"id", timeout));
        let master = SocketAddr::from(([127, 0, 0, 1], port));
        let connect = || loop {
            if let Ok(s) = TcpStream::connect(master) {
                break s;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let mut other = connect();
        other.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        drop(connect());
        // Rank 1 of another job of the same size, whose rank 0 could not take the port.
        let other_job = std::thread::spawn(move || {
            let mut env = env(1, 3, port);
            env.run_id = "job-b".into();
            rendezvous(&env, 999, &[], Duration::from_secs(2))
        });
        // Its hello arrives before this job's ranks connect.
        std::thread::sleep(Duration::from_millis(300));
        let ranks: Vec<_> = (1..3)
            .map(|r| {
                std::thread::spawn(move || {
                    rendezvous(&env(r, 3, port), 1000 + r as u16, &[], timeout)
                })
            })
            .collect();
        let mut met = vec![zero.join().unwrap().unwrap()];
        met.extend(ranks.into_iter().map(|h| h.join().unwrap().unwrap()));
        assert!(
            other_job.join().unwrap().is_err(),
            "the other job's rank gets no answer"
        );
        for m in &met {
            assert_eq!(m.shared, b"id");
            let ports: Vec<u16> = m.peers.iter().map(SocketAddr::port).collect();
            assert_eq!(ports, [1000, 1001, 1002]);
        }
    }
}
