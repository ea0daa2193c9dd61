//! The Responses API: `POST /v1/responses` (streamed as SSE, answered when done, or run in the
//! [`background`]), `GET` / `DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`, `GET
//! /v1/responses/{id}/input_items` ([`input_items`]), and what the WebSocket mode
//! ([`super::ws`]) shares with them.
//!
//! A request becomes a [`Job`] ([`prepare`]): the stored conversation of `previous_response_id`
//! (unknown or another key's → 400, never a silent restart) plus the new input items, rendered
//! with `instructions` through the chat template. A stored conversation is bound to an engine
//! session named after it, so a continuation re-renders the whole conversation and the session
//! reuses the KV up to the first differing token: only the new items are prefilled. [`run`]
//! drives the engine's events through the [`builder::Builder`] and emits the standard events to
//! whoever streams them (SSE, a WebSocket, or nobody for a plain JSON answer).

pub mod background;
pub mod builder;
pub mod event_log;
pub mod input_items;
pub mod items;
pub mod store;
pub mod tools;
pub mod types;

use super::auth::Authorized;
use super::disconnect::Peer;
use super::errors::{from_value, read_json_object, ApiError};
use super::generate::{self, Plan};
use super::metrics::TokenClock;
use super::tool_calls::ToolCallParser;
use super::tool_grammar;
use super::types::{ErrorResponse, GenerationParams};
use super::{sse, AppState};
use crate::engine::{Engine, EngineEvent, EventStream, Prompt};
use crate::sampling::OutputFormat;
use crate::scheduler::FinishReason;
use crate::session::SessionKey;
use actix_web::web::Bytes;
use actix_web::{web, HttpRequest, HttpResponse};
use builder::{assistant_message, new_item_id, Builder, Ending};
use serde_json::{json, Value};
use std::future::Future;
use std::sync::Arc;
use store::ItemChain;
use tools::{ToolMode, ToolNamespaces};
use types::{ResponseEvent, ResponseObject, ResponsesRequest};

/// A validated request, ready to submit.
#[derive(Debug, Clone)]
pub struct Job {
    pub id: String,
    pub scope: String,
    /// Names the engine session (and is inherited by continuations).
    pub conversation_id: String,
    /// The conversation so far (stored messages and the new input), without `instructions`.
    pub history: Vec<Value>,
    /// The stored messages `history` continues (shared by the stored response, see
    /// [`ItemChain`]).
    pub earlier_messages: Option<Arc<ItemChain>>,
    /// The same as Responses items (what `input_items` lists).
    pub input_items: ItemChain,
    pub plan: Plan,
    pub parse_tools: bool,
    /// `tool_choice: "none"` with tools: rendered, but no call may be written (see
    /// [`Plan::ban_tool_calls`]); done at submission.
    pub ban_tool_calls: bool,
    pub single_call: bool,
    pub tool_names: Vec<String>,
    /// Which offered tool names are a namespace's functions.
    pub namespaces: ToolNamespaces,
    pub store: bool,
    /// The response object as created.
    pub template: ResponseObject,
}

impl Job {
    /// The response object as created (naming its conversation when stored).
    pub fn created(&self) -> ResponseObject {
        let mut created = self.template.clone();
        if self.store {
            created.conversation = Some(json!({ "id": self.conversation_id }));
        }
        created
    }
}

fn session_of(scope: &str, conversation_id: &str) -> SessionKey {
    SessionKey {
        scope: scope.to_string(),
        session_id: format!("responses/{conversation_id}"),
    }
}

/// (name, parameters) of chat-shaped tools, as the tool grammars take them.
fn grammar_tools(tools: &[Value]) -> Vec<(&str, Option<&Value>)> {
    tools
        .iter()
        .filter_map(|t| {
            let name = t.pointer("/function/name").and_then(Value::as_str)?;
            Some((name, t.pointer("/function/parameters")))
        })
        .collect()
}

