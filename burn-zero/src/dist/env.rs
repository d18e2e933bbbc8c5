//! Where a process sits in the job: from torchrun's variables, or SLURM's, or Open MPI's.

use std::fmt;

/// Which launcher's variables described this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EnvSource {
    /// `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, ... (torchrun, `burn-zero run`).
    Torchrun,
    /// `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, ...
    Slurm,
    /// `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, ...
    OpenMpi,
    /// None set: a single process.
    Single,
}

/// This process's place in the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistEnv {
    /// Global rank.
    pub rank: usize,
    /// Rank on this node (picks the GPU).
    pub local_rank: usize,
    /// Ranks in the job.
    pub world_size: usize,
    /// Ranks on this node.
    pub local_world_size: usize,
    /// Host of rank 0's rendezvous.
    pub master_addr: String,
    /// Port of rank 0's rendezvous.
    pub master_port: u16,
    /// Where the values came from.
    pub source: EnvSource,
    /// The job's id, when its launcher gives one (`BURN_ZERO_RUN_ID`, torchrun's
    /// `TORCHELASTIC_RUN_ID`, SLURM's `SLURM_JOB_ID`; empty otherwise): rank 0's rendezvous
    /// drops a rank of another job that reached its port.
    pub run_id: String,
}

/// A variable that is missing or malformed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("environment: {0}")]
pub struct EnvError(pub String);

/// The default rendezvous port, as torchrun's.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

impl DistEnv {
    /// Reads the process environment.
    pub fn from_env() -> Result<Self, EnvError> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// Reads variables through `get` (testable without touching the environment).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, EnvError> {
        let number = |name: &str| -> Result<Option<usize>, EnvError> {
            get(name)
                .map(|v| {
                    v.trim()
                        .parse::<usize>()
                        .map_err(|_| EnvError(format!("{name}={v:?} is not a whole number")))
                })
                .transpose()
        };
        let (source, rank, world, local_rank, local_world) = if let (Some(rank), Some(world)) =
            (number("RANK")?, number("WORLD_SIZE")?)
        {
            let local_world = number("LOCAL_WORLD_SIZE")?.unwrap_or(world);
            let local_rank = number("LOCAL_RANK")?.unwrap_or(rank % local_world.max(1));
            (EnvSource::Torchrun, rank, world, local_rank, local_world)
        } else if let (Some(rank), Some(world)) = (number("SLURM_PROCID")?, number("SLURM_NTASKS")?)
        {
            let nodes = number("SLURM_NNODES")?.unwrap_or(1).max(1);
            let local_world = match get("SLURM_NTASKS_PER_NODE") {
                // "4" or "4(x2)": tasks on each node.
                Some(v) => v
                    .split('(')
                    .next()
                    .unwrap_or("")
                    .trim()
                    .parse()
                    .map_err(|_| {
                        EnvError(format!("SLURM_NTASKS_PER_NODE={v:?} is not understood"))
                    })?,
                None => world.div_ceil(nodes),
            };
            let local_rank = number("SLURM_LOCALID")?.unwrap_or(rank % local_world.max(1));
            (EnvSource::Slurm, rank, world, local_rank, local_world)
        } else if let (Some(rank), Some(world)) = (
            number("OMPI_COMM_WORLD_RANK")?,
            number("OMPI_COMM_WORLD_SIZE")?,
        ) {
            let local_world = number("OMPI_COMM_WORLD_LOCAL_SIZE")?.unwrap_or(world);
            let local_rank =
                number("OMPI_COMM_WORLD_LOCAL_RANK")?.unwrap_or(rank % local_world.max(1));
            (EnvSource::OpenMpi, rank, world, local_rank, local_world)
        } else {
            (EnvSource::Single, 0, 1, 0, 1)
        };
        if world == 0 || rank >= world {
            return Err(EnvError(format!(
                "rank {rank} is not below the world size {world} ({source:?})"
            )));
        }
        if local_rank >= local_world.max(1) {
            return Err(EnvError(format!(
                "local rank {local_rank} is not below the local world size {local_world}"
            )));
        }
        let single_node = local_world >= world;
        let master_addr = match get("MASTER_ADDR") {
            Some(addr) => addr,
            None if single_node => "127.0.0.1".to_string(),
            None => {
                return Err(EnvError(format!(
                    "MASTER_ADDR is not set but the job spans several nodes ({world} ranks, {local_world} per node): \
                     export rank 0's host as MASTER_ADDR"
                )));
            }
        };
        let master_port = match get("MASTER_PORT") {
            Some(p) => p
                .trim()
                .parse()
                .map_err(|_| EnvError(format!("MASTER_PORT={p:?} is not a port number")))?,
            None => DEFAULT_MASTER_PORT,
        };
        Ok(Self {
            rank,
            local_rank,
            world_size: world,
            local_world_size: local_world,
            master_addr,
            master_port,
            source,
            run_id: ["BURN_ZERO_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"]
                .into_iter()
                .find_map(&get)
                .unwrap_or_default(),
        })
    }
}

