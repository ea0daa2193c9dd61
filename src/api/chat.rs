//! `POST /v1/chat/completions`, streamed (`chat.completion.chunk` SSE) and not.
//!
//! Each choice's text goes through its own [`ToolCallParser`], so the same output gives the
//! same content / reasoning / tool calls whether streamed or not. Stream layout: a first chunk
//! per choice with the role, content and tool-call deltas, a last chunk per choice with its
//! `finish_reason` (and llama.cpp `timings`), a usage chunk when
//! `stream_options.include_usage`, then `data: [DONE]`. An engine error mid-stream is sent as
//! an OpenAI error object in a `data:` frame, then `[DONE]`.

use super::auth::Authorized;
use super::chat_prompt;
use super::disconnect::Peer;
use super::errors::{from_value, read_json_object, ApiError};
use super::generate::{self, collect_all, finish_reason, submit_all, Collected};
use super::metrics::TokenClock;
use super::sse;
use super::tool_calls::{Piece, ToolCallParser};
use super::types::*;
use super::AppState;
use crate::engine::EngineEvent;
use crate::scheduler::Usage as EngineUsage;
use actix_web::web::Bytes;
use actix_web::{web, HttpRequest, HttpResponse};
use futures::StreamExt;
use std::collections::VecDeque;

/// Response identity and options shared by every chunk of a request.
#[derive(Clone)]
struct ChatContext {
    id: String,
    created: u64,
    model: String,
    parse_tools: bool,
    /// Forced start of each reply (`tool_choice`), fed to the parser before the model's text.
    forced_prefix: String,
    single_call: bool,
    tool_names: Vec<String>,
    logprobs: bool,
    include_usage: bool,
}

impl ChatContext {
    fn tool_parser(&self) -> ToolCallParser {
        ToolCallParser::new(self.parse_tools, self.single_call)
            .with_tool_names(self.tool_names.clone())
    }
}

/// Create a chat completion.
#[utoipa::path(
    post,
    path = "/v1/chat/completions",
    request_body = ChatCompletionRequest,
    params(("X-Session-Id" = Option<String>, Header, description = "Continue a persistent session (its KV is reused)")),
    responses(
        (status = 200, description = "A completion, or an SSE stream of `ChatCompletionChunk`s when `stream` is true", body = ChatCompletionResponse),
        (status = 400, description = "Invalid request or `context_length_exceeded`", body = ErrorResponse),
        (status = 401, description = "Missing or wrong API key", body = ErrorResponse),
        (status = 404, description = "Unknown model", body = ErrorResponse),
        (status = 413, description = "Body over --max-body", body = ErrorResponse),
        (status = 503, description = "Overloaded or loading (see Retry-After)", body = ErrorResponse),
    )
)]
pub async fn chat_completions(
    auth: Authorized,
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let value = read_json_object(&req, payload, state.config.max_body).await?;
    let params: GenerationParams = from_value(&value)?;
    let request: ChatCompletionRequest = from_value(&value)?;
    state.check_model(params.model.as_deref())?;
    let engine = state.engine()?;
    let prompt = chat_prompt::build(&value, &request)?;
    let logprobs = request.logprobs.unwrap_or(false);
    let session = generate::session_key(&req, &auth.scope)?;
    let mut plan = generate::plan(
        &params,
        prompt.prompt,
        logprobs,
        request.top_logprobs.unwrap_or(0),
        session,
    )?;
    if let Some(grammar) = prompt.forced_grammar.clone() {
        plan.force_tool_calls(grammar)?;
    }
    plan.lazy_tool_calls(prompt.lazy_calls.clone());
    if prompt.ban_tool_calls {
        plan.ban_tool_calls(engine).await?;
    }
    let streams = submit_all(engine, &plan).await?;
    let ctx = ChatContext {
        id: generate::new_id("chatcmpl"),
        created: super::unix_now(),
        model: state.config.model_id.clone(),
        parse_tools: prompt.parse_tools,
        forced_prefix: prompt.forced_prefix.clone(),
        single_call: prompt.single_call,
        tool_names: prompt.tool_names.clone(),
        logprobs,
        include_usage: params
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage),
    };
    if params.stream.unwrap_or(false) {
        let frames = ChatStream::new(ctx, state.clone(), streams.len()).frames(streams);
        return Ok(sse::response(
            frames,
            state.config.keep_alive,
            Peer::of(&req),
        ));
    }
    let collected = collect_all(streams, &state.metrics, Peer::of(&req)).await?;
    Ok(HttpResponse::Ok().json(response(&ctx, &state, collected)))
}

