use super::*;

fn tracer(bucket: usize, live: usize) -> GatherTracer {
    GatherTracer::new(TraceConfig {
        prefetch_bucket_size: bucket,
        max_live_parameters: live,
        max_reuse_distance: 0,
    })
}

/// Runs one step of `order` (id, numel), releasing each handle right after its use; returns
/// (ids gathered on demand, ids prefetched), in issue order.
fn step(t: &mut GatherTracer, order: &[(HandleId, usize)]) -> (Vec<HandleId>, Vec<HandleId>) {
    t.begin_step();
    let (mut demand, mut ahead) = (Vec::new(), Vec::new());
    for &(id, numel) in order {
        let u = t.on_use(id, numel);
        if !u.prefetched {
            demand.push(id);
        }
        ahead.extend(u.prefetch);
        t.release(id);
    }
    assert_eq!(
        t.live_numel(),
        0,
        "everything released at the end of the step"
    );
    (demand, ahead)
}

/// A forward over layers 1..=4 and a backward in reverse, as a ZeRO-3 step gathers.
fn fwd_bwd() -> Vec<(HandleId, usize)> {
    let layers = [(1, 10), (2, 20), (3, 10), (4, 30)];
    layers.iter().chain(layers.iter().rev()).copied().collect()
}

#[test]
fn first_step_records_later_steps_prefetch_in_order() {
    let mut t = tracer(40, 1000);
    let order = fwd_bwd();
    let (demand, ahead) = step(&mut t, &order);
    assert_eq!(t.mode(), TraceMode::Record);
    assert_eq!(
        demand,
        vec![1, 2, 3, 4, 4, 3, 2, 1],
        "no trace: every use gathers"
    );
    assert!(ahead.is_empty());
    let (demand, ahead) = step(&mut t, &order);
    assert_eq!(t.mode(), TraceMode::Replay);
    // Every use is gathered exactly once, on demand or ahead, in the recorded order.
    let mut all = demand.clone();
    all.extend(&ahead);
    all.sort_unstable();
    // Layer 4 is used twice in a row (end of forward, start of backward): the live copy
    // serves both, so 7 gathers for 8 uses.
    assert_eq!(all, vec![1, 1, 2, 2, 3, 3, 4]);
    assert_eq!(demand, vec![1], "only the first use waits");
    assert_eq!(ahead, vec![2, 3, 4, 3, 2, 1]);
    assert_eq!(t.invalidations(), 0);
}

#[test]
fn prefetch_fills_the_bucket_in_batches_and_respects_the_live_budget() {
    // Bucket 20: a batch starts once at most 10 are in flight and takes handles while fewer
    // than 20 are, so a handle larger than the bucket is still prefetched (DeepSpeed's rule).
    let mut t = tracer(20, 1000);
    let order = fwd_bwd();
    step(&mut t, &order);
    t.begin_step();
    let u = t.on_use(1, 10);
    assert_eq!(u.prefetch, vec![2], "2 (20) fills the bucket: 3 waits");
    let u = t.on_use(2, 20);
    assert!(u.prefetched);
    assert_eq!(
        u.prefetch,
        vec![3, 4],
        "nothing in flight: 3 (10), then 4 (30) overshoots the bucket by one handle"
    );
    // 1 and 2 still held (30) + 3 and 4 prefetched (40).
    assert_eq!(t.live_numel(), 70);
    t.release(1);
    t.release(2);
    let u = t.on_use(3, 10);
    assert!(u.prefetched && u.prefetch.is_empty(), "30 in flight > 10");
    t.release(3);
    // 4 was just used (it is live): the rest of the trace (3, 2, 1: 40) is one batch of 3, 2.
    let u = t.on_use(4, 30);
    assert_eq!(
        u.prefetch,
        vec![3, 2],
        "0 in flight: 3 (10), 2 (20), then 30 >= 20"
    );

    // No bucket, no prefetch.
    let mut t = tracer(0, 1000);
    step(&mut t, &order);
    t.begin_step();
    assert!(t.on_use(1, 10).prefetch.is_empty());

    // Live budget 35: with 1 (10) and 2 (20) held, 3 (10) does not fit; after releases it does.
    let mut t = tracer(1000, 35);
    step(&mut t, &order);
    t.begin_step();
    assert_eq!(t.on_use(1, 10).prefetch, vec![2]);
    assert!(t.on_use(2, 20).prefetch.is_empty(), "10 + 20 + 10 > 35");
    t.release(1);
    t.release(2);
    assert!(t.on_use(3, 10).prefetch.is_empty(), "10 + 30 > 35");
    assert!(t.peak_live_numel() <= 35);
}

