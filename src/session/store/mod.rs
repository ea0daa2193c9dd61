//! The session store: sessions' K/V pages and token histories on disk, so that a session
//! evicted from RAM or lost in a restart (an upgrade, an OOM kill, `kill -9`) resumes from its
//! pages instead of a cold prefill, and stored Responses so that `previous_response_id` still
//! resolves.
//!
//! A session's file (`format`) grows by one segment per finished turn: the session actor asks
//! the model worker to copy the turn's new pages out between two forwards ([`ExportPages`]),
//! and the store's writer thread encodes, appends and syncs them off every request's path.
//! Restoring reads the file on a blocking thread, checks it (checksums, model, K/V layout,
//! API-key scope and session id) and writes the pages straight into pool pages
//! ([`ImportPages`]). Anything that does not check out is skipped with a warning and the turn
//! recomputes: the store can make a turn faster, never wrong.
//!
//! Layout: `DIR/<model sha256, 16 hex>/<sha256(scope, id), 40 hex>.kv` (names derive from
//! hashes, so no client id can reach outside the directory) and `DIR/responses/<…>.json`. The
//! directory can be shared by replicas serving the same model.

pub mod format;
mod writer;

pub use format::KvLayout;

use super::registry::SessionKey;
use crate::kv::PageId;
use actix::prelude::*;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};
use writer::Job;

/// The bytes of whole pages as the K/V storage holds them, sent to `reply` (the model worker
/// answers). Sent with `try_send`, it is in the worker's queue before the session handles its
/// next message, so no later forward can change the pages before they are copied.
#[derive(Message)]
#[rtype(result = "()")]
pub struct ExportPages {
    pub page_ids: Vec<PageId>,
    pub reply: tokio::sync::oneshot::Sender<Vec<u8>>,
}

/// Writes pages read back from the store into pool pages the caller holds and no sequence
/// reads yet (the model worker answers).
#[derive(Message)]
#[rtype(result = "()")]
pub struct ImportPages {
    pub page_ids: Vec<PageId>,
    pub bytes: Vec<u8>,
}

/// Where the pages' bytes live: the model worker, reached by message.
#[derive(Clone)]
pub struct PageMover {
    pub export: Recipient<ExportPages>,
    pub import: Recipient<ImportPages>,
}

#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub dir: PathBuf,
    /// Files past this many bytes are evicted, oldest first.
    pub budget_bytes: u64,
    /// Stored responses older than this are not read back (the response store's TTL).
    pub response_ttl: Duration,
}

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct StoreMetrics {
    pub bytes_on_disk: AtomicU64,
    pub files_on_disk: AtomicU64,
    pub writes: AtomicU64,
    pub bytes_written: AtomicU64,
    pub write_errors: AtomicU64,
    pub restores: AtomicU64,
    pub restored_bytes: AtomicU64,
    pub restored_tokens: AtomicU64,
    pub restore_micros: AtomicU64,
    pub torn_files: AtomicU64,
    pub foreign_files: AtomicU64,
    pub evicted_files: AtomicU64,
    /// Turns not written because the writer was too far behind ([`MAX_QUEUED_BYTES`]).
    pub dropped_writes: AtomicU64,
}

/// Bytes of copied pages that may wait for the writer. Past it a finished turn is not written
/// (counted in `dropped_writes`; the session's next write rewrites its file): a disk slower
/// than the traffic costs persistence, never memory without bound.
pub const MAX_QUEUED_BYTES: u64 = 256 << 20;

/// A session read back and checked: its history and its pages, back to back.
#[derive(Debug)]
pub struct Restored {
    pub tokens: Vec<u32>,
    pub pages: Vec<u8>,
}

/// What the store must know of the model, computed once on first use (hashing a GGUF of a few
/// GiB takes seconds; q8's key scales need the calibration).
type LayoutFn = Box<dyn Fn() -> KvLayout + Send + Sync>;

pub struct SessionStore {
    dir: PathBuf,
    model_path: PathBuf,
    fingerprint: OnceLock<String>,
    layout_fn: LayoutFn,
    layout: OnceLock<KvLayout>,
    pub mover: PageMover,
    response_ttl: Duration,
    jobs: Mutex<mpsc::Sender<Job>>,
    pending: Mutex<usize>,
    drained: Condvar,
    /// Bytes of pages queued for the writer.
    queued_bytes: AtomicU64,
    /// Bytes written since the writer last listed the directory (responses included).
    unscanned_bytes: AtomicU64,
    /// Sessions whose last turn was dropped: their next write rewrites the file.
    needs_rewrite: Mutex<std::collections::HashSet<SessionKey>>,
    pub metrics: StoreMetrics,
}