/// The grammars a call follows once the model opens one (`tool_choice: "auto"`).
fn lazy_calls(tools: &[Value], parallel: bool) -> tool_grammar::LazyCalls {
    tool_grammar::lazy_calls(&grammar_tools(tools), parallel)
}

/// The grammar of the reply when `tool_choice` forces calls (see `tool_grammar`).
fn forced_calls(tools: &[Value], mode: &ToolMode, parallel: bool) -> Option<String> {
    let named = match mode {
        ToolMode::Required => None,
        ToolMode::Named(name) => Some(name.as_str()),
        ToolMode::Auto | ToolMode::None => return None,
    };
    let tools = grammar_tools(tools);
    Some(tool_grammar::forced_calls(
        &tools,
        named,
        parallel,
        tool_grammar::Start::Empty,
    ))
}

/// `text.format`: like chat's `response_format`, with the schema's fields in the format itself.
fn text_format(format: Option<&Value>) -> Result<Option<OutputFormat>, ApiError> {
    match format.filter(|f| !f.is_null()) {
        Some(f) if f.get("type").and_then(Value::as_str) == Some("json_schema") => {
            generate::schema_format(f.get("schema"), "text.format.schema")
        }
        other => generate::output_format(other).map_err(|mut e| {
            e.param = e
                .param
                .take()
                .map(|p| p.replace("response_format", "text.format"));
            e.message = e.message.replace("response_format", "text.format");
            e
        }),
    }
}

fn unknown_previous(id: &str) -> ApiError {
    ApiError::invalid(
        Some("previous_response_id"),
        format!(
            "Previous response with id `{id}` not found (it may have expired, not been stored, \
             or belong to another API key)."
        ),
    )
    .with_code("previous_response_not_found")
}

/// A background response still running, or one that failed, cannot be continued: its
/// conversation has no last turn yet (or never will).
fn unfinished_previous(id: &str, status: &str) -> Result<(), ApiError> {
    let message = match status {
        "in_progress" | "queued" => format!(
            "Previous response `{id}` is still in progress: continue it once it has ended \
             (poll `GET /v1/responses/{id}`)."
        ),
        "failed" => format!("Previous response `{id}` failed: it has no output to continue from."),
        _ => return Ok(()),
    };
    Err(ApiError::invalid(Some("previous_response_id"), message)
        .with_code("previous_response_not_completed"))
}

/// The engine session of a conversation that is not stored: named by the client's key for it
/// (`X-Session-Id` or Codex's `session-id` header, else `prompt_cache_key`), so that a client
/// that resends the whole conversation each turn continues its K/V, replies included.
fn keyed_session(
    scope: &str,
    header: Option<&str>,
    req: &ResponsesRequest,
) -> Result<Option<SessionKey>, ApiError> {
    let (key, param) = match (header, req.prompt_cache_key.as_deref()) {
        (Some(h), _) => (h, "X-Session-Id"),
        (None, Some(k)) => (k, "prompt_cache_key"),
        (None, None) => return Ok(None),
    };
    let key = key.trim();
    if key.is_empty() || key.len() > 256 {
        return Err(ApiError::invalid(
            Some(param),
            format!("`{param}` must be 1 to 256 characters"),
        ));
    }
    Ok(Some(SessionKey {
        scope: scope.to_string(),
        session_id: key.to_string(),
    }))
}

