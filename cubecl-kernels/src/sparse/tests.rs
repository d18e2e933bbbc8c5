//! Layouts written out by hand, as DeepSpeed's `sparsity_config.py` defines them.

use super::{
    BigBirdConfig, BlockLayout, BsLongformerConfig, Direction, FixedConfig, SparseLayout,
    SparsityConfig, SparsityMode, VariableConfig,
};

/// A layout written as rows of `#` (computed) and `.`.
fn drawn(rows: &[&str]) -> BlockLayout {
    BlockLayout {
        blocks: rows.len(),
        tiles: rows
            .iter()
            .flat_map(|r| r.chars().map(|c| c == '#'))
            .collect(),
    }
}

fn fixed(heads: usize, per_head: bool, f: FixedConfig) -> SparsityConfig {
    SparsityConfig {
        num_heads: heads,
        block: 16,
        different_layout_per_head: per_head,
        mode: SparsityMode::Fixed(f),
    }
}

#[test]
fn dense_keeps_every_tile() {
    let c = SparsityConfig {
        num_heads: 2,
        block: 16,
        different_layout_per_head: false,
        mode: SparsityMode::Dense,
    };
    let l = c.make_layout(64).unwrap();
    assert_eq!(l.len(), 2);
    assert!(l.iter().all(|h| h.count() == 16));
}

/// 8 blocks, windows of 4, one global block (the last of each window), bidirectional.
#[test]
fn fixed_bidirectional_written_out() {
    let l = fixed(1, false, FixedConfig::default())
        .make_layout(128)
        .unwrap();
    let want = drawn(&[
        "####...#", //
        "####...#", //
        "####...#", //
        "####...#", //
        "...#####", //
        "...#####", //
        "...#####", //
        "...#####",
    ]);
    assert_eq!(l[0], want);
}

/// Unidirectional: causal windows, and global columns only from their own row down.
#[test]
fn fixed_unidirectional_written_out() {
    let f = FixedConfig {
        attention: Direction::Unidirectional,
        ..FixedConfig::default()
    };
    let l = fixed(1, false, f).make_layout(128).unwrap();
    let want = drawn(&[
        "#.......", //
        "##......", //
        "###.....", //
        "####....", //
        "...##...", //
        "...###..", //
        "...####.", //
        "...#####",
    ]);
    assert_eq!(l[0], want);
}

/// Horizontal global attention, a short last window (6 blocks, windows of 4), and a second
/// head taking the third block of each window as global.
#[test]
fn fixed_horizontal_short_window_and_per_head_patterns() {
    let f = FixedConfig {
        horizontal_global_attention: true,
        num_different_global_patterns: 2,
        ..FixedConfig::default()
    };
    let l = fixed(2, true, f).make_layout(96).unwrap();
    let head0 = drawn(&[
        "####.#", //
        "####.#", //
        "####.#", //
        "######", //
        "...###", //
        "######",
    ]);
    // The second head's globals are the third block of each window; the short last
    // window's is clamped to its last block, as DeepSpeed clamps it.
    let head1 = drawn(&[
        "####.#", //
        "####.#", //
        "######", //
        "####.#", //
        "..#.##", //
        "######",
    ]);
    assert_eq!(l[0], head0);
    assert_eq!(l[1], head1);
}

fn longformer(c: BsLongformerConfig) -> BlockLayout {
    let config = SparsityConfig {
        num_heads: 1,
        block: 16,
        different_layout_per_head: false,
        mode: SparsityMode::BsLongformer(c),
    };
    config.make_layout(96).unwrap().remove(0)
}