impl SessionStore {
    /// Opens (creating) the directory and starts the writer thread.
    pub fn open(
        cfg: StoreConfig,
        model_path: PathBuf,
        layout_fn: LayoutFn,
        mover: PageMover,
    ) -> std::io::Result<Arc<Self>> {
        std::fs::create_dir_all(cfg.dir.join("responses"))?;
        let (tx, rx) = mpsc::channel();
        let store = Arc::new(Self {
            dir: cfg.dir.clone(),
            model_path,
            fingerprint: OnceLock::new(),
            layout_fn,
            layout: OnceLock::new(),
            mover,
            response_ttl: cfg.response_ttl,
            jobs: Mutex::new(tx),
            pending: Mutex::new(0),
            drained: Condvar::new(),
            queued_bytes: AtomicU64::new(0),
            unscanned_bytes: AtomicU64::new(0),
            needs_rewrite: Mutex::new(Default::default()),
            metrics: StoreMetrics::default(),
        });
        let weak = Arc::downgrade(&store);
        std::thread::Builder::new()
            .name("session-store".into())
            .spawn(move || writer::run(weak, rx, cfg.budget_bytes))?;
        Ok(store)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The model file's sha256 (cached beside the sessions by path, size and mtime).
    pub fn fingerprint(&self) -> &str {
        self.fingerprint
            .get_or_init(|| model_sha256(&self.model_path, &self.dir))
    }

    pub fn layout(&self) -> &KvLayout {
        self.layout.get_or_init(|| (self.layout_fn)())
    }

    fn session_dir(&self) -> PathBuf {
        self.dir.join(&self.fingerprint()[..16])
    }

    pub fn session_path(&self, key: &SessionKey) -> PathBuf {
        self.session_dir()
            .join(format!("{}.kv", scoped_name(&key.scope, &key.session_id)))
    }

    fn response_path(&self, scope: &str, id: &str) -> PathBuf {
        self.dir
            .join("responses")
            .join(format!("{}.json", scoped_name(scope, id)))
    }

    /// The size of `key`'s file, if it has one.
    pub fn file_len(&self, key: &SessionKey) -> Option<u64> {
        // Before the model's hash is known nothing was read or written.
        self.fingerprint.get()?;
        std::fs::metadata(self.session_path(key))
            .ok()
            .map(|m| m.len())
    }

    /// Reads `key`'s session back (blocking: call it off the actors' threads). A file that is
    /// torn, corrupt, for another model or layout, or for another scope is skipped with a
    /// warning; a torn tail is cut off so later appends continue what was read.
    pub fn load(&self, key: &SessionKey) -> Option<Restored> {
        let path = self.session_path(key);
        let started = Instant::now();
        let bytes = std::fs::read(&path).ok()?;
        let decoded = match format::decode(&bytes) {
            Ok(d) => d,
            Err(e) => {
                self.metrics.torn_files.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(path = %path.display(), "session file skipped: {e}");
                return None;
            }
        };
        let h = &decoded.header;
        let mismatch = if h.model_sha256 != self.fingerprint() {
            Some(format!("written for model {}", h.model_sha256))
        } else if h.kv != *self.layout() {
            Some(format!("written for another K/V layout ({:?})", h.kv))
        } else if h.scope != key.scope || h.session_id != key.session_id {
            Some("written for another session or API key".to_string())
        } else {
            None
        };
        if let Some(why) = mismatch {
            self.metrics.foreign_files.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(path = %path.display(), "session file skipped: {why}");
            return None;
        }
        if decoded.torn {
            self.metrics.torn_files.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                path = %path.display(),
                kept_tokens = decoded.tokens.len(),
                "session file's tail is torn or corrupt: restoring what precedes it"
            );
            if let Ok(f) = std::fs::OpenOptions::new().write(true).open(&path) {
                let _ = f.set_len(decoded.valid_bytes as u64);
            }
        }
        if decoded.tokens.is_empty() {
            return None;
        }
        let m = &self.metrics;
        m.restores.fetch_add(1, Ordering::Relaxed);
        m.restored_bytes
            .fetch_add(decoded.pages.len() as u64, Ordering::Relaxed);
        m.restored_tokens
            .fetch_add(decoded.tokens.len() as u64, Ordering::Relaxed);
        m.restore_micros
            .fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
        tracing::debug!(
            session_id = key.session_id,
            tokens = decoded.tokens.len(),
            bytes = decoded.pages.len(),
            ms = started.elapsed().as_secs_f64() * 1e3,
            "session read back from disk"
        );
        Some(Restored {
            tokens: decoded.tokens,
            pages: decoded.pages,
        })
    }

