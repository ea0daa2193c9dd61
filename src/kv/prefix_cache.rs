//! Content addresses for full pages, so that a request sharing a prefix with an earlier one
//! reuses its K/V. A page's key hashes its tokens together with the key of the page before, so
//! a key names the whole prefix up to and including that page.
//!
//! The cache holds one reference on each page it indexes. A page referenced only by the cache
//! is evictable, least recently used first.

use super::pool::{PageId, PagePool};
use crate::error::KvError;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

/// Keys of the full pages of `tokens` (`tokens.len() / page_size` of them).
pub fn page_keys(tokens: &[u32], page_size: usize) -> Vec<u64> {
    let mut keys = Vec::with_capacity(tokens.len() / page_size);
    let mut prev = 0u64;
    for page in tokens.chunks_exact(page_size) {
        // SipHash with fixed keys: stable across runs, unlike RandomState.
        #[allow(deprecated)]
        let mut h = std::hash::SipHasher::new();
        prev.hash(&mut h);
        page.hash(&mut h);
        prev = h.finish();
        keys.push(prev);
    }
    keys
}

struct Entry {
    page_id: PageId,
    /// The page's tokens, checked on lookup so that a hash collision can never alias K/V.
    tokens: Vec<u32>,
    last_used: u64,
}

#[derive(Default)]
pub struct PrefixCache {
    entries: HashMap<u64, Entry>,
    clock: u64,
    hits: u64,
    lookups: u64,
}

impl PrefixCache {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// (pages found, pages looked up) over all lookups: the hit ratio's parts.
    pub fn hit_counts(&self) -> (u64, u64) {
        (self.hits, self.lookups)
    }

    /// The longest run of cached pages that starts `tokens`; each returned page gains a
    /// reference for the caller.
    pub fn lookup(&mut self, tokens: &[u32], pool: &mut PagePool) -> Result<Vec<PageId>, KvError> {
        let page_size = pool.page_size();
        self.clock += 1;
        let mut found = Vec::new();
        let keys = page_keys(tokens, page_size);
        self.lookups += keys.len() as u64;
        for (i, key) in keys.iter().enumerate() {
            let page = &tokens[i * page_size..(i + 1) * page_size];
            match self.entries.get_mut(key) {
                Some(e) if e.tokens == page => {
                    e.last_used = self.clock;
                    pool.retain(e.page_id)?;
                    found.push(e.page_id);
                }
                _ => break,
            }
        }
        self.hits += found.len() as u64;
        Ok(found)
    }

    /// Indexes the full pages of a sequence (`page_ids[i]` holds `tokens[i*ps..(i+1)*ps]`).
    /// Pages already indexed under the same key are left as they are.
    pub fn insert(
        &mut self,
        tokens: &[u32],
        page_ids: &[PageId],
        pool: &mut PagePool,
    ) -> Result<(), KvError> {
        let page_size = pool.page_size();
        self.clock += 1;
        for (i, key) in page_keys(tokens, page_size).into_iter().enumerate() {
            let Some(&page_id) = page_ids.get(i) else {
                break;
            };
            if let Some(e) = self.entries.get_mut(&key) {
                e.last_used = self.clock;
                continue;
            }
            pool.retain(page_id)?;
            self.entries.insert(
                key,
                Entry {
                    page_id,
                    tokens: tokens[i * page_size..(i + 1) * page_size].to_vec(),
                    last_used: self.clock,
                },
            );
        }
        Ok(())
    }

    /// Pages that only the cache references: what eviction could free.
    pub fn num_evictable(&self, pool: &PagePool) -> usize {
        self.entries
            .values()
            .filter(|e| pool.ref_count(e.page_id) == 1)
            .count()
    }

    /// Frees up to `num_pages` pages that only the cache references, least recently used first.
    pub fn evict(&mut self, num_pages: usize, pool: &mut PagePool) -> Result<usize, KvError> {
        let mut candidates: Vec<(u64, u64)> = self
            .entries
            .iter()
            .filter(|(_, e)| pool.ref_count(e.page_id) == 1)
            .map(|(k, e)| (e.last_used, *k))
            .collect();
        candidates.sort_unstable();
        let mut freed = 0;
        for (_, key) in candidates.into_iter().take(num_pages) {
            let entry = self.entries.remove(&key).expect("candidate exists");
            pool.release(entry.page_id)?;
            freed += 1;
        }
        Ok(freed)
    }

    /// Drops every entry, releasing the cache's references.
    pub fn clear(&mut self, pool: &mut PagePool) -> Result<(), KvError> {
        for (_, e) in self.entries.drain() {
            pool.release(e.page_id)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_prefix_is_found_page_by_page() {
        let mut pool = PagePool::new(16, 4);
        let mut cache = PrefixCache::default();
        let tokens: Vec<u32> = (0..10).collect();
        let pages = pool.try_allocate(3).unwrap();
        cache.insert(&tokens, &pages, &mut pool).unwrap();
        assert_eq!(cache.len(), 2, "only full pages are indexed");

        let mut other: Vec<u32> = (0..6).collect();
        other.extend([99, 98, 97]);
        let found = cache.lookup(&other, &mut pool).unwrap();
        assert_eq!(found, vec![pages[0]], "second page differs");
        assert_eq!(pool.ref_count(pages[0]), 3);
    }

    #[test]
    fn only_pages_nobody_else_holds_are_evicted() {
        let mut pool = PagePool::new(8, 2);
        let mut cache = PrefixCache::default();
        let tokens: Vec<u32> = (0..4).collect();
        let pages = pool.try_allocate(2).unwrap();
        cache.insert(&tokens, &pages, &mut pool).unwrap();
        pool.release(pages[1]).unwrap();
        assert_eq!(cache.num_evictable(&pool), 1);
        assert_eq!(cache.evict(5, &mut pool).unwrap(), 1);
        assert_eq!(pool.num_used(), 1);
        pool.release(pages[0]).unwrap();
        cache.clear(&mut pool).unwrap();
        assert_eq!(pool.num_used(), 0);
    }
}
