//! A session: one conversation's token history and the page table that holds its K/V. Only
//! this actor changes them; pages come from and return to the page pool actor by message.
//!
//! Invariant: `tokens.len() == table.len()` — the history is exactly the positions whose K/V is
//! in the pages. The leading `num_shared` pages are also indexed by the prefix cache, so they
//! are never written again. A turn that diverges inside one of them, or whose prompt matches
//! the start of a cached page, still reuses those positions: copy-on-write. The session keeps a
//! reference on the source page and reports the positions as cached ([`PartialPage`]); the
//! next [`Grow`] takes the page for them with the step's others (so the scheduler's page
//! budget covers it) and hands the copy to the scheduler, which has the model worker run it
//! before the forward and then releases the source.

use super::registry::SessionKey;
use super::store::{ExportPages, ImportPages, SessionStore};
use crate::error::EngineError;
use crate::kv::pool_actor::{Allocate, LookupPrefix, PagePoolActor, PublishPrefix, Release};
use crate::kv::{PageCopy, PageId, PageTable};
use crate::tokenizer::common_prefix;
use actix::prelude::*;
use std::sync::Arc;
use std::time::Instant;

pub struct SessionActor {
    session_id: String,
    pool: Addr<PagePoolActor>,
    page_size: usize,
    tokens: Vec<u32>,
    table: PageTable,
    num_shared: usize,
    /// Reused positions past the last whole page, to be copied from a shared page.
    partial: Option<PartialPage>,
    turn_in_progress: bool,
    last_used: Instant,
    /// The disk tier, for a named session when the server has a store.
    disk: Option<OnDisk>,
}

/// A session's file in the store and how much of the history it holds.
struct OnDisk {
    store: Arc<SessionStore>,
    key: SessionKey,
    /// Whether the file was looked for (on the first turn).
    looked: bool,
    /// Leading positions of the history the file holds as they are now.
    len: usize,
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
            partial: None,
            turn_in_progress: false,
            last_used: Instant::now(),
            disk: None,
        }
    }

    /// Keeps the session in `store` under `key`: read back on its first turn, written after
    /// each.
    pub fn with_store(mut self, store: Arc<SessionStore>, key: SessionKey) -> Self {
        self.disk = Some(OnDisk {
            store,
            key,
            looked: false,
            len: 0,
        });
        self
    }

    /// Cuts history and pages back to `len` and returns the pages to release (the emptied
    /// ones, and the source of a copy not made).
    fn cut(&mut self, len: usize) -> Vec<PageId> {
        let mut emptied = self.table.cut(len, self.page_size);
        emptied.extend(self.partial.take().map(|p| p.src));
        self.tokens.truncate(self.table.len());
        self.num_shared = self.num_shared.min(self.table.page_ids().len());
        if let Some(disk) = &mut self.disk {
            disk.len = disk.len.min(self.tokens.len());
        }
        emptied
    }

    fn turn_start(&self) -> TurnStart {
        TurnStart {
            cached_tokens: self.table.len() + self.partial.as_ref().map_or(0, |p| p.tokens.len()),
            num_pages: self.table.page_ids().len(),
        }
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
    /// `false`: compute the whole prompt again (its rows' logits are wanted), keeping nothing.
    pub reuse: bool,
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
        match self.read_back(&msg) {
            None => AtomicResponse::new(self.begin(msg)),
            Some(restore) => AtomicResponse::new(Box::pin(restore.into_actor(self).then(
                move |restored, act, _| {
                    if let Some((tokens, pages)) = restored {
                        act.table.push_granted(&pages, tokens.len(), act.page_size);
                        if let Some(disk) = &mut act.disk {
                            disk.len = tokens.len();
                        }
                        act.tokens = tokens;
                    }
                    act.begin(msg)
                },
            ))),
        }
    }
}