fn response(
    ctx: &ChatContext,
    state: &AppState,
    collected: Vec<Collected>,
) -> ChatCompletionResponse {
    let usages: Vec<EngineUsage> = collected.iter().map(|c| c.usage).collect();
    let usage = generate::usage(&usages);
    state.metrics.count_usage(
        usage.prompt_tokens,
        usage.prompt_tokens_details.cached_tokens,
        usage.completion_tokens,
    );
    let choices = collected
        .into_iter()
        .enumerate()
        .map(|(index, c)| {
            let mut parser = ctx.tool_parser();
            let mut pieces = parser.push(&ctx.forced_prefix);
            pieces.extend(parser.push(&c.text));
            pieces.extend(parser.finish());
            let mut message = AssistantMessage {
                role: "assistant".into(),
                ..AssistantMessage::default()
            };
            let (mut content, mut reasoning) = (String::new(), String::new());
            for piece in pieces {
                match piece {
                    Piece::Content(t) => content.push_str(&t),
                    Piece::Reasoning(t) => reasoning.push_str(&t),
                    Piece::ToolCallStart { .. } | Piece::ToolCallArgs { .. } => {}
                }
            }
            message.tool_calls = parser.tool_calls().to_vec();
            message.content =
                (!content.is_empty() || message.tool_calls.is_empty()).then_some(content);
            message.reasoning_content = (!reasoning.is_empty()).then_some(reasoning);
            let logprobs = ctx
                .logprobs
                .then(|| chat_logprobs(state, &c.token_ids, &c.logprobs, &c.top_logprobs));
            ChatChoice {
                index,
                finish_reason: c
                    .finish
                    .map(|r| finish_reason(r, !message.tool_calls.is_empty())),
                message,
                logprobs,
            }
        })
        .collect();
    ChatCompletionResponse {
        id: ctx.id.clone(),
        object: "chat.completion".into(),
        created: ctx.created,
        model: ctx.model.clone(),
        choices,
        usage,
        timings: generate::timings(&usages[0]),
    }
}

/// OpenAI `logprobs.content` for some tokens (token strings through the detokenizer).
fn chat_logprobs(
    state: &AppState,
    token_ids: &[u32],
    logprobs: &[Option<f32>],
    top: &[Vec<(u32, f32)>],
) -> ChatLogprobs {
    let text = |id: u32| state.token_text(id);
    // The end-of-turn token that ends a reply is not part of it (OpenAI lists none), so the
    // entries' bytes spell the reply's content exactly.
    let content = token_ids
        .iter()
        .enumerate()
        .filter(|&(_, &id)| !state.is_special_token(id))
        .map(|(i, &id)| {
            let token = text(id);
            TokenLogprob {
                bytes: state.token_bytes(id),
                token,
                logprob: logprobs
                    .get(i)
                    .copied()
                    .flatten()
                    .unwrap_or(f32::NEG_INFINITY),
                top_logprobs: top
                    .get(i)
                    .into_iter()
                    .flatten()
                    .map(|&(alt, lp)| {
                        let token = text(alt);
                        TopLogprob {
                            bytes: state.token_bytes(alt),
                            token,
                            logprob: lp,
                        }
                    })
                    .collect(),
            }
        })
        .collect();
    ChatLogprobs { content }
}

/// The streaming state of one request: a parser and a clock per choice.
struct ChatStream {
    ctx: ChatContext,
    state: web::Data<AppState>,
    parsers: Vec<ToolCallParser>,
    clocks: Vec<TokenClock>,
    usages: Vec<Option<EngineUsage>>,
    failed: bool,
}

impl ChatStream {
    fn new(ctx: ChatContext, state: web::Data<AppState>, num_choices: usize) -> Self {
        Self {
            parsers: (0..num_choices).map(|_| ctx.tool_parser()).collect(),
            clocks: (0..num_choices).map(|_| TokenClock::start()).collect(),
            usages: vec![None; num_choices],
            ctx,
            state,
            failed: false,
        }
    }

