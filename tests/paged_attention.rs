//! Paged attention equals naive contiguous attention computed in f64, over random page layouts,
//! page sizes, GQA ratios, chunk shapes and all three KV element types, on every instruction-set
//! path this CPU has (f32 products on each instruction set, and bf16 products where the CPU has
//! them), and with the keys of long sequences split across tasks (split-K).

use mtpx::kv::{
    paged_attention, paged_attention_with, AttentionPath, AttentionRow, AttentionShape, KvDtype,
    KvShape, KvStorage, PagePool, PageTable,
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

/// Maximum |paged − reference| allowed per element type (values are O(1)) and path: bf16
/// products round Q, K, V and the weights to 8 significant bits.
fn tolerance(path: AttentionPath, dtype: KvDtype) -> f64 {
    match (path, dtype) {
        (_, KvDtype::Q8) => 2.5e-2,
        (AttentionPath::Bf16 | AttentionPath::Amx | AttentionPath::Int8, _) => 1e-2,
        // fp16 products round Q, centred K and the weights to 11 significant bits and sum in
        // fp16 within a block; with f32 K/V the path runs as f32.
        (AttentionPath::F16, KvDtype::F16) => 1e-2,
        (_, KvDtype::F32) => 1e-5,
        (_, KvDtype::F16) => 2e-3,
    }
}

/// The worst error of `case` over every supported path, planned for 1, 2 and 8 threads (more
/// planned threads split long sequences into more pieces), as a fraction of the path's
/// tolerance: below 1 passes.
fn run_case(case: &Case) -> f64 {
    let fx = Fixture::build(case);
    let mut worst = 0f64;
    for path in AttentionPath::supported() {
        for threads in [1, 2, 8] {
            let out = fx.attend(Some((path, threads)), &fx.rows, &fx.q);
            let err = fx.max_error(&out);
            if threads == 2 {
                println!("  {path:?}: {err:.2e}");
            }
            worst = worst.max(err / tolerance(path, case.dtype));
        }
    }
    worst
}

/// Which attention paths `run_case` compares on this CPU, for the CI log (`tests/run.sh` runs
/// this with `--nocapture`): the f32 products on each instruction set the CPU has (on AVX2 with
/// f16 K/V read in place from the pages), and the bf16 / AMX / int8 / fp16 products where the
/// CPU has AVX-512 BF16, AMX, VNNI + VBMI or FP16.
#[test]
fn paths_on_this_cpu() {
    let paths = AttentionPath::supported();
    let names: Vec<String> = paths.iter().map(|p| p.name()).collect();
    println!("attention paths tested: {}", names.join(", "));
    for dtype in [KvDtype::F16, KvDtype::Q8, KvDtype::F32] {
        let default = AttentionPath::for_kv(dtype);
        println!("  default for {dtype:?} K/V: {}", default.name());
        assert!(
            paths.contains(&default),
            "the default path is among those tested"
        );
    }
}

/// A case's pages, written, with its rows and queries and the f32 K/V they were written from.
struct Fixture {
    case_heads: (usize, usize, usize),
    pool: PagePool,
    storage: KvStorage,
    tables: Vec<PageTable>,
    /// Per sequence: `[len][kv_width]`.
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    rows: Vec<AttentionRow>,
    q: Vec<f32>,
}

const LAYER: usize = 1;

impl Fixture {
    fn build(case: &Case) -> Fixture {
        Self::build_with_outliers(case, None)
    }

    /// With `outliers = Some((factor, scaled))`, two key channels (a rotary pair) carry an offset
    /// `factor` times the others' range, as Qwen2.5's (from its K bias) do; `scaled` stores q8
    /// keys over channel scales (each channel's largest |k|, as `runner::calibrate` measures).
    fn build_with_outliers(case: &Case, outliers: Option<(f32, bool)>) -> Fixture {
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

        if let Some((factor, true)) = outliers {
            let mut scales = vec![1f32; 2 * kv_width];
            for (i, s) in scales.iter_mut().enumerate() {
                if [3, 3 + hd / 2].contains(&(i % hd)) {
                    *s = factor + 1.0;
                }
            }
            storage.set_key_channels(scales.into());
        }
        let mut tables = Vec::new();
        let mut keys = Vec::new();
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
            let mut k: Vec<f32> = (0..len * kv_width)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            if let Some((factor, _)) = outliers {
                for (i, x) in k.iter_mut().enumerate() {
                    if [3, 3 + hd / 2].contains(&(i % hd)) {
                        *x += factor;
                    }
                }
            }
            let v: Vec<f32> = (0..len * kv_width)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            for pos in 0..len {
                let page = table.page_ids()[pos / case.page_size];
                let slot = pos % case.page_size;
                storage.write_token(
                    page,
                    slot,
                    LAYER,
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
        Fixture {
            case_heads: (case.num_heads, case.num_kv_heads, hd),
            pool,
            storage,
            tables,
            keys,
            values,
            rows,
            q,
        }
    }

    /// Attention for `rows` (queries `q`); `how`: the path and planned thread count, or `None`
    /// for [`paged_attention`]'s defaults.
    fn attend(
        &self,
        how: Option<(AttentionPath, usize)>,
        rows: &[AttentionRow],
        q: &[f32],
    ) -> Vec<f32> {
        let (num_heads, num_kv_heads, head_dim) = self.case_heads;
        let shape = AttentionShape {
            num_heads,
            num_kv_heads,
            head_dim,
        };
        let tables: Vec<&[u32]> = self.tables.iter().map(|t| t.page_ids()).collect();
        let mut out = vec![0f32; q.len()];
        let kv = &self.storage;
        match how {
            Some((path, threads)) => {
                paged_attention_with(path, threads, q, rows, &tables, kv, LAYER, shape, &mut out)
            }
            None => paged_attention(q, rows, &tables, kv, LAYER, shape, &mut out),
        }
        out
    }

    /// Largest |out − f64 reference| over the fixture's rows.
    fn max_error(&self, out: &[f32]) -> f64 {
        let (num_heads, num_kv_heads, hd) = self.case_heads;
        let kv_width = num_kv_heads * hd;
        let group = num_heads / num_kv_heads;
        let mut max_err = 0f64;
        for (r, row) in self.rows.iter().enumerate() {
            for h in 0..num_heads {
                let kvh = h / group;
                let qv = &self.q[(r * num_heads + h) * hd..][..hd];
                let scores: Vec<f64> = (0..=row.position)
                    .map(|t| {
                        let kr = &self.keys[row.seq][t * kv_width + kvh * hd..][..hd];
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
                let values = &self.values[row.seq];
                for d in 0..hd {
                    let want: f64 = weights
                        .iter()
                        .enumerate()
                        .map(|(t, w)| w * values[t * kv_width + kvh * hd + d] as f64)
                        .sum::<f64>()
                        / z;
                    let got = out[(r * num_heads + h) * hd + d] as f64;
                    max_err = max_err.max((got - want).abs());
                }
            }
        }
        max_err
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        for mut t in std::mem::take(&mut self.tables) {
            t.release(&mut self.pool).unwrap();
        }
        assert_eq!(self.pool.num_used(), 0);
    }
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (
        prop::sample::select(vec![1usize, 5, 16, 64]),
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
        prop_assert!(err < 1.0, "max error {err} of the tolerance for {:?}", case.dtype);
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
        println!("{dtype:?}: worst error {err:.2} of the tolerance");
        assert!(err < 1.0, "{dtype:?}: {err}");
    }
}

#[test]
fn split_k_over_one_long_sequence_matches_the_reference() {
    // One sequence deep in context, as in long-context decode and continuation prefill: planned
    // for 2 and 8 threads its keys are split into pieces whose partial softmax states merge.
    for (page_size, dtype, ctx, new) in [
        (16, KvDtype::F16, 16_000, 1),
        (16, KvDtype::Q8, 5_000, 9),
        (16, KvDtype::F32, 3_000, 40),
        (64, KvDtype::F16, 4_100, 1),
        (5, KvDtype::F16, 2_600, 17),
        (1, KvDtype::F32, 1_200, 3),
    ] {
        let case = Case {
            page_size,
            num_heads: 14,
            num_kv_heads: 2,
            head_dim: 64,
            seqs: vec![(ctx, new)],
            dtype,
            seed: ctx as u64,
        };
        let err = run_case(&case);
        println!("page {page_size}, {dtype:?}, {ctx}+{new}: {err:.2} of the tolerance");
        assert!(err < 1.0, "{case:?}: {err}");
    }
    // Split and unsplit sequences in one batch, GQA 8:1, head_dim 128 (as Qwen2.5-Coder-1.5B's),
    // and q8 on pages of 32 (the integer path's other page layout); head_dim 96, whose fp16
    // weighted values end on a tile of 32 dimensions.
    for (page_size, dtype, head_dim) in [
        (16, KvDtype::F16, 128),
        (32, KvDtype::Q8, 128),
        (16, KvDtype::F16, 96),
    ] {
        let case = Case {
            page_size,
            num_heads: 8,
            num_kv_heads: 1,
            head_dim,
            seqs: vec![(3_000, 1), (40, 2), (2_500, 20), (0, 5)],
            dtype,
            seed: 11,
        };
        let err = run_case(&case);
        assert!(err < 1.0, "{dtype:?}, head_dim {head_dim}: {err}");
    }
}

#[test]
fn the_default_entry_point_matches_the_reference() {
    let case = Case {
        page_size: 16,
        num_heads: 14,
        num_kv_heads: 2,
        head_dim: 64,
        seqs: vec![(4_000, 1), (300, 9)],
        dtype: KvDtype::F16,
        seed: 3,
    };
    let fx = Fixture::build(&case);
    let err = fx.max_error(&fx.attend(None, &fx.rows, &fx.q));
    let path = AttentionPath::for_kv(KvDtype::F16);
    assert!(err < tolerance(path, KvDtype::F16), "{path:?}: {err}");
}

#[test]
fn q8_keys_with_outlier_channels_match_the_reference_over_channel_scales() {
    // Two key channels offset by 40 times the others' range: one int8 scale per token then
    // leaves the other channels a few levels each. Stored over channel scales (queries multiplied back by them),
    // every path stays within the q8 tolerance, and several times closer than without them.
    let case = Case {
        page_size: 16,
        num_heads: 14,
        num_kv_heads: 2,
        head_dim: 64,
        seqs: vec![(600, 9), (300, 1)],
        dtype: KvDtype::Q8,
        seed: 11,
    };
    let scaled = Fixture::build_with_outliers(&case, Some((40.0, true)));
    let unscaled = Fixture::build_with_outliers(&case, Some((40.0, false)));
    for path in AttentionPath::supported() {
        let tolerance = tolerance(path, KvDtype::Q8);
        let err = scaled.max_error(&scaled.attend(Some((path, 2)), &scaled.rows, &scaled.q));
        let err_unscaled =
            unscaled.max_error(&unscaled.attend(Some((path, 2)), &unscaled.rows, &unscaled.q));
        println!("{path:?}: {err:.2e} over channel scales, {err_unscaled:.2e} without");
        assert!(err < tolerance, "{path:?}: {err}");
        assert!(
            err_unscaled > 3.0 * err,
            "{path:?}: {err_unscaled} against {err}"
        );
    }
}

#[test]
fn a_row_is_bit_identical_alone_in_any_batch_and_any_split() {
    // What greedy speculative decoding relies on: a verify row equals the decode row it stands
    // for, and a row does not change with its neighbours or with how the keys are split. (A
    // decode row alone is a task of one lane chunk, which the bf16 path reads in place from the
    // pages; in a batch its rows share tasks that pack K and V first.)
    for dtype in [KvDtype::F16, KvDtype::Q8, KvDtype::F32] {
        rows_are_bit_identical_alone_in_any_batch(dtype, 64);
    }
}

#[test]
fn heads_of_128_dimensions_match_the_reference_and_stay_bit_identical() {
    // Qwen2.5-1.5B's heads: the int8 path's tiles sum their products over two steps of 64.
    let case = Case {
        page_size: 16,
        num_heads: 12,
        num_kv_heads: 2,
        head_dim: 128,
        seqs: vec![(1_500, 9), (300, 20), (0, 3)],
        dtype: KvDtype::Q8,
        seed: 9,
    };
    let err = run_case(&case);
    assert!(err < 1.0, "worst error {err} of the tolerance");
    rows_are_bit_identical_alone_in_any_batch(KvDtype::Q8, 128);
}

fn rows_are_bit_identical_alone_in_any_batch(dtype: KvDtype, head_dim: usize) {
    let case = Case {
        page_size: 16,
        num_heads: 14,
        num_kv_heads: 2,
        head_dim,
        seqs: vec![(3_000, 9), (700, 1), (1_020, 30), (0, 5)],
        dtype,
        seed: 5,
    };
    let fx = Fixture::build(&case);
    let width = case.num_heads * case.head_dim;
    for path in AttentionPath::supported() {
        let batch = fx.attend(Some((path, 2)), &fx.rows, &fx.q);
        for threads in [1, 8] {
            let again = fx.attend(Some((path, threads)), &fx.rows, &fx.q);
            assert!(
                batch == again,
                "{path:?}, {dtype:?}: {threads} threads changed the batch"
            );
        }
        for (r, row) in fx.rows.iter().enumerate() {
            let q = &fx.q[r * width..(r + 1) * width];
            for threads in [1, 2, 8] {
                let alone = fx.attend(Some((path, threads)), &[*row], q);
                assert!(
                    alone[..] == batch[r * width..(r + 1) * width],
                    "{path:?}, {dtype:?}: row {r} at {} differs alone ({threads} threads)",
                    row.position
                );
            }
        }
    }
}