#[test]
fn live_elements_from_prefetch_never_exceed_the_budget() {
    // Random orders of 12 handles of 1..=9 elements, fixed seed; on-demand gathers may exceed
    // the budget by one handle, prefetches never.
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % n
    };
    for budget in [5, 12, 30] {
        let sizes: Vec<usize> = (0..12).map(|_| 1 + next(9) as usize).collect();
        let order: Vec<(HandleId, usize)> = (0..40)
            .map(|_| {
                let id = next(12);
                (id, sizes[id as usize])
            })
            .collect();
        let mut t = tracer(budget, budget);
        for _ in 0..3 {
            t.begin_step();
            for &(id, numel) in &order {
                let before = t.live_numel();
                let u = t.on_use(id, numel);
                let demand = if u.prefetched { 0 } else { numel };
                assert!(
                    t.live_numel() <= budget.max(before + demand),
                    "budget {budget}: {} live after prefetch",
                    t.live_numel()
                );
                t.release(id);
            }
        }
        assert_eq!(t.mode(), TraceMode::Replay);
        assert_eq!(t.invalidations(), 0);
    }
}

#[test]
fn a_changed_order_evicts_prefetches_and_is_re_recorded() {
    let mut t = tracer(1000, 1000);
    let a: Vec<(HandleId, usize)> = vec![(1, 5), (2, 5), (3, 5)];
    step(&mut t, &a);
    t.begin_step();
    assert_eq!(t.on_use(1, 5).prefetch, vec![2, 3]);
    t.release(1);
    // Control flow changed: 3 comes before 2.
    let u = t.on_use(3, 5);
    assert!(u.prefetched, "3 was prefetched and is still valid data");
    assert_eq!(u.evict, vec![2], "2 is dropped; the trace is gone");
    assert_eq!(t.mode(), TraceMode::Record);
    t.release(3);
    let u = t.on_use(2, 5);
    assert!(!u.prefetched && u.prefetch.is_empty());
    t.release(2);
    assert_eq!(t.invalidations(), 1);
    // The new order (1, 3, 2) is what the next step replays.
    let b: Vec<(HandleId, usize)> = vec![(1, 5), (3, 5), (2, 5)];
    let (demand, ahead) = step(&mut t, &b);
    assert_eq!((demand, ahead), (vec![1], vec![3, 2]));
    assert_eq!(t.mode(), TraceMode::Replay);
}

#[test]
fn a_step_that_ends_early_or_runs_long_re_records() {
    let mut t = tracer(1000, 1000);
    step(&mut t, &[(1, 1), (2, 1), (3, 1)]);
    // Shorter: replays 1, 2 then ends; the caller drops the unused prefetch of 3.
    t.begin_step();
    t.on_use(1, 1);
    t.release(1);
    t.on_use(2, 1);
    t.release(2);
    t.release(3);
    t.begin_step();
    assert_eq!(t.invalidations(), 1);
    assert_eq!(
        t.mode(),
        TraceMode::Replay,
        "the short order is the new trace"
    );
    // Longer than the trace: the extra use invalidates.
    t.on_use(1, 1);
    t.release(1);
    t.on_use(2, 1);
    t.release(2);
    let u = t.on_use(4, 1);
    assert!(!u.prefetched);
    assert_eq!(t.mode(), TraceMode::Record);
    assert_eq!(t.invalidations(), 2);
}

#[test]
fn a_handle_used_twice_while_alive_is_shared() {
    let mut t = tracer(0, 0);
    t.begin_step();
    assert!(!t.on_use(7, 4).prefetched);
    assert!(
        t.on_use(7, 4).prefetched,
        "tied weights: the live gather serves both uses"
    );
    assert_eq!(t.live_numel(), 4);
    t.release(7);
    assert_eq!(t.live_numel(), 4, "the second use still holds it");
    t.release(7);
    assert_eq!(t.live_numel(), 0);
}

#[test]
fn released_handles_reused_within_the_distance_are_kept() {
    // 1 is used again after 2 and 3 (15 elements gathered in between).
    let order: Vec<(HandleId, usize)> = vec![(1, 4), (2, 5), (3, 10), (1, 4)];
    for (distance, kept) in [(14, false), (15, true)] {
        let mut t = GatherTracer::new(TraceConfig {
            prefetch_bucket_size: 0,
            max_live_parameters: 1000,
            max_reuse_distance: distance,
        });
        step(&mut t, &order);
        t.begin_step();
        t.on_use(1, 4);
        assert_eq!(t.release(1), !kept, "distance {distance}");
        for (id, n) in [(2, 5), (3, 10)] {
            t.on_use(id, n);
            assert!(t.release(id));
        }
        assert_eq!(t.on_use(1, 4).prefetched, kept, "distance {distance}");
        assert!(t.release(1), "not reused again: freed");
    }
}
