//! Page allocation and release: the per-step bookkeeping cost of growing and rolling back.

use criterion::{criterion_group, criterion_main, Criterion};
use mtpx::kv::{PagePool, PageTable};

fn bench(c: &mut Criterion) {
    c.bench_function("page_table_grow_to_4096_tokens_then_release", |b| {
        let mut pool = PagePool::new(8192, 16);
        b.iter(|| {
            let mut table = PageTable::new();
            for _ in 0..4096 {
                table.try_grow(1, &mut pool).unwrap();
            }
            table.release(&mut pool).unwrap();
        })
    });
    c.bench_function("speculative_rollback_9_rows", |b| {
        let mut pool = PagePool::new(8192, 16);
        let mut table = PageTable::new();
        table.try_grow(1000, &mut pool).unwrap();
        b.iter(|| {
            table.try_grow(9, &mut pool).unwrap();
            table.truncate(1000, &mut pool).unwrap();
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
