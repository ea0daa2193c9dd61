//! Paged attention with Qwen2.5-Coder-0.5B's head layout (14 query heads, 2 KV heads, head_dim
//! 64), f16 and q8 KV, on each attention path this CPU has (f32 products, bf16 products with
//! AVX-512 and AMX, integer products over q8 pages, fp16 products over f16 pages): one decode row and a 9-row verify run at 1K and 16K context, and the 50 new
//! rows of a continuation after 8K tokens.
//!
//! Each of those calls attends over the same layer, which at 16K context (8 MB of f16 K/V)
//! stays in a 32 MB L3 from one call to the next; a decode step reads 24 such layers once each,
//! from DRAM. The `streamed` cases write all 24 layers and attend over the next one each call,
//! as a decode step does. Times are per call (one layer) and throughput is one layer's K/V bytes.

use criterion::measurement::WallTime;
use criterion::{
    criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, Throughput,
};
use mtpx::kernels::Dispatch;
use mtpx::kv::{
    paged_attention_with, AttentionPath, AttentionRow, AttentionShape, KvDtype, KvShape, KvStorage,
    PagePool, PageTable,
};

const LAYERS: usize = 24;
const PAGE_SIZE: usize = 16;

fn bench(c: &mut Criterion) {
    let mut paths = vec![AttentionPath::F32(Dispatch::best())];
    paths.extend(
        AttentionPath::supported()
            .into_iter()
            .filter(|p| !matches!(p, AttentionPath::F32(_))),
    );
    let mut group = c.benchmark_group("paged_attention");
    for (context, num_rows, streamed) in [
        (1024usize, 1usize, false),
        (1024, 9, false),
        (16384, 1, false),
        (16384, 9, false),
        (8192, 50, false),
        (16384, 1, true),
        (16384, 9, true),
    ] {
        for dtype in [KvDtype::F16, KvDtype::Q8] {
            bench_case(&mut group, &paths, context, num_rows, dtype, streamed);
        }
    }
    group.finish();
}

fn bench_case(
    group: &mut BenchmarkGroup<WallTime>,
    paths: &[AttentionPath],
    context: usize,
    num_rows: usize,
    dtype: KvDtype,
    streamed: bool,
) {
    let shape = AttentionShape {
        num_heads: 14,
        num_kv_heads: 2,
        head_dim: 64,
    };
    let kv_shape = KvShape {
        num_layers: LAYERS,
        num_kv_heads: 2,
        head_dim: 64,
        page_size: PAGE_SIZE,
    };
    let num_pages = context.div_ceil(PAGE_SIZE) + 1;
    let mut pool = PagePool::new(num_pages, PAGE_SIZE);
    let mut kv = KvStorage::new(kv_shape, dtype, num_pages);
    let mut table = PageTable::new();
    table.try_grow(context, &mut pool).unwrap();
    // The last layer alone, or all of them.
    let layers = if streamed {
        0..LAYERS
    } else {
        LAYERS - 1..LAYERS
    };
    for layer in layers.clone() {
        for pos in 0..context {
            let row: Vec<f32> = (0..128)
                .map(|i| ((i + pos + layer) as f32 * 0.37).sin())
                .collect();
            let page = table.page_ids()[pos / PAGE_SIZE];
            kv.write_token(page, pos % PAGE_SIZE, layer, &row, &row);
        }
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
    let threads = rayon::current_num_threads();
    group.throughput(Throughput::Bytes((kv.bytes_allocated() / LAYERS) as u64));
    // The integer path reads q8 pages and the fp16 path f16 pages; on others they run as bf16
    // and f32, measured already.
    let runs_as_itself = |path: &&AttentionPath| match path {
        AttentionPath::Int8 => dtype == KvDtype::Q8,
        AttentionPath::F16 => dtype == KvDtype::F16,
        _ => true,
    };
    for &path in paths.iter().filter(runs_as_itself) {
        let kind = if streamed { "streamed" } else { "one layer" };
        let id = format!("{dtype:?}/{num_rows}rows/{kind}/{}", path.name());
        let mut layer = layers.start;
        group.bench_with_input(BenchmarkId::new(id, context), &context, |b, _| {
            b.iter(|| {
                layer = if layer + 1 < layers.end {
                    layer + 1
                } else {
                    layers.start
                };
                paged_attention_with(
                    path, threads, &q, &rows, &tables, &kv, layer, shape, &mut out,
                )
            })
        });
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = bench
}
criterion_main!(benches);
