//! The registry of named sessions: finds or starts a session's actor, expires idle sessions
//! after their TTL, and gives up the least recently used idle one under memory pressure.
//! Session ids are scoped by the API key that created them.

use super::actor::{GetSessionInfo, SessionActor, SessionInfo, TryExpire};
use super::store::SessionStore;
use crate::kv::pool_actor::PagePoolActor;
use actix::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A session's name: the id the client gave, within the scope of its API key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SessionKey {
    pub scope: String,
    pub session_id: String,
}

impl SessionKey {
    /// The key drafters keep this session's K/V under.
    pub fn draft_key(&self) -> String {
        format!("session/{}/{}", self.scope, self.session_id)
    }
}

/// A session expired or was evicted from memory: whoever keeps state for it (the drafters'
/// K/V) lets it go.
#[derive(Message)]
#[rtype(result = "()")]
pub struct SessionLeftMemory {
    pub draft_key: String,
}

struct Entry {
    addr: Addr<SessionActor>,
    last_used: Instant,
}

pub struct SessionRegistry {
    sessions: HashMap<SessionKey, Entry>,
    pool: Addr<PagePoolActor>,
    page_size: usize,
    ttl: Duration,
    /// Where sessions are written after each turn and read back from when not in memory.
    store: Option<Arc<SessionStore>>,
    /// The drafters keeping K/V per session (MTP heads, draft model): told when one goes.
    drafters: Vec<Recipient<SessionLeftMemory>>,
}

impl SessionRegistry {
    pub fn new(pool: Addr<PagePoolActor>, page_size: usize, ttl: Duration) -> Self {
        Self {
            sessions: HashMap::new(),
            pool,
            page_size,
            ttl,
            store: None,
            drafters: Vec::new(),
        }
    }

    /// Tells `drafters` when a session leaves memory, so its drafter K/V goes too.
    pub fn with_drafters(mut self, drafters: Vec<Recipient<SessionLeftMemory>>) -> Self {
        self.drafters = drafters;
        self
    }

    /// Forgets `key`: the map entry and its drafters' K/V.
    fn remove(&mut self, key: &SessionKey) -> bool {
        for d in &self.drafters {
            d.do_send(SessionLeftMemory {
                draft_key: key.draft_key(),
            });
        }
        self.sessions.remove(key).is_some()
    }

    /// Sessions kept in `store` too: an expired or evicted session, or one from before a
    /// restart, resumes from its pages there.
    pub fn with_store(mut self, store: Option<Arc<SessionStore>>) -> Self {
        self.store = store;
        self
    }

    fn start_session(&self, key: &SessionKey) -> Addr<SessionActor> {
        let session = SessionActor::new(key.session_id.clone(), self.pool.clone(), self.page_size);
        match &self.store {
            Some(store) => session.with_store(store.clone(), key.clone()),
            None => session,
        }
        .start()
    }

    fn expire(&mut self, key: SessionKey, ctx: &mut Context<Self>) {
        let Some(entry) = self.sessions.get(&key) else {
            return;
        };
        let addr = entry.addr.clone();
        addr.send(TryExpire)
            .into_actor(self)
            .map(move |expired, act, _| {
                if expired.unwrap_or(true) {
                    act.remove(&key);
                }
            })
            .wait(ctx);
    }
}

impl Actor for SessionRegistry {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let every = (self.ttl / 4).clamp(Duration::from_millis(50), Duration::from_secs(60));
        ctx.run_interval(every, |act, ctx| {
            let now = Instant::now();
            let stale: Vec<SessionKey> = act
                .sessions
                .iter()
                .filter(|(_, e)| now.duration_since(e.last_used) >= act.ttl)
                .map(|(k, _)| k.clone())
                .collect();
            for key in stale {
                act.expire(key, ctx);
            }
        });
    }
}

/// The session named `key`, started if new.
#[derive(Message)]
#[rtype(result = "Addr<SessionActor>")]
pub struct GetOrCreate {
    pub key: SessionKey,
}

impl Handler<GetOrCreate> for SessionRegistry {
    type Result = MessageResult<GetOrCreate>;
    fn handle(&mut self, msg: GetOrCreate, _: &mut Context<Self>) -> Self::Result {
        let started = match self.sessions.get(&msg.key) {
            Some(e) if e.addr.connected() => None,
            _ => Some(self.start_session(&msg.key)),
        };
        let entry = self.sessions.entry(msg.key).or_insert_with(|| Entry {
            addr: started.clone().expect("started above"),
            last_used: Instant::now(),
        });
        if let Some(addr) = started {
            entry.addr = addr;
        }
        entry.last_used = Instant::now();
        MessageResult(entry.addr.clone())
    }
}

/// Expire the least recently used session that is idle (memory pressure); replies whether
/// one was. Sessions with a turn running are passed over, so an old busy session does not
/// shield the idle ones behind it.
#[derive(Message)]
#[rtype(result = "bool")]
pub struct EvictLeastRecentlyUsed;

impl Handler<EvictLeastRecentlyUsed> for SessionRegistry {
    type Result = AtomicResponse<Self, bool>;
    /// Atomic: no session is handed out while it may be expiring.
    fn handle(&mut self, _: EvictLeastRecentlyUsed, _: &mut Context<Self>) -> Self::Result {
        let mut by_age: Vec<(Instant, SessionKey, Addr<SessionActor>)> = self
            .sessions
            .iter()
            .map(|(k, e)| (e.last_used, k.clone(), e.addr.clone()))
            .collect();
        by_age.sort_by_key(|(last_used, _, _)| *last_used);
        let first_expired = async move {
            for (_, key, addr) in by_age {
                if addr.send(TryExpire).await.unwrap_or(true) {
                    return Some(key);
                }
            }
            None
        };
        AtomicResponse::new(Box::pin(first_expired.into_actor(self).map(
            |expired, act, _| match expired {
                Some(key) => act.remove(&key),
                None => false,
            },
        )))
    }
}

/// Expire every idle session now (tests and shutdown: "caches cleared").
#[derive(Message)]
#[rtype(result = "()")]
pub struct ExpireAll;

impl Handler<ExpireAll> for SessionRegistry {
    type Result = ResponseActFuture<Self, ()>;
    /// Replies once every idle session has released its pages.
    fn handle(&mut self, _: ExpireAll, _: &mut Context<Self>) -> Self::Result {
        let sessions: Vec<(SessionKey, Addr<SessionActor>)> = self
            .sessions
            .iter()
            .map(|(k, e)| (k.clone(), e.addr.clone()))
            .collect();
        let expiries =
            futures::future::join_all(sessions.into_iter().map(|(key, addr)| async move {
                (key, addr.send(TryExpire).await.unwrap_or(true))
            }));
        Box::pin(expiries.into_actor(self).map(|results, act, _| {
            for (key, expired) in results {
                if expired {
                    act.remove(&key);
                }
            }
        }))
    }
}

#[derive(Message)]
#[rtype(result = "Vec<SessionInfo>")]
pub struct ListSessions;

impl Handler<ListSessions> for SessionRegistry {
    type Result = ResponseFuture<Vec<SessionInfo>>;
    fn handle(&mut self, _: ListSessions, _: &mut Context<Self>) -> Self::Result {
        let addrs: Vec<_> = self.sessions.values().map(|e| e.addr.clone()).collect();
        Box::pin(async move {
            let mut out = Vec::new();
            for addr in addrs {
                if let Ok(info) = addr.send(GetSessionInfo).await {
                    out.push(info);
                }
            }
            out.sort_by(|a, b| a.session_id.cmp(&b.session_id));
            out
        })
    }
}