    /// SSE frames for the merged choices, ending with `[DONE]`.
    fn frames(
        mut self,
        streams: Vec<crate::engine::EventStream>,
    ) -> futures::stream::LocalBoxStream<'static, Bytes> {
        let mut queue = VecDeque::new();
        for index in 0..self.parsers.len() {
            let delta = ChunkDelta {
                role: Some("assistant".into()),
                content: Some(String::new()),
                ..ChunkDelta::default()
            };
            queue.push_back(self.chunk(index, delta, None, None, Vec::new()));
            // A forced tool call starts before the model's first token.
            let prefix = self.ctx.forced_prefix.clone();
            for piece in self.parsers[index].push(&prefix) {
                queue.push_back(self.chunk(index, delta_of(piece), None, None, Vec::new()));
            }
        }
        let events = generate::merge(streams);
        futures::stream::unfold(
            (self, events, queue, false),
            |(mut me, mut events, mut queue, mut ended)| async move {
                loop {
                    if let Some(frame) = queue.pop_front() {
                        return Some((frame, (me, events, queue, ended)));
                    }
                    if ended {
                        return None;
                    }
                    match events.next().await {
                        Some((index, event)) => me.on_event(index, event, &mut queue),
                        None => {
                            me.on_end(&mut queue);
                            ended = true;
                        }
                    }
                }
            },
        )
        .boxed_local()
    }

    fn chunk(
        &self,
        index: usize,
        delta: ChunkDelta,
        finish_reason: Option<String>,
        logprobs: Option<ChatLogprobs>,
        draft_depths: Vec<u8>,
    ) -> Bytes {
        sse::data(&ChatCompletionChunk {
            id: self.ctx.id.clone(),
            object: "chat.completion.chunk".into(),
            created: self.ctx.created,
            model: self.ctx.model.clone(),
            choices: vec![ChunkChoice {
                index,
                delta,
                logprobs,
                finish_reason,
                draft_depths,
            }],
            usage: None,
            timings: None,
        })
    }

    fn on_event(&mut self, index: usize, event: EngineEvent, queue: &mut VecDeque<Bytes>) {
        if self.failed {
            return;
        }
        match event {
            EngineEvent::Started { .. } | EngineEvent::PromptLogprobs { .. } => {}
            EngineEvent::Delta {
                text,
                token_ids,
                logprobs,
                top_logprobs,
                draft_depths,
            } => {
                self.clocks[index].tokens(&self.state.metrics, token_ids.len());
                let pieces = self.parsers[index].push(&text);
                let mut lp = (self.ctx.logprobs && !token_ids.is_empty())
                    .then(|| chat_logprobs(&self.state, &token_ids, &logprobs, &top_logprobs));
                // Token-level annotations ride on the first chunk the tokens produce.
                let mut depths = wire_draft_depths(&draft_depths);
                if pieces.is_empty() && (lp.is_some() || !depths.is_empty()) {
                    let depths = std::mem::take(&mut depths);
                    let chunk = self.chunk(index, ChunkDelta::default(), None, lp.take(), depths);
                    queue.push_back(chunk);
                }
                for piece in pieces {
                    let depths = std::mem::take(&mut depths);
                    queue.push_back(self.chunk(index, delta_of(piece), None, lp.take(), depths));
                }
            }
            EngineEvent::Finished { reason, usage, .. } => {
                for piece in self.parsers[index].finish() {
                    queue.push_back(self.chunk(index, delta_of(piece), None, None, Vec::new()));
                }
                let tool_calls = self.parsers[index].has_tool_calls();
                let frame = ChatCompletionChunk {
                    id: self.ctx.id.clone(),
                    object: "chat.completion.chunk".into(),
                    created: self.ctx.created,
                    model: self.ctx.model.clone(),
                    choices: vec![ChunkChoice {
                        index,
                        delta: ChunkDelta::default(),
                        logprobs: None,
                        finish_reason: Some(finish_reason(reason, tool_calls)),
                        draft_depths: Vec::new(),
                    }],
                    usage: None,
                    timings: Some(generate::timings(&usage)),
                };
                queue.push_back(sse::data(&frame));
                self.usages[index] = Some(usage);
            }
            EngineEvent::Error(e) => {
                self.failed = true;
                queue.push_back(sse::data(&ApiError::from(e).body()));
            }
        }
    }

    fn on_end(&mut self, queue: &mut VecDeque<Bytes>) {
        let usages: Vec<EngineUsage> = self.usages.iter().flatten().copied().collect();
        if !usages.is_empty() {
            let usage = generate::usage(&usages);
            self.state.metrics.count_usage(
                usage.prompt_tokens,
                usage.prompt_tokens_details.cached_tokens,
                usage.completion_tokens,
            );
            if self.ctx.include_usage && !self.failed {
                queue.push_back(sse::data(&ChatCompletionChunk {
                    id: self.ctx.id.clone(),
                    object: "chat.completion.chunk".into(),
                    created: self.ctx.created,
                    model: self.ctx.model.clone(),
                    choices: Vec::new(),
                    usage: Some(usage),
                    timings: Some(generate::timings(&usages[0])),
                }));
            }
        }
        queue.push_back(sse::done());
    }
}

/// A parser piece as a chunk delta.
fn delta_of(piece: Piece) -> ChunkDelta {
    let mut delta = ChunkDelta::default();
    match piece {
        Piece::Content(t) => delta.content = Some(t),
        Piece::Reasoning(t) => delta.reasoning_content = Some(t),
        Piece::ToolCallStart { index, id, name } => delta.tool_calls.push(ToolCallDelta {
            index,
            id: Some(id),
            kind: Some("function".into()),
            function: FunctionCallDelta {
                name: Some(name),
                arguments: Some(String::new()),
            },
        }),
        Piece::ToolCallArgs { index, fragment } => delta.tool_calls.push(ToolCallDelta {
            index,
            id: None,
            kind: None,
            function: FunctionCallDelta {
                name: None,
                arguments: Some(fragment),
            },
        }),
    }
    delta
}
