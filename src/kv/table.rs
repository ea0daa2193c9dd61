//! A sequence's page table: the ordered pages that hold its K/V and how many positions are
//! filled. Capacity is derived from the pages held (`pages × page_size`), never stored, so it
//! cannot drift from what was actually allocated.

use super::pool::{PageId, PagePool};
use crate::error::KvError;

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PageTable {
    page_ids: Vec<PageId>,
    len: usize,
}

impl PageTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// Positions filled with K/V.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn page_ids(&self) -> &[PageId] {
        &self.page_ids
    }

    pub fn capacity(&self, page_size: usize) -> usize {
        self.page_ids.len() * page_size
    }

    /// Pages to allocate before `num_new` more positions fit.
    pub fn pages_needed(&self, num_new: usize, page_size: usize) -> usize {
        (self.len + num_new)
            .div_ceil(page_size)
            .saturating_sub(self.page_ids.len())
    }

    /// Makes room for `num_new` more positions, taking pages from the pool all-or-nothing.
    /// The new positions count as filled: the caller writes their K/V in the next forward.
    pub fn try_grow(&mut self, num_new: usize, pool: &mut PagePool) -> Result<(), KvError> {
        let needed = self.pages_needed(num_new, pool.page_size());
        let granted = pool.try_allocate(needed)?;
        self.page_ids.extend(granted);
        self.len += num_new;
        Ok(())
    }

    /// Shrinks to `new_len` positions (speculative rollback, divergent tail), returning pages
    /// that became empty to the pool. Growing through `truncate` is a no-op.
    pub fn truncate(&mut self, new_len: usize, pool: &mut PagePool) -> Result<(), KvError> {
        let emptied = self.cut(new_len, pool.page_size());
        pool.release_all(&emptied)
    }

    /// Adds pages granted by a pool owned elsewhere (the page pool actor) and counts `num_new`
    /// more positions as filled. The caller asked for `pages_needed(num_new)` pages.
    pub fn push_granted(&mut self, page_ids: &[PageId], num_new: usize, page_size: usize) {
        self.page_ids.extend_from_slice(page_ids);
        self.len += num_new;
        debug_assert!(self.len <= self.capacity(page_size));
    }

    /// Shrinks to `new_len` positions and hands back the pages that became empty; the caller
    /// returns them to whichever pool granted them.
    #[must_use = "the emptied pages must be released to the pool"]
    pub fn cut(&mut self, new_len: usize, page_size: usize) -> Vec<PageId> {
        if new_len >= self.len {
            return Vec::new();
        }
        let keep = new_len.div_ceil(page_size);
        let emptied = self.page_ids.split_off(keep);
        self.len = new_len;
        emptied
    }

    /// Returns every page to the pool.
    pub fn release(&mut self, pool: &mut PagePool) -> Result<(), KvError> {
        self.truncate(0, pool)
    }

    /// Adopts pages someone else already holds (shared prefix): each gains a reference.
    pub fn adopt_shared(
        &mut self,
        page_ids: &[PageId],
        len: usize,
        pool: &mut PagePool,
    ) -> Result<(), KvError> {
        debug_assert!(self.is_empty(), "adopt_shared only on an empty table");
        debug_assert!(len <= page_ids.len() * pool.page_size());
        for &id in page_ids {
            pool.retain(id)?;
        }
        self.page_ids.extend_from_slice(page_ids);
        self.len = len;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn growth_takes_pages_only_at_page_boundaries() {
        let mut pool = PagePool::new(10, 4);
        let mut table = PageTable::new();
        table.try_grow(3, &mut pool).unwrap();
        assert_eq!(table.page_ids().len(), 1);
        table.try_grow(1, &mut pool).unwrap();
        assert_eq!(table.page_ids().len(), 1);
        table.try_grow(1, &mut pool).unwrap();
        assert_eq!(table.page_ids().len(), 2);
        assert_eq!(table.capacity(4), 8);
    }

    #[test]
    fn rollback_that_empties_a_page_returns_it() {
        let mut pool = PagePool::new(10, 4);
        let mut table = PageTable::new();
        table.try_grow(9, &mut pool).unwrap();
        assert_eq!(pool.num_used(), 3);
        table.truncate(8, &mut pool).unwrap();
        assert_eq!(pool.num_used(), 2);
        table.truncate(5, &mut pool).unwrap();
        assert_eq!(pool.num_used(), 2);
        table.truncate(4, &mut pool).unwrap();
        assert_eq!(pool.num_used(), 1);
        table.release(&mut pool).unwrap();
        assert_eq!(pool.num_used(), 0);
    }

    #[test]
    fn refused_growth_leaves_the_table_unchanged() {
        let mut pool = PagePool::new(2, 4);
        let mut table = PageTable::new();
        table.try_grow(5, &mut pool).unwrap();
        let before = table.clone();
        assert!(matches!(
            table.try_grow(4, &mut pool),
            Err(KvError::PoolExhausted { needed: 1, free: 0 })
        ));
        assert_eq!(table, before);
    }
}
