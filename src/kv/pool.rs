//! The page pool: page ids, reference counts and the free list. It knows nothing about
//! sequences, sessions or tensors; the K/V bytes behind a page live in [`super::KvStorage`],
//! and which pages a sequence holds lives in its [`super::PageTable`].
//!
//! Allocation is all-or-nothing: a refusal changes nothing. Free pages are handed out lowest id
//! first so the lazily grown storage stays compact.

use crate::error::KvError;
use std::collections::BTreeSet;

/// Index of a page in the pool (and in the KV storage).
pub type PageId = u32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStats {
    pub num_pages: usize,
    pub num_used: usize,
    pub num_free: usize,
    pub page_size: usize,
}

#[derive(Debug)]
pub struct PagePool {
    page_size: usize,
    /// `ref_counts[id] == 0` means the page is free.
    ref_counts: Vec<u32>,
    free: BTreeSet<PageId>,
}

impl PagePool {
    /// A pool of `num_pages` pages of `page_size` tokens each.
    pub fn new(num_pages: usize, page_size: usize) -> Self {
        assert!(page_size > 0, "page size must be positive");
        Self {
            page_size,
            ref_counts: vec![0; num_pages],
            free: (0..num_pages as PageId).collect(),
        }
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    pub fn num_pages(&self) -> usize {
        self.ref_counts.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn num_used(&self) -> usize {
        self.num_pages() - self.num_free()
    }

    pub fn stats(&self) -> PoolStats {
        PoolStats {
            num_pages: self.num_pages(),
            num_used: self.num_used(),
            num_free: self.num_free(),
            page_size: self.page_size,
        }
    }

    /// Pages needed to hold `num_tokens` tokens.
    pub fn pages_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.page_size)
    }

    pub fn can_allocate(&self, num_pages: usize) -> bool {
        num_pages <= self.free.len()
    }

    /// Takes `num_pages` free pages (each with reference count 1), or refuses without change.
    pub fn try_allocate(&mut self, num_pages: usize) -> Result<Vec<PageId>, KvError> {
        if !self.can_allocate(num_pages) {
            return Err(KvError::PoolExhausted {
                needed: num_pages,
                free: self.free.len(),
            });
        }
        let mut page_ids = Vec::with_capacity(num_pages);
        for _ in 0..num_pages {
            let id = self.free.pop_first().expect("checked above");
            self.ref_counts[id as usize] = 1;
            page_ids.push(id);
        }
        Ok(page_ids)
    }

    /// Adds a reference to an allocated page (a second holder of a shared prefix page).
    pub fn retain(&mut self, page_id: PageId) -> Result<(), KvError> {
        match self.ref_counts.get_mut(page_id as usize) {
            Some(count) if *count > 0 => {
                *count += 1;
                Ok(())
            }
            _ => Err(KvError::NotAllocated { page_id }),
        }
    }

    /// Drops one reference; the page returns to the free list when none remain.
    pub fn release(&mut self, page_id: PageId) -> Result<(), KvError> {
        match self.ref_counts.get_mut(page_id as usize) {
            Some(count) if *count > 0 => {
                *count -= 1;
                if *count == 0 {
                    self.free.insert(page_id);
                }
                Ok(())
            }
            _ => Err(KvError::NotAllocated { page_id }),
        }
    }

    pub fn release_all(&mut self, page_ids: &[PageId]) -> Result<(), KvError> {
        page_ids.iter().try_for_each(|&id| self.release(id))
    }

    pub fn ref_count(&self, page_id: PageId) -> u32 {
        self.ref_counts.get(page_id as usize).copied().unwrap_or(0)
    }

    /// The highest page id ever needed so far plus one: bounds the storage actually touched.
    pub fn high_water_mark(&self) -> usize {
        self.ref_counts
            .iter()
            .rposition(|&c| c > 0)
            .map_or(0, |i| i + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusal_changes_nothing() {
        let mut pool = PagePool::new(4, 16);
        let held = pool.try_allocate(3).unwrap();
        assert_eq!(
            pool.try_allocate(2),
            Err(KvError::PoolExhausted { needed: 2, free: 1 })
        );
        assert_eq!(pool.num_free(), 1);
        pool.release_all(&held).unwrap();
        assert_eq!(pool.num_used(), 0);
    }

    #[test]
    fn lowest_ids_are_handed_out_first() {
        let mut pool = PagePool::new(8, 16);
        let a = pool.try_allocate(3).unwrap();
        assert_eq!(a, vec![0, 1, 2]);
        pool.release(1).unwrap();
        assert_eq!(pool.try_allocate(1).unwrap(), vec![1]);
    }

    #[test]
    fn shared_pages_free_on_last_release() {
        let mut pool = PagePool::new(2, 16);
        let ids = pool.try_allocate(1).unwrap();
        pool.retain(ids[0]).unwrap();
        pool.release(ids[0]).unwrap();
        assert_eq!(pool.num_used(), 1);
        pool.release(ids[0]).unwrap();
        assert_eq!(pool.num_used(), 0);
        assert_eq!(
            pool.release(ids[0]),
            Err(KvError::NotAllocated { page_id: ids[0] })
        );
    }
}
