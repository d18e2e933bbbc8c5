use proptest::prelude::*;

use super::*;
use crate::partition::{PartitionPlan, ShardPlan};

fn entry(name: &str, shape: &[usize], chunk: Option<usize>) -> ParamEntry {
    ParamEntry {
        name: name.into(),
        shape: shape.to_vec(),
        chunk,
    }
}

fn file(path: &str, rank: Option<usize>) -> FileEntry {
    FileEntry {
        path: path.into(),
        rank,
        bytes: 10,
        sha256: "ab".repeat(32),
    }
}

/// A stage-3 manifest laid out by the engine's own [`ShardPlan`] (align 4).
fn per_param(shapes: &[&[usize]], world: usize) -> Manifest {
    let numels: Vec<usize> = shapes.iter().map(|s| s.iter().product()).collect();
    let plan = ShardPlan::new(&numels, world, 4);
    Manifest {
        format: FORMAT.into(),
        version: VERSION,
        tag: "global_step3".into(),
        stage: ZeroStage::Parameters,
        world_size: world,
        partitioning: Partitioning::PerParam,
        params: shapes
            .iter()
            .enumerate()
            .map(|(i, s)| entry(&format!("p{i}"), s, Some(plan.chunk(i))))
            .collect(),
        tensors: Default::default(),
        files: (0..world)
            .map(|r| file(&format!("rank{r}.safetensors"), Some(r)))
            .collect(),
        engine: serde_json::json!({"global_step": 3}),
    }
}

const SHAPES: [&[usize]; 4] = [&[7, 15], &[15], &[15, 9], &[3]];

#[test]
fn round_trips_through_json() {
    let m = per_param(&SHAPES, 3);
    assert_eq!(Manifest::parse(m.to_json().as_bytes()).unwrap(), m);
}

#[test]
fn pieces_match_the_engines_plans() {
    let numels: Vec<usize> = SHAPES.iter().map(|s| s.iter().product()).collect();
    for world in 1..=5 {
        // Stage 3: each parameter's chunks, as the ShardPlan cuts them.
        let m = per_param(&SHAPES, world);
        let plan = ShardPlan::new(&numels, world, 4);
        assert_eq!(m.partition_len(), plan.len());
        for p in 0..SHAPES.len() {
            let want: Vec<Piece> = (0..world)
                .map(|r| (r, plan.owned(p, r)))
                .filter(|(_, o)| !o.is_empty())
                .map(|(rank, elements)| Piece {
                    rank,
                    elements,
                    at: plan.offset(p),
                })
                .collect();
            assert_eq!(m.pieces(p), want, "world {world}, param {p}");
        }
        // Stages 1-2: one flat buffer in equal chunks, as the PartitionPlan cuts it.
        let total: usize = numels.iter().sum();
        let flat = PartitionPlan::aligned(total, world, 4);
        let m = Manifest {
            partitioning: Partitioning::Flat {
                chunk: flat.chunk(),
            },
            params: SHAPES
                .iter()
                .enumerate()
                .map(|(i, s)| entry(&format!("p{i}"), s, None))
                .collect(),
            ..m
        };
        m.validate().unwrap();
        let mut start = 0;
        for (p, n) in numels.iter().enumerate() {
            let pieces = m.pieces(p);
            // Every element once, in order, each piece inside its rank's owned range.
            let mut next = 0;
            for piece in &pieces {
                assert_eq!(piece.elements.start, next);
                next = piece.elements.end;
                let owned = flat.owned(piece.rank);
                let global = start + piece.elements.start;
                assert!(owned.contains(&global), "world {world}, param {p}");
                assert_eq!(piece.at, global - owned.start);
            }
            assert_eq!(next, *n);
            start += n;
        }
    }
}