/// Validates a request body (`value`, a JSON object) into a job with response id `id`.
/// `session_header`: the conversation's key from the request's headers, if any (see
/// [`session_header`]).
pub fn prepare(
    state: &AppState,
    scope: &str,
    value: &Value,
    id: String,
    session_header: Option<&str>,
) -> Result<Job, ApiError> {
    let req: ResponsesRequest = from_value(value)?;
    let mut params: GenerationParams = from_value(value)?;
    state.check_model(req.model.as_deref())?;
    params.n = None;
    params.max_tokens = None;
    params.max_completion_tokens = req.max_output_tokens;
    if value.get("conversation").is_some_and(|c| !c.is_null()) {
        return Err(ApiError::invalid(
            Some("conversation"),
            "the Conversations API is not served: continue a conversation with \
             `previous_response_id` (every stored response can be continued)",
        ));
    }
    if req.max_output_tokens == Some(0) {
        return Err(ApiError::invalid(
            Some("max_output_tokens"),
            "`max_output_tokens` must be at least 1",
        ));
    }
    let raw_tools = req.tools.clone().unwrap_or_default();
    let offered = tools::chat_tools(&raw_tools)?;
    let mode = tools::tool_mode(req.tool_choice.as_ref(), &offered)?;
    let tool_names: Vec<String> = offered.names().iter().map(|n| n.to_string()).collect();
    let tools = offered.chat;
    let namespaces = offered.namespaces;
    let (conversation_id, mut history, earlier, earlier_messages) = match &req.previous_response_id
    {
        Some(prev) => {
            let entry = state
                .responses
                .get(scope, prev)
                .ok_or_else(|| unknown_previous(prev))?;
            unfinished_previous(prev, &entry.response.status)?;
            let history = entry.messages.items().into_iter().cloned().collect();
            let earlier = (entry.input_items.clone(), entry.response.clone());
            (
                entry.conversation_id.clone(),
                history,
                Some(earlier),
                Some(entry.messages.clone()),
            )
        }
        None => (new_item_id("conv"), Vec::new(), None, None),
    };
    // This turn's items: the previous response's output, then the new input.
    let mut new_items: Vec<Value> = earlier
        .iter()
        .flat_map(|(_, response)| &response.output)
        .filter_map(|item| serde_json::to_value(item).ok())
        .collect();
    match &req.input {
        Some(input) => {
            items::append_input(&mut history, input, &namespaces)?;
            new_items.extend(items::listed_items(input));
        }
        None if req.previous_response_id.is_none() => {
            return Err(ApiError::invalid(Some("input"), "`input` is required"))
        }
        None => {}
    }
    let input_items = ItemChain::new(earlier.map(|(chain, _)| chain), new_items);
    let mut messages: Vec<Value> = req
        .instructions
        .iter()
        .map(|i| json!({"role": "system", "content": i}))
        .collect();
    messages.extend(history.iter().cloned());
    if history.is_empty() {
        return Err(ApiError::invalid(
            Some("input"),
            "`input` must not be empty",
        ));
    }
    let use_tools = !tools.is_empty() && mode != ToolMode::None;
    // Rendered with "none" too, as chat completions do: the conversation's prefix stays cached.
    let render_tools = !tools.is_empty();
    let parallel = req.parallel_tool_calls != Some(false);
    let forced_grammar = forced_calls(&tools, &mode, parallel);
    let lazy = (use_tools && mode == ToolMode::Auto).then(|| lazy_calls(&tools, parallel));
    match &mode {
        ToolMode::Required => messages.push(json!({"role": "system", "content":
            "Respond only with one or more tool calls, using the tools provided."})),
        ToolMode::Named(name) => messages.push(json!({"role": "system", "content":
            format!("Respond only with a call of the function `{name}`.")})),
        ToolMode::Auto | ToolMode::None => {}
    }
    let prompt = Prompt::Chat {
        messages: Value::Array(messages),
        tools: render_tools.then(|| Value::Array(tools)),
    };
    let store = req.store.unwrap_or(true);
    let background = req.background == Some(true);
    if background && !store {
        return Err(ApiError::invalid(
            Some("background"),
            "`background: true` needs `store: true`: a background response is read back with \
             `GET /v1/responses/{id}`",
        ));
    }
    let session = match store {
        true => Some(session_of(scope, &conversation_id)),
        false => keyed_session(scope, session_header, &req)?,
    };
    let mut plan = generate::plan(&params, prompt, false, 0, session)?;
    // A stored conversation's session is its own: a second continuation of the same response
    // at once forks into a conversation of its own (see [`submit`]) rather than run without.
    plan.exclusive_session = store;
    let format = req.text.as_ref().and_then(|t| t.get("format")).cloned();
    plan.format = text_format(format.as_ref())?;
    plan.format_param = "text.format";
    if let Some(grammar) = forced_grammar {
        plan.force_tool_calls(grammar)?;
    }
    plan.lazy_tool_calls(lazy);
    let template = ResponseObject {
        id: id.clone(),
        object: "response".into(),
        created_at: super::unix_now(),
        status: "in_progress".into(),
        error: None,
        incomplete_details: None,
        instructions: req.instructions.clone(),
        max_output_tokens: req.max_output_tokens,
        model: state.config.model_id.clone(),
        output: Vec::new(),
        parallel_tool_calls: req.parallel_tool_calls.unwrap_or(true),
        previous_response_id: req.previous_response_id.clone(),
        store,
        background,
        temperature: Some(plan.sampling.temperature),
        tool_choice: req.tool_choice.clone().unwrap_or_else(|| json!("auto")),
        tools: raw_tools,
        top_p: Some(plan.sampling.top_p),
        truncation: "disabled".into(),
        usage: None,
        metadata: req.metadata.clone().unwrap_or_else(|| json!({})),
        text: json!({"format": format.unwrap_or_else(|| json!({"type": "text"}))}),
        timings: None,
        conversation: None,
    };
    Ok(Job {
        id,
        scope: scope.to_string(),
        conversation_id,
        history,
        earlier_messages,
        input_items,
        plan,
        parse_tools: use_tools,
        ban_tool_calls: render_tools && !use_tools,
        single_call: req.parallel_tool_calls == Some(false),
        tool_names,
        namespaces,
        store,
        template,
    })
}