/// 6 blocks, a window of 3, block 0 global; then causal; then a global range 1..3.
#[test]
fn bslongformer_written_out() {
    let both = longformer(BsLongformerConfig::default());
    let want = drawn(&[
        "######", //
        "###...", //
        "####..", //
        "#.###.", //
        "#..###", //
        "#...##",
    ]);
    assert_eq!(both, want);
    let causal = longformer(BsLongformerConfig {
        attention: Direction::Unidirectional,
        ..BsLongformerConfig::default()
    });
    let want = drawn(&[
        "#.....", //
        "##....", //
        "###...", //
        "#.##..", //
        "#..##.", //
        "#...##",
    ]);
    assert_eq!(causal, want);
    let ranged = longformer(BsLongformerConfig {
        global_block_indices: vec![1],
        global_block_end_indices: Some(vec![3]),
        ..BsLongformerConfig::default()
    });
    let want = drawn(&[
        "###...", //
        "######", //
        "######", //
        ".####.", //
        ".#####", //
        ".##.##",
    ]);
    assert_eq!(ranged, want);
}

#[test]
fn bad_settings_are_named() {
    let bad = |f: FixedConfig, per_head: bool| fixed(2, per_head, f).make_layout(128).unwrap_err();
    let e = bad(
        FixedConfig {
            num_local_blocks: 4,
            num_global_blocks: 3,
            ..FixedConfig::default()
        },
        false,
    );
    assert!(e.contains("num_local_blocks 4"), "{e}");
    let e = bad(
        FixedConfig {
            attention: Direction::Unidirectional,
            horizontal_global_attention: true,
            ..FixedConfig::default()
        },
        false,
    );
    assert!(e.contains("bidirectional"), "{e}");
    let e = bad(
        FixedConfig {
            num_different_global_patterns: 2,
            ..FixedConfig::default()
        },
        false,
    );
    assert!(e.contains("different_layout_per_head"), "{e}");
    let e = fixed(1, false, FixedConfig::default())
        .make_layout(100)
        .unwrap_err();
    assert!(e.contains("multiple of the block size 16"), "{e}");
}

fn layout_of(mode: SparsityMode, blocks: usize, heads: usize, per_head: bool) -> Vec<BlockLayout> {
    let config = SparsityConfig {
        num_heads: heads,
        block: 16,
        different_layout_per_head: per_head,
        mode,
    };
    config.make_layout(16 * blocks).unwrap()
}

/// 6 blocks, no random blocks, a window of 3, one global block: both directions.
#[test]
fn bigbird_written_out() {
    let bird = |attention| BigBirdConfig {
        num_random_blocks: 0,
        attention,
        ..BigBirdConfig::default()
    };
    let both = layout_of(
        SparsityMode::BigBird(bird(Direction::Bidirectional)),
        6,
        1,
        false,
    );
    let want = drawn(&[
        "######", //
        "###...", //
        "####..", //
        "#.###.", //
        "#..###", //
        "#...##",
    ]);
    assert_eq!(both[0], want);
    let causal = layout_of(
        SparsityMode::BigBird(bird(Direction::Unidirectional)),
        6,
        1,
        false,
    );
    let want = drawn(&[
        "#.....", //
        "##....", //
        "###...", //
        "#.##..", //
        "#..##.", //
        "#...##",
    ]);
    assert_eq!(causal[0], want);
}

/// Random blocks: the deterministic part stays, at most `num_random_blocks` more per row,
/// none above the diagonal when unidirectional, the same draw twice, heads drawn apart.
#[test]
fn bigbird_random_blocks_add_to_the_window() {
    for attention in [Direction::Bidirectional, Direction::Unidirectional] {
        let with = |random| BigBirdConfig {
            num_random_blocks: random,
            attention,
            ..BigBirdConfig::default()
        };
        let base = &layout_of(SparsityMode::BigBird(with(0)), 12, 1, false)[0];
        let heads = layout_of(SparsityMode::BigBird(with(2)), 12, 4, true);
        assert_eq!(
            heads,
            layout_of(SparsityMode::BigBird(with(2)), 12, 4, true)
        );
        assert!(
            heads.iter().any(|h| h != &heads[0]),
            "per-head draws differ"
        );
        for layout in &heads {
            for row in 0..12 {
                let extra = (0..12).filter(|c| layout.get(row, *c) && !base.get(row, *c));
                assert!(extra.count() <= 2);
                for col in 0..12 {
                    assert!(!base.get(row, col) || layout.get(row, col));
                    if attention == Direction::Unidirectional && col > row {
                        assert!(!layout.get(row, col), "({row}, {col}) above the diagonal");
                    }
                }
            }
            assert!(layout.count() > base.count());
        }
    }
}

