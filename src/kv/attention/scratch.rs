//! Each thread's task scratch, kept from call to call, and what its contents were laid out for.

#[cfg(target_arch = "x86_64")]
use super::int8;
use super::Context;
use crate::kernels::Dispatch;
use std::cell::RefCell;

thread_local! {
    /// Each thread's task scratch, kept from call to call (see [`ScratchLayout`]).
    pub(super) static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
    /// The calling thread's buffer of split-K segment states.
    pub(super) static PARTIALS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// What a [`Scratch`]'s contents were laid out for. A thread's tasks reuse one scratch, within
/// a call as across calls with the same layout; a call with another layout (another model's
/// head size or pages, another path) starts from an empty one, as the buffers' padding must
/// then be zero again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ScratchLayout {
    pub(super) head_dim: usize,
    pub(super) page_size: usize,
    /// `Context`'s path flags.
    pub(super) path: (Dispatch, bool, bool, bool, bool, bool, bool),
}

impl ScratchLayout {
    pub(super) fn of(ctx: &Context) -> Self {
        ScratchLayout {
            head_dim: ctx.shape.head_dim,
            page_size: ctx.kv.shape().page_size,
            path: (
                ctx.path,
                ctx.bf16,
                ctx.amx,
                ctx.bf16_pages,
                ctx.in_place,
                ctx.int8,
                ctx.fp16,
            ),
        }
    }
}

/// Per-thread buffers, reused across tasks.
#[derive(Default)]
pub(super) struct Scratch {
    /// What the buffers are laid out for (`None` when new).
    pub(super) layout: Option<ScratchLayout>,
    /// Scaled queries, `[lane][hdp]` (`hdp`: head_dim rounded up to 16, zero padded).
    pub(super) q: Vec<f32>,
    /// A block of K, transposed: `[head_dim][bs]` (`bs`: block keys rounded up to 16).
    pub(super) kt: Vec<f32>,
    /// A block of V: `[key][hdp]`, zero padded.
    pub(super) v: Vec<f32>,
    /// Scores, then softmax weights: `[lane][bs]`.
    pub(super) s: Vec<f32>,
    /// Unnormalised outputs: `[lane][hdp]`.
    pub(super) o: Vec<f32>,
    pub(super) max: Vec<f32>,
    pub(super) sum: Vec<f32>,
    /// Keys of the current block each lane sees.
    pub(super) visible: Vec<usize>,
    /// The bf16 path's operands: V pairs `[keys / 2][hdp]`, softmax weights `[lane][bs]`,
    /// centred K pairs `[head_dim / 2][bs]`, the scaled queries in bf16 `[lane][hdp]` and in
    /// f32 transposed `[head_dim][lanes16]` (`lanes16`: lanes rounded up to 16), the block's
    /// first key `[hdp]`, each lane's dot product with it `[lanes16]`, each lane's running sum
    /// as 16 partial sums `[lane][16]` and its block's 16 partial maxima `[lane][16]`.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) v2: Vec<u32>,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) p16: Vec<u16>,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) kt2: Vec<u32>,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) q16: Vec<u16>,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) kref: Vec<f32>,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) qt: Vec<f32>,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) offset: Vec<f32>,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) sums: Vec<f32>,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) maxima: Vec<f32>,
    /// The bf16 path's lane chunks of the current block, `(l0, l1, keys)` as [`seeing_chunks`](super::seeing_chunks)
    /// (collected, as the steps on each chunk borrow the scratch).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) chunks: Vec<(usize, usize, usize)>,
    /// The running fold of the task's segments: max, sum, `[lane][hdp]` output.
    pub(super) fold_max: Vec<f32>,
    pub(super) fold_sum: Vec<f32>,
    pub(super) fold_o: Vec<f32>,
    #[cfg(target_arch = "x86_64")]
    pub(super) int8: int8::Int8Scratch,
}
