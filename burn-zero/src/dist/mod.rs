//! Multi-process jobs: the environment a launcher sets, the rendezvous, and
//! [`init_distributed`], which returns this process's communicator.

mod env;
mod port;
mod rendezvous;

pub use env::{DEFAULT_MASTER_PORT, DistEnv, EnvError, EnvSource};
pub use port::free_port;
pub use rendezvous::{Rendezvous, rendezvous};

mod init;
pub use init::*;
