//! Stored responses: what `previous_response_id` continues. Each entry keeps the whole
//! conversation as chat messages (inputs and outputs, without `instructions`), the id of the
//! conversation (which names the engine session holding its KV), and the final response object
//! for `GET /v1/responses/{id}`. Entries are scoped by API key: another key's id is unknown.
//!
//! The map is only touched in short, non-async critical sections (never across an `.await`).
//! Entries expire after a TTL (the session TTL in `serve`) and the oldest go first beyond a cap.

use super::types::ResponseObject;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A conversation's items, oldest first, as a chain that shares the earlier turns' items with
/// the stored responses it continues: each turn adds only its own (the previous response's
/// output and the new input), so a long session's stored responses take memory linear in its
/// length, not quadratic. A link outlives the response that made it (deleting a response does
/// not cut its continuations' chains).
#[derive(Debug, Default, Clone)]
pub struct ItemChain {
    earlier: Option<Arc<ItemChain>>,
    items: Vec<serde_json::Value>,
}

impl ItemChain {
    /// `items` after `earlier`'s.
    pub fn new(earlier: Option<Arc<ItemChain>>, items: Vec<serde_json::Value>) -> Self {
        Self { earlier, items }
    }

    /// Every item, oldest first.
    pub fn items(&self) -> Vec<&serde_json::Value> {
        let mut links = vec![self];
        while let Some(earlier) = links.last().and_then(|l| l.earlier.as_deref()) {
            links.push(earlier);
        }
        links.iter().rev().flat_map(|l| &l.items).collect()
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
    /// The conversation up to and including this response's output.
    pub messages: Arc<Vec<serde_json::Value>>,
    /// The items this response was generated from: earlier turns' inputs and outputs and this
    /// turn's input (`GET /v1/responses/{id}/input_items`).
    pub input_items: Arc<ItemChain>,
    pub response: Arc<ResponseObject>,
    stored_at: Instant,
}

pub struct ResponseStore {
    entries: Mutex<HashMap<String, StoredResponse>>,
    ttl: Duration,
    max_entries: usize,
}

impl ResponseStore {
    pub fn new(ttl: Duration, max_entries: usize) -> Self {
        Self {
            entries: Mutex::new(HashMap::new()),
            ttl,
            max_entries: max_entries.max(1),
        }
    }

    pub fn insert(
        &self,
        scope: &str,
        conversation_id: &str,
        messages: Vec<serde_json::Value>,
        input_items: ItemChain,
        response: ResponseObject,
    ) {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
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
                stored_at: Instant::now(),
            },
        );
    }

    /// The response `id` if it exists, has not expired and belongs to `scope`.
    pub fn get(&self, scope: &str, id: &str) -> Option<StoredResponse> {
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        entries
            .get(id)
            .filter(|e| e.scope == scope && e.stored_at.elapsed() < self.ttl)
            .cloned()
    }

    /// Deletes `id` when it belongs to `scope`; whether it did.
    pub fn remove(&self, scope: &str, id: &str) -> bool {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if entries.get(id).is_some_and(|e| e.scope == scope) {
            entries.remove(id);
            return true;
        }
        false
    }

    pub fn len(&self) -> usize {
        self.entries.lock().map(|e| e.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
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
}
