//! The store's writer thread: encodes and writes what sessions and responses hand it, one job
//! at a time, off every request's path, and keeps the directory within its budget (oldest
//! files go first). A full disk costs a warning and the oldest files, never a request.

use super::format::{self, Header, Segment};
use super::SessionStore;
use crate::session::SessionKey;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Weak};
use std::time::{Duration, Instant, SystemTime};

pub(super) enum Job {
    /// A finished turn: pages `first_page..` of `history` (all of it when `first_page == 0`:
    /// the file is then written anew).
    Session {
        key: SessionKey,
        first_page: usize,
        history: Vec<u32>,
        pages: Vec<u8>,
    },
}

/// How often the writer lists the directory even while within budget: replicas sharing it
/// write too, and the listing costs a `stat` per file (tens of ms at thousands of files), so
/// it cannot run per write.
const RESCAN_EVERY: Duration = Duration::from_secs(30);

pub(super) fn run(store: Weak<SessionStore>, jobs: mpsc::Receiver<Job>, budget: u64) {
    yield_to_requests();
    // What every job needs: worked out now, before the first turn ends.
    let mut scanned = match store.upgrade() {
        Some(s) => {
            s.fingerprint();
            s.layout();
            enforce_budget(&s, budget, None)
        }
        None => return,
    };
    let mut scanned_at = Instant::now();
    // Fault injection for the tests: a slow disk (`MTPX_TEST_STORE_DELAY_MS` before each job).
    let delay = std::env::var("MTPX_TEST_STORE_DELAY_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map(std::time::Duration::from_millis);
    while let Ok(job) = jobs.recv() {
        let Some(store) = store.upgrade() else {
            return;
        };
        if let Some(delay) = delay {
            std::thread::sleep(delay);
        }
        let written = execute_with_room(&store, &job);
        let Job::Session { pages, .. } = &job;
        store
            .queued_bytes
            .fetch_sub(pages.len() as u64, Ordering::Relaxed);
        drop(job);
        // The directory is listed again when what was written since may have crossed the
        // budget, or now and then; otherwise its size is what the last listing found plus what
        // was written since (an overestimate: rewrites replace files).
        let just_written = written.as_ref().map_or(0, |(_, b)| *b);
        let unscanned = store
            .unscanned_bytes
            .fetch_add(just_written, Ordering::Relaxed)
            + just_written;
        if scanned + unscanned > budget || scanned_at.elapsed() >= RESCAN_EVERY {
            store.unscanned_bytes.store(0, Ordering::Relaxed);
            scanned = enforce_budget(&store, budget, written.as_ref().map(|(p, _)| p.as_path()));
            scanned_at = Instant::now();
        } else {
            let m = &store.metrics;
            m.bytes_on_disk
                .store(scanned + unscanned, Ordering::Relaxed);
        }
        // Counted once the directory is back within its budget: whoever waits for a write
        // finds the store settled.
        if let Some((_, bytes)) = written {
            let m = &store.metrics;
            m.writes.fetch_add(1, Ordering::Relaxed);
            m.bytes_written.fetch_add(bytes, Ordering::Relaxed);
        }
        store.job_done();
    }
}

/// Runs `job`; on a full disk evicts the oldest file and tries once more. Returns the path
/// and bytes written.
fn execute_with_room(store: &SessionStore, job: &Job) -> Option<(PathBuf, u64)> {
    let mut tried_room = false;
    loop {
        match execute(store, job) {
            Ok(Some(written)) => return Some(written),
            Ok(None) => return None,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && !tried_room => {
                tracing::warn!("session store: the disk is full; evicting the oldest file");
                tried_room = true;
                let files = inventory(store.dir());
                let oldest = files.first()?;
                remove(store, &oldest.path);
            }
            Err(e) => {
                store.metrics.write_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!("session store: a write failed (serving goes on): {e}");
                return None;
            }
        }
    }
}

/// Writes `job`; the path and bytes written, or `None` when there was nothing to do.
fn execute(store: &SessionStore, job: &Job) -> std::io::Result<Option<(PathBuf, u64)>> {
    match job {
        Job::Session {
            key,
            first_page,
            history,
            pages,
        } => {
            let path = store.session_path(key);
            let layout = store.layout();
            let from = first_page * layout.page_size;
            let segment = format::encode_segment(
                &Segment {
                    first_page: *first_page,
                    total_len: history.len(),
                    prefix_hash: format::prefix_hash(&history[..from]),
                    tokens: &history[from..],
                    pages,
                },
                layout.page_bytes,
            );
            if *first_page == 0 {
                let mut bytes = format::encode_header(&Header {
                    format: format::FORMAT_VERSION,
                    model_sha256: store.fingerprint().to_string(),
                    kv: layout.clone(),
                    scope: key.scope.clone(),
                    session_id: key.session_id.clone(),
                });
                bytes.extend_from_slice(&segment);
                write_atomically(&path, &bytes)?;
                return Ok(Some((path, bytes.len() as u64)));
            }
            // Appending continues a file this process read or wrote; one evicted meanwhile is
            // written whole by the session's next turn.
            let mut file = match std::fs::OpenOptions::new().append(true).open(&path) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(e),
            };
            file.write_all(&segment)?;
            file.sync_data()?;
            Ok(Some((path, segment.len() as u64)))
        }
    }
}

