//! The events of a background response created with `stream: true`, kept with the stored
//! response so that the stream survives its client: the creating request streams them as they
//! come, and `GET /v1/responses/{id}?stream=true&starting_after=N` replays them from sequence
//! number `N + 1` (from the start without `starting_after`) and follows the run to its end,
//! however often the client reconnects. A response's events are numbered from 0 without gaps
//! (the builder's `sequence_number`), so event `n` is frame `n`.
//!
//! Frames are kept as the SSE bytes every reader sends: one serialisation per event, however
//! many readers. A log ends when its run does (also when the run's task panics: see
//! [`EndOnDrop`]); readers then finish once they have sent every frame.

use actix_web::web::Bytes;
use futures::Stream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

/// How far a log has come: frames written, and whether the run has ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Progress {
    frames: usize,
    ended: bool,
}

#[derive(Debug)]
pub struct EventLog {
    frames: Mutex<Vec<Bytes>>,
    bytes: AtomicUsize,
    progress: watch::Sender<Progress>,
}

impl EventLog {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            frames: Mutex::new(Vec::new()),
            bytes: AtomicUsize::new(0),
            progress: watch::Sender::new(Progress::default()),
        })
    }

    fn frames(&self) -> std::sync::MutexGuard<'_, Vec<Bytes>> {
        self.frames.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends the next event's frame and wakes the readers.
    pub fn push(&self, frame: Bytes) {
        self.bytes.fetch_add(frame.len(), Ordering::Relaxed);
        let frames = {
            let mut all = self.frames();
            all.push(frame);
            all.len()
        };
        self.progress.send_modify(|p| p.frames = frames);
    }

    /// Marks the run ended: readers finish after the last frame.
    pub fn end(&self) {
        self.progress.send_modify(|p| p.ended = true);
    }

    /// Bytes of the frames written so far.
    pub fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Frames written so far, and whether the run has ended.
    pub fn state(&self) -> (usize, bool) {
        let p = *self.progress.borrow();
        (p.frames, p.ended)
    }

    /// The frames from index `from` on: those written, then each as it comes, until the run
    /// has ended and every frame has been read.
    pub fn follow(self: Arc<Self>, from: usize) -> impl Stream<Item = Bytes> + Unpin {
        let progress = self.progress.subscribe();
        Box::pin(futures::stream::unfold(
            (self, progress, from),
            |(log, mut progress, next)| async move {
                loop {
                    let p = *progress.borrow_and_update();
                    if next < p.frames {
                        let frame = log.frames()[next].clone();
                        return Some((frame, (log, progress, next + 1)));
                    }
                    // (The sender lives in `log`, so `changed` fails only if it is gone.)
                    if p.ended || progress.changed().await.is_err() {
                        return None;
                    }
                }
            },
        ))
    }
}

/// Ends its log when dropped: a run's task holds one, so that readers finish even if the run
/// never returns normally.
pub struct EndOnDrop(pub Arc<EventLog>);

impl Drop for EndOnDrop {
    fn drop(&mut self) {
        self.0.end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    fn frame(n: usize) -> Bytes {
        Bytes::from(format!("event {n}"))
    }

    #[actix_rt::test]
    async fn readers_get_every_frame_from_where_they_start_to_the_end() {
        let log = EventLog::new();
        log.push(frame(0));
        log.push(frame(1));
        let from_start = actix_rt::spawn(log.clone().follow(0).collect::<Vec<_>>());
        let from_one = actix_rt::spawn(log.clone().follow(1).collect::<Vec<_>>());
        for n in 2..50 {
            log.push(frame(n));
            if n % 7 == 0 {
                actix_rt::task::yield_now().await;
            }
        }
        let guard = EndOnDrop(log.clone());
        drop(guard);
        assert_eq!(log.state(), (50, true));
        let all: Vec<Bytes> = (0..50).map(frame).collect();
        assert_eq!(from_start.await.unwrap(), all);
        assert_eq!(from_one.await.unwrap(), all[1..]);
        // After the end: a replay, and a start past the last frame (nothing).
        assert_eq!(log.clone().follow(48).collect::<Vec<_>>().await, all[48..]);
        assert!(log.clone().follow(50).collect::<Vec<_>>().await.is_empty());
    }
}
