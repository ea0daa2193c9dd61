//! A session: one conversation's token history and the page table that holds its K/V. Only
//! this actor changes them; pages come from and return to the page pool actor by message.
//!
//! Invariant: `tokens.len() == table.len()` — the history is exactly the positions whose K/V is
//! in the pages. The leading `num_shared` pages are also indexed by the prefix cache, so they
//! are never written again: a turn that diverges inside one of them drops that whole page.

use crate::error::EngineError;
use crate::kv::pool_actor::{Allocate, LookupPrefix, PagePoolActor, PublishPrefix, Release};
use crate::kv::{PageId, PageTable};
use actix::prelude::*;
use std::time::Instant;

pub struct SessionActor {
    session_id: String,
    pool: Addr<PagePoolActor>,
    page_size: usize,
    tokens: Vec<u32>,
    table: PageTable,
    num_shared: usize,
    turn_in_progress: bool,
    last_used: Instant,
}

impl SessionActor {
    pub fn new(session_id: String, pool: Addr<PagePoolActor>, page_size: usize) -> Self {
        Self {
            session_id,
            pool,
            page_size,
            tokens: Vec::new(),
            table: PageTable::new(),
            num_shared: 0,
            turn_in_progress: false,
            last_used: Instant::now(),
        }
    }

    /// Cuts history and pages back to `len` and returns the emptied pages.
    fn cut(&mut self, len: usize) -> Vec<PageId> {
        let emptied = self.table.cut(len, self.page_size);
        self.tokens.truncate(self.table.len());
        self.num_shared = self.num_shared.min(self.table.page_ids().len());
        emptied
    }

    fn release_later(&self, page_ids: Vec<PageId>) {
        if !page_ids.is_empty() {
            self.pool.do_send(Release { page_ids });
        }
    }
}

impl Actor for SessionActor {
    type Context = Context<Self>;

    fn stopped(&mut self, _: &mut Self::Context) {
        let all = self.cut(0);
        self.release_later(all);
    }
}

/// What a new turn starts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TurnStart {
    /// Prompt tokens whose K/V is reused (not prefilled again).
    pub cached_tokens: usize,
    pub num_pages: usize,
}

/// Start a turn whose full token sequence is `prompt`: keep the longest common prefix with the
/// history (or, with no history, with the prefix cache) and release the divergent tail.
#[derive(Message)]
#[rtype(result = "Result<TurnStart, EngineError>")]
pub struct BeginTurn {
    pub prompt: Vec<u32>,
}

impl Handler<BeginTurn> for SessionActor {
    type Result = AtomicResponse<Self, Result<TurnStart, EngineError>>;

    fn handle(&mut self, msg: BeginTurn, _: &mut Context<Self>) -> Self::Result {
        if self.turn_in_progress {
            let err = EngineError::SessionBusy {
                session_id: self.session_id.clone(),
            };
            return AtomicResponse::new(Box::pin(fut::ready(Err(err))));
        }
        self.turn_in_progress = true;
        self.last_used = Instant::now();
        // At least one prompt token is always computed: its logits start the reply.
        let limit = msg.prompt.len().saturating_sub(1);
        let mut reuse = common_prefix(&self.tokens, &msg.prompt).min(limit);
        let shared_len = self.num_shared * self.page_size;
        if reuse < shared_len && !reuse.is_multiple_of(self.page_size) {
            reuse -= reuse % self.page_size;
        }
        let emptied = self.cut(reuse);
        self.release_later(emptied);
        if !self.table.is_empty() {
            let start = TurnStart {
                cached_tokens: self.table.len(),
                num_pages: self.table.page_ids().len(),
            };
            return AtomicResponse::new(Box::pin(fut::ready(Ok(start))));
        }
        let lookup = self.pool.send(LookupPrefix {
            tokens: msg.prompt[..limit].to_vec(),
        });
        AtomicResponse::new(Box::pin(lookup.into_actor(self).map(
            move |found, act, _| {
                let found = found??;
                let len = found.len() * act.page_size;
                act.table.push_granted(&found, len, act.page_size);
                act.tokens.extend_from_slice(&msg.prompt[..len]);
                act.num_shared = found.len();
                Ok(TurnStart {
                    cached_tokens: len,
                    num_pages: found.len(),
                })
            },
        )))
    }
}

