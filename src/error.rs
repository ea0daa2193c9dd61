//! Typed errors of the engine. Every refusal the engine can give a request is a value here, so
//! that the API layer can map it to a precise client error instead of a crash.

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum KvError {
    /// The pool cannot hand out `needed` pages; only `free` remain. Nothing was allocated.
    #[error("KV page pool exhausted: needed {needed} pages, {free} free")]
    PoolExhausted { needed: usize, free: usize },
    /// A write or read addressed a position the page table holds no page for.
    #[error("position {position} is past the page table's capacity of {capacity} tokens")]
    PastCapacity { position: usize, capacity: usize },
    /// A page id was released that is not currently allocated (a double free).
    #[error("page {page_id} is not allocated")]
    NotAllocated { page_id: u32 },
}
