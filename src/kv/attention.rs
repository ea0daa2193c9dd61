//! Paged attention on the CPU for a ragged batch of query rows.
//!
//! Every query row belongs to one sequence and sits at one absolute position; it attends to all
//! of that sequence's positions `0..=position`, read in place from the sequence's pages. That
//! one rule covers prefill chunks (causal within the chunk, full attention to earlier pages),
//! decode rows and runs of consecutive speculative verify rows. New K/V must already have been
//! written to the pages before this runs.
//!
//! Work is split into tasks of (sequence, KV head, up to [`ROWS_PER_TASK`] consecutive rows):
//! each task reads each page of its head once for all of its rows and all the query heads that
//! share that KV head (GQA), with an online softmax in f32.

use super::pool::PageId;
use super::storage::{KvKind, KvStorage};
use crate::kernels::math::exp_nonpositive;
use rayon::prelude::*;

/// Where one query row attends from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionRow {
    /// Index into the page tables passed alongside.
    pub seq: usize,
    /// Absolute position of the row's token; it sees positions `0..=position`.
    pub position: usize,
}

#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

const ROWS_PER_TASK: usize = 16;

struct Task {
    kv_head: usize,
    /// Consecutive row indices `rows.start..rows.end`, all of one sequence.
    rows: std::ops::Range<usize>,
}

/// A raw output pointer shared by tasks that write disjoint `(row, head)` slices.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// `q`: `[num_rows, num_heads, head_dim]`; `out`: same shape. Rows of one sequence must be
/// consecutive in the batch for page reads to be shared; correctness does not depend on it.
pub fn paged_attention(
    q: &[f32],
    rows: &[AttentionRow],
    page_tables: &[&[PageId]],
    kv: &KvStorage,
    layer: usize,
    shape: AttentionShape,
    out: &mut [f32],
) {
    let hd = shape.head_dim;
    assert_eq!(q.len(), rows.len() * shape.num_heads * hd);
    assert_eq!(out.len(), q.len());
    assert_eq!(shape.num_heads % shape.num_kv_heads, 0);
    let tasks = plan_tasks(rows, shape.num_kv_heads);
    let out_ptr = OutPtr(out.as_mut_ptr());
    tasks
        .par_iter()
        .for_each_init(Scratch::default, |scratch, task| {
            attend_task(
                q,
                rows,
                page_tables,
                kv,
                layer,
                shape,
                task,
                scratch,
                out_ptr,
            );
        });
}

fn plan_tasks(rows: &[AttentionRow], num_kv_heads: usize) -> Vec<Task> {
    let mut tasks = Vec::new();
    let mut start = 0;
    while start < rows.len() {
        let seq = rows[start].seq;
        let mut end = start + 1;
        while end < rows.len() && rows[end].seq == seq && end - start < ROWS_PER_TASK {
            end += 1;
        }
        for kv_head in 0..num_kv_heads {
            tasks.push(Task {
                kv_head,
                rows: start..end,
            });
        }
        start = end;
    }
    tasks
}

#[derive(Default)]
struct Scratch {
    keys: Vec<f32>,
    values: Vec<f32>,
    scores: Vec<f32>,
    acc: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
}

#[allow(clippy::too_many_arguments)]
fn attend_task(
    q: &[f32],
    rows: &[AttentionRow],
    page_tables: &[&[PageId]],
    kv: &KvStorage,
    layer: usize,
    shape: AttentionShape,
    task: &Task,
    s: &mut Scratch,
    out: OutPtr,
) {
    let hd = shape.head_dim;
    let group = shape.num_heads / shape.num_kv_heads;
    let page_size = kv.shape().page_size;
    let scale = 1.0 / (hd as f32).sqrt();
    let task_rows = &rows[task.rows.clone()];
    let table = page_tables[task_rows[0].seq];
    let max_pos = task_rows.iter().map(|r| r.position).max().unwrap();
    let lanes = task_rows.len() * group;

    s.keys.resize(page_size * hd, 0.0);
    s.values.resize(page_size * hd, 0.0);
    s.scores.resize(page_size, 0.0);
    s.acc.clear();
    s.acc.resize(lanes * hd, 0.0);
    s.max.clear();
    s.max.resize(lanes, f32::NEG_INFINITY);
    s.sum.clear();
    s.sum.resize(lanes, 0.0);

    for (page_index, &page_id) in table.iter().enumerate().take(max_pos / page_size + 1) {
        let first = page_index * page_size;
        let num_slots = page_size.min(max_pos + 1 - first);
        kv.head_rows(page_id, layer, KvKind::Key, task.kv_head)
            .decode_into(num_slots, hd, &mut s.keys);
        kv.head_rows(page_id, layer, KvKind::Value, task.kv_head)
            .decode_into(num_slots, hd, &mut s.values);
        for (r, row) in task_rows.iter().enumerate() {
            if row.position < first {
                continue;
            }
            let visible = num_slots.min(row.position + 1 - first);
            let row_index = task.rows.start + r;
            for g in 0..group {
                let head = task.kv_head * group + g;
                let q_off = (row_index * shape.num_heads + head) * hd;
                let q_row = &q[q_off..q_off + hd];
                let lane = r * group + g;
                let scores = &mut s.scores[..visible];
                for (slot, score) in scores.iter_mut().enumerate() {
                    *score = dot(q_row, &s.keys[slot * hd..(slot + 1) * hd]) * scale;
                }
                let block_max = scores.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                let new_max = s.max[lane].max(block_max);
                // A separate pass so the branch-free exp vectorises.
                for score in scores.iter_mut() {
                    *score = exp_nonpositive(*score - new_max);
                }
                let correction = exp_nonpositive(s.max[lane] - new_max);
                let acc = &mut s.acc[lane * hd..(lane + 1) * hd];
                if correction != 1.0 {
                    acc.iter_mut().for_each(|a| *a *= correction);
                }
                let mut sum = s.sum[lane] * correction;
                for (slot, &w) in scores.iter().enumerate() {
                    sum += w;
                    axpy(acc, w, &s.values[slot * hd..(slot + 1) * hd]);
                }
                s.sum[lane] = sum;
                s.max[lane] = new_max;
            }
        }
    }

    for r in 0..task_rows.len() {
        let row_index = task.rows.start + r;
        for g in 0..group {
            let head = task.kv_head * group + g;
            let lane = r * group + g;
            let inv = 1.0 / s.sum[lane];
            let acc = &s.acc[lane * hd..(lane + 1) * hd];
            let off = (row_index * shape.num_heads + head) * hd;
            // SAFETY: each (row, head) pair belongs to exactly one task, so writes are disjoint,
            // and `off + hd <= out.len()` because row_index < num_rows and head < num_heads.
            let dst = unsafe { std::slice::from_raw_parts_mut(out.0.add(off), hd) };
            for (d, a) in dst.iter_mut().zip(acc) {
                *d = a * inv;
            }
        }
    }
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent accumulators let the compiler vectorise without reassociation flags.
    let mut acc = [0f32; 8];
    let (a8, a_rest) = a.split_at(a.len() / 8 * 8);
    let (b8, b_rest) = b.split_at(a8.len());
    for (ca, cb) in a8.chunks_exact(8).zip(b8.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += ca[l] * cb[l];
        }
    }
    let tail: f32 = a_rest.iter().zip(b_rest).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

#[inline]
fn axpy(acc: &mut [f32], w: f32, v: &[f32]) {
    for (a, x) in acc.iter_mut().zip(v) {
        *a += w * x;
    }
}
