//! Property tests of the page pool and page tables under random grow / truncate / share /
//! release sequences: no double free, reference counts balance, capacity is exactly
//! pages × page size, storage never exceeds its budget, and exhaustion is a typed error that
//! changes nothing.

use mtpx::error::KvError;
use mtpx::kv::{KvDtype, KvShape, KvStorage, PagePool, PageTable};
use proptest::prelude::*;
use proptest::test_runner::RngSeed;
use std::collections::HashMap;

#[derive(Debug, Clone)]
enum Op {
    Grow {
        table: usize,
        tokens: usize,
    },
    Truncate {
        table: usize,
        keep_fraction: f64,
    },
    /// Start `table` (if empty) as a sharer of `from`'s full pages.
    Share {
        table: usize,
        from: usize,
    },
    Release {
        table: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0usize..6, 1usize..80).prop_map(|(table, tokens)| Op::Grow { table, tokens }),
        2 => (0usize..6, 0.0f64..1.0).prop_map(|(table, keep_fraction)| Op::Truncate { table, keep_fraction }),
        1 => (0usize..6, 0usize..6).prop_map(|(table, from)| Op::Share { table, from }),
        1 => (0usize..6).prop_map(|table| Op::Release { table }),
    ]
}

fn check_invariants(pool: &PagePool, tables: &[PageTable], storage: &KvStorage) {
    let page_size = pool.page_size();
    let mut expected_refs: HashMap<u32, u32> = HashMap::new();
    for t in tables {
        assert_eq!(t.capacity(page_size), t.page_ids().len() * page_size);
        assert!(t.len() <= t.capacity(page_size));
        // No table holds more pages than its length needs.
        assert_eq!(t.page_ids().len(), t.len().div_ceil(page_size));
        for &id in t.page_ids() {
            *expected_refs.entry(id).or_default() += 1;
        }
    }
    for (&id, &count) in &expected_refs {
        assert_eq!(pool.ref_count(id), count, "page {id}");
    }
    assert_eq!(pool.num_used(), expected_refs.len());
    assert_eq!(pool.num_used() + pool.num_free(), pool.num_pages());
    assert!(storage.bytes_allocated() <= storage.budget_bytes());
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        rng_seed: RngSeed::Fixed(0x706f6f6c),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]
    #[test]
    fn pool_and_tables_stay_consistent(
        num_pages in 1usize..40,
        page_size in prop::sample::select(vec![1usize, 4, 16]),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let mut pool = PagePool::new(num_pages, page_size);
        let shape = KvShape { num_layers: 1, num_kv_heads: 1, head_dim: 4, page_size };
        let mut storage = KvStorage::new(shape, KvDtype::F16, num_pages);
        let mut tables = vec![PageTable::new(); 6];
        for op in ops {
            match op {
                Op::Grow { table, tokens } => {
                    let before = tables[table].clone();
                    let free_before = pool.num_free();
                    let needed = tables[table].pages_needed(tokens, page_size);
                    match tables[table].try_grow(tokens, &mut pool) {
                        Ok(()) => {
                            // Touch the new positions so storage grows as a forward would.
                            let t = &tables[table];
                            for pos in before.len()..t.len() {
                                storage.write_token(t.page_ids()[pos / page_size], pos % page_size, 0, &[1.0; 4], &[1.0; 4]);
                            }
                        }
                        Err(e) => {
                            prop_assert_eq!(e, KvError::PoolExhausted { needed, free: free_before });
                            prop_assert_eq!(&tables[table], &before);
                            prop_assert_eq!(pool.num_free(), free_before);
                        }
                    }
                }
                Op::Truncate { table, keep_fraction } => {
                    let len = tables[table].len();
                    let keep = (len as f64 * keep_fraction) as usize;
                    tables[table].truncate(keep, &mut pool).unwrap();
                    prop_assert_eq!(tables[table].len(), keep);
                }
                Op::Share { table, from } => {
                    if table != from && tables[table].is_empty() {
                        let full = tables[from].len() / page_size;
                        let ids = tables[from].page_ids()[..full].to_vec();
                        tables[table].adopt_shared(&ids, full * page_size, &mut pool).unwrap();
                    }
                }
                Op::Release { table } => tables[table].release(&mut pool).unwrap(),
            }
            check_invariants(&pool, &tables, &storage);
        }
        for t in &mut tables {
            t.release(&mut pool).unwrap();
        }
        prop_assert_eq!(pool.num_used(), 0);
    }
}

#[test]
fn releasing_a_free_page_is_a_typed_error_not_a_double_free() {
    let mut pool = PagePool::new(2, 16);
    let ids = pool.try_allocate(1).unwrap();
    pool.release(ids[0]).unwrap();
    assert_eq!(
        pool.release(ids[0]),
        Err(KvError::NotAllocated { page_id: ids[0] })
    );
    assert_eq!(pool.num_free(), 2);
}
