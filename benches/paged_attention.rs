//! Paged attention with Qwen2.5-Coder-0.5B's head layout (14 query heads, 2 KV heads, head_dim
//! 64), f16 and q8 KV, on each attention path this CPU has (f32 products, bf16 products with AVX-512 and AMX): one
//! decode row and a 9-row verify run at 1K and 16K context, and the 50 new rows of a
//! continuation after 8K tokens.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use mtpx::kernels::Dispatch;
use mtpx::kv::{
    paged_attention_with, AttentionPath, AttentionRow, AttentionShape, KvDtype, KvShape, KvStorage,
    PagePool, PageTable,
};

/// The layer attended: the storage holds 24, as the model's does.
const LAYER: usize = 23;

fn bench(c: &mut Criterion) {
    let shape = AttentionShape {
        num_heads: 14,
        num_kv_heads: 2,
        head_dim: 64,
    };
    let page_size = 16;
    let threads = rayon::current_num_threads();
    let mut paths = vec![AttentionPath::F32(Dispatch::best())];
    paths.extend(
        AttentionPath::supported()
            .into_iter()
            .filter(|p| matches!(p, AttentionPath::Bf16 | AttentionPath::Amx)),
    );
    let mut group = c.benchmark_group("paged_attention");
    for (context, num_rows) in [
        (1024usize, 1usize),
        (1024, 9),
        (16384, 1),
        (16384, 9),
        (8192, 50),
    ] {
        for dtype in [KvDtype::F16, KvDtype::Q8] {
            let kv_shape = KvShape {
                num_layers: 24,
                num_kv_heads: 2,
                head_dim: 64,
                page_size,
            };
            let num_pages = context.div_ceil(page_size) + 1;
            let mut pool = PagePool::new(num_pages, page_size);
            let mut kv = KvStorage::new(kv_shape, dtype, num_pages);
            let mut table = PageTable::new();
            table.try_grow(context, &mut pool).unwrap();
            for pos in 0..context {
                let row: Vec<f32> = (0..128).map(|i| ((i + pos) as f32 * 0.37).sin()).collect();
                kv.write_token(
                    table.page_ids()[pos / page_size],
                    pos % page_size,
                    LAYER,
                    &row,
                    &row,
                );
            }
            let rows: Vec<AttentionRow> = (0..num_rows)
                .map(|i| AttentionRow {
                    seq: 0,
                    position: context - num_rows + i,
                })
                .collect();
            let q: Vec<f32> = (0..num_rows * 14 * 64).map(|i| (i as f32).cos()).collect();
            let mut out = vec![0f32; q.len()];
            let tables = [table.page_ids()];
            group.throughput(Throughput::Bytes(kv.bytes_allocated() as u64));
            for &path in &paths {
                let id = format!("{dtype:?}/{num_rows}rows/{}", path.name());
                group.bench_with_input(BenchmarkId::new(id, context), &context, |b, _| {
                    b.iter(|| {
                        paged_attention_with(
                            path, threads, &q, &rows, &tables, &kv, LAYER, shape, &mut out,
                        )
                    })
                });
            }
        }
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = bench
}
criterion_main!(benches);