/// Writes `bytes` to a temporary file beside `path`, syncs it and renames it over `path`: a
/// crash leaves the old file or the new one, never a mix.
pub(super) fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let written = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_data()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

fn remove(store: &SessionStore, path: &Path) {
    if std::fs::remove_file(path).is_ok() {
        store.metrics.evicted_files.fetch_add(1, Ordering::Relaxed);
    }
}

struct StoredFile {
    path: PathBuf,
    bytes: u64,
    modified: SystemTime,
    is_session: bool,
}

/// The store's files (sessions of every model, responses), oldest first.
fn inventory(dir: &Path) -> Vec<StoredFile> {
    let mut files = Vec::new();
    let Ok(top) = std::fs::read_dir(dir) else {
        return files;
    };
    for sub in top.flatten().filter(|e| e.path().is_dir()) {
        let Ok(entries) = std::fs::read_dir(sub.path()) else {
            continue;
        };
        for e in entries.flatten() {
            let path = e.path();
            let ext = path.extension().and_then(|x| x.to_str()).unwrap_or("");
            if ext.starts_with("tmp") {
                remove_if_stale(&path);
                continue;
            }
            if ext != "kv" && ext != "json" {
                continue;
            }
            if let Ok(meta) = e.metadata() {
                files.push(StoredFile {
                    is_session: ext == "kv",
                    bytes: meta.len(),
                    modified: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                    path,
                });
            }
        }
    }
    files.sort_by_key(|f| f.modified);
    files
}

/// A temporary file (`write_atomically`) untouched for this long was left by a writer that
/// died between writing and renaming it (any replica sharing the directory): it is removed.
const STALE_TEMPORARY: Duration = Duration::from_secs(3600);

fn remove_if_stale(path: &Path) {
    let age = std::fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok());
    if age.is_some_and(|a| a >= STALE_TEMPORARY) && std::fs::remove_file(path).is_ok() {
        tracing::info!(path = %path.display(), "session store: removed a stale temporary file");
    }
}

/// Over `budget`, evicts the oldest files (never `keep`, the file just written) down to 90% of
/// it, so that a full store lists its directory once per tenth of its budget written, not on
/// every write; publishes what is on disk and returns its bytes.
fn enforce_budget(store: &SessionStore, budget: u64, keep: Option<&Path>) -> u64 {
    let files = inventory(store.dir());
    let mut total: u64 = files.iter().map(|f| f.bytes).sum();
    let mut sessions = files.iter().filter(|f| f.is_session).count() as u64;
    let (over, low_water) = (total > budget, budget - budget / 10);
    for f in &files {
        if !over || total <= low_water {
            break;
        }
        if Some(f.path.as_path()) == keep {
            continue;
        }
        tracing::info!(path = %f.path.display(), bytes = f.bytes, "session store over budget: evicted");
        remove(store, &f.path);
        total -= f.bytes;
        sessions -= f.is_session as u64;
    }
    let m = &store.metrics;
    m.bytes_on_disk.store(total, Ordering::Relaxed);
    m.files_on_disk.store(sessions, Ordering::Relaxed);
    total
}

/// Lowers this thread's CPU priority (nice 10): encoding and checksumming a turn's pages must
/// not take a core from the forward passes on a small machine.
fn yield_to_requests() {
    #[cfg(target_os = "linux")]
    // SAFETY: setpriority on this thread's id changes only this thread's scheduling priority.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 10);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listing_removes_only_stale_temporaries_and_lists_stored_files() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("0123456789abcdef");
        std::fs::create_dir_all(&sub).unwrap();
        let write = |name: &str, age: Duration| {
            let path = sub.join(name);
            let f = std::fs::File::create(&path).unwrap();
            f.set_modified(SystemTime::now() - age).unwrap();
            path
        };
        let stale = write("a.kv.tmp4242", STALE_TEMPORARY + Duration::from_secs(60));
        let fresh = write("b.kv.tmp4243", Duration::from_secs(5));
        let stored = write("c.kv", STALE_TEMPORARY * 2);
        let listed: Vec<PathBuf> = inventory(dir.path()).into_iter().map(|f| f.path).collect();
        assert_eq!(listed, [stored]);
        assert!(
            !stale.exists(),
            "a temporary file left for an hour is removed"
        );
        assert!(fresh.exists(), "one being written now is not");
    }
}
