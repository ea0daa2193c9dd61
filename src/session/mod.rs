//! Sessions: each conversation's token history and page table, owned by its own actor, and
//! the registry that names, expires and evicts them.

pub mod actor;
pub mod registry;
pub mod store;

pub use actor::{
    BeginTurn, EndTurn, Flush, Grow, Grown, History, ReleaseAll, SessionActor, SessionInfo,
    Truncate, TurnStart,
};
pub use registry::{SessionKey, SessionLeftMemory, SessionRegistry};
pub use store::SessionStore;
