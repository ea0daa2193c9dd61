//! Zeroed buffers for the data the kernels stream: packed weights and K/V chunks.
//!
//! Two properties a `Vec` from the allocator does not give:
//! - **Cache-line alignment.** glibc serves large allocations from `mmap` at 16 bytes past a
//!   page boundary, so every 64-byte vector load of a packed weight matrix straddled two cache
//!   lines (two accesses where one would do) and so did every other 32-byte load of a K/V page.
//!   Buffers here start on a 64-byte boundary, and on a 2 MB one from 2 MB up.
//! - **Transparent huge pages.** A decode step streams every weight (and, deep in a context,
//!   every K/V page) once; with 4 KB pages it takes a TLB miss every 4 KB, and the hardware
//!   prefetchers stop at every 4 KB boundary. On Linux, buffers from 2 MB up are their own
//!   anonymous mapping, advised `MADV_HUGEPAGE` (THP in `madvise` mode, Debian's default)
//!   before anything touches it. (They came from the allocator before, advised the same way,
//!   but the allocator hands out memory freed earlier, whose 4 KB pages were already faulted
//!   in: the advice then changed nothing. With Qwen2.5-Coder-1.5B loaded, ~170 MB of its packed
//!   weights sat in 4 KB pages; now every packed matrix is in huge pages.) A fresh mapping is
//!   zero already; smaller buffers are zeroed.

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
        #[cfg(target_os = "linux")]
        if layout.size() >= HUGE {
            return AlignedBuf {
                ptr: huge::map(layout).cast(),
                len,
            };
        }
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            handle_alloc_error(layout)
        };
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
        let Some(layout) = Self::layout(self.len) else {
            return;
        };
        #[cfg(target_os = "linux")]
        if layout.size() >= HUGE {
            // SAFETY: mapped in `zeroed` with this same layout, and no longer used.
            unsafe { huge::unmap(self.ptr.cast(), layout) };
            return;
        }
        // SAFETY: allocated in `zeroed` with this same layout.
        unsafe { dealloc(self.ptr.as_ptr().cast(), layout) };
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

/// Buffers of whole 2 MB huge pages, each its own anonymous mapping (see the module docs).
#[cfg(target_os = "linux")]
mod huge {
    use super::HUGE;
    use std::alloc::{handle_alloc_error, Layout};
    use std::ptr::NonNull;

    /// `layout.size()` zero bytes (a multiple of [`HUGE`]) at a 2 MB boundary, advised
    /// `MADV_HUGEPAGE` before their first touch.
    pub(super) fn map(layout: Layout) -> NonNull<u8> {
        let size = layout.size();
        debug_assert!(size.is_multiple_of(HUGE) && layout.align() <= HUGE);
        // Mapped 2 MB longer, then trimmed to the boundary: `mmap` aligns to 4 KB only.
        let span = size + HUGE;
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            handle_alloc_error(layout)
        }
        let start = raw as usize;
        let aligned = start.next_multiple_of(HUGE);
        let (head, tail) = (aligned - start, start + span - (aligned + size));
        // SAFETY: both ranges lie in the mapping just made, outside the part kept; advice on
        // the kept part only.
        unsafe {
            if head > 0 {
                libc::munmap(raw, head);
            }
            if tail > 0 {
                libc::munmap((aligned + size) as *mut libc::c_void, tail);
            }
            libc::madvise(aligned as *mut libc::c_void, size, libc::MADV_HUGEPAGE);
        }
        NonNull::new(aligned as *mut u8).expect("mmap returned null")
    }

    /// Unmaps a buffer from [`map`].
    ///
    /// # Safety
    /// `ptr` and `layout` are a [`map`] result and its argument, and the buffer is not used
    /// again.
    pub(super) unsafe fn unmap(ptr: NonNull<u8>, layout: Layout) {
        libc::munmap(ptr.as_ptr().cast(), layout.size());
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

    /// The `VmFlags` of the mapping of this process that holds all of `addr..end`, if one does.
    #[cfg(target_os = "linux")]
    fn mapping_flags(addr: usize, end: usize) -> Option<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut lines = smaps.lines();
        while let Some(line) = lines.next() {
            let range = line.split_whitespace().next().unwrap_or("");
            let Some((start, stop)) = range.split_once('-') else {
                continue;
            };
            let hex = |x| usize::from_str_radix(x, 16).ok();
            let (Some(start), Some(stop)) = (hex(start), hex(stop)) else {
                continue;
            };
            if !(start <= addr && end <= stop) {
                continue;
            }
            return lines
                .find_map(|l| l.strip_prefix("VmFlags:"))
                .map(str::to_string);
        }
        None
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn huge_buffers_are_mapped_and_advised_before_use() {
        let mut b = AlignedBuf::<f32>::zeroed((13 << 20) / 4 + 3);
        let (addr, end) = (b.as_ptr() as usize, b.as_ptr() as usize + (14 << 20));
        assert_eq!(addr % HUGE, 0);
        let flags = mapping_flags(addr, end).expect("mapped");
        // (qemu-user, which runs the aarch64 build in CI, takes the advice without passing it
        // on to the kernel.)
        if cfg!(target_arch = "x86_64") {
            assert!(flags.split_whitespace().any(|f| f == "hg"), "{flags}");
        }
        assert!(b.iter().all(|&x| x == 0.0));
        let n = b.len();
        b[n - 1] = 1.5;
        assert_eq!(b.iter().sum::<f32>(), 1.5);
    }
}
