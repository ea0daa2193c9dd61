//! Stored responses: what `previous_response_id` continues. Each entry keeps the whole
//! conversation as chat messages (inputs and outputs, without `instructions`) and as Responses
//! items, both as [`ItemChain`]s that share the earlier turns with the responses they continue,
//! the id of the conversation (which names the engine session holding its KV), and the final
//! response object for `GET /v1/responses/{id}` (with, for a background stream, its events:
//! [`EventLog`], within [`EVENT_LOG_BUDGET`]). Entries are scoped by API key: another key's id
//! is unknown.
//!
//! The map is only touched in short, non-async critical sections (never across an `.await`).
//! Entries expire after a TTL (the session TTL in `serve`) and the oldest go first beyond a cap.

use super::event_log::EventLog;
use super::types::ResponseObject;
use crate::session::SessionStore;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// A conversation's items (or chat messages), oldest first, as a chain that shares the earlier
/// turns with the stored responses it continues: each turn adds a link holding only what it
/// changed, so a long session's stored responses take memory linear in its length, not
/// quadratic. A link outlives the response that made it (deleting a response does not cut its
/// continuations' chains).
#[derive(Debug, Default, Clone)]
pub struct ItemChain {
    earlier: Option<Arc<ItemChain>>,
    /// How many of the earlier chain's last items this link's `items` replace (a tool call
    /// joining the assistant message it follows rewrites that message).
    replaces: usize,
    items: Vec<serde_json::Value>,
}

impl ItemChain {
    /// `items` after `earlier`'s.
    pub fn new(earlier: Option<Arc<ItemChain>>, items: Vec<serde_json::Value>) -> Self {
        Self {
            earlier,
            replaces: 0,
            items,
        }
    }

    /// The chain whose items are `whole`, sharing with `earlier` the items both start with.
    pub fn extending(earlier: Option<Arc<ItemChain>>, mut whole: Vec<serde_json::Value>) -> Self {
        let Some(earlier) = earlier else {
            return Self::new(None, whole);
        };
        let shared = earlier.items();
        let common = shared
            .iter()
            .zip(&whole)
            .take_while(|(a, b)| **a == *b)
            .count();
        Self {
            replaces: shared.len() - common,
            items: whole.split_off(common),
            earlier: Some(earlier),
        }
    }

    /// Every item, oldest first.
    pub fn items(&self) -> Vec<&serde_json::Value> {
        let mut links = vec![self];
        while let Some(earlier) = links.last().and_then(|l| l.earlier.as_deref()) {
            links.push(earlier);
        }
        let mut items = Vec::new();
        for link in links.iter().rev() {
            items.truncate(items.len().saturating_sub(link.replaces));
            items.extend(&link.items);
        }
        items
    }
}

impl Drop for ItemChain {
    /// Unlinks iteratively: dropping a chain of thousands of turns must not recurse that deep.
    fn drop(&mut self) {
        let mut earlier = self.earlier.take();
        while let Some(link) = earlier {
            earlier = match Arc::try_unwrap(link) {
                Ok(mut link) => link.earlier.take(),
                Err(_) => None,
            };
        }
    }
}

#[derive(Debug, Clone)]
pub struct StoredResponse {
    pub scope: String,
    pub conversation_id: String,
    /// The conversation as chat messages, up to and including this response's output.
    pub messages: Arc<ItemChain>,
    /// The items this response was generated from: earlier turns' inputs and outputs and this
    /// turn's input (`GET /v1/responses/{id}/input_items`).
    pub input_items: Arc<ItemChain>,
    pub response: Arc<ResponseObject>,
    /// The events of a background response created with `stream: true` ([`EventLog`]), until
    /// they are dropped for [`EVENT_LOG_BUDGET`] (`events_dropped` then).
    pub events: Option<Arc<EventLog>>,
    pub events_dropped: bool,
    stored_at: Instant,
}

/// Bytes of finished background streams' events kept for streaming again (each generated
/// token's delta event is a few hundred bytes of SSE): past it the oldest finished logs are
/// dropped, and their responses are read with a plain `GET` only. Runs still going keep theirs.
pub const EVENT_LOG_BUDGET: usize = 256 << 20;

pub struct ResponseStore {
    entries: Mutex<HashMap<String, StoredResponse>>,
    ttl: Duration,
    max_entries: usize,
    event_log_budget: usize,
    /// Where stored responses are also written, so `previous_response_id` outlives a restart
    /// and resolves on any replica sharing the directory (events of background streams are
    /// not kept there).
    disk: OnceLock<Arc<SessionStore>>,
}

/// A stored response as written to disk: the chains flattened.
#[derive(serde::Serialize, serde::Deserialize)]
struct OnDisk<V> {
    scope: String,
    conversation_id: String,
    messages: Vec<V>,
    input_items: Vec<V>,
    response: ResponseObject,
}

