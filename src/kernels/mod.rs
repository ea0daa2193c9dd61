//! CPU matmul kernels for GGUF-quantised weights: `out = x · Wᵀ` for 1 to thousands of rows.
//!
//! This module owns the packed weight layout (`layout`), activation quantisation (`act`) and the
//! per-instruction-set kernels (`scalar`, `avx2`, `avx512`, `neon`), chosen at run time
//! (`dispatch`).
//! It depends only on external crates and never touches model, KV or scheduler state.
//!
//! How a call runs: the activations are quantised to int8 once (per 32 weights, or per 256 for
//! K-quants); the output rows are split into groups of 16, and groups are shared out over
//! rayon's pool. For each group, a kernel applies every weight block to 4 activation rows while
//! the block is in registers (accumulators and `vpdpbusd` chains stay in registers too); further
//! rows re-read the group (a few to ~100 KiB) from L1/L2, never from DRAM. So a decode or
//! verify step reads each weight from memory once, and prefill (rows taken 16 per group visit)
//! is bound by integer throughput rather than bandwidth.
//!
//! Call from inside rayon's pool (e.g. the model worker's `ThreadPool::install`) where possible:
//! a call from outside it pays a cross-thread hand-off (several µs) per matmul.
//!
//! Results are bit-identical across dispatch paths, thread counts and batch sizes: row `r` of a
//! 9-row matmul equals row `r` computed alone, to the bit.

/// Rows per chunk when `num_rows` are split into as few chunks of at most `max` as possible,
/// evenly (9 rows by 5: 5 + 4, not 5 + 4 or 4 + 4 + 1 with a chunk that re-reads for one row).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn chunk_rows(num_rows: usize, max: usize) -> usize {
    num_rows.div_ceil(num_rows.div_ceil(max))
}

/// A safe entry point `$name` for a SIMD module's group kernel `$imp::<R>`: checks the call with
/// the module's `check`, splits its rows evenly into chunks of at most `$max` (`chunk_rows`)
/// and runs each chunk through `$imp` instantiated for its row count (one of `[$r…]`).
#[cfg(target_arch = "x86_64")]
macro_rules! chunked_kernel {
    ($name:ident, $imp:ident, $format:expr, $act:ty, $max:expr, [$($r:literal),*]) => {
        pub fn $name(w: &[u8], acts: &[$act], out: &mut [f32]) {
            let (num_rows, nb) = check($format, w, acts, out);
            let rows = super::chunk_rows(num_rows, $max);
            for (a, o) in acts.chunks(rows * nb).zip(out.chunks_mut(rows * GROUP)) {
                // SAFETY: `check` proved the CPU features `$imp` enables and that `w` holds
                // `nb` blocks; `a` and `o` hold the same number (1..=$max) of rows.
                unsafe {
                    match o.len() / GROUP {
                        $($r => $imp::<$r>(w, a, o, nb),)*
                        n => unreachable!("a chunk of {n} rows (at most {})", $max),
                    }
                }
            }
        }
    };
}

mod act;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod buffer;
pub mod cpu;
mod dispatch;
mod layout;
pub mod math;
#[cfg(target_arch = "aarch64")]
mod neon;
mod prefetch;
mod scalar;
pub mod team;

use candle_core::quantized::{GgmlDType, QTensor};

pub use act::{quantize_block, ActQ8, ActQ8K};
pub use buffer::{AlignedBuf, Zeroable};
pub use dispatch::{cpu_is_amd, Dispatch};
pub use layout::{Format, GROUP};
pub use prefetch::{
    choose_one_row_prefetch, choose_one_row_prefetch_for, one_row_prefetch, set_one_row_prefetch,
    PrefetchChoice,
};

/// Why a matrix could not be packed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelError {
    /// A GGUF type these kernels do not handle (named).
    UnsupportedFormat(String),
    /// The tensor is not 2-D, or its sizes do not fit the format's blocks.
    Shape(String),
    /// Reading the tensor's bytes failed.
    Read(String),
}

impl std::fmt::Display for KernelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KernelError::UnsupportedFormat(name) => {
                write!(f, "no CPU matmul kernel for tensor type {name}")
            }
            KernelError::Shape(msg) | KernelError::Read(msg) => f.write_str(msg),
        }
    }
}

