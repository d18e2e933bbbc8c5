//! `zero_optimization.stage` as a type: what a rank partitions. Read and written as DeepSpeed's
//! number (0–3), in ds_config files and checkpoint manifests alike.

use core::fmt;

use serde::de::{Error, Unexpected};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The ZeRO stage: each partitions what the one before did, and one thing more.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum ZeroStage {
    /// 0: plain data parallelism; every rank holds everything, gradients are all-reduced.
    #[default]
    Disabled,
    /// 1: the optimizer state (and fp32 master) is partitioned.
    OptimizerStates,
    /// 2: gradients too, reduce-scattered as backward produces them.
    Gradients,
    /// 3: parameters too, gathered for their use and released after.
    Parameters,
}

impl ZeroStage {
    /// Every stage, in order.
    pub const ALL: [ZeroStage; 4] = [
        ZeroStage::Disabled,
        ZeroStage::OptimizerStates,
        ZeroStage::Gradients,
        ZeroStage::Parameters,
    ];

    /// DeepSpeed's number for it.
    pub fn number(self) -> u8 {
        self as u8
    }

    /// What it partitions, in words.
    pub fn partitions(self) -> &'static str {
        match self {
            ZeroStage::Disabled => "nothing partitioned (data parallel)",
            ZeroStage::OptimizerStates => "optimizer state partitioned",
            ZeroStage::Gradients => "optimizer state and gradients partitioned",
            ZeroStage::Parameters => "optimizer state, gradients and parameters partitioned",
        }
    }

    /// Whether this build compiled the stage in (Cargo features `zero1`, `zero2`, `zero3`).
    pub fn compiled(self) -> bool {
        match self {
            ZeroStage::Disabled => true,
            ZeroStage::OptimizerStates => cfg!(feature = "zero1"),
            ZeroStage::Gradients => cfg!(feature = "zero2"),
            ZeroStage::Parameters => cfg!(feature = "zero3"),
        }
    }
}

impl TryFrom<u64> for ZeroStage {
    type Error = u64;

    fn try_from(n: u64) -> Result<Self, u64> {
        Self::ALL.get(n as usize).copied().ok_or(n)
    }
}

impl fmt::Display for ZeroStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.number())
    }
}

/// `stage == 3` reads as DeepSpeed users write it.
impl PartialEq<u8> for ZeroStage {
    fn eq(&self, n: &u8) -> bool {
        self.number() == *n
    }
}

impl Serialize for ZeroStage {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u8(self.number())
    }
}

impl<'de> Deserialize<'de> for ZeroStage {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = u64::deserialize(d)?;
        ZeroStage::try_from(n)
            .map_err(|n| D::Error::invalid_value(Unexpected::Unsigned(n), &"0, 1, 2 or 3"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_and_writes_deepspeeds_numbers() {
        for (n, stage) in ZeroStage::ALL.into_iter().enumerate() {
            let text = n.to_string();
            assert_eq!(serde_json::from_str::<ZeroStage>(&text).unwrap(), stage);
            assert_eq!(serde_json::to_string(&stage).unwrap(), text);
            assert_eq!(stage, n as u8);
        }
        let err = serde_json::from_str::<ZeroStage>("4")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("invalid value: integer `4`, expected 0, 1, 2 or 3"),
            "{err}"
        );
        assert!(serde_json::from_str::<ZeroStage>("\"two\"").is_err());
    }
}
