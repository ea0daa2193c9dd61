//! `POST /v1/completions` (the legacy text endpoint): a prompt string or token ids, streamed
//! and not. A non-empty `suffix` makes it a fill-in-the-middle request (the model's FIM
//! tokens around `prompt` and `suffix`; a model without them gets a 400). `echo` puts the
//! prompt before the completion, and with `logprobs` scores the prompt's own tokens as well
//! (the first token's logprob is null), which is how evaluation harnesses compute a text's
//! log-likelihood; the prompt is then computed in full, without the prefix cache. Several
//! prompts in one request are refused (send one request per prompt).

use super::auth::Authorized;
use super::disconnect::Peer;
use super::errors::{from_value, read_json_object, ApiError};
use super::generate::{self, collect_all, finish_reason, submit_all, Collected, PromptScores};
use super::metrics::TokenClock;
use super::sse;
use super::types::*;
use super::AppState;
use crate::engine::{EngineEvent, Prompt};
use crate::model::FimTokens;
use crate::scheduler::{FinishReason, Usage as EngineUsage};
use actix_web::web::Bytes;
use actix_web::{web, HttpRequest, HttpResponse};
use futures::StreamExt;
use std::collections::VecDeque;

/// Create a text completion.
#[utoipa::path(
    post,
    path = "/v1/completions",
    request_body = CompletionRequest,
    params(("X-Session-Id" = Option<String>, Header, description = "Continue a persistent session")),
    responses(
        (status = 200, description = "A completion, or an SSE stream of completion chunks when `stream` is true", body = CompletionResponse),
        (status = 400, description = "Invalid request or `context_length_exceeded`", body = ErrorResponse),
        (status = 401, body = ErrorResponse), (status = 404, body = ErrorResponse),
        (status = 413, body = ErrorResponse), (status = 503, body = ErrorResponse),
    )
)]
pub async fn completions(
    auth: Authorized,
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let value = read_json_object(&req, payload, state.config.max_body).await?;
    let mut params: GenerationParams = from_value(&value)?;
    let request: CompletionRequest = from_value(&value)?;
    state.check_model(params.model.as_deref())?;
    let engine = state.engine()?;
    let echo = request.echo == Some(true);
    // `echo` with `max_tokens: 0` scores the prompt alone, as GPT-3-era evaluation code asks
    // (lm-eval's log-likelihoods): one token is generated and left out of the reply.
    let prompt_only =
        echo && params.max_tokens == Some(0) && params.max_completion_tokens.is_none();
    if prompt_only {
        if params.stream == Some(true) {
            return Err(ApiError::invalid(
                Some("max_tokens"),
                "`max_tokens: 0` (the prompt alone, with `echo`) is answered whole: drop `stream`",
            ));
        }
        params.max_tokens = Some(1);
    }
    let suffix = request.suffix.filter(|s| !s.is_empty());
    if echo && suffix.is_some() {
        return Err(ApiError::invalid(
            Some("echo"),
            "`echo` cannot be combined with `suffix` (fill-in-the-middle)",
        ));
    }
    let prompts = prompts_of(request.prompt, engine.info().vocab_size)?;
    let per_prompt = params.n.unwrap_or(1).max(1) as usize;
    if prompts.len() * per_prompt > MAX_BATCH_CHOICES {
        return Err(ApiError::invalid(
            Some("prompt"),
            format!(
                "{} prompts × n = {per_prompt} is over {MAX_BATCH_CHOICES} choices a request",
                prompts.len()
            ),
        ));
    }
    // A session continues with one prompt only: a batch's prompts would each overwrite it.
    let session = match prompts.len() {
        1 => generate::session_key(&req, &auth.scope)?,
        _ => None,
    };
    let logprobs = request.logprobs.is_some();
    let (mut streams, mut echoes) = (Vec::new(), Vec::new());
    for mut prompt in prompts {
        let echo_text = match (&prompt, echo) {
            (_, false) => None,
            (Prompt::Text(text), true) => Some(text.clone()),
            (Prompt::Tokens(ids), true) => Some(
                state
                    .detokenizer()?
                    .decode(ids)
                    .map_err(ApiError::internal)?,
            ),
            (_, true) => None,
        };
        if let Some(suffix) = &suffix {
            prompt = fill_in_the_middle(prompt, suffix, engine.info().fim.as_ref())?;
        }
        let mut plan = generate::plan(
            &params,
            prompt,
            logprobs,
            request.logprobs.unwrap_or(0),
            session.clone(),
        )
        .map_err(|mut e| {
            if e.param.as_deref() == Some("top_logprobs") {
                e.param = Some("logprobs".into());
            }
            e
        })?;
        if echo && logprobs {
            plan.prompt_logprobs = Some(request.logprobs.unwrap_or(0) as usize);
        }
        let choices = submit_all(engine, &plan)
            .await
            .map_err(|e| e.with_param_renamed("messages", "prompt"))?;
        echoes.extend(std::iter::repeat_n(echo_text, choices.len()));
        streams.extend(choices);
    }
    let id = generate::new_id("cmpl");
    let created = super::unix_now();
    if params.stream.unwrap_or(false) {
        let include_usage = params
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage);
        let shape = TextShape {
            include_usage,
            logprobs,
            echoes,
            per_prompt,
        };
        let frames = text_frames(state.clone(), id, created, streams, shape);
        return Ok(sse::response(
            frames,
            state.config.keep_alive,
            Peer::of(&req),
        ));
    }
    let mut collected = collect_all(streams, &state.metrics, Peer::of(&req)).await?;
    if prompt_only {
        for c in &mut collected {
            *c = Collected {
                finish: Some(FinishReason::Length),
                usage: EngineUsage {
                    completion_tokens: 0,
                    ..c.usage
                },
                prompt: c.prompt.take(),
                ..Collected::default()
            };
        }
    }
    let reply = response(
        &state,
        (id, created),
        collected,
        logprobs,
        &echoes,
        per_prompt,
    );
    Ok(HttpResponse::Ok().json(reply))
}

