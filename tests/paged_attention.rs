//! Paged attention equals naive contiguous attention computed in f64, over random page layouts,
//! page sizes, GQA ratios, chunk shapes and all three KV element types.

use mtpx::kv::{
    paged_attention, AttentionRow, AttentionShape, KvDtype, KvShape, KvStorage, PagePool, PageTable,
};
use proptest::prelude::*;
use proptest::test_runner::RngSeed;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[derive(Debug)]
struct Case {
    page_size: usize,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    /// Per sequence: (context length before this step, new rows this step).
    seqs: Vec<(usize, usize)>,
    dtype: KvDtype,
    seed: u64,
}

/// Maximum |paged − reference| allowed per element type (values are O(1)).
fn tolerance(dtype: KvDtype) -> f64 {
    match dtype {
        KvDtype::F32 => 1e-5,
        KvDtype::F16 => 2e-3,
        KvDtype::Q8 => 2.5e-2,
    }
}

fn run_case(case: &Case) -> f64 {
    let mut rng = ChaCha8Rng::seed_from_u64(case.seed);
    let hd = case.head_dim;
    let kv_width = case.num_kv_heads * hd;
    let shape = KvShape {
        num_layers: 2,
        num_kv_heads: case.num_kv_heads,
        head_dim: hd,
        page_size: case.page_size,
    };
    let total: usize = case.seqs.iter().map(|(c, n)| c + n).sum();
    let num_pages = total.div_ceil(case.page_size) + case.seqs.len() + 8;
    let mut pool = PagePool::new(num_pages, case.page_size);
    // Scatter the pages: take some decoy pages first so tables are non-contiguous.
    let decoys = pool.try_allocate(rng.random_range(0..4)).unwrap();
    let mut storage = KvStorage::new(shape, case.dtype, num_pages);
    let layer = 1;

    let mut tables = Vec::new();
    let mut keys = Vec::new(); // per seq: [len][kv_width]
    let mut values = Vec::new();
    for &(ctx, new) in &case.seqs {
        let mut table = PageTable::new();
        let len = ctx + new;
        // Grow in random steps so page ids interleave between sequences.
        let mut grown = 0;
        while grown < len {
            let step = rng.random_range(1..=len - grown);
            table.try_grow(step, &mut pool).unwrap();
            grown += step;
        }
        let k: Vec<f32> = (0..len * kv_width)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let v: Vec<f32> = (0..len * kv_width)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        for pos in 0..len {
            let page = table.page_ids()[pos / case.page_size];
            let slot = pos % case.page_size;
            storage.write_token(
                page,
                slot,
                layer,
                &k[pos * kv_width..(pos + 1) * kv_width],
                &v[pos * kv_width..(pos + 1) * kv_width],
            );
        }
        tables.push(table);
        keys.push(k);
        values.push(v);
    }
    pool.release_all(&decoys).unwrap();

    let mut rows = Vec::new();
    for (seq, &(ctx, new)) in case.seqs.iter().enumerate() {
        for i in 0..new {
            rows.push(AttentionRow {
                seq,
                position: ctx + i,
            });
        }
    }
    let q: Vec<f32> = (0..rows.len() * case.num_heads * hd)
        .map(|_| rng.random_range(-2.0..2.0))
        .collect();
    let mut out = vec![0f32; q.len()];
    let table_refs: Vec<&[u32]> = tables.iter().map(|t| t.page_ids()).collect();
    let attn_shape = AttentionShape {
        num_heads: case.num_heads,
        num_kv_heads: case.num_kv_heads,
        head_dim: hd,
    };
    paged_attention(
        &q,
        &rows,
        &table_refs,
        &storage,
        layer,
        attn_shape,
        &mut out,
    );

    let group = case.num_heads / case.num_kv_heads;
    let mut max_err = 0f64;
    for (r, row) in rows.iter().enumerate() {
        for h in 0..case.num_heads {
            let kvh = h / group;
            let qv = &q[(r * case.num_heads + h) * hd..][..hd];
            let scores: Vec<f64> = (0..=row.position)
                .map(|t| {
                    let kr = &keys[row.seq][t * kv_width + kvh * hd..][..hd];
                    qv.iter()
                        .zip(kr)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        / (hd as f64).sqrt()
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f64 = weights.iter().sum();
            for d in 0..hd {
                let want: f64 = weights
                    .iter()
                    .enumerate()
                    .map(|(t, w)| w * values[row.seq][t * kv_width + kvh * hd + d] as f64)
                    .sum::<f64>()
                    / z;
                let got = out[(r * case.num_heads + h) * hd + d] as f64;
                max_err = max_err.max((got - want).abs());
            }
        }
    }
    for mut t in tables {
        t.release(&mut pool).unwrap();
    }
    assert_eq!(pool.num_used(), 0);
    max_err
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (
        prop::sample::select(vec![1usize, 16, 64]),
        prop::sample::select(vec![(1usize, 1usize), (4, 4), (4, 2), (8, 1), (14, 2)]),
        prop::sample::select(vec![8usize, 16, 64]),
        prop::collection::vec((0usize..150, 1usize..40), 1..4),
        prop::sample::select(vec![KvDtype::F32, KvDtype::F16, KvDtype::Q8]),
        any::<u64>(),
    )
        .prop_map(
            |(page_size, (num_heads, num_kv_heads), head_dim, seqs, dtype, seed)| Case {
                page_size,
                num_heads,
                num_kv_heads,
                head_dim,
                seqs,
                dtype,
                seed,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 96,
        rng_seed: RngSeed::Fixed(0x70616765),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]
    #[test]
    fn paged_attention_equals_contiguous_reference(case in case_strategy()) {
        let err = run_case(&case);
        prop_assert!(err < tolerance(case.dtype), "max error {err} for {:?}", case.dtype);
    }
}

#[test]
fn decode_verify_and_prefill_rows_mixed_in_one_batch() {
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Q8] {
        let case = Case {
            page_size: 16,
            num_heads: 14,
            num_kv_heads: 2,
            head_dim: 64,
            // A decode row deep in context, 9 verify rows crossing a page, a 37-row prefill chunk
            // after 5 cached tokens, and a fresh 20-token prompt.
            seqs: vec![(1000, 1), (250, 9), (5, 37), (0, 20)],
            dtype,
            seed: 7,
        };
        let err = run_case(&case);
        println!("{dtype:?}: max |paged - f64 reference| = {err:.2e}");
        assert!(err < tolerance(dtype), "{dtype:?}: {err}");
    }
}
