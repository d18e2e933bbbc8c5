//! Counts in `ds_config.json`, which DeepSpeed users often write as floats (`5e8`).

use core::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer, de};

/// A count of elements or steps. DeepSpeed configs often write them as floats (`5e8`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Count(pub u64);

impl Count {
    /// As `usize`.
    pub fn get(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for Count {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl Serialize for Count {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_u64(self.0)
    }
}

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = serde_json::Value::deserialize(deserializer)?;
        let number = value.as_u64().or_else(|| {
            value
                .as_f64()
                .filter(|f| *f >= 0.0 && f.fract() == 0.0 && *f < 1.8e19)
                .map(|f| f as u64)
        });
        number.map(Count).ok_or_else(|| {
            de::Error::custom(format!(
                "expected a non-negative whole number (e.g. 500000000 or 5e8), found {value}"
            ))
        })
    }
}