/// Make room for `tokens` (whose K/V the next step computes) and record them in the history.
/// Replies with the whole page table, or a typed refusal that changes nothing.
#[derive(Message)]
#[rtype(result = "Result<Vec<PageId>, EngineError>")]
pub struct Grow {
    pub tokens: Vec<u32>,
}

impl Handler<Grow> for SessionActor {
    type Result = AtomicResponse<Self, Result<Vec<PageId>, EngineError>>;

    fn handle(&mut self, msg: Grow, _: &mut Context<Self>) -> Self::Result {
        let need = self.table.pages_needed(msg.tokens.len(), self.page_size);
        let pool = self.pool.clone();
        let allocate = async move {
            if need == 0 {
                return Ok(Vec::new());
            }
            Ok(pool.send(Allocate { num_pages: need }).await??)
        };
        AtomicResponse::new(Box::pin(allocate.into_actor(self).map(
            move |granted: Result<Vec<PageId>, EngineError>, act, _| {
                let pages = granted?;
                act.table
                    .push_granted(&pages, msg.tokens.len(), act.page_size);
                act.tokens.extend_from_slice(&msg.tokens);
                Ok(act.table.page_ids().to_vec())
            },
        )))
    }
}

/// Roll back to `len` positions (rejected drafts); emptied pages return to the pool.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Truncate {
    pub len: usize,
}

impl Handler<Truncate> for SessionActor {
    type Result = ();
    fn handle(&mut self, msg: Truncate, _: &mut Context<Self>) {
        debug_assert!(msg.len >= self.num_shared * self.page_size);
        let emptied = self.cut(msg.len);
        self.release_later(emptied);
    }
}

/// Give back every page (preemption: the turn recomputes later; or the end of a throwaway
/// session).
#[derive(Message)]
#[rtype(result = "()")]
pub struct ReleaseAll;

impl Handler<ReleaseAll> for SessionActor {
    type Result = ();
    fn handle(&mut self, _: ReleaseAll, _: &mut Context<Self>) {
        let all = self.cut(0);
        self.release_later(all);
    }
}

/// The turn is over; with `publish`, index its full pages in the prefix cache.
#[derive(Message)]
#[rtype(result = "()")]
pub struct EndTurn {
    pub publish: bool,
}

impl Handler<EndTurn> for SessionActor {
    type Result = ();
    fn handle(&mut self, msg: EndTurn, _: &mut Context<Self>) {
        self.turn_in_progress = false;
        self.last_used = Instant::now();
        let full = self.table.len() / self.page_size;
        if msg.publish && full > self.num_shared {
            self.pool.do_send(PublishPrefix {
                tokens: self.tokens[..full * self.page_size].to_vec(),
                page_ids: self.table.page_ids()[..full].to_vec(),
            });
            self.num_shared = full;
        }
    }
}

/// Release everything and stop, unless a turn is running (then reply `false`).
#[derive(Message)]
#[rtype(result = "bool")]
pub struct TryExpire;

impl Handler<TryExpire> for SessionActor {
    type Result = bool;
    fn handle(&mut self, _: TryExpire, ctx: &mut Context<Self>) -> bool {
        if self.turn_in_progress {
            return false;
        }
        // Release before replying, so that whoever waited for the expiry finds the pages back
        // in the pool (the pool's mailbox is FIFO).
        let all = self.cut(0);
        self.release_later(all);
        ctx.stop();
        true
    }
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SessionInfo {
    pub session_id: String,
    pub num_tokens: usize,
    pub num_pages: usize,
    pub turn_in_progress: bool,
    pub idle_s: u64,
}

#[derive(Message)]
#[rtype(result = "SessionInfo")]
pub struct GetSessionInfo;

impl Handler<GetSessionInfo> for SessionActor {
    type Result = MessageResult<GetSessionInfo>;
    fn handle(&mut self, _: GetSessionInfo, _: &mut Context<Self>) -> Self::Result {
        MessageResult(SessionInfo {
            session_id: self.session_id.clone(),
            num_tokens: self.tokens.len(),
            num_pages: self.table.page_ids().len(),
            turn_in_progress: self.turn_in_progress,
            idle_s: self.last_used.elapsed().as_secs(),
        })
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