/// `prompt` + `suffix` as the model's fill-in-the-middle prompt: it writes what goes between
/// them (and ends with its end-of-text token).
pub(crate) fn fill_in_the_middle(
    prompt: Prompt,
    suffix: &str,
    fim: Option<&FimTokens>,
) -> Result<Prompt, ApiError> {
    let Some(fim) = fim else {
        return Err(ApiError::invalid(
            Some("suffix"),
            "this model has no fill-in-the-middle tokens, so `suffix` cannot be used",
        ));
    };
    match prompt {
        Prompt::Text(before) => Ok(Prompt::Text(fim.prompt(&before, suffix))),
        _ => Err(ApiError::invalid(
            Some("prompt"),
            "with `suffix`, `prompt` must be text (the code before the insertion point)",
        )),
    }
}

/// Most choices one request may ask for: its prompts times `n`.
const MAX_BATCH_CHOICES: usize = 128;

/// The request's prompts: one, or a batch (strings or lists of token ids).
fn prompts_of(input: PromptInput, vocab_size: usize) -> Result<Vec<Prompt>, ApiError> {
    let prompts: Vec<Prompt> = match input {
        PromptInput::Text(text) => vec![Prompt::Text(text)],
        PromptInput::Texts(texts) => texts.into_iter().map(Prompt::Text).collect(),
        PromptInput::Tokens(ids) => vec![Prompt::Tokens(ids)],
        PromptInput::TokenLists(lists) => lists.into_iter().map(Prompt::Tokens).collect(),
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid(
            Some("prompt"),
            "`prompt` is an empty list: give a prompt (a string or token ids), or several",
        ));
    }
    for prompt in &prompts {
        check_token_ids(prompt, vocab_size)?;
    }
    Ok(prompts)
}

/// A token-id prompt's ids must be in the vocabulary (400 naming `prompt`).
pub(crate) fn check_token_ids(prompt: &Prompt, vocab_size: usize) -> Result<(), ApiError> {
    if let Prompt::Tokens(ids) = prompt {
        if let Some(id) = ids.iter().find(|&&id| id as usize >= vocab_size) {
            return Err(ApiError::invalid(
                Some("prompt"),
                format!("token id {id} is outside the vocabulary of {vocab_size} tokens"),
            ));
        }
    }
    Ok(())
}

/// Usage of a batch: each prompt's choices as [`generate::usage`] counts them, summed.
fn batch_usage(per_choice: &[EngineUsage], per_prompt: usize) -> Usage {
    let mut total = Usage::default();
    for u in per_choice.chunks(per_prompt.max(1)).map(generate::usage) {
        total.prompt_tokens += u.prompt_tokens;
        total.completion_tokens += u.completion_tokens;
        total.total_tokens += u.total_tokens;
        total.prompt_tokens_details.cached_tokens += u.prompt_tokens_details.cached_tokens;
        let (done, d) = (
            &mut total.completion_tokens_details,
            u.completion_tokens_details,
        );
        done.accepted_prediction_tokens += d.accepted_prediction_tokens;
        done.rejected_prediction_tokens += d.rejected_prediction_tokens;
    }
    total
}