impl std::error::Error for KernelError {}

/// A weight matrix `[out_dim, in_dim]`, repacked for the kernels at load time.
#[derive(Debug, Clone)]
pub struct QuantMatrix {
    format: Format,
    out_dim: usize,
    in_dim: usize,
    /// `[num_groups][num_blocks][group_block_bytes]`, see `layout`.
    packed: AlignedBuf<u8>,
}

/// Per-caller buffers reused across calls, so a matmul allocates only when a call is larger
/// than every earlier one.
#[derive(Default)]
pub struct Scratch {
    q8: Vec<ActQ8>,
    q8k: Vec<ActQ8K>,
}

impl Scratch {
    pub fn new() -> Self {
        Self::default()
    }
}

/// Rows a kernel applies one weight block to while it is in registers.
const MAX_KERNEL_ROWS: usize = 16;

/// Below this many weight bytes × row chunks a call runs on the calling thread.
const SERIAL_BYTES: usize = 96 << 10;

impl QuantMatrix {
    /// Packs a 2-D CPU `QTensor` (`[out_dim, in_dim]`, GGUF block layout).
    pub fn from_qtensor(tensor: &QTensor) -> Result<Self, KernelError> {
        let &[out_dim, in_dim] = tensor.shape().dims() else {
            return Err(KernelError::Shape(format!(
                "matmul weights must be 2-D, got {:?}",
                tensor.shape()
            )));
        };
        let data = tensor
            .data()
            .map_err(|e| KernelError::Read(e.to_string()))?;
        Self::from_gguf_bytes(tensor.dtype(), &data, out_dim, in_dim)
    }

    /// Packs row-major GGUF blocks of `dtype`.
    pub fn from_gguf_bytes(
        dtype: GgmlDType,
        data: &[u8],
        out_dim: usize,
        in_dim: usize,
    ) -> Result<Self, KernelError> {
        let (format, packed) = layout::repack(dtype, data, out_dim, in_dim)?;
        Ok(QuantMatrix {
            format,
            out_dim,
            in_dim,
            packed,
        })
    }

    pub fn format(&self) -> Format {
        self.format
    }

    pub fn out_dim(&self) -> usize {
        self.out_dim
    }

    pub fn in_dim(&self) -> usize {
        self.in_dim
    }

    /// Bytes of packed weights one matmul streams.
    pub fn packed_bytes(&self) -> usize {
        self.packed.len()
    }

    /// `out = x · Wᵀ` on the path `Dispatch::active()` picks.
    /// `x`: `[num_rows, in_dim]`, `out`: `[num_rows, out_dim]`.
    pub fn matmul(&self, x: &[f32], out: &mut [f32], scratch: &mut Scratch) {
        self.matmul_with(Dispatch::active(), x, out, scratch)
    }

    /// `matmul` on an explicit path. Panics if the CPU lacks it or the shapes disagree.
    pub fn matmul_with(&self, path: Dispatch, x: &[f32], out: &mut [f32], scratch: &mut Scratch) {
        assert!(
            path.is_supported(),
            "kernel path {path:?} is not supported by this CPU"
        );
        assert!(
            x.len().is_multiple_of(self.in_dim),
            "x has {} values, not a multiple of in_dim {}",
            x.len(),
            self.in_dim
        );
        let num_rows = x.len() / self.in_dim;
        assert_eq!(
            out.len(),
            num_rows * self.out_dim,
            "out must be [num_rows, out_dim]"
        );
        if num_rows == 0 {
            return;
        }
        let num_blocks = self.in_dim / self.format.block_len();
        let job = Job {
            matrix: self,
            num_rows,
            num_blocks,
        };
        match self.format {
            Format::Q8_0 | Format::Q4_1 | Format::Q5_0 => {
                let acts = grown(&mut scratch.q8, num_rows * num_blocks);
                act::quantize_q8(x, acts);
                job.run(acts, out, kernel_q8(self.format, path));
            }
            Format::Q4K | Format::Q6K => {
                let acts = grown(&mut scratch.q8k, num_rows * num_blocks);
                act::quantize_q8k(x, acts);
                job.run(acts, out, kernel_q8k(self.format, path));
            }
            Format::F16 | Format::F32 => {
                // Float weights read f32 activations directly: one "block" per input value.
                job.run(x, out, kernel_float(self.format, path));
            }
        }
    }

