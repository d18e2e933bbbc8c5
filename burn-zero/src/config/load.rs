//! Reading `ds_config.json`: `"auto"` values, unknown keys, and errors that name the key.

use serde::de::{DeserializeOwned, Error as _, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};

use super::base::SECTIONS_NOT_YET_IMPLEMENTED;
use super::error::ConfigError;

/// Deserializes `value` into `T`, appending a warning for every key `T` does not know (with
/// the known key it is likely a typo of). `prefix` is the dotted path of `value` in the
/// document (empty for the root).
pub(crate) fn parse_value<T: DeserializeOwned + Serialize>(
    value: Value,
    prefix: &str,
    warnings: &mut Vec<String>,
) -> Result<T, ConfigError> {
    // serde's paths mark `Option` layers and the root with `?` / `.`: drop those segments.
    let join = |path: String| {
        let segments = prefix.split('.').chain(path.split('.'));
        let segments: Vec<&str> = segments.filter(|s| !s.is_empty() && *s != "?").collect();
        segments.join(".")
    };
    let mut ignored = Vec::new();
    let mut record = |path: serde_ignored::Path<'_>| ignored.push(path.to_string());
    let deserializer = serde_ignored::Deserializer::new(value, &mut record);
    let parsed = serde_path_to_error::deserialize(deserializer).map_err(|e| {
        let key = join(e.path().to_string());
        let reason = e.inner().to_string();
        match out_of_range(&reason) {
            Some((value, allowed)) => ConfigError::Invalid {
                key,
                value: value.into(),
                allowed: allowed.into(),
            },
            None => ConfigError::Parse { key, reason },
        }
    })?;
    // The keys `T` knows, with their nesting: the parsed value written back.
    let known = serde_json::to_value(&parsed).unwrap_or(Value::Null);
    for path in ignored {
        let hint =
            typo_of(&known, &path).map_or_else(String::new, |k| format!(" (did you mean `{k}`?)"));
        let key = join(path);
        let section = key.split('.').next().unwrap_or_default();
        if prefix.is_empty() && SECTIONS_NOT_YET_IMPLEMENTED.contains(&section) && key == section {
            warnings.push(format!(
                "`{key}` is a DeepSpeed section burn-zero does not implement yet: ignored"
            ));
        } else {
            warnings.push(format!("unknown key `{key}`: ignored{hint}"));
        }
    }
    Ok(parsed)
}

/// The key beside unknown key `path` (serde's dotted path in `known`) that it most likely
/// misspells: at most two edits away, and fewer than a third of its length.
fn typo_of(known: &Value, path: &str) -> Option<String> {
    let mut segments: Vec<&str> = path
        .split('.')
        .filter(|s| !s.is_empty() && *s != "?")
        .collect();
    let unknown = segments.pop()?;
    let siblings = segments
        .iter()
        .try_fold(known, |node, s| node.get(s))?
        .as_object()?;
    let limit = 2.min(unknown.chars().count() / 3);
    siblings
        .keys()
        .map(|k| (edits(k, unknown), k))
        .filter(|(d, _)| *d <= limit)
        .min()
        .map(|(_, k)| k.clone())
}

/// Levenshtein distance between `a` and `b`, in characters.
fn edits(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let substituted = diagonal + usize::from(ca != *cb);
            diagonal = row[j + 1];
            row[j + 1] = substituted.min(row[j] + 1).min(diagonal + 1);
        }
    }
    row[b.len()]
}

/// A JSON document read with DeepSpeed's rule that a key appears at most once in an object
/// (a second `train_batch_size` would otherwise silently win); the error names the key and,
/// through serde_json, its line and column.
pub(crate) struct UniqueKeys(pub Value);

impl<'de> Deserialize<'de> for UniqueKeys {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(UniqueKeysVisitor)
    }
}

struct UniqueKeysVisitor;

impl<'de> Visitor<'de> for UniqueKeysVisitor {
    type Value = UniqueKeys;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<UniqueKeys, E> {
        Ok(UniqueKeys(Value::Bool(v)))
    }

    fn visit_i64<E>(self, v: i64) -> Result<UniqueKeys, E> {
        Ok(UniqueKeys(Value::from(v)))
    }

    fn visit_u64<E>(self, v: u64) -> Result<UniqueKeys, E> {
        Ok(UniqueKeys(Value::from(v)))
    }

    fn visit_f64<E>(self, v: f64) -> Result<UniqueKeys, E> {
        Ok(UniqueKeys(Value::from(v)))
    }

    fn visit_str<E>(self, v: &str) -> Result<UniqueKeys, E> {
        Ok(UniqueKeys(Value::String(v.to_string())))
    }

    fn visit_unit<E>(self) -> Result<UniqueKeys, E> {
        Ok(UniqueKeys(Value::Null))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<UniqueKeys, A::Error> {
        let mut values = Vec::new();
        while let Some(UniqueKeys(v)) = seq.next_element()? {
            values.push(v);
        }
        Ok(UniqueKeys(Value::Array(values)))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<UniqueKeys, A::Error> {
        let mut map = Map::new();
        while let Some(key) = access.next_key::<String>()? {
            if map.contains_key(&key) {
                return Err(A::Error::custom(format!(
                    "key `{key}` appears twice in one object"
                )));
            }
            let UniqueKeys(value) = access.next_value()?;
            map.insert(key, value);
        }
        Ok(UniqueKeys(Value::Object(map)))
    }
}

/// DeepSpeed's handling of `"auto"` (a value left to the framework): the key is dropped and
/// its default applies; for the batch triad, that means "not given". Returns the dropped keys.
pub(crate) fn drop_auto_values(value: &mut Value, prefix: &str, dropped: &mut Vec<String>) {
    if let Value::Object(map) = value {
        map.retain(|key, v| {
            let keep = v.as_str() != Some("auto");
            if !keep {
                dropped.push(if prefix.is_empty() {
                    key.clone()
                } else {
                    format!("{prefix}.{key}")
                });
            }
            keep
        });
        for (key, v) in map.iter_mut() {
            let path = if prefix.is_empty() {
                key.clone()
            } else {
                format!("{prefix}.{key}")
            };
            drop_auto_values(v, &path, dropped);
        }
    }
}

/// The legacy form `"zero_optimization": true|false` means stage 1|0, as in DeepSpeed.
pub(crate) fn upgrade_legacy_zero(value: &mut Value, warnings: &mut Vec<String>) {
    if let Some(zero) = value.get_mut("zero_optimization")
        && let Some(enabled) = zero.as_bool()
    {
        warnings.push(format!(
            "`zero_optimization: {enabled}` is deprecated: read as {{\"stage\": {}}}",
            u8::from(enabled)
        ));
        *zero = serde_json::json!({ "stage": u8::from(enabled) });
    }
}

/// serde's "invalid value: integer `5`, expected 0, 1, 2 or 3" (a value of the right type that
/// a typed key refuses) as the value and what is allowed, for the same error the range checks
/// give.
fn out_of_range(reason: &str) -> Option<(&str, &str)> {
    let rest = reason.strip_prefix("invalid value: ")?;
    let (_, rest) = rest.split_once('`')?;
    let (value, rest) = rest.split_once('`')?;
    Some((value, rest.strip_prefix(", expected ")?))
}