    /// Whether `key`'s file must be written whole (a turn of it was dropped, so appending would
    /// leave a gap); asking clears it.
    pub fn take_needs_rewrite(&self, key: &SessionKey) -> bool {
        self.needs_rewrite
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key)
    }

    /// A place in the writer's queue for a write whose pages are still being copied out:
    /// [`SessionStore::flush`] waits for it too.
    pub fn reserve(self: &Arc<Self>) -> SaveTicket {
        *self.pending.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        SaveTicket {
            store: Some(self.clone()),
        }
    }

    /// Writes a stored response's JSON (atomically, synced) on a blocking thread; resolves once
    /// it is on disk, so a client may continue the response on any replica sharing the
    /// directory the moment it sees it end. A failed write costs a warning: the response is
    /// still kept in this process's memory.
    pub fn save_response(
        self: &Arc<Self>,
        scope: &str,
        id: &str,
        json: Vec<u8>,
    ) -> impl std::future::Future<Output = ()> + 'static {
        let (store, path) = (self.clone(), self.response_path(scope, id));
        async move {
            let written = actix_rt::task::spawn_blocking(move || {
                let bytes = json.len() as u64;
                let result = writer::write_atomically(&path, &json);
                let m = &store.metrics;
                match &result {
                    Ok(()) => {
                        m.writes.fetch_add(1, Ordering::Relaxed);
                        m.bytes_written.fetch_add(bytes, Ordering::Relaxed);
                        store.unscanned_bytes.fetch_add(bytes, Ordering::Relaxed);
                    }
                    Err(_) => {
                        m.write_errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
                result
            })
            .await;
            match written {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!("a stored response could not be written: {e}"),
                Err(e) => tracing::warn!("a stored response could not be written: {e}"),
            }
        }
    }

    /// Removes a stored response's file at once (every replica sharing the directory stops
    /// finding it); whether there was one within the TTL.
    pub fn remove_response(&self, scope: &str, id: &str) -> bool {
        let Some(path) = self.fresh_response(scope, id) else {
            return false;
        };
        std::fs::remove_file(path).is_ok()
    }

    /// A stored response's JSON, if it was written within the TTL.
    pub fn load_response(&self, scope: &str, id: &str) -> Option<Vec<u8>> {
        std::fs::read(self.fresh_response(scope, id)?).ok()
    }

    /// The path of a stored response written within the TTL.
    fn fresh_response(&self, scope: &str, id: &str) -> Option<PathBuf> {
        let path = self.response_path(scope, id);
        let age = std::fs::metadata(&path)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| SystemTime::now().duration_since(t).ok())?;
        (age < self.response_ttl).then_some(path)
    }

    fn send_reserved(&self, job: Job) {
        let sent = self
            .jobs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(job);
        if sent.is_err() {
            self.job_done();
        }
    }

    fn job_done(&self) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        *pending = pending.saturating_sub(1);
        if *pending == 0 {
            self.drained.notify_all();
        }
    }

    /// Blocks until every queued write is on disk (graceful shutdown, tests).
    pub fn flush(&self) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        while *pending > 0 {
            pending = self
                .drained
                .wait(pending)
                .unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// A reserved write ([`SessionStore::reserve`]); dropped unused, it gives its place back.
pub struct SaveTicket {
    store: Option<Arc<SessionStore>>,
}

impl SaveTicket {
    /// Queues a finished turn's pages for writing: pages `first_page..` of `history`'s; with
    /// `first_page == 0` the file is written anew (atomically), otherwise they are appended.
    pub fn save(mut self, key: &SessionKey, first_page: usize, history: Vec<u32>, pages: Vec<u8>) {
        if let Some(store) = self.store.take() {
            let bytes = pages.len() as u64;
            let queued = store.queued_bytes.fetch_add(bytes, Ordering::Relaxed);
            if queued + bytes > MAX_QUEUED_BYTES {
                store.queued_bytes.fetch_sub(bytes, Ordering::Relaxed);
                store.metrics.dropped_writes.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    queued_mib = queued >> 20,
                    "session store: the writer is behind; this turn is not written"
                );
                store
                    .needs_rewrite
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(key.clone());
                store.job_done();
                return;
            }
            store.send_reserved(Job::Session {
                key: key.clone(),
                first_page,
                history,
                pages,
            });
        }
    }
}

impl Drop for SaveTicket {
    fn drop(&mut self) {
        if let Some(store) = self.store.take() {
            store.job_done();
        }
    }
}

/// A file name for `(scope, id)`: a hash, so a hostile id cannot name a path.
fn scoped_name(scope: &str, id: &str) -> String {
    let mut h = Sha256::new();
    h.update(scope.as_bytes());
    h.update([0]);
    h.update(id.as_bytes());
    hex::encode(h.finalize())[..40].to_string()
}

/// The sha256 of the model file, remembered in `dir` by its path, size and modification time
/// so a restart does not read gigabytes again.
fn model_sha256(path: &Path, dir: &Path) -> String {
    let meta = std::fs::metadata(path).ok();
    let stamp = meta.as_ref().map(|m| {
        let mtime = m
            .modified()
            .ok()
            .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        let canonical = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        scoped_name(
            &canonical.display().to_string(),
            &format!("{}:{mtime}", m.len()),
        )
    });
    let memo = stamp.map(|s| dir.join(format!(".model-{s}.sha256")));
    if let Some(known) = memo.as_ref().and_then(|m| std::fs::read_to_string(m).ok()) {
        if known.len() == 64 {
            return known;
        }
    }
    let digest = std::fs::File::open(path).and_then(|mut f| {
        let mut h = Sha256::new();
        std::io::copy(&mut f, &mut h)?;
        Ok(hex::encode(h.finalize()))
    });
    match digest {
        Ok(d) => {
            if let Some(m) = memo {
                let _ = writer::write_atomically(&m, d.as_bytes());
            }
            d
        }
        // Unreadable (a model built in memory by a test): nothing will match it but itself.
        Err(_) => hex::encode(Sha256::digest(path.display().to_string().as_bytes())),
    }
}
