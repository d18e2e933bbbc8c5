//! Reading `ds_config.json`: `"auto"` values, unknown keys, and errors that name the key.

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

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
    let parsed =
        serde_path_to_error::deserialize(deserializer).map_err(|e| ConfigError::Parse {
            key: join(e.path().to_string()),
            reason: e.inner().to_string(),
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
