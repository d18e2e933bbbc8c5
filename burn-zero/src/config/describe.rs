//! `burn-zero config FILE [--world-size N]...`: a `ds_config.json` checked and explained before
//! a run. Users paste configs from everywhere (DeepSpeed's docs, Hugging Face's `"auto"` files);
//! this says what each key became and what would fail, without starting anything.

use super::DeepSpeedConfig;

/// The report on `text` (read from `name`): every warning, then for each world size the
/// resolved setup ([`super::ResolvedConfig::summary`]) or why it does not resolve. `Err` holds
/// the report up to the first error, which names the key (and the line and column for JSON
/// errors); the command exits non-zero on it.
pub fn describe_config(name: &str, text: &str, world_sizes: &[usize]) -> Result<String, String> {
    let loaded = DeepSpeedConfig::parse_json(text).map_err(|e| format!("{name}: {e}\n"))?;
    let mut out = String::new();
    let mut warned = Vec::new();
    let mut warn = |out: &mut String, w: &String| {
        if !warned.contains(w) {
            out.push_str(&format!("warning: {w}\n"));
            warned.push(w.clone());
        }
    };
    loaded.warnings.iter().for_each(|w| warn(&mut out, w));
    for &world in world_sizes {
        // Sections after the first are set apart by a blank line.
        let resolved = loaded.config.resolve(world);
        if let Ok(r) = &resolved {
            r.warnings.iter().for_each(|w| warn(&mut out, w));
        }
        if !out.is_empty() {
            out.push('\n');
        }
        match resolved {
            Ok(resolved) => {
                out.push_str(&format!("world size {world}:\n"));
                for line in resolved.summary().lines() {
                    out.push_str(&format!("  {line}\n"));
                }
            }
            Err(e) => {
                out.push_str(&format!("world size {world}: {e}\n"));
                return Err(out);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::describe_config;

    fn examples() -> Vec<(String, String)> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/configs");
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .expect("examples/configs")
            .map(|e| e.expect("entry").path())
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        files.sort();
        files
            .into_iter()
            .map(|p| {
                (
                    p.display().to_string(),
                    std::fs::read_to_string(&p).unwrap(),
                )
            })
            .collect()
    }

    /// Every shipped config resolves for some world size from 1 to 8 (a config that fixes
    /// `train_batch_size` resolves only where the triad holds), with one summary.
    #[test]
    fn every_example_config_resolves() {
        let files = examples();
        assert!(files.len() >= 5, "{} files", files.len());
        for (name, text) in files {
            let reports: Vec<String> = (1..=8)
                .filter_map(|world| describe_config(&name, &text, &[world]).ok())
                .collect();
            if name.ends_with("hf_zero2_auto.json") {
                // Hugging Face's Trainer fills its "auto" batch keys; alone, none is given.
                let err = describe_config(&name, &text, &[1]).unwrap_err();
                assert!(err.contains("train_batch_size"), "{name}:\n{err}");
                assert!(err.contains("is \"auto\""), "{name}:\n{err}");
                continue;
            }
            assert!(
                !reports.is_empty(),
                "{name} resolves for no world size from 1 to 8"
            );
            for report in reports {
                assert_eq!(report.matches("ZeRO stage").count(), 1, "{name}:\n{report}");
            }
        }
    }

    #[test]
    fn an_unknown_key_is_a_warning_with_the_likely_key() {
        let text = r#"{"train_batch_size": 8, "zero_optimisation": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}}"#;
        let report = describe_config("bad.json", text, &[2]).unwrap();
        assert!(
            report.contains(
                "warning: unknown key `zero_optimisation`: ignored (did you mean `zero_optimization`?)"
            ),
            "{report}"
        );
        assert!(report.contains("2 ranks, ZeRO stage 0"), "{report}");
    }

    #[test]
    fn a_duplicate_key_is_an_error_with_its_line_and_column() {
        let text = "{\n  \"train_batch_size\": 8,\n  \"train_batch_size\": 16\n}";
        let err = describe_config("dup.json", text, &[1]).unwrap_err();
        assert!(err.starts_with("dup.json: "), "{err}");
        assert!(err.contains("train_batch_size"), "{err}");
        assert!(err.contains("line 3"), "{err}");
    }

    #[test]
    fn comments_are_refused_with_the_line() {
        let text = "{\n  // DeepSpeed's docs sometimes show comments\n  \"train_batch_size\": 8\n}";
        let err = describe_config("comments.json", text, &[1]).unwrap_err();
        assert!(err.contains("not valid JSON"), "{err}");
        assert!(err.contains("line 2"), "{err}");
    }

    /// A triad that holds for one world size and not another: the first resolves, the second
    /// is the error, naming all three keys.
    #[test]
    fn a_bad_triad_names_the_world_size_and_the_keys() {
        let text = r#"{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}"#;
        let err = describe_config("triad.json", text, &[2, 4]).unwrap_err();
        assert!(err.contains("world size 2:\n  2 ranks"), "{err}");
        let last = err.lines().last().unwrap();
        assert!(last.starts_with("world size 4: "), "{err}");
        for key in [
            "train_batch_size",
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
        ] {
            assert!(last.contains(key), "{err}");
        }
    }
}