/// An engine refusal, naming this endpoint's fields.
fn renamed(e: ApiError) -> ApiError {
    e.with_param_renamed("messages", "input")
}

/// Submits the job. When its conversation's session is busy (two continuations of the same
/// response at once), the job forks into a new conversation rather than failing (an unstored
/// conversation's keyed session that is busy is left by the engine itself: the request runs
/// without it).
pub async fn submit(engine: &Engine, job: &mut Job) -> Result<EventStream, ApiError> {
    if std::mem::take(&mut job.ban_tool_calls) {
        job.plan.ban_tool_calls(engine).await?;
    }
    let first = generate::submit_all(engine, &job.plan).await;
    let mut streams = match first {
        Err(e) if e.code == Some("session_busy") => {
            job.conversation_id = new_item_id("conv");
            job.plan.session = Some(session_of(&job.scope, &job.conversation_id));
            generate::submit_all(engine, &job.plan)
                .await
                .map_err(renamed)?
        }
        other => other.map_err(renamed)?,
    };
    Ok(streams.remove(0))
}

/// Streams a submitted job to its end: events go to `emit` (which returns `false` once its
/// receiver is gone: the run stops and dropping the engine stream cancels the request);
/// `cancel` resolving stops it with status `cancelled`. A finished response is stored (when
/// `store`) before its terminal event is emitted, so a client may continue from it at once; a
/// failed one only in the [`background`], where a client polls for it (and cannot continue it).
pub async fn run(
    job: Job,
    mut stream: EventStream,
    state: web::Data<AppState>,
    cancel: impl Future<Output = ()>,
    mut emit: impl FnMut(ResponseEvent) -> bool,
) -> Option<ResponseObject> {
    let template = job.created();
    let parser = ToolCallParser::new(job.parse_tools, job.single_call)
        .with_tool_names(job.tool_names.clone());
    let mut builder = Builder::new(template, parser).with_namespaces(job.namespaces.clone());
    for e in builder.start() {
        if !emit(e) {
            return None;
        }
    }
    let mut clock = TokenClock::start();
    tokio::pin!(cancel);
    let (ending, usage) = loop {
        let event = tokio::select! {
            e = stream.recv() => e,
            _ = &mut cancel => break (Ending::Cancelled, None),
        };
        match event {
            None => {
                let e = ApiError::internal("the request ended without finishing");
                break (Ending::Failed(e.body()["error"].clone()), None);
            }
            Some(EngineEvent::Started { .. } | EngineEvent::PromptLogprobs { .. }) => {}
            Some(EngineEvent::Delta {
                text,
                token_ids,
                draft_depths,
                ..
            }) => {
                clock.tokens(&state.metrics, token_ids.len());
                for e in builder.push_text(&text, &draft_depths) {
                    if !emit(e) {
                        return None;
                    }
                }
            }
            Some(EngineEvent::Finished { reason, usage, .. }) => {
                let ending = match reason {
                    FinishReason::Stop => Ending::Completed,
                    FinishReason::Length => Ending::Length,
                    FinishReason::Cancelled => Ending::Cancelled,
                };
                break (ending, Some(usage));
            }
            Some(EngineEvent::Error(e)) => {
                break (
                    Ending::Failed(ApiError::from(e).body()["error"].clone()),
                    None,
                )
            }
        }
    };
    drop(stream);
    if let Some(u) = usage {
        state
            .metrics
            .count_usage(u.prompt_tokens, u.cached_tokens, u.completion_tokens);
    }
    let failed = matches!(ending, Ending::Failed(_));
    let (events, response) = builder.finish(ending, usage);
    if job.store && (!failed || job.template.background) {
        let mut messages = job.history;
        messages.push(assistant_message(&response, &job.namespaces));
        state
            .responses
            .insert(
                &job.scope,
                &job.conversation_id,
                ItemChain::extending(job.earlier_messages, messages),
                job.input_items,
                response.clone(),
            )
            .await;
    }
    for e in events {
        if !emit(e) {
            break;
        }
    }
    Some(response)
}