fn response(
    state: &AppState,
    (id, created): (String, u64),
    collected: Vec<Collected>,
    logprobs: bool,
    echoes: &[Option<String>],
    per_prompt: usize,
) -> CompletionResponse {
    let usages: Vec<EngineUsage> = collected.iter().map(|c| c.usage).collect();
    let usage = batch_usage(&usages, per_prompt);
    state.metrics.count_usage(
        usage.prompt_tokens,
        usage.prompt_tokens_details.cached_tokens,
        usage.completion_tokens,
    );
    let choices = collected
        .into_iter()
        .enumerate()
        .map(|(index, c)| {
            let echoed = echoes.get(index).cloned().flatten().unwrap_or_default();
            CompletionChoice {
                index,
                logprobs: logprobs.then(|| {
                    let mut lp = match &c.prompt {
                        Some(p) => text_logprobs(state, p.run(), TextOffset::default()).0,
                        None => CompletionLogprobs::default(),
                    };
                    let run = (&c.token_ids[..], &c.logprobs[..], &c.top_logprobs[..]);
                    lp.append(text_logprobs(state, run, TextOffset::after(&echoed)).0);
                    lp
                }),
                finish_reason: c.finish.map(|r| finish_reason(r, false)),
                text: format!("{echoed}{}", c.text),
            }
        })
        .collect();
    CompletionResponse {
        id,
        object: "text_completion".into(),
        created,
        model: state.config.model_id.clone(),
        choices,
        usage: Some(usage),
        timings: Some(generate::timings(&usages[0])),
    }
}

/// A run of tokens: their ids, logprobs and top alternatives.
pub type TokenRun<'a> = (&'a [u32], &'a [Option<f32>], &'a [Vec<(u32, f32)>]);

impl PromptScores {
    fn run(&self) -> TokenRun<'_> {
        (&self.token_ids, &self.logprobs, &self.top_logprobs)
    }
}

/// What a streamed text completion carries besides the text.
struct TextShape {
    include_usage: bool,
    logprobs: bool,
    /// Per choice, its prompt's text, sent first when `echo` is on.
    echoes: Vec<Option<String>>,
    /// Choices per prompt (`n`): usage counts each prompt once.
    per_prompt: usize,
}

/// Where the next token's text starts in a text completion, in characters (the logprobs'
/// `text_offset`, which clients slice the text with), counted over the tokens' raw bytes: a
/// token that starts inside a character (half an emoji) starts at that character.
#[derive(Debug, Clone, Copy, Default)]
struct TextOffset {
    /// Characters begun so far.
    chars: usize,
    /// Bytes the last character begun still lacks.
    missing: u8,
}

impl TextOffset {
    fn after(text: &str) -> Self {
        Self {
            chars: text.chars().count(),
            missing: 0,
        }
    }

    fn at(self) -> usize {
        self.chars - usize::from(self.missing > 0)
    }

    fn advance(&mut self, bytes: &[u8]) {
        for &b in bytes {
            if b & 0xC0 == 0x80 {
                self.missing = self.missing.saturating_sub(1);
            } else {
                self.chars += 1;
                self.missing = match b {
                    0xF0.. => 3,
                    0xE0.. => 2,
                    0xC0.. => 1,
                    _ => 0,
                };
            }
        }
    }
}

/// The legacy logprobs shape of `tokens`, whose text starts at `offset` in the output; also
/// where the next token's text starts.
fn text_logprobs(
    state: &AppState,
    (token_ids, logprobs, top_logprobs): TokenRun,
    offset: TextOffset,
) -> (CompletionLogprobs, TextOffset) {
    let mut out = CompletionLogprobs::default();
    let mut at = offset;
    for (i, &id) in token_ids.iter().enumerate() {
        out.text_offset.push(at.at());
        at.advance(&state.token_bytes(id));
        out.tokens.push(state.token_text(id));
        let logprob = logprobs.get(i).copied().flatten();
        out.token_logprobs.push(logprob);
        // Most likely first; alternatives that read the same keep the likelier score.
        let top = logprob.map(|_| {
            let mut top = serde_json::Map::new();
            for &(alt, lp) in top_logprobs.get(i).into_iter().flatten() {
                top.entry(state.token_text(alt))
                    .or_insert(serde_json::json!(lp));
            }
            top
        });
        out.top_logprobs.push(top);
    }
    (out, at)
}

