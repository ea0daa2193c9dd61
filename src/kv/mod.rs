//! KV memory: the page pool (ids and reference counts), per-sequence page tables, the storage
//! behind the pages, and paged attention that reads K/V in place.
//!
//! This module owns no notion of request or session; callers hold page tables and pass them in.

pub mod attention;
pub mod pool;
pub mod pool_actor;
pub mod prefix_cache;
pub mod storage;
pub mod table;

pub use attention::{
    paged_attention, paged_attention_with, AttentionPath, AttentionRow, AttentionShape, SimdReport,
};
pub use pool::{PageId, PagePool, PoolStats};
pub use storage::{HeadRows, KvDtype, KvKind, KvShape, KvStorage, PageCopy};
pub use table::PageTable;