    fn num_groups(&self) -> usize {
        self.out_dim.div_ceil(GROUP)
    }
}

/// The matmul's `[num_rows, out_dim]` output, written group by group by the tasks that computed
/// them: each group is its own 16 columns of every row, so no two tasks write the same element.
#[derive(Clone, Copy)]
struct RowsOut {
    ptr: *mut f32,
    num_rows: usize,
    out_dim: usize,
}

// SAFETY: tasks write disjoint columns (see `put_group`).
unsafe impl Send for RowsOut {}
unsafe impl Sync for RowsOut {}

impl RowsOut {
    /// Copies a kernel's `[rows, 16]` output for group `g` into its columns of rows
    /// `first_row..`, dropping the padding columns of a last partial group.
    ///
    /// # Safety
    /// No other thread may access group `g`'s columns meanwhile.
    unsafe fn put(&self, g: usize, first_row: usize, tile: &[f32]) {
        let first = g * GROUP;
        let n = GROUP.min(self.out_dim - first);
        assert!(first_row + tile.len() / GROUP <= self.num_rows);
        for (r, row) in (first_row..).zip(tile.chunks_exact(GROUP)) {
            // SAFETY: `r < num_rows` and `first + n <= out_dim`, inside the output; the caller
            // guarantees the columns are this thread's.
            let dst = std::slice::from_raw_parts_mut(self.ptr.add(r * self.out_dim + first), n);
            dst.copy_from_slice(&row[..n]);
        }
    }
}

/// A group kernel: `(group weights, acts [rows, blocks], out [rows, 16])`.
type Kernel<A> = fn(&[u8], &[A], &mut [f32]);

/// One matmul's work, split over groups of output rows.
struct Job<'a> {
    matrix: &'a QuantMatrix,
    num_rows: usize,
    num_blocks: usize,
}

impl Job<'_> {
    /// Runs the kernel on every group, up to [`MAX_KERNEL_ROWS`] rows a call into a tile on
    /// the stack, and copies each tile to `out` (`[num_rows, out_dim]`) while it is in L1.
    fn run<A: Sync>(&self, acts: &[A], out: &mut [f32], kernel: Kernel<A>) {
        let group_bytes = self.num_blocks * self.matrix.format.group_block_bytes();
        let num_groups = self.matrix.num_groups();
        let row_chunks = self.num_rows.div_ceil(MAX_KERNEL_ROWS);
        assert_eq!(out.len(), self.num_rows * self.matrix.out_dim);
        let rows_out = RowsOut {
            ptr: out.as_mut_ptr(),
            num_rows: self.num_rows,
            out_dim: self.matrix.out_dim,
        };
        let run_group = |g: usize| {
            let w = &self.matrix.packed[g * group_bytes..(g + 1) * group_bytes];
            let mut tile = [0f32; MAX_KERNEL_ROWS * GROUP];
            let act_rows = acts.chunks(MAX_KERNEL_ROWS * self.num_blocks);
            for (chunk, a) in act_rows.enumerate() {
                let tile = &mut tile[..a.len() / self.num_blocks * GROUP];
                kernel(w, a, tile);
                // SAFETY: every group is run once, by one task.
                unsafe { rows_out.put(g, chunk * MAX_KERNEL_ROWS, tile) };
            }
        };
        let num_threads = rayon::current_num_threads();
        if num_threads == 1 || self.matrix.packed.len() * row_chunks <= SERIAL_BYTES {
            (0..num_groups).for_each(run_group);
            return;
        }
        // A few tasks per thread balance uneven progress; each task takes whole groups.
        let num_tasks = (num_threads * 4).min(num_groups);
        let per_task = num_groups.div_ceil(num_tasks);
        team::for_each(num_groups.div_ceil(per_task), |task| {
            (task * per_task..((task + 1) * per_task).min(num_groups)).for_each(run_group)
        });
    }
}

/// `v[..n]`, growing `v` first if it is shorter.
fn grown<T: Default + Clone>(v: &mut Vec<T>, n: usize) -> &mut [T] {
    if v.len() < n {
        v.resize(n, T::default());
    }
    &mut v[..n]
}