/// The conversation key a request's headers give: `X-Session-Id`, or the `session-id` Codex
/// sends with every request of a session.
pub fn session_header(req: &HttpRequest) -> Option<&str> {
    [generate::SESSION_HEADER, "session-id"]
        .iter()
        .find_map(|h| req.headers().get(*h))
        .and_then(|v| v.to_str().ok())
}

/// One SSE event: `event: TYPE` and `data: JSON`.
fn sse_event(e: &ResponseEvent) -> Bytes {
    let json = serde_json::to_string(e).unwrap_or_else(|_| "{}".into());
    Bytes::from(format!("event: {}\ndata: {json}\n\n", e.kind()))
}

/// Create a response.
#[utoipa::path(post, path = "/v1/responses", request_body = ResponsesRequest, responses(
    (status = 200, description = "The response object, or with `stream: true` a `text/event-stream` of `ResponseEvent`s", body = ResponseObject),
    (status = 400, description = "Invalid request, unknown `previous_response_id`, hosted tools, or `context_length_exceeded`", body = ErrorResponse),
    (status = 401, body = ErrorResponse),
    (status = 503, body = ErrorResponse),
))]
pub async fn create_response(
    auth: Authorized,
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let value = read_json_object(&req, payload, state.config.max_body).await?;
    let header = session_header(&req);
    let mut job = prepare(&state, &auth.scope, &value, new_item_id("resp"), header)?;
    let streamed = value.get("stream").and_then(Value::as_bool) == Some(true);
    let engine = state.engine()?;
    let events = submit(engine, &mut job).await?;
    let peer = Peer::of(&req);
    if job.template.background {
        let (created, log) = background::start(state.clone(), job, events, streamed);
        return Ok(match log {
            // The run goes on when this client hangs up; it can stream the rest again.
            Some(log) => sse::response(log.follow(0), state.config.keep_alive, peer),
            None => HttpResponse::Ok().json(created),
        });
    }
    if streamed {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        // The body ends when the client hangs up (`sse::response`), dropping `rx`: the run is
        // cancelled then, whether or not an event is on its way.
        let body_gone = tx.clone();
        actix_rt::spawn(run(
            job,
            events,
            state.clone(),
            async move { body_gone.closed().await },
            move |e| tx.send(sse_event(&e)).is_ok(),
        ));
        let frames = Box::pin(futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|b| (b, rx))
        }));
        return Ok(sse::response(frames, state.config.keep_alive, peer));
    }
    let response = run(job, events, state.clone(), peer.hung_up(), |_| true)
        .await
        .ok_or_else(|| ApiError::internal("the response was not produced"))?;
    if let Some(error) = response
        .error
        .clone()
        .filter(|_| response.status == "failed")
    {
        return Ok(HttpResponse::InternalServerError().json(json!({ "error": error })));
    }
    Ok(HttpResponse::Ok().json(response))
}