impl ResponseStore {
    pub fn new(ttl: Duration, max_entries: usize) -> Self {
        Self {
            entries: Mutex::new(HashMap::new()),
            ttl,
            max_entries: max_entries.max(1),
            event_log_budget: EVENT_LOG_BUDGET,
            disk: OnceLock::new(),
        }
    }

    /// Writes stored responses to `store` too, and reads back from it those not in memory.
    pub fn keep_on_disk(&self, store: Arc<SessionStore>) {
        let _ = self.disk.set(store);
    }

    /// A store keeping at most `bytes` of finished event logs (tests).
    pub fn with_event_log_budget(mut self, bytes: usize) -> Self {
        self.event_log_budget = bytes;
        self
    }

    /// Stores `response` under its id, in memory at once; the returned future resolves once it
    /// is on disk too (at once without a session store). An entry it replaces (a background
    /// response's, as created, replaced by its end) passes on its event log.
    #[must_use = "await it before the client may continue the response on another replica"]
    pub fn insert(
        &self,
        scope: &str,
        conversation_id: &str,
        messages: ItemChain,
        input_items: ItemChain,
        response: ResponseObject,
    ) -> impl std::future::Future<Output = ()> + 'static {
        let persisted = self.disk.get().and_then(|disk| {
            let on_disk = OnDisk {
                scope: scope.to_string(),
                conversation_id: conversation_id.to_string(),
                messages: messages.items(),
                input_items: input_items.items(),
                response: response.clone(),
            };
            match serde_json::to_vec(&on_disk) {
                Ok(json) => Some(disk.save_response(scope, &response.id, json)),
                Err(e) => {
                    tracing::warn!("a stored response could not be written: {e}");
                    None
                }
            }
        });
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let (events, events_dropped) = entries
            .get(&response.id)
            .map_or((None, false), |e| (e.events.clone(), e.events_dropped));
        let ttl = self.ttl;
        entries.retain(|_, e| e.stored_at.elapsed() < ttl);
        while entries.len() >= self.max_entries {
            let Some(oldest) = entries
                .iter()
                .min_by_key(|(_, e)| e.stored_at)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            entries.remove(&oldest);
        }
        entries.insert(
            response.id.clone(),
            StoredResponse {
                scope: scope.to_string(),
                conversation_id: conversation_id.to_string(),
                messages: Arc::new(messages),
                input_items: Arc::new(input_items),
                response: Arc::new(response),
                events,
                events_dropped,
                stored_at: Instant::now(),
            },
        );
        drop_oldest_event_logs(&mut entries, self.event_log_budget);
        async move {
            if let Some(persisted) = persisted {
                persisted.await;
            }
        }
    }

    /// The response `id` if it exists, has not expired and belongs to `scope`.
    pub fn get(&self, scope: &str, id: &str) -> Option<StoredResponse> {
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let found = entries
            .get(id)
            .filter(|e| e.scope == scope && e.stored_at.elapsed() < self.ttl)
            .cloned();
        drop(entries);
        found.or_else(|| self.read_back(scope, id))
    }

    /// A response from before a restart (or another replica's), from disk; kept in memory
    /// again once read.
    fn read_back(&self, scope: &str, id: &str) -> Option<StoredResponse> {
        let json = self.disk.get()?.load_response(scope, id)?;
        let on_disk: OnDisk<serde_json::Value> = match serde_json::from_slice(&json) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(id, "a stored response on disk is unreadable: {e}");
                return None;
            }
        };
        if on_disk.scope != scope || on_disk.response.id != id {
            return None;
        }
        let stored = StoredResponse {
            scope: on_disk.scope,
            conversation_id: on_disk.conversation_id,
            messages: Arc::new(ItemChain::new(None, on_disk.messages)),
            input_items: Arc::new(ItemChain::new(None, on_disk.input_items)),
            response: Arc::new(on_disk.response),
            events: None,
            events_dropped: true,
            stored_at: Instant::now(),
        };
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        entries.insert(id.to_string(), stored.clone());
        Some(stored)
    }

    /// Keeps `events` with the stored response `id`.
    pub fn attach_events(&self, id: &str, events: Arc<EventLog>) {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = entries.get_mut(id) {
            entry.events = Some(events);
        }
    }

    /// Deletes `id` when it belongs to `scope`; whether it did.
    pub fn remove(&self, scope: &str, id: &str) -> bool {
        let on_disk = self
            .disk
            .get()
            .is_some_and(|d| d.remove_response(scope, id));
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if entries.get(id).is_some_and(|e| e.scope == scope) {
            entries.remove(id);
            return true;
        }
        on_disk
    }

    pub fn len(&self) -> usize {
        self.entries.lock().map(|e| e.len()).unwrap_or(0)
    }

    /// Bytes of the event logs kept (finished and running).
    pub fn event_log_bytes(&self) -> usize {
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        total_log_bytes(&entries)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn total_log_bytes(entries: &HashMap<String, StoredResponse>) -> usize {
    entries
        .values()
        .filter_map(|e| e.events.as_ref())
        .map(|log| log.bytes())
        .sum()
}

/// Drops the oldest finished event logs until all logs together fit in `budget` bytes.
fn drop_oldest_event_logs(entries: &mut HashMap<String, StoredResponse>, budget: usize) {
    let mut total = total_log_bytes(entries);
    if total <= budget {
        return;
    }
    let mut finished: Vec<(Instant, String)> = entries
        .iter()
        .filter(|(_, e)| e.events.as_ref().is_some_and(|log| log.state().1))
        .map(|(id, e)| (e.stored_at, id.clone()))
        .collect();
    finished.sort();
    for (_, id) in finished {
        if total <= budget {
            break;
        }
        let entry = entries.get_mut(&id).expect("listed above");
        if let Some(log) = entry.events.take() {
            total -= log.bytes();
            entry.events_dropped = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_chain_lists_its_links_oldest_first_and_outlives_deleted_links() {
        let first = Arc::new(ItemChain::new(None, vec![json!(1), json!(2)]));
        let second = Arc::new(ItemChain::new(Some(first.clone()), vec![json!(3)]));
        let branch = ItemChain::new(Some(first.clone()), vec![json!(4)]);
        drop(first);
        assert_eq!(second.items(), [&json!(1), &json!(2), &json!(3)]);
        assert_eq!(branch.items(), [&json!(1), &json!(2), &json!(4)]);
        // A very long chain drops without deep recursion.
        let mut long = Arc::new(ItemChain::default());
        for i in 0..200_000 {
            long = Arc::new(ItemChain::new(Some(long), vec![json!(i)]));
        }
        assert_eq!(long.items().len(), 200_000);
        drop(long);
    }

    #[test]
    fn an_extending_link_keeps_only_what_changed() {
        let first = Arc::new(ItemChain::extending(None, vec![json!("a"), json!("b")]));
        let same_start = ItemChain::extending(
            Some(first.clone()),
            vec![json!("a"), json!("b"), json!("c")],
        );
        assert_eq!((same_start.replaces, same_start.items.len()), (0, 1));
        assert_eq!(same_start.items(), [&json!("a"), &json!("b"), &json!("c")]);
        // The last message rewritten (a tool call joined it), then one more.
        let rewritten = Arc::new(ItemChain::extending(
            Some(first.clone()),
            vec![json!("a"), json!("b2"), json!("c")],
        ));
        assert_eq!((rewritten.replaces, rewritten.items.len()), (1, 2));
        assert_eq!(rewritten.items(), [&json!("a"), &json!("b2"), &json!("c")]);
        let next = ItemChain::extending(
            Some(rewritten),
            vec![json!("a"), json!("b2"), json!("c"), json!("d")],
        );
        assert_eq!(
            next.items(),
            [&json!("a"), &json!("b2"), &json!("c"), &json!("d")]
        );
        assert_eq!(
            first.items(),
            [&json!("a"), &json!("b")],
            "the earlier chain unchanged"
        );
    }

    fn stored(id: &str) -> ResponseObject {
        serde_json::from_value(json!({
            "id": id, "object": "response", "created_at": 0, "status": "completed",
            "model": "m", "output": [], "parallel_tool_calls": true, "store": true,
            "tool_choice": "auto", "tools": [], "truncation": "disabled", "metadata": {},
            "text": {},
        }))
        .unwrap()
    }

    fn put(store: &ResponseStore, id: &str) {
        let empty = ItemChain::default;
        let _in_memory_at_once = store.insert("k", "c", empty(), empty(), stored(id));
    }

    #[test]
    fn the_oldest_finished_event_logs_go_first_beyond_the_budget() {
        let store = ResponseStore::new(Duration::from_secs(60), 100).with_event_log_budget(250);
        let log_of = |id: &str, bytes: usize, ended: bool| {
            put(&store, id);
            let log = EventLog::new();
            log.push(vec![b'x'; bytes].into());
            if ended {
                log.end();
            }
            store.attach_events(id, log.clone());
            log
        };
        log_of("old", 100, true);
        let running = log_of("running", 100, false);
        log_of("new", 100, true);
        // Storing anything enforces the budget: 300 bytes, the oldest finished one goes.
        put(&store, "plain");
        let old = store.get("k", "old").unwrap();
        assert!(old.events.is_none() && old.events_dropped);
        assert!(store.get("k", "running").unwrap().events.is_some());
        assert!(store.get("k", "new").unwrap().events.is_some());
        // A run going on keeps its log even past the budget.
        running.push(vec![b'x'; 500].into());
        put(&store, "plain2");
        assert!(store.get("k", "running").unwrap().events.is_some());
        assert!(store.get("k", "new").unwrap().events_dropped);
        // Its end stores it again: it keeps its log, then drops it as the oldest finished.
        running.end();
        put(&store, "running");
        let ran = store.get("k", "running").unwrap();
        assert!(ran.events.is_none() && ran.events_dropped);
    }
}
