//! Paged attention for one decode row and for a 9-row verify run, at 1K, 8K and 32K context,
//! with Qwen2.5-Coder-0.5B's head layout (14 query heads, 2 KV heads, head_dim 64), f16 KV.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use mtpx::kv::{
    paged_attention, AttentionRow, AttentionShape, KvDtype, KvShape, KvStorage, PagePool, PageTable,
};

fn bench(c: &mut Criterion) {
    let shape = AttentionShape {
        num_heads: 14,
        num_kv_heads: 2,
        head_dim: 64,
    };
    let page_size = 16;
    let mut group = c.benchmark_group("paged_attention");
    for &context in &[1024usize, 8192, 32768] {
        for dtype in [KvDtype::F16, KvDtype::Q8] {
            let kv_shape = KvShape {
                num_layers: 1,
                num_kv_heads: 2,
                head_dim: 64,
                page_size,
            };
            let num_pages = context.div_ceil(page_size) + 1;
            let mut pool = PagePool::new(num_pages, page_size);
            let mut kv = KvStorage::new(kv_shape, dtype, num_pages);
            let mut table = PageTable::new();
            table.try_grow(context, &mut pool).unwrap();
            let row: Vec<f32> = (0..128).map(|i| (i as f32 * 0.37).sin()).collect();
            for pos in 0..context {
                kv.write_token(
                    table.page_ids()[pos / page_size],
                    pos % page_size,
                    0,
                    &row,
                    &row,
                );
            }
            for num_rows in [1usize, 9] {
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
                let id = format!("{dtype:?}/{num_rows}rows");
                group.bench_with_input(BenchmarkId::new(id, context), &context, |b, _| {
                    b.iter(|| paged_attention(&q, &rows, &tables, &kv, 0, shape, &mut out))
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