impl fmt::Display for DistEnv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {}/{} (local {}/{}), rendezvous {}:{} ({:?})",
            self.rank,
            self.world_size,
            self.local_rank,
            self.local_world_size,
            self.master_addr,
            self.master_port,
            self.source
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> Result<DistEnv, EnvError> {
        let map: std::collections::HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        DistEnv::from_vars(|k| map.get(k).cloned())
    }

    #[test]
    fn torchrun_slurm_openmpi_and_single() {
        let t = env(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap();
        assert_eq!(
            (
                t.rank,
                t.world_size,
                t.local_rank,
                t.local_world_size,
                t.master_addr.as_str(),
                t.master_port,
                t.source
            ),
            (5, 8, 1, 4, "node0", 1234, EnvSource::Torchrun)
        );
        assert_eq!(t.run_id, "", "no launcher named the job");
        let named = |vars: &[(&str, &str)]| {
            let mut all = vec![("RANK", "0"), ("WORLD_SIZE", "2")];
            all.extend_from_slice(vars);
            env(&all).unwrap().run_id
        };
        assert_eq!(named(&[("TORCHELASTIC_RUN_ID", "t1")]), "t1");
        assert_eq!(
            named(&[("SLURM_JOB_ID", "77"), ("BURN_ZERO_RUN_ID", "b2")]),
            "b2"
        );
        let s = env(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "2(x2)"),
            ("SLURM_NNODES", "2"),
            ("MASTER_ADDR", "n1"),
        ])
        .unwrap();
        assert_eq!(
            (
                s.rank,
                s.world_size,
                s.local_rank,
                s.local_world_size,
                s.source
            ),
            (3, 4, 1, 2, EnvSource::Slurm)
        );
        let o = env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ])
        .unwrap();
        assert_eq!(
            (o.rank, o.master_addr.as_str(), o.master_port, o.source),
            (1, "127.0.0.1", DEFAULT_MASTER_PORT, EnvSource::OpenMpi)
        );
        assert_eq!(env(&[]).unwrap().source, EnvSource::Single);
    }

    #[test]
    fn bad_values_are_named() {
        assert!(
            env(&[("RANK", "x"), ("WORLD_SIZE", "2")])
                .unwrap_err()
                .to_string()
                .contains("RANK=\"x\"")
        );
        assert!(
            env(&[("RANK", "2"), ("WORLD_SIZE", "2")])
                .unwrap_err()
                .to_string()
                .contains("rank 2 is not below the world size 2")
        );
        assert!(
            env(&[
                ("RANK", "0"),
                ("WORLD_SIZE", "8"),
                ("LOCAL_WORLD_SIZE", "4")
            ])
            .unwrap_err()
            .to_string()
            .contains("MASTER_ADDR is not set")
        );
        assert!(
            env(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", "http")])
                .unwrap_err()
                .to_string()
                .contains("MASTER_PORT=\"http\"")
        );
    }
}