/// 8 blocks, windows of 2 then 3 (repeating), global block 0; unidirectional with a global
/// range 1..3; horizontal global attention.
#[test]
fn variable_written_out() {
    let both = layout_of(
        SparsityMode::Variable(VariableConfig {
            local_window_blocks: vec![2, 3],
            ..VariableConfig::default()
        }),
        8,
        1,
        false,
    );
    let want = drawn(&[
        "##......", //
        "##......", //
        "#.###...", //
        "#.###...", //
        "#.###...", //
        "#....###", //
        "#....###", //
        "#....###",
    ]);
    assert_eq!(both[0], want);
    let causal = layout_of(
        SparsityMode::Variable(VariableConfig {
            local_window_blocks: vec![2, 3],
            global_block_indices: vec![1],
            global_block_end_indices: Some(vec![3]),
            attention: Direction::Unidirectional,
            ..VariableConfig::default()
        }),
        8,
        1,
        false,
    );
    let want = drawn(&[
        "#.......", //
        "###.....", //
        ".##.....", //
        ".###....", //
        ".####...", //
        ".##..#..", //
        ".##..##.", //
        ".##..###",
    ]);
    assert_eq!(causal[0], want);
    let horizontal = layout_of(
        SparsityMode::Variable(VariableConfig {
            local_window_blocks: vec![2, 3],
            horizontal_global_attention: true,
            ..VariableConfig::default()
        }),
        8,
        1,
        false,
    );
    let mut want = both[0].clone();
    (0..8).for_each(|c| want.set(0, c));
    assert_eq!(horizontal[0], want);
}

#[test]
fn bigbird_and_variable_bad_settings_are_named() {
    let err = |mode| {
        SparsityConfig {
            num_heads: 1,
            block: 16,
            different_layout_per_head: false,
            mode,
        }
        .make_layout(64)
        .unwrap_err()
    };
    let e = err(SparsityMode::BigBird(BigBirdConfig {
        num_sliding_window_blocks: 5,
        ..BigBirdConfig::default()
    }));
    assert!(e.contains("num_sliding_window_blocks 5"), "{e}");
    let e = err(SparsityMode::Variable(VariableConfig {
        horizontal_global_attention: true,
        attention: Direction::Unidirectional,
        ..VariableConfig::default()
    }));
    assert!(e.contains("bidirectional"), "{e}");
    let e = err(SparsityMode::Variable(VariableConfig {
        global_block_end_indices: Some(vec![0]),
        ..VariableConfig::default()
    }));
    assert!(e.contains("empty"), "{e}");
    let e = err(SparsityMode::Variable(VariableConfig {
        local_window_blocks: vec![],
        ..VariableConfig::default()
    }));
    assert!(e.contains("local_window_blocks"), "{e}");
}

#[test]
fn a_sparse_layout_holds_every_heads_tiles() {
    let config = SparsityConfig {
        num_heads: 3,
        block: 16,
        different_layout_per_head: true,
        mode: SparsityMode::BigBird(BigBirdConfig::default()),
    };
    let layout = SparseLayout::new(&config, 128).unwrap();
    let heads = config.make_layout(128).unwrap();
    assert_eq!(
        (layout.heads, layout.blocks, layout.kept.len()),
        (3, 8, 3 * 64)
    );
    for (h, head) in heads.iter().enumerate() {
        for (t, tile) in head.tiles.iter().enumerate() {
            assert_eq!(layout.kept[h * 64 + t] != 0, *tile);
            assert_eq!(layout.keeps(h, t / 8 * 16 + 3, t % 8 * 16 + 15), *tile);
        }
    }
    assert!(layout.density() > 0.0 && layout.density() < 1.0);
    assert!(
        SparseLayout::new(&config, 100)
            .unwrap_err()
            .contains("block size 16")
    );
}
