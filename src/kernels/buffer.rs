//! Zeroed buffers for the data the kernels stream: packed weights and K/V chunks.
//!
//! Two properties a `Vec` from the allocator does not give:
//! - **Cache-line alignment.** glibc serves large allocations from `mmap` at 16 bytes past a
//!   page boundary, so every 64-byte vector load of a packed weight matrix straddled two cache
//!   lines (two accesses where one would do) and so did every other 32-byte load of a K/V page.
//!   Buffers here start on a 64-byte boundary, and on a 2 MB one from 2 MB up.
//! - **Transparent huge pages.** A decode step streams every weight (and, deep in a context,
//!   every K/V page) once; with 4 KB pages it takes a TLB miss every 4 KB. The memory is advised
//!   `MADV_HUGEPAGE` before it is first touched (Linux with THP in `madvise` mode, Debian's
//!   default), then zeroed.

use std::alloc::{alloc, dealloc, handle_alloc_error, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// Element types whose all-zero bytes are a valid value (zero).
///
/// # Safety
/// Implementors must be plain data for which every all-zero bit pattern is a valid value.
pub unsafe trait Zeroable: Copy {}
// SAFETY: integers and IEEE floats are plain data; all-zero bits are 0 / +0.0.
unsafe impl Zeroable for u8 {}
// SAFETY: as above.
unsafe impl Zeroable for i8 {}
// SAFETY: as above.
unsafe impl Zeroable for f32 {}
// SAFETY: as above.
unsafe impl Zeroable for half::f16 {}

/// Allocations from this size up are aligned to (and advised as) 2 MB huge pages.
const HUGE: usize = 2 << 20;
const LINE: usize = 64;

/// A fixed-length, zero-initialised, aligned buffer (see the module docs).
pub struct AlignedBuf<T: Zeroable> {
    ptr: NonNull<T>,
    len: usize,
}

// SAFETY: the buffer owns its elements like a `Vec<T>` does.
unsafe impl<T: Zeroable + Send> Send for AlignedBuf<T> {}
// SAFETY: shared access only reads, as for `Vec<T>`.
unsafe impl<T: Zeroable + Sync> Sync for AlignedBuf<T> {}

impl<T: Zeroable> AlignedBuf<T> {
    /// `len` zeros.
    pub fn zeroed(len: usize) -> Self {
        let Some(layout) = Self::layout(len) else {
            return AlignedBuf {
                ptr: NonNull::dangling(),
                len,
            };
        };
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            handle_alloc_error(layout)
        };
        #[cfg(target_os = "linux")]
        if layout.size() >= HUGE {
            // SAFETY: advice only, on the allocation's own (2 MB aligned) range.
            unsafe { libc::madvise(raw.cast(), layout.size(), libc::MADV_HUGEPAGE) };
        }
        // SAFETY: `raw` is valid for `layout.size()` bytes; zero bytes are valid `T`s
        // (`Zeroable`), so the buffer is initialised from here on.
        unsafe { std::ptr::write_bytes(raw, 0, layout.size()) };
        AlignedBuf {
            ptr: ptr.cast(),
            len,
        }
    }

    /// `None` for an empty buffer (no allocation).
    fn layout(len: usize) -> Option<Layout> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .expect("buffer size overflows");
        if bytes == 0 {
            return None;
        }
        let align = if bytes >= HUGE { HUGE } else { LINE };
        let align = align.max(std::mem::align_of::<T>());
        Some(Layout::from_size_align(bytes.next_multiple_of(align), align).unwrap())
    }
}

impl<T: Zeroable> Drop for AlignedBuf<T> {
    fn drop(&mut self) {
        if let Some(layout) = Self::layout(self.len) {
            // SAFETY: allocated in `zeroed` with this same layout.
            unsafe { dealloc(self.ptr.as_ptr().cast(), layout) };
        }
    }
}

impl<T: Zeroable> Deref for AlignedBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` holds `len` initialised elements (or is dangling with `len` of
        // zero-sized storage, which a slice allows).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Zeroable> DerefMut for AlignedBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Zeroable> Clone for AlignedBuf<T> {
    fn clone(&self) -> Self {
        let mut copy = Self::zeroed(self.len);
        copy.copy_from_slice(self);
        copy
    }
}

impl<T: Zeroable> std::fmt::Debug for AlignedBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} elements)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zeroed_and_aligned_to_lines_or_huge_pages() {
        for (len, align) in [(1usize, LINE), (1000, LINE), (3 << 20, HUGE)] {
            let mut b = AlignedBuf::<u8>::zeroed(len);
            assert_eq!(b.len(), len);
            assert_eq!(b.as_ptr() as usize % align, 0, "{len}");
            assert!(b.iter().all(|&x| x == 0));
            b[len - 1] = 7;
            let c = b.clone();
            assert_eq!(c[len - 1], 7);
            assert_eq!(c.as_ptr() as usize % align, 0);
        }
        let f = AlignedBuf::<f32>::zeroed(17);
        assert_eq!(f.as_ptr() as usize % LINE, 0);
        assert!(AlignedBuf::<half::f16>::zeroed(0).is_empty());
    }
}