#[test]
fn bad_values_are_named() {
    let good = per_param(&SHAPES, 2);
    let cases: Vec<(Manifest, &str)> = vec![
        (
            Manifest {
                format: "zip".into(),
                ..good.clone()
            },
            "format",
        ),
        (
            Manifest {
                version: 2,
                ..good.clone()
            },
            "version",
        ),
        (
            Manifest {
                world_size: 0,
                ..good.clone()
            },
            "world_size",
        ),
        (
            Manifest {
                params: vec![entry("a", &[4], Some(2)), entry("a", &[4], Some(2))],
                ..good.clone()
            },
            "params[1].name",
        ),
        (
            Manifest {
                params: vec![entry("a", &[5], Some(2))],
                ..good.clone()
            },
            "params[0].chunk",
        ),
        (
            Manifest {
                params: vec![entry("a", &[5], None)],
                ..good.clone()
            },
            "params[0].chunk",
        ),
        (
            Manifest {
                params: vec![entry("a", &[usize::MAX, 3], Some(1))],
                ..good.clone()
            },
            "params[0].shape",
        ),
        (
            Manifest {
                partitioning: Partitioning::Flat { chunk: 10 },
                ..good.clone()
            },
            "partitioning.chunk",
        ),
        (
            Manifest {
                files: vec![file("../etc/passwd", None)],
                ..good.clone()
            },
            "files[0].path",
        ),
        (
            Manifest {
                files: vec![file("/abs", None)],
                ..good.clone()
            },
            "files[0].path",
        ),
        (
            Manifest {
                files: vec![file("r.st", Some(2))],
                ..good.clone()
            },
            "files[0].rank",
        ),
        (
            Manifest {
                files: vec![FileEntry {
                    sha256: "xyz".into(),
                    ..file("r.st", None)
                }],
                ..good.clone()
            },
            "files[0].sha256",
        ),
    ];
    for (m, field) in cases {
        let err = Manifest::parse(m.to_json().as_bytes())
            .unwrap_err()
            .to_string();
        assert!(err.contains(&format!("`{field}`")), "{field}: {err}");
    }
    // The stage is a type: a number outside 0-3 does not parse, and the error names the key.
    let mut value = serde_json::to_value(&good).unwrap();
    value["stage"] = 4.into();
    let err = Manifest::parse(value.to_string().as_bytes()).unwrap_err();
    assert!(err.to_string().contains("`stage`"), "{err}");
    assert!(matches!(
        Manifest::parse(b"{"),
        Err(ManifestError::Parse(_))
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// Arbitrary bytes: an error or a manifest, never a panic.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = Manifest::parse(&bytes);
    }

    /// A valid manifest with bytes replaced, removed or inserted: never a panic, and whatever
    /// parses also answers `pieces` and `partition_len` without panicking.
    #[test]
    fn mutated_manifests_never_panic(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..8)
    ) {
        let mut bytes = per_param(&SHAPES, 3).to_json().into_bytes();
        for (at, byte, how) in edits {
            let i = at.index(bytes.len().max(1)).min(bytes.len());
            match how {
                0 if i < bytes.len() => bytes[i] = byte,
                1 if i < bytes.len() => { bytes.remove(i); }
                _ => bytes.insert(i, byte),
            }
        }
        if let Ok(m) = Manifest::parse(&bytes) {
            for p in 0..m.params.len() {
                let _ = m.pieces(p);
            }
            let _ = m.partition_len();
        }
    }

    /// Digits swapped into the numeric fields: validation catches what `pieces` cannot take.
    #[test]
    fn numeric_fields_are_validated(world in 0usize..6, chunk in 0usize..40, dims in proptest::collection::vec(0usize..20, 0..3)) {
        let m = Manifest {
            world_size: world,
            params: vec![entry("w", &dims, Some(chunk))],
            files: vec![],
            ..per_param(&SHAPES, 1)
        };
        if Manifest::parse(m.to_json().as_bytes()).is_ok() {
            let pieces = m.pieces(0);
            let covered: usize = pieces.iter().map(|p| p.elements.len()).sum();
            prop_assert_eq!(covered, dims.iter().product::<usize>());
        }
    }
}