/// SSE frames of a streamed text completion.
fn text_frames(
    state: web::Data<AppState>,
    id: String,
    created: u64,
    streams: Vec<crate::engine::EventStream>,
    shape: TextShape,
) -> futures::stream::LocalBoxStream<'static, Bytes> {
    let TextShape {
        include_usage,
        logprobs,
        echoes,
        per_prompt,
    } = shape;
    let num_choices = streams.len();
    let model = state.config.model_id.clone();
    let frame =
        move |choices: Vec<CompletionChoice>, usage: Option<Usage>, timings: Option<Timings>| {
            sse::data(&CompletionResponse {
                id: id.clone(),
                object: "text_completion".into(),
                created,
                model: model.clone(),
                choices,
                usage,
                timings,
            })
        };
    let clocks: Vec<TokenClock> = (0..num_choices).map(|_| TokenClock::start()).collect();
    let usages: Vec<Option<EngineUsage>> = vec![None; num_choices];
    // Where each choice's next token text starts (the logprobs' `text_offset`).
    let offsets = vec![TextOffset::default(); num_choices];
    let events = generate::merge(streams);
    let init = (events, VecDeque::new(), clocks, usages, offsets, false);
    futures::stream::unfold(
        init,
        move |(mut events, mut queue, mut clocks, mut usages, mut offsets, mut ended)| {
            let state = state.clone();
            let frame = frame.clone();
            let echoes = echoes.clone();
            async move {
                loop {
                    if let Some(f) = queue.pop_front() {
                        return Some((f, (events, queue, clocks, usages, offsets, ended)));
                    }
                    if ended {
                        return None;
                    }
                    let Some((index, event)) = events.next().await else {
                        let all: Vec<EngineUsage> = usages.iter().flatten().copied().collect();
                        if !all.is_empty() {
                            let usage = batch_usage(&all, per_prompt);
                            state.metrics.count_usage(
                                usage.prompt_tokens,
                                usage.prompt_tokens_details.cached_tokens,
                                usage.completion_tokens,
                            );
                            if include_usage {
                                queue.push_back(frame(
                                    Vec::new(),
                                    Some(usage),
                                    Some(generate::timings(&all[0])),
                                ));
                            }
                        }
                        queue.push_back(sse::done());
                        ended = true;
                        continue;
                    };
                    let echo = echoes.get(index).cloned().flatten();
                    let choice = |text: String, finish: Option<String>| CompletionChoice {
                        index,
                        text,
                        logprobs: None,
                        finish_reason: finish,
                    };
                    match event {
                        // The echoed prompt comes first: at once without logprobs, with its
                        // scores once the prompt is computed with them.
                        EngineEvent::Started { .. } => {
                            if let Some(text) = echo.as_ref().filter(|_| !logprobs) {
                                offsets[index] = TextOffset::after(text);
                                queue.push_back(frame(
                                    vec![choice(text.clone(), None)],
                                    None,
                                    None,
                                ));
                            }
                        }
                        EngineEvent::PromptLogprobs {
                            token_ids,
                            logprobs: token_logprobs,
                            top_logprobs,
                        } => {
                            if let Some(text) = &echo {
                                let run = (&token_ids[..], &token_logprobs[..], &top_logprobs[..]);
                                let mut c = choice(text.clone(), None);
                                c.logprobs =
                                    Some(text_logprobs(&state, run, TextOffset::default()).0);
                                offsets[index] = TextOffset::after(&c.text);
                                queue.push_back(frame(vec![c], None, None));
                            }
                        }
                        EngineEvent::Delta {
                            text,
                            token_ids,
                            logprobs: token_logprobs,
                            top_logprobs,
                            ..
                        } => {
                            clocks[index].tokens(&state.metrics, token_ids.len());
                            let mut c = choice(text, None);
                            if logprobs && !token_ids.is_empty() {
                                let run = (&token_ids[..], &token_logprobs[..], &top_logprobs[..]);
                                let (lp, next) = text_logprobs(&state, run, offsets[index]);
                                (c.logprobs, offsets[index]) = (Some(lp), next);
                            }
                            if !c.text.is_empty() || c.logprobs.is_some() {
                                queue.push_back(frame(vec![c], None, None));
                            }
                        }
                        EngineEvent::Finished { reason, usage, .. } => {
                            let finish = Some(finish_reason(reason, false));
                            queue.push_back(frame(
                                vec![choice(String::new(), finish)],
                                None,
                                Some(generate::timings(&usage)),
                            ));
                            usages[index] = Some(usage);
                        }
                        EngineEvent::Error(e) => {
                            queue.push_back(sse::data(&ApiError::from(e).body()));
                            queue.push_back(sse::done());
                            ended = true;
                        }
                    }
                }
            }
        },
    )
    .boxed_local()
}
