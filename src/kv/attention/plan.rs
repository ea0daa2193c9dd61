//! How a batch's attention is cut into parallel tasks: rows of one sequence grouped so that
//! they share every K/V read, and a long context's keys split across tasks (split-K) when
//! there are too few tasks to balance the threads.

use super::AttentionRow;
use std::ops::Range;

/// Consecutive rows of one sequence that share a task (and so every K/V block they read).
const ROWS_PER_TASK: usize = 16;
/// Rows per task from this position on: a long context's K/V does not stay in cache between
/// the tasks that read it, so more rows share each read (a 50-row continuation after 8K tokens
/// measured 20-30% faster with 64 than with 16); shorter ones keep the smaller scratch, which
/// measured faster for a 512-row prompt.
const LONG_CONTEXT: usize = 4096;
const ROWS_PER_TASK_LONG: usize = 64;
/// Keys per block, rounded down to whole pages (at least one page): larger blocks spread each
/// lane's per-block softmax work over more keys.
const BLOCK_KEYS: usize = 128;
/// Keys per segment, rounded down to whole blocks: the unit of split-K.
const SEGMENT_KEYS: usize = 1024;
/// Split-K aims for at least this many tasks per thread, so that stealing can balance them.
const TASKS_PER_THREAD: usize = 4;

/// One unit of parallel work.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Task {
    pub(super) kv_head: usize,
    /// Consecutive row indices, all of one sequence.
    pub(super) rows: Range<usize>,
    /// Key positions `keys.start..keys.end`, whole segments but the last (clipped to what the
    /// rows see).
    pub(super) keys: Range<usize>,
    /// For one piece of a split: where segment 0's state goes in the partials buffer (segment
    /// `i`'s is `i` states further). `None`: the task folds its segments and writes the output.
    pub(super) partial: Option<usize>,
}

/// A (rows, KV head) split across tasks, merged after the parallel pass.
#[derive(Debug, Clone)]
pub(super) struct Multi {
    pub(super) kv_head: usize,
    pub(super) rows: Range<usize>,
    /// Offset of segment 0's partial state.
    pub(super) at: usize,
    pub(super) segments: usize,
}

#[derive(Debug, Default)]
pub(super) struct Plan {
    pub(super) tasks: Vec<Task>,
    pub(super) merges: Vec<Multi>,
    pub(super) partials_len: usize,
}

/// Keys per block: whole pages, at least one.
pub(super) fn block_keys(page_size: usize) -> usize {
    (BLOCK_KEYS / page_size).max(1) * page_size
}

/// Keys per segment: whole blocks, at least one.
pub(super) fn segment_keys(page_size: usize) -> usize {
    let block = block_keys(page_size);
    (SEGMENT_KEYS / block).max(1) * block
}

/// Lanes of a task of `num_rows` rows.
pub(super) fn lanes(num_rows: usize, group: usize) -> usize {
    num_rows * group
}

/// Floats of one segment's state: max and sum per lane, then the unnormalised output.
pub(super) fn partial_len(lanes: usize, hd: usize) -> usize {
    lanes * (2 + hd)
}

/// The tasks for a batch's `rows` on `threads` threads, and the merges its split (rows, KV head)
/// pairs need afterwards.
pub(super) fn plan_tasks(
    rows: &[AttentionRow],
    num_kv_heads: usize,
    group: usize,
    hd: usize,
    page_size: usize,
    threads: usize,
) -> Plan {
    // Row chunks and how many keys each sees.
    let mut chunks = Vec::new();
    let mut start = 0;
    while start < rows.len() {
        let seq = rows[start].seq;
        let cap = if rows[start].position >= LONG_CONTEXT {
            ROWS_PER_TASK_LONG
        } else {
            ROWS_PER_TASK
        };
        let mut end = start + 1;
        while end < rows.len() && rows[end].seq == seq && end - start < cap {
            end += 1;
        }
        let keys = rows[start..end].iter().map(|r| r.position).max().unwrap() + 1;
        chunks.push((start..end, keys));
        start = end;
    }
    let cost = |rows: &Range<usize>, keys: usize| (rows.len() * keys) as u64;
    let total: u64 = chunks.iter().map(|(r, k)| cost(r, *k)).sum::<u64>() * num_kv_heads as u64;
    let target = (total / (threads * TASKS_PER_THREAD) as u64).max(1);
    let segment = segment_keys(page_size);

    let mut plan = Plan::default();
    for (rows, keys) in chunks {
        let segments = keys.div_ceil(segment);
        // Pieces by cost, in whole segments; one thread gains nothing from splitting.
        let pieces = if threads > 1 {
            (cost(&rows, keys).div_ceil(target) as usize).clamp(1, segments)
        } else {
            1
        };
        let per = segments.div_ceil(pieces) * segment;
        let state = partial_len(lanes(rows.len(), group), hd);
        for kv_head in 0..num_kv_heads {
            let partial = (pieces > 1).then(|| {
                let at = plan.partials_len;
                plan.partials_len += segments * state;
                plan.merges.push(Multi {
                    kv_head,
                    rows: rows.clone(),
                    at,
                    segments,
                });
                at
            });
            for first in (0..keys).step_by(per) {
                plan.tasks.push(Task {
                    kv_head,
                    rows: rows.clone(),
                    keys: first..(first + per).min(keys),
                    partial,
                });
            }
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_rows(n: usize, position: usize) -> Vec<AttentionRow> {
        (0..n).map(|i| AttentionRow { seq: i, position }).collect()
    }

    #[test]
    fn one_long_sequence_is_split_across_threads() {
        let plan = plan_tasks(&decode_rows(1, 16_383), 2, 7, 64, 16, 2);
        assert_eq!(plan.tasks.len(), 8, "{plan:?}");
        assert_eq!(plan.merges.len(), 2);
        for multi in &plan.merges {
            assert_eq!(multi.segments, 16);
        }
        // The pieces of a head cover every key once, in whole segments.
        let head0: Vec<_> = plan.tasks.iter().filter(|t| t.kv_head == 0).collect();
        assert_eq!(head0[0].keys.start, 0);
        for w in head0.windows(2) {
            assert_eq!(w[0].keys.end, w[1].keys.start);
            assert_eq!(w[1].keys.start % SEGMENT_KEYS, 0);
        }
        assert_eq!(head0.last().unwrap().keys.end, 16_384);
    }

    #[test]
    fn many_sequences_or_one_thread_or_one_segment_are_not_split() {
        // Enough tasks to balance: each sequence is one task per head, folding its segments.
        let plan = plan_tasks(&decode_rows(16, 4000), 2, 7, 64, 16, 2);
        assert_eq!(
            (plan.tasks.len(), plan.merges.len(), plan.partials_len),
            (32, 0, 0)
        );
        let plan = plan_tasks(&decode_rows(1, 30_000), 2, 7, 64, 16, 1);
        assert_eq!((plan.tasks.len(), plan.merges.len()), (2, 0));
        let plan = plan_tasks(&decode_rows(1, 1000), 2, 7, 64, 16, 2);
        assert_eq!((plan.tasks.len(), plan.merges.len()), (2, 0));
    }

    #[test]
    fn a_long_prefill_is_not_split_and_needs_no_partial_states() {
        let rows: Vec<_> = (0..512)
            .map(|i| AttentionRow {
                seq: 0,
                position: 20_000 + i,
            })
            .collect();
        let plan = plan_tasks(&rows, 2, 7, 64, 16, 2);
        assert_eq!((plan.tasks.len(), plan.partials_len), (16, 0));
    }
}