impl SessionActor {
    /// On a named session's first turn, with nothing in memory: reads its file back into pool
    /// pages, as much of it as the prompt starts with. Resolves to the history and pages
    /// restored, or `None` (no file, one that does not check out, or no pages free: the turn
    /// then recomputes).
    fn read_back(
        &mut self,
        msg: &BeginTurn,
    ) -> Option<impl std::future::Future<Output = Option<(Vec<u32>, Vec<PageId>)>>> {
        let disk = self.disk.as_mut()?;
        if disk.looked || !self.tokens.is_empty() || !msg.reuse {
            return None;
        }
        disk.looked = true;
        let (store, key, pool) = (disk.store.clone(), disk.key.clone(), self.pool.clone());
        let limit = msg.prompt.len().saturating_sub(1);
        let prompt = msg.prompt.clone();
        let page_size = self.page_size;
        Some(async move {
            let started = Instant::now();
            let read = store.clone();
            let saved = actix_rt::task::spawn_blocking(move || read.load(&key))
                .await
                .ok()??;
            let read_ms = started.elapsed().as_secs_f64() * 1e3;
            let reuse = common_prefix(&saved.tokens, &prompt).min(limit);
            let num_pages = reuse.div_ceil(page_size);
            if num_pages == 0 {
                return None;
            }
            let pages = pool.send(Allocate { num_pages }).await.ok()?.ok()?;
            let mut bytes = saved.pages;
            bytes.truncate(num_pages * store.layout().page_bytes);
            let import = ImportPages {
                page_ids: pages.clone(),
                bytes,
            };
            if store.mover.import.send(import).await.is_err() {
                pool.do_send(Release { page_ids: pages });
                return None;
            }
            let mut tokens = saved.tokens;
            tokens.truncate(reuse);
            tracing::debug!(
                tokens = reuse,
                read_ms,
                total_ms = started.elapsed().as_secs_f64() * 1e3,
                "session restored into pool pages"
            );
            Some((tokens, pages))
        })
    }

    /// Starts the turn from what the session holds: keeps the longest common prefix with the
    /// prompt, or what the prefix cache holds of it when that is longer.
    fn begin(&mut self, msg: BeginTurn) -> ResponseActFuture<Self, Result<TurnStart, EngineError>> {
        // At least one prompt token is always computed: its logits start the reply.
        let limit = if msg.reuse {
            msg.prompt.len().saturating_sub(1)
        } else {
            0
        };
        let reuse = common_prefix(&self.tokens, &msg.prompt).min(limit);
        let page_size = self.page_size;
        if reuse < self.num_shared * page_size && !reuse.is_multiple_of(page_size) {
            // Diverging inside a shared page: keep it only as the source of a copy.
            let boundary = reuse - reuse % page_size;
            let tokens = self.tokens[boundary..reuse].to_vec();
            let mut emptied = self.cut(boundary);
            let src = emptied.remove(0); // the first emptied page is the one the copy reads
            self.release_later(emptied);
            self.partial = Some(PartialPage { src, tokens });
        } else {
            let emptied = self.cut(reuse);
            self.release_later(emptied);
        }
        // The prefix cache may hold more of the prompt than the session's own history does: a
        // session key a client also sends with side requests (a title, a sub-agent) holds what
        // the last of them left, while the turn itself was computed beside it. Within a page of
        // the prompt's end there is nothing more to find.
        if reuse + page_size > limit {
            return Box::pin(fut::ready(Ok(self.turn_start())));
        }
        let lookup = self.pool.send(LookupPrefix {
            tokens: msg.prompt[..limit].to_vec(),
        });
        Box::pin(lookup.into_actor(self).map(move |found, act, _| {
            let found = found??;
            let len = found.pages.len() * page_size;
            let found_len = len + found.partial.map_or(0, |p| p.len);
            if found_len <= act.turn_start().cached_tokens {
                // What the session keeps is as long: the cache's references go back.
                let mut unused = found.pages;
                unused.extend(found.partial.map(|p| p.page_id));
                act.release_later(unused);
                return Ok(act.turn_start());
            }
            let kept = act.cut(0);
            act.release_later(kept);
            act.table.push_granted(&found.pages, len, page_size);
            act.tokens.extend_from_slice(&msg.prompt[..len]);
            act.num_shared = found.pages.len();
            act.partial = found.partial.map(|p| PartialPage {
                src: p.page_id,
                tokens: msg.prompt[len..len + p.len].to_vec(),
            });
            Ok(act.turn_start())
        }))
    }
}

/// Positions reused from part of a shared page, not yet copied into a page of the session's.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PartialPage {
    /// Holds them; the session has a reference on it until the copy is handed out.
    src: PageId,
    tokens: Vec<u32>,
}

/// Make room for `tokens` (whose K/V the next step computes) and record them in the history.
/// Replies with the whole page table and the pending copies, or a typed refusal that changes
/// nothing.
#[derive(Message)]
#[rtype(result = "Result<Grown, EngineError>")]
pub struct Grow {
    pub tokens: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grown {
    pub page_ids: Vec<PageId>,
    /// Copies to run before the step's forward; after them, each source page's reference is
    /// the caller's to release.
    pub copies: Vec<PageCopy>,
}

impl Handler<Grow> for SessionActor {
    type Result = AtomicResponse<Self, Result<Grown, EngineError>>;

