//! The page pool and the prefix cache behind one owner: an actor that sessions ask for pages
//! and give them back to. Refusals are values (`KvError`), never panics.

use super::pool::{PageId, PagePool};
use super::prefix_cache::{PrefixCache, PrefixMatch};
use crate::error::KvError;
use actix::prelude::*;

pub struct PagePoolActor {
    pool: PagePool,
    cache: PrefixCache,
}

impl PagePoolActor {
    pub fn new(num_pages: usize, page_size: usize) -> Self {
        Self {
            pool: PagePool::new(num_pages, page_size),
            cache: PrefixCache::default(),
        }
    }
}

impl Actor for PagePoolActor {
    type Context = Context<Self>;
}

/// Take `num_pages` pages (evicting unreferenced cached pages if needed), all or nothing.
#[derive(Message)]
#[rtype(result = "Result<Vec<PageId>, KvError>")]
pub struct Allocate {
    pub num_pages: usize,
}

/// Drop one reference on each page.
#[derive(Message)]
#[rtype(result = "Result<(), KvError>")]
pub struct Release {
    pub page_ids: Vec<PageId>,
}

/// The cached pages that start `tokens` (and a page matching part of the rest), each retained
/// for the caller.
#[derive(Message)]
#[rtype(result = "Result<PrefixMatch, KvError>")]
pub struct LookupPrefix {
    pub tokens: Vec<u32>,
}

/// Index the full pages of a finished turn so later requests can reuse them.
#[derive(Message)]
#[rtype(result = "Result<(), KvError>")]
pub struct PublishPrefix {
    pub tokens: Vec<u32>,
    pub page_ids: Vec<PageId>,
}

/// Release every page the cache holds.
#[derive(Message)]
#[rtype(result = "Result<(), KvError>")]
pub struct ClearCache;

#[derive(Message)]
#[rtype(result = "PoolSnapshot")]
pub struct GetPoolStats;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PoolSnapshot {
    pub num_pages: usize,
    pub page_size: usize,
    pub num_used: usize,
    pub num_free: usize,
    /// Pages indexed by the prefix cache (some may also be held by sessions).
    pub num_cached: usize,
    /// Cached pages only the cache holds: free for the asking.
    pub num_evictable: usize,
    pub prefix_hits: u64,
    pub prefix_lookups: u64,
}

impl PoolSnapshot {
    /// Pages an allocation could get right now.
    pub fn num_available(&self) -> usize {
        self.num_free + self.num_evictable
    }
}

impl Handler<Allocate> for PagePoolActor {
    type Result = Result<Vec<PageId>, KvError>;
    fn handle(&mut self, msg: Allocate, _: &mut Context<Self>) -> Self::Result {
        let short = msg.num_pages.saturating_sub(self.pool.num_free());
        if short > 0 {
            self.cache.evict(short, &mut self.pool)?;
        }
        self.pool.try_allocate(msg.num_pages)
    }
}

impl Handler<Release> for PagePoolActor {
    type Result = Result<(), KvError>;
    fn handle(&mut self, msg: Release, _: &mut Context<Self>) -> Self::Result {
        self.pool.release_all(&msg.page_ids)
    }
}

impl Handler<LookupPrefix> for PagePoolActor {
    type Result = Result<PrefixMatch, KvError>;
    fn handle(&mut self, msg: LookupPrefix, _: &mut Context<Self>) -> Self::Result {
        self.cache.lookup(&msg.tokens, &mut self.pool)
    }
}

impl Handler<PublishPrefix> for PagePoolActor {
    type Result = Result<(), KvError>;
    fn handle(&mut self, msg: PublishPrefix, _: &mut Context<Self>) -> Self::Result {
        self.cache
            .insert(&msg.tokens, &msg.page_ids, &mut self.pool)
    }
}

impl Handler<ClearCache> for PagePoolActor {
    type Result = Result<(), KvError>;
    fn handle(&mut self, _: ClearCache, _: &mut Context<Self>) -> Self::Result {
        self.cache.clear(&mut self.pool)
    }
}

impl Handler<GetPoolStats> for PagePoolActor {
    type Result = MessageResult<GetPoolStats>;
    fn handle(&mut self, _: GetPoolStats, _: &mut Context<Self>) -> Self::Result {
        let (hits, lookups) = self.cache.hit_counts();
        MessageResult(PoolSnapshot {
            num_pages: self.pool.num_pages(),
            page_size: self.pool.page_size(),
            num_used: self.pool.num_used(),
            num_free: self.pool.num_free(),
            num_cached: self.cache.len(),
            num_evictable: self.cache.num_evictable(&self.pool),
            prefix_hits: hits,
            prefix_lookups: lookups,
        })
    }
}