fn kernel_q8(format: Format, path: Dispatch) -> Kernel<ActQ8> {
    match (format, path) {
        #[cfg(target_arch = "x86_64")]
        (Format::Q8_0, Dispatch::Avx512) => avx512::q8_0,
        #[cfg(target_arch = "x86_64")]
        (Format::Q4_1, Dispatch::Avx512) => avx512::q4_1,
        #[cfg(target_arch = "x86_64")]
        (Format::Q5_0, Dispatch::Avx512) => avx512::q5_0,
        #[cfg(target_arch = "x86_64")]
        (Format::Q8_0, Dispatch::Avx2) => avx2::q8_0,
        #[cfg(target_arch = "x86_64")]
        (Format::Q5_0, Dispatch::Avx2) => avx2::q5_0,
        #[cfg(target_arch = "x86_64")]
        (Format::Q4_1, Dispatch::Avx2) => avx2::q4_1,
        #[cfg(target_arch = "aarch64")]
        (Format::Q8_0, Dispatch::NeonDot) => neon::q8_0_dot,
        #[cfg(target_arch = "aarch64")]
        (Format::Q4_1, Dispatch::NeonDot) => neon::q4_1_dot,
        #[cfg(target_arch = "aarch64")]
        (Format::Q5_0, Dispatch::NeonDot) => neon::q5_0_dot,
        #[cfg(target_arch = "aarch64")]
        (Format::Q8_0, Dispatch::Neon) => neon::q8_0,
        #[cfg(target_arch = "aarch64")]
        (Format::Q4_1, Dispatch::Neon) => neon::q4_1,
        #[cfg(target_arch = "aarch64")]
        (Format::Q5_0, Dispatch::Neon) => neon::q5_0,
        (Format::Q4_1, _) => scalar::q4_1,
        (Format::Q5_0, _) => scalar::q5_0,
        _ => scalar::q8_0,
    }
}

fn kernel_q8k(format: Format, path: Dispatch) -> Kernel<ActQ8K> {
    match (format, path) {
        #[cfg(target_arch = "x86_64")]
        (Format::Q4K, Dispatch::Avx512) => avx512::q4k,
        #[cfg(target_arch = "x86_64")]
        (Format::Q6K, Dispatch::Avx512) => avx512::q6k,
        #[cfg(target_arch = "x86_64")]
        (Format::Q4K, Dispatch::Avx2) => avx2::q4k,
        #[cfg(target_arch = "x86_64")]
        (Format::Q6K, Dispatch::Avx2) => avx2::q6k,
        #[cfg(target_arch = "aarch64")]
        (Format::Q4K, Dispatch::NeonDot) => neon::q4k_dot,
        #[cfg(target_arch = "aarch64")]
        (Format::Q6K, Dispatch::NeonDot) => neon::q6k_dot,
        #[cfg(target_arch = "aarch64")]
        (Format::Q4K, Dispatch::Neon) => neon::q4k,
        #[cfg(target_arch = "aarch64")]
        (Format::Q6K, Dispatch::Neon) => neon::q6k,
        (Format::Q6K, _) => scalar::q6k,
        _ => scalar::q4k,
    }
}

fn kernel_float(format: Format, path: Dispatch) -> Kernel<f32> {
    match (format, path) {
        #[cfg(target_arch = "x86_64")]
        (Format::F16, Dispatch::Avx512) => avx512::f16,
        #[cfg(target_arch = "x86_64")]
        (Format::F32, Dispatch::Avx512) => avx512::f32,
        #[cfg(target_arch = "x86_64")]
        (Format::F16, Dispatch::Avx2) => avx2::f16,
        #[cfg(target_arch = "x86_64")]
        (Format::F32, Dispatch::Avx2) => avx2::f32,
        // Float weights take no integer dot products: both NEON paths share these.
        #[cfg(target_arch = "aarch64")]
        (Format::F16, Dispatch::Neon | Dispatch::NeonDot) => neon::f16,
        #[cfg(target_arch = "aarch64")]
        (Format::F32, Dispatch::Neon | Dispatch::NeonDot) => neon::f32,
        (Format::F16, _) => scalar::f16,
        _ => scalar::f32,
    }
}