    fn handle(&mut self, msg: Grow, _: &mut Context<Self>) -> Self::Result {
        let partial_len = self.partial.as_ref().map_or(0, |p| p.tokens.len());
        let need = self
            .table
            .pages_needed(partial_len + msg.tokens.len(), self.page_size);
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
                // The table ends on a page boundary while a copy is pending, so the copied
                // positions go to the first new page.
                let copies = match act.partial.take() {
                    Some(p) => {
                        act.table.push_granted(&pages[..1], 0, act.page_size);
                        act.table.push_granted(&[], p.tokens.len(), act.page_size);
                        act.tokens.extend_from_slice(&p.tokens);
                        vec![PageCopy {
                            src: p.src,
                            dst: pages[0],
                            num_slots: p.tokens.len(),
                        }]
                    }
                    None => Vec::new(),
                };
                let rest = &pages[copies.len()..];
                act.table
                    .push_granted(rest, msg.tokens.len(), act.page_size);
                act.tokens.extend_from_slice(&msg.tokens);
                Ok(Grown {
                    page_ids: act.table.page_ids().to_vec(),
                    copies,
                })
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
    type Result = AtomicResponse<Self, ()>;
    /// Atomic only in the rare case that the model worker's queue is full: the copy-out of the
    /// turn's pages for the store must be queued before the next turn can change them.
    fn handle(&mut self, msg: EndTurn, _: &mut Context<Self>) -> Self::Result {
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
        let wait = if msg.publish {
            self.write_behind()
        } else {
            None
        };
        match wait {
            Some(queued) => AtomicResponse::new(Box::pin(queued.into_actor(self))),
            None => AtomicResponse::new(Box::pin(fut::ready(()))),
        }
    }
}

impl SessionActor {
    /// The store's copy of what the finished turn added: its pages from the first one the file
    /// does not hold as they are (all of them when the file is missing, or mostly pages that
    /// later segments replaced), copied out by the model worker and handed to the store's
    /// writer. Returns a future to wait for only when the copy could not be queued at once.
    fn write_behind(&mut self) -> Option<impl std::future::Future<Output = ()>> {
        let disk = self.disk.as_mut()?;
        let len = self.tokens.len();
        if len == 0 || disk.len == len {
            return None;
        }
        let num_pages = len.div_ceil(self.page_size);
        let page_bytes = disk.store.layout().page_bytes as u64;
        let live_bytes = num_pages as u64 * (page_bytes + 4);
        let first_page = match disk.store.file_len(&disk.key) {
            _ if disk.store.take_needs_rewrite(&disk.key) => 0,
            Some(file) if file <= 2 * live_bytes + (1 << 20) => disk.len / self.page_size,
            _ => 0,
        };
        let (reply, copied) = tokio::sync::oneshot::channel();
        let export = ExportPages {
            page_ids: self.table.page_ids()[first_page..num_pages].to_vec(),
            reply,
        };
        let (ticket, key, history) = (disk.store.reserve(), disk.key.clone(), self.tokens.clone());
        disk.len = len;
        let save = async move {
            match copied.await {
                Ok(pages) => ticket.save(&key, first_page, history, pages),
                Err(_) => tracing::warn!("session store: the model worker did not copy the pages"),
            }
        };
        match disk.store.mover.export.try_send(export) {
            Ok(()) => {
                actix_rt::spawn(save);
                None
            }
            Err(SendError::Full(export)) => {
                let queued = disk.store.mover.export.send(export);
                Some(async move {
                    let _ = queued.await;
                    save.await;
                })
            }
            Err(SendError::Closed(_)) => {
                disk.len = 0;
                None
            }
        }
    }
}

/// Replies once every message sent to the session before it is handled (its mailbox is FIFO):
/// the page releases and prefix publications those messages caused are then in the pool's
/// mailbox.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Flush;

impl Handler<Flush> for SessionActor {
    type Result = ();
    fn handle(&mut self, _: Flush, _: &mut Context<Self>) {}
}

/// The session's token history (the positions whose K/V it holds).
#[derive(Message)]
#[rtype(result = "Vec<u32>")]
pub struct History;

impl Handler<History> for SessionActor {
    type Result = MessageResult<History>;
    fn handle(&mut self, _: History, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.tokens.clone())
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
