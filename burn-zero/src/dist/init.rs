//! Joining the process group: the environment, the rendezvous and the communicators.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use super::{DistEnv, EnvError, Rendezvous, rendezvous};
use crate::comm::{Communicator, DEFAULT_TIMEOUT, TcpComm};

/// This process's place in the job and its communicator.
pub struct Distributed {
    /// Rank, world size, local rank, rendezvous address.
    pub env: DistEnv,
    /// The communicator of this rank.
    pub comm: Arc<dyn Communicator>,
}

/// How long a rank waits for the others, from `BURN_ZERO_TIMEOUT` (seconds) or the default.
pub fn timeout_from_env() -> Result<Duration, EnvError> {
    match std::env::var("BURN_ZERO_TIMEOUT") {
        Ok(v) => v
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| *s > 0.0)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| {
                EnvError(format!(
                    "BURN_ZERO_TIMEOUT={v:?} is not a positive number of seconds"
                ))
            }),
        Err(_) => Ok(DEFAULT_TIMEOUT),
    }
}

/// Joins the job described by the environment (torchrun / `burn-zero run`, SLURM or Open MPI
/// variables) over TCP, for CPU ranks. A process started without them is a job of one.
pub fn init_distributed() -> Result<Distributed, EnvError> {
    let env = DistEnv::from_env()?;
    let (comm, _) = meet(&env, |_| Ok(Vec::new()))?;
    Ok(Distributed {
        env,
        comm: Arc::new(comm),
    })
}

/// Opens this rank's data port, meets the others (rank 0 shares what `shared` makes for it) and
/// connects the TCP communicator. Returns it and the shared blob.
fn meet(
    env: &DistEnv,
    shared: impl FnOnce(&DistEnv) -> Result<Vec<u8>, EnvError>,
) -> Result<(TcpComm, Vec<u8>), EnvError> {
    let timeout = timeout_from_env()?;
    let listener = TcpListener::bind("0.0.0.0:0")
        .map_err(|e| EnvError(format!("cannot open a data port: {e}")))?;
    let local = listener.local_addr().map_err(|e| EnvError(e.to_string()))?;
    let blob = if env.rank == 0 {
        shared(env)?
    } else {
        Vec::new()
    };
    let meeting = if env.world_size == 1 {
        Rendezvous {
            peers: vec![local],
            shared: blob,
        }
    } else {
        rendezvous(env, local.port(), &blob, timeout)?
    };
    let comm = TcpComm::connect(env.rank, listener, &meeting.peers, timeout)
        .map_err(|e| EnvError(format!("connecting rank {}: {e}", env.rank)))?;
    Ok((comm, meeting.shared))
}

/// Joins the job on GPUs: GPU `LOCAL_RANK`, NCCL for collectives (its unique id shared through
/// the rendezvous), and a TCP side channel that checks every host-buffer collective's signature.
#[cfg(feature = "nccl")]
pub fn init_nccl() -> Result<(DistEnv, crate::comm::NcclComm), EnvError> {
    // Compiled kernels and autotune results persist across processes (a no-op with a message
    // if the program already ran a tensor op).
    if let Err(e) = crate::kernel_cache::persist(&crate::kernel_cache::default_dir()) {
        crate::log::warn(&e);
    }
    let env = DistEnv::from_env()?;
    let (checker, id) = meet(&env, |_| crate::comm::nccl_unique_id().map_err(EnvError))?;
    let nccl =
        crate::comm::NcclComm::new(env.rank, env.world_size, env.local_rank, &id, Some(checker))
            .map_err(EnvError)?;
    Ok((env, nccl))
}