fn not_stored(id: &str) -> ApiError {
    let mut e = ApiError::invalid(Some("response_id"), format!("No response with id `{id}`."))
        .with_code("response_not_found");
    e.status = actix_web::http::StatusCode::NOT_FOUND;
    e
}

/// A stored response.
#[utoipa::path(get, path = "/v1/responses/{id}", params(("id" = String, Path), RetrieveQuery), responses(
    (status = 200, description = "The response object, or with `stream=true` a `text/event-stream` of its `ResponseEvent`s", body = ResponseObject),
    (status = 400, description = "`stream=true` for a response not created with `background` and `stream`, or `starting_after` past its last event", body = ErrorResponse),
    (status = 401, body = ErrorResponse),
    (status = 404, body = ErrorResponse),
))]
pub async fn get_response(
    auth: Authorized,
    req: HttpRequest,
    id: web::Path<String>,
    query: web::Query<RetrieveQuery>,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let stored = stored(&state, &auth.scope, &id)?;
    if query.stream != Some(true) {
        return Ok(HttpResponse::Ok().json(&*stored.response));
    }
    let frames = background::stream_stored(&stored, query.starting_after)?;
    Ok(sse::response(
        frames,
        state.config.keep_alive,
        Peer::of(&req),
    ))
}

/// `GET /v1/responses/{id}`'s query: with `stream=true` a background response created with
/// `stream: true` is streamed again, from the event after `starting_after` (a sequence
/// number) or from its first, and followed to its end. (`include` is accepted and ignored:
/// every field is always included.)
#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct RetrieveQuery {
    pub stream: Option<bool>,
    pub starting_after: Option<u64>,
}

/// Cancels a background response.
#[utoipa::path(post, path = "/v1/responses/{id}/cancel", params(("id" = String, Path)), responses(
    (status = 200, description = "The response as it ended (`cancelled`, or as it had already ended)", body = ResponseObject),
    (status = 400, description = "The response was not created with `background: true`", body = ErrorResponse),
    (status = 401, body = ErrorResponse),
    (status = 404, body = ErrorResponse),
))]
pub async fn cancel_response(
    auth: Authorized,
    id: web::Path<String>,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let response = background::cancel(&state, &auth.scope, &id).await?;
    Ok(HttpResponse::Ok().json(&*response))
}

/// The stored response `id` of `scope`, or the 404 an unknown one gets.
fn stored(state: &AppState, scope: &str, id: &str) -> Result<store::StoredResponse, ApiError> {
    state.responses.get(scope, id).ok_or_else(|| not_stored(id))
}

/// Deletes a stored response (its conversation's later responses keep working).
#[utoipa::path(delete, path = "/v1/responses/{id}", params(("id" = String, Path)), responses(
    (status = 200, description = "`{\"id\", \"object\": \"response.deleted\", \"deleted\": true}`"),
    (status = 401, body = ErrorResponse),
    (status = 404, body = ErrorResponse),
))]
pub async fn delete_response(
    auth: Authorized,
    id: web::Path<String>,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    // A background response still running is stopped first (its end would store it again).
    state.background.stop(&auth.scope, &id).await;
    if !state.responses.remove(&auth.scope, &id) {
        return Err(not_stored(&id));
    }
    Ok(HttpResponse::Ok().json(json!({"id": *id, "object": "response.deleted", "deleted": true})))
}
