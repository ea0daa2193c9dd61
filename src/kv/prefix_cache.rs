//! Content addresses for full pages, so that a request sharing a prefix with an earlier one
//! reuses its K/V. A page's key hashes its tokens together with the key of the page before, so
//! a key names the whole prefix up to and including that page.
//!
//! The cache holds one reference on each page it indexes. A page referenced only by the cache
//! is evictable, least recently used first.
//!
//! Past the last fully matching page, a lookup also offers the cached page (a child of that
//! prefix) whose first tokens match the rest of the request best: the caller copies those
//! positions into a page of its own (copy-on-write) instead of prefilling them again.

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
    /// Key of the page before (0 for a first page).
    parent: u64,
    /// The page's tokens, checked on lookup so that a hash collision can never alias K/V.
    tokens: Vec<u32>,
    last_used: u64,
}

/// What a lookup found: whole pages, then maybe a page whose first `len` positions match.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    pub pages: Vec<PageId>,
    pub partial: Option<PartialPage>,
}

/// A cached page whose first `len` (< page size) positions continue the match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartialPage {
    pub page_id: PageId,
    pub len: usize,
}

#[derive(Default)]
pub struct PrefixCache {
    entries: HashMap<u64, Entry>,
    /// Keys of the cached pages that follow each key (0: first pages).
    children: HashMap<u64, Vec<u64>>,
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

    /// The longest run of cached pages that starts `tokens`, then the cached page that best
    /// continues it for part of a page; every returned page gains a reference for the caller.
    pub fn lookup(&mut self, tokens: &[u32], pool: &mut PagePool) -> Result<PrefixMatch, KvError> {
        let page_size = pool.page_size();
        self.clock += 1;
        let mut found = PrefixMatch::default();
        let keys = page_keys(tokens, page_size);
        self.lookups += keys.len() as u64;
        let mut parent = 0;
        for (i, key) in keys.iter().enumerate() {
            let page = &tokens[i * page_size..(i + 1) * page_size];
            match self.entries.get_mut(key) {
                Some(e) if e.tokens == page => {
                    e.last_used = self.clock;
                    pool.retain(e.page_id)?;
                    found.pages.push(e.page_id);
                    parent = *key;
                }
                _ => break,
            }
        }
        self.hits += found.pages.len() as u64;
        let rest = &tokens[found.pages.len() * page_size..];
        let best = self
            .children
            .get(&parent)
            .into_iter()
            .flatten()
            .filter_map(|k| self.entries.get(k).map(|e| (*k, e)))
            .map(|(k, e)| (common_len(&e.tokens, rest).min(page_size - 1), k))
            .max();
        if let Some((len, key)) = best.filter(|(len, _)| *len > 0) {
            let e = self.entries.get_mut(&key).expect("a listed child exists");
            e.last_used = self.clock;
            pool.retain(e.page_id)?;
            found.partial = Some(PartialPage {
                page_id: e.page_id,
                len,
            });
        }
        Ok(found)
    }

    fn remove(&mut self, key: u64) -> Option<Entry> {
        let entry = self.entries.remove(&key)?;
        if let Some(siblings) = self.children.get_mut(&entry.parent) {
            siblings.retain(|k| *k != key);
            if siblings.is_empty() {
                self.children.remove(&entry.parent);
            }
        }
        Some(entry)
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
        let mut parent = 0;
        for (i, key) in page_keys(tokens, page_size).into_iter().enumerate() {
            let Some(&page_id) = page_ids.get(i) else {
                break;
            };
            if let Some(e) = self.entries.get_mut(&key) {
                e.last_used = self.clock;
                parent = key;
                continue;
            }
            pool.retain(page_id)?;
            self.entries.insert(
                key,
                Entry {
                    page_id,
                    parent,
                    tokens: tokens[i * page_size..(i + 1) * page_size].to_vec(),
                    last_used: self.clock,
                },
            );
            self.children.entry(parent).or_default().push(key);
            parent = key;
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
            let entry = self.remove(key).expect("candidate exists");
            pool.release(entry.page_id)?;
            freed += 1;
        }
        Ok(freed)
    }

    /// Drops every entry, releasing the cache's references.
    pub fn clear(&mut self, pool: &mut PagePool) -> Result<(), KvError> {
        self.children.clear();
        for (_, e) in self.entries.drain() {
            pool.release(e.page_id)?;
        }
        Ok(())
    }
}

fn common_len(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
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
        assert_eq!(found.pages, vec![pages[0]], "second page differs");
        assert_eq!(pool.ref_count(pages[0]), 3);
        // The second page shares its first 2 positions: offered for copy-on-write.
        let partial = found.partial.expect("a partial match");
        assert_eq!((partial.page_id, partial.len), (pages[1], 2));
        assert_eq!(pool.ref_count(pages[1]), 3);
    }

    #[test]
    fn the_best_partial_page_is_chosen_and_evicted_pages_are_forgotten() {
        let mut pool = PagePool::new(8, 4);
        let mut cache = PrefixCache::default();
        let a: Vec<u32> = vec![1, 2, 3, 4, 10, 11, 12, 13];
        let b: Vec<u32> = vec![1, 2, 3, 4, 10, 11, 20, 21];
        let pa = pool.try_allocate(2).unwrap();
        let pb = pool.try_allocate(2).unwrap();
        cache.insert(&a, &pa, &mut pool).unwrap();
        cache.insert(&b, &pb, &mut pool).unwrap();
        // b's first page is a's: only b's second page is new.
        assert_eq!(cache.len(), 3);
        let found = cache
            .lookup(&[1, 2, 3, 4, 10, 11, 20, 99], &mut pool)
            .unwrap();
        assert_eq!(found.pages, vec![pa[0]]);
        assert_eq!(found.partial.map(|p| (p.page_id, p.len)), Some((pb[1], 3)));
        pool.release_all(&[pa[0], pb[1]]).unwrap();
        // Nothing shares a first token: no partial page.
        assert_eq!(
            cache.lookup(&[7, 7, 7], &mut pool).unwrap(),
            PrefixMatch::default()
        );
        pool.release_all(&pa).unwrap();
        pool.release_all(&pb).unwrap();
        cache.evict(10, &mut pool).unwrap();
        assert!(cache.children.is_empty(), "eviction unlinks children");
        assert_eq!(pool.num_used(), 0);
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
