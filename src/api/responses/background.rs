//! Background responses (`background: true`): `POST /v1/responses` answers at once with the
//! response `in_progress`, the run goes on without the client, and `GET /v1/responses/{id}`
//! shows it until it ends (`completed`, `incomplete`, `failed` or `cancelled`);
//! `POST /v1/responses/{id}/cancel` stops it.
//!
//! While it runs, the store holds the response as created (so `GET` and `input_items` answer,
//! and a continuation is refused with a clear error rather than started from half a turn), and
//! [`BackgroundRuns`] holds what stops it and what tells its end. The run replaces the entry
//! with the final response, failed ones included (`run` stores those for background jobs), and
//! leaves the registry.
//!
//! Created with `stream: true` as well, a background response keeps its events ([`EventLog`]):
//! the creating request streams them, and a client that lost that stream (or never had it)
//! streams them again from any point with `GET /v1/responses/{id}?stream=true&starting_after=N`
//! ([`stream_stored`]), while the run goes on and after it has ended.

use super::event_log::{EndOnDrop, EventLog};
use super::store::{ItemChain, StoredResponse, EVENT_LOG_BUDGET};
use super::types::ResponseObject;
use super::{not_stored, run, sse_event, Job};
use crate::api::errors::ApiError;
use crate::api::AppState;
use crate::engine::EventStream;
use actix_web::web;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::{oneshot, watch};

/// What stops a running background response and tells when it has ended.
struct Running {
    scope: String,
    stop: Option<oneshot::Sender<()>>,
    ended: watch::Receiver<bool>,
}

/// The background responses still running, by id.
#[derive(Default)]
pub struct BackgroundRuns {
    runs: Mutex<HashMap<String, Running>>,
}

impl BackgroundRuns {
    /// Whether none is running.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// How many are running.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Running>> {
        self.runs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Asks the run `id` of `scope` to stop and waits for its end; whether one was running.
    pub async fn stop(&self, scope: &str, id: &str) -> bool {
        let mut ended = {
            let mut runs = self.lock();
            let Some(run) = runs.get_mut(id).filter(|r| r.scope == scope) else {
                return false;
            };
            if let Some(stop) = run.stop.take() {
                let _ = stop.send(());
            }
            run.ended.clone()
        };
        // (An error means the run's task is gone: it has ended too.)
        let _ = ended.wait_for(|&done| done).await;
        true
    }
}

/// Starts `job` (submitted as `events`) in the background; returns the response as created
/// and, when `streamed`, the log its events go to.
pub fn start(
    state: web::Data<AppState>,
    job: Job,
    events: EventStream,
    streamed: bool,
) -> (ResponseObject, Option<Arc<EventLog>>) {
    let created = job.created();
    // On disk before the run stores its end over it (the run waits for it).
    let created_on_disk = state.responses.insert(
        &job.scope,
        &job.conversation_id,
        ItemChain::default(),
        job.input_items.clone(),
        created.clone(),
    );
    let log = streamed.then(EventLog::new);
    if let Some(log) = &log {
        state.responses.attach_events(&job.id, log.clone());
    }
    let (stop, stopped) = oneshot::channel::<()>();
    let (ended_tx, ended) = watch::channel(false);
    state.background.lock().insert(
        job.id.clone(),
        Running {
            scope: job.scope.clone(),
            stop: Some(stop),
            ended,
        },
    );
    let task_log = log.clone();
    actix_rt::spawn(async move {
        let _end = task_log.clone().map(EndOnDrop);
        created_on_disk.await;
        let stop = async move {
            // A dropped sender is no request to stop.
            if stopped.await.is_err() {
                std::future::pending::<()>().await;
            }
        };
        let id = job.id.clone();
        run(job, events, state.clone(), stop, |e| {
            if let Some(log) = &task_log {
                log.push(sse_event(&e));
            }
            true
        })
        .await;
        state.background.lock().remove(&id);
        let _ = ended_tx.send(true);
    });
    (created, log)
}

/// The events of the stored background response `stored` after sequence number
/// `starting_after` (all without it), as they come until its run ends; errors name what
/// cannot be streamed.
pub fn stream_stored(
    stored: &StoredResponse,
    starting_after: Option<u64>,
) -> Result<impl futures::Stream<Item = actix_web::web::Bytes> + Unpin, ApiError> {
    let id = &stored.response.id;
    let Some(log) = stored.events.clone() else {
        let why = if stored.events_dropped {
            format!(
                "The events of response `{id}` are no longer kept (the server keeps the newest \
                 {} MiB of finished background streams).",
                EVENT_LOG_BUDGET >> 20
            )
        } else {
            let how = if stored.response.background {
                "was created without `stream: true`"
            } else {
                "was not created with `background: true`"
            };
            format!(
                "Response `{id}` {how}: only background responses created with `stream: true` \
                 can be streamed again."
            )
        };
        return Err(ApiError::invalid(
            Some("stream"),
            format!("{why} Read it with `GET /v1/responses/{id}` instead."),
        ));
    };
    let from = match starting_after {
        None => 0,
        Some(n) => {
            // (A client only knows sequence numbers it was sent, so one past the log's end,
            // running or not, is a mistake rather than a wait.)
            let (frames, ended) = log.state();
            let from = usize::try_from(n).unwrap_or(usize::MAX).saturating_add(1);
            if from > frames {
                let so_far = if ended { "" } else { " so far" };
                return Err(ApiError::invalid(
                    Some("starting_after"),
                    format!(
                        "Response `{id}` has events 0 to {}{so_far}: `starting_after` {n} is \
                         past its last one.",
                        frames.saturating_sub(1)
                    ),
                ));
            }
            from
        }
    };
    Ok(log.follow(from))
}

/// `POST /v1/responses/{id}/cancel`: stops a running background response and answers the
/// response as it ended; a background response that already ended is answered as it is.
pub async fn cancel(
    state: &AppState,
    scope: &str,
    id: &str,
) -> Result<Arc<ResponseObject>, ApiError> {
    state.background.stop(scope, id).await;
    let stored = state
        .responses
        .get(scope, id)
        .ok_or_else(|| not_stored(id))?;
    if !stored.response.background {
        return Err(ApiError::invalid(
            Some("response_id"),
            format!(
                "Response `{id}` was not created with `background: true`: only background \
                 responses can be cancelled."
            ),
        ));
    }
    Ok(stored.response)
}
