//! What chat and text completions share: request fields → [`GenerateRequest`]s (validated
//! before anything is submitted), submitting `n` of them, collecting a finished choice, and
//! usage/timings in OpenAI and llama.cpp shapes.

use super::disconnect::Peer;
use super::errors::ApiError;
use super::metrics::{Metrics, TokenClock};
use super::types::{
    CompletionTokensDetails, DepthAcceptance, GenerationParams, MessageContent,
    PromptTokensDetails, Speculative, Timings, Usage,
};
use crate::engine::{Engine, EngineEvent, EventStream, GenerateRequest, Prompt};
use crate::error::EngineError;
use crate::sampling::{OutputFormat, SamplingParams};
use crate::scheduler::{FinishReason, Usage as EngineUsage};
use crate::session::SessionKey;
use crate::spec::{DraftSource, SpecChoice};
use actix_web::web::Bytes;
use actix_web::HttpRequest;
use std::collections::VecDeque;

/// The most choices one request may ask for.
pub const MAX_CHOICES: usize = 8;
/// The most stop strings one request may give.
pub const MAX_STOP: usize = 16;
/// The header that names a persistent session.
pub const SESSION_HEADER: &str = "x-session-id";

/// Everything needed to submit a request's choices.
#[derive(Debug, Clone)]
pub struct Plan {
    pub prompt: Prompt,
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub session: Option<SessionKey>,
    pub num_choices: usize,
    /// The predicted output's text (a source of drafts).
    pub prediction: Option<String>,
    pub speculative: Option<SpecChoice>,
    /// What the output must be (`response_format` or a vLLM `guided_*` field).
    pub format: Option<OutputFormat>,
    /// The request field `format` came from, for errors.
    pub format_param: &'static str,
    /// Score the prompt's tokens too, with this many alternatives each (`echo` + `logprobs`).
    pub prompt_logprobs: Option<usize>,
    /// Banned end tokens (`ignore_eos`).
    pub ignore_eos: bool,
    /// `max_tokens` is a ceiling (see [`GenerateRequest::max_tokens_ceiling`]).
    pub max_tokens_ceiling: bool,
    /// A busy session refuses the request (see [`GenerateRequest::exclusive_session`]).
    pub exclusive_session: bool,
}

impl Plan {
    /// `tool_choice: "none"` with the tools in the prompt: the model's tool-call tag is banned
    /// so that no call is written. A model whose tag is not one token cannot be held back that
    /// way; its prompt is rendered without the tools instead.
    pub async fn ban_tool_calls(&mut self, engine: &Engine) -> Result<(), ApiError> {
        let tag = Prompt::Text(super::tool_calls::OPEN_TOOL.into());
        match engine.tokenize(&tag).await?[..] {
            [id] => {
                self.sampling.logit_bias.insert(id, -100.0);
            }
            _ => {
                if let Prompt::Chat { tools, .. } | Prompt::ChatContinued { tools, .. } =
                    &mut self.prompt
                {
                    *tools = None;
                }
            }
        }
        Ok(())
    }

    /// Constrains the reply to the grammar of the calls `tool_choice` forces (see
    /// `tool_grammar`); refused when the request already constrains its output otherwise.
    pub fn force_tool_calls(&mut self, grammar: String) -> Result<(), ApiError> {
        if self.format.is_some() {
            let field = self.format_param;
            return Err(ApiError::invalid(
                Some(field),
                format!(
                    "`{field}` cannot apply to a reply that `tool_choice` forces to be a tool \
                     call; drop one of the two"
                ),
            ));
        }
        self.format = Some(OutputFormat::ToolCalls(grammar));
        Ok(())
    }

    /// Holds a call the model opens under `tool_choice: "auto"` to the tools' grammar (see
    /// `tool_grammar::lazy_calls`), unless the request constrains its output otherwise (its
    /// `response_format` applies to the whole reply; calls are then parsed as written).
    pub fn lazy_tool_calls(&mut self, calls: Option<super::tool_grammar::LazyCalls>) {
        if let (None, Some(calls)) = (&self.format, calls) {
            self.format = Some(OutputFormat::LazyToolCalls {
                tagged: calls.tagged,
                bare: calls.bare,
            });
        }
    }
}

/// The `response_format` field: plain text (`None`), any JSON object, or JSON valid against a
/// schema (compiled, and refused if invalid, when the request is submitted).
pub fn output_format(format: Option<&serde_json::Value>) -> Result<Option<OutputFormat>, ApiError> {
    let Some(format) = format.filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    match format.get("type").and_then(|t| t.as_str()) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(OutputFormat::JsonObject)),
        Some("json_schema") => {
            let Some(spec) = format.get("json_schema").filter(|s| s.is_object()) else {
                return Err(ApiError::invalid(
                    Some("response_format.json_schema"),
                    "response_format `json_schema` needs a `json_schema` object with the `schema`",
                ));
            };
            schema_format(spec.get("schema"), "response_format.json_schema.schema")
        }
        Some(other) => Err(ApiError::invalid(
            Some("response_format.type"),
            format!("response_format type must be `text`, `json_object` or `json_schema`, got `{other}`"),
        )),
        None => Err(ApiError::invalid(
            Some("response_format.type"),
            "response_format needs a `type`: `text`, `json_object` or `json_schema`",
        )),
    }
}

/// The output format and the field it came from: `response_format` or one of vLLM's
/// `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, or llama.cpp's `grammar`
/// (at most one of them).
fn guided_format(p: &GenerationParams) -> Result<(Option<OutputFormat>, &'static str), ApiError> {
    let mut given = Vec::new();
    if let Some(f) = output_format(p.response_format.as_ref())? {
        given.push((f, "response_format"));
    }
    if let Some(schema) = &p.guided_json {
        let f = schema_format(Some(schema), "guided_json")?.expect("a schema was given");
        given.push((f, "guided_json"));
    }
    if let Some(rx) = &p.guided_regex {
        given.push((OutputFormat::Regex(rx.clone()), "guided_regex"));
    }
    if let Some(options) = &p.guided_choice {
        if options.is_empty() {
            return Err(ApiError::invalid(
                Some("guided_choice"),
                "`guided_choice` needs at least one string",
            ));
        }
        given.push((OutputFormat::Choice(options.clone()), "guided_choice"));
    }
    if let Some(text) = &p.guided_grammar {
        given.push((grammar_format(text, "guided_grammar")?, "guided_grammar"));
    }
    if let Some(text) = p.grammar.as_ref().filter(|g| !g.trim().is_empty()) {
        given.push((grammar_format(text, "grammar")?, "grammar"));
    }
    match given.len() {
        0 => Ok((None, "response_format")),
        1 => {
            let (f, param) = given.remove(0);
            Ok((Some(f), param))
        }
        _ => Err(ApiError::invalid(
            Some(given[1].1),
            format!(
                "give one output constraint, not `{}` and `{}`",
                given[0].1, given[1].1
            ),
        )),
    }
}

/// A grammar field as an output format. `grammar` (llama.cpp's) is GBNF unless it begins with
/// `%llguidance`, as in llama.cpp; `guided_grammar` (vLLM's) is GBNF when a line has `::=`,
/// else Lark, as vLLM tells them apart. GBNF errors are refused here, Lark's when compiled.
fn grammar_format(text: &str, param: &'static str) -> Result<OutputFormat, ApiError> {
    use crate::sampling::gbnf;
    if text.trim().is_empty() {
        return Err(ApiError::invalid(
            Some(param),
            format!("`{param}` is empty"),
        ));
    }
    let lark = text.trim_start().starts_with("%llguidance")
        || (param == "guided_grammar" && !gbnf::looks_like_gbnf(text));
    if lark {
        return Ok(OutputFormat::Lark(text.to_string()));
    }
    let translated = gbnf::to_lark(text).map_err(|m| ApiError::invalid(Some(param), m))?;
    Ok(OutputFormat::Lark(translated))
}

/// A JSON Schema as an output format; none (or `true`) means any JSON value.
pub fn schema_format(
    schema: Option<&serde_json::Value>,
    param: &str,
) -> Result<Option<OutputFormat>, ApiError> {
    match schema {
        None | Some(serde_json::Value::Bool(true)) => {
            Ok(Some(OutputFormat::JsonSchema(serde_json::json!({}))))
        }
        Some(s) if s.is_object() => Ok(Some(OutputFormat::JsonSchema(s.clone()))),
        Some(other) => Err(ApiError::invalid(
            Some(param),
            format!("the schema must be a JSON Schema object, got `{other}`"),
        )),
    }
}

pub fn plan(
    p: &GenerationParams,
    prompt: Prompt,
    logprobs: bool,
    top_logprobs: u32,
    session: Option<SessionKey>,
) -> Result<Plan, ApiError> {
    let (format, format_param) = guided_format(p)?;
    let num_choices = p.n.unwrap_or(1) as usize;
    if !(1..=MAX_CHOICES).contains(&num_choices) {
        return Err(ApiError::invalid(
            Some("n"),
            format!("`n` must be in 1..={MAX_CHOICES}, got {num_choices}"),
        ));
    }
    let max_tokens = match (p.max_completion_tokens, p.max_tokens) {
        (Some(0), _) => return Err(zero_tokens("max_completion_tokens")),
        (None, Some(0)) => return Err(zero_tokens("max_tokens")),
        (Some(n), _) | (None, Some(n)) => Some(n as usize),
        (None, None) => None,
    };
    let stop: Vec<String> = p
        .stop
        .clone()
        .map(|s| s.into_vec())
        .unwrap_or_default()
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect();
    if stop.len() > MAX_STOP {
        return Err(ApiError::invalid(
            Some("stop"),
            format!("at most {MAX_STOP} stop strings, got {}", stop.len()),
        ));
    }
    Ok(Plan {
        prompt,
        max_tokens,
        sampling: sampling_params(p, logprobs, top_logprobs)?,
        stop,
        session,
        num_choices,
        prediction: prediction_text(p)?,
        speculative: speculative_choice(p)?,
        format,
        format_param,
        prompt_logprobs: None,
        ignore_eos: p.ignore_eos.unwrap_or(false),
        max_tokens_ceiling: false,
        exclusive_session: false,
    })
}

/// The `speculative` field: `true`, `false`, or a drafter's name.
fn speculative_choice(p: &GenerationParams) -> Result<Option<SpecChoice>, ApiError> {
    Ok(match &p.speculative {
        None => None,
        Some(Speculative::Switch(on)) => Some((*on).into()),
        Some(Speculative::Drafter(name)) => match DraftSource::from_name(name) {
            Some(source) => Some(SpecChoice::Only(source)),
            None => {
                return Err(ApiError::invalid(
                    Some("speculative"),
                    format!(
                        "`speculative` must be true, false or a drafter's name (\"ngram\", \"prediction\", \"mtp\", \"draft\"), got \"{name}\""
                    ),
                ))
            }
        },
    })
}

/// The text of a `prediction` field; only `"type": "content"` exists.
fn prediction_text(p: &GenerationParams) -> Result<Option<String>, ApiError> {
    let Some(prediction) = &p.prediction else {
        return Ok(None);
    };
    if prediction.kind != "content" {
        return Err(ApiError::invalid(
            Some("prediction.type"),
            format!(
                "`prediction.type` must be \"content\", got \"{}\"",
                prediction.kind
            ),
        ));
    }
    let text = match &prediction.content {
        MessageContent::Text(t) => t.clone(),
        MessageContent::Parts(parts) => parts.iter().filter_map(|p| p.text.as_deref()).collect(),
    };
    Ok((!text.is_empty()).then_some(text))
}

fn zero_tokens(field: &str) -> ApiError {
    ApiError::invalid(Some(field), format!("`{field}` must be at least 1"))
}

/// The temperature of requests that give none: OpenAI's 1.0 unless the server was started with
/// `--temperature` (llama.cpp's `--temp`). Set once, at start-up, for the whole process.
static DEFAULT_TEMPERATURE: std::sync::OnceLock<f32> = std::sync::OnceLock::new();

/// Sets the temperature of requests that give none (see [`DEFAULT_TEMPERATURE`]); the first call
/// wins.
pub fn set_default_temperature(t: f32) {
    let _ = DEFAULT_TEMPERATURE.set(t);
}

/// OpenAI sampling fields onto the engine's [`SamplingParams`], validated (400 naming the field).
pub fn sampling_params(
    p: &GenerationParams,
    logprobs: bool,
    top_logprobs: u32,
) -> Result<SamplingParams, ApiError> {
    let d = SamplingParams::default();
    let mut logit_bias = std::collections::BTreeMap::new();
    for (key, bias) in p.logit_bias.iter().flatten() {
        let id: u32 = key.trim().parse().map_err(|_| {
            ApiError::invalid(
                Some("logit_bias"),
                format!("`logit_bias` keys must be token ids, got `{key}`"),
            )
        })?;
        logit_bias.insert(id, *bias);
    }
    let params = SamplingParams {
        temperature: p
            .temperature
            .unwrap_or(*DEFAULT_TEMPERATURE.get().unwrap_or(&d.temperature)),
        // -1 is vLLM's (and llama.cpp's) "off", as 0 is here.
        top_k: match p.top_k {
            Some(-1) => 0,
            k => k.unwrap_or(d.top_k),
        },
        top_p: p.top_p.unwrap_or(d.top_p),
        min_p: p.min_p.unwrap_or(d.min_p),
        repetition_penalty: p.repetition_penalty.unwrap_or(d.repetition_penalty),
        presence_penalty: p.presence_penalty.unwrap_or(d.presence_penalty),
        frequency_penalty: p.frequency_penalty.unwrap_or(d.frequency_penalty),
        logit_bias,
        seed: p.seed.map(|s| s as u64),
        logprobs,
        top_logprobs,
        ..d
    };
    params.validate()?;
    Ok(params)
}

/// The session named by `X-Session-Id`, scoped to the caller's key.
pub fn session_key(req: &HttpRequest, scope: &str) -> Result<Option<SessionKey>, ApiError> {
    let Some(value) = req.headers().get(SESSION_HEADER) else {
        return Ok(None);
    };
    let id = value
        .to_str()
        .ok()
        .map(str::trim)
        .filter(|s| !s.is_empty() && s.len() <= 256)
        .ok_or_else(|| {
            ApiError::invalid(
                Some("X-Session-Id"),
                "`X-Session-Id` must be 1 to 256 visible ASCII characters",
            )
        })?;
    Ok(Some(SessionKey {
        scope: scope.to_string(),
        session_id: id.to_string(),
    }))
}

/// Submits every choice; all are admitted or none (a refusal cancels the ones before it).
/// Choice `i` gets seed `seed + i`; only choice 0 continues the session.
pub async fn submit_all(engine: &Engine, plan: &Plan) -> Result<Vec<EventStream>, ApiError> {
    let mut streams = Vec::with_capacity(plan.num_choices);
    if let Some(choice) = plan.speculative {
        engine
            .info()
            .speculative
            .drafters_for(choice)
            .map_err(|m| ApiError::invalid(Some("speculative"), m))?;
    }
    let prediction = match &plan.prediction {
        Some(text) => Some(
            engine
                .tokenize(&Prompt::Text(text.clone()))
                .await
                .map_err(ApiError::from)?,
        ),
        None => None,
    };
    for i in 0..plan.num_choices {
        let mut req = GenerateRequest::new(plan.prompt.clone());
        req.max_tokens = plan.max_tokens;
        req.sampling = plan.sampling.clone();
        req.sampling.seed = plan.sampling.seed.map(|s| s.wrapping_add(i as u64));
        req.stop = plan.stop.clone();
        req.session = if i == 0 { plan.session.clone() } else { None };
        req.prediction = prediction.clone();
        req.speculative = plan.speculative;
        req.format = plan.format.clone();
        req.prompt_logprobs = plan.prompt_logprobs;
        req.ignore_eos = plan.ignore_eos;
        req.max_tokens_ceiling = plan.max_tokens_ceiling;
        req.exclusive_session = plan.exclusive_session;
        let refused =
            |e| ApiError::from(e).with_param_renamed("response_format", plan.format_param);
        streams.push(engine.submit(req).await.map_err(refused)?);
    }
    Ok(streams)
}

/// One choice, run to its end.
#[derive(Debug, Clone, Default)]
pub struct Collected {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    pub finish: Option<FinishReason>,
    pub usage: EngineUsage,
    /// The prompt's tokens scored, when the request asked ([`Plan::prompt_logprobs`]).
    pub prompt: Option<PromptScores>,
    /// The stop string that ended the reply, when one did.
    pub stop_string: Option<String>,
}

/// A prompt's tokens with their log-probabilities (the first token's is `None`).
#[derive(Debug, Clone, Default)]
pub struct PromptScores {
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
}

/// Every stream collected (a non-streaming request's choices), unless the client hangs up first:
/// then the streams are dropped, which cancels their sequences at the scheduler's next step.
pub async fn collect_all(
    streams: Vec<EventStream>,
    metrics: &Metrics,
    peer: Peer,
) -> Result<Vec<Collected>, ApiError> {
    let all = futures::future::join_all(streams.into_iter().map(|s| collect(s, metrics)));
    tokio::select! {
        collected = all => collected.into_iter().collect(),
        () = peer.hung_up() => Err(ApiError::client_closed()),
    }
}

/// Drains a choice's events; an engine error mid-run becomes the error response.
pub async fn collect(mut stream: EventStream, metrics: &Metrics) -> Result<Collected, ApiError> {
    let mut out = Collected::default();
    let mut clock = TokenClock::start();
    while let Some(event) = stream.recv().await {
        match event {
            EngineEvent::Started { .. } => {}
            EngineEvent::Delta {
                text,
                token_ids,
                logprobs,
                top_logprobs,
                ..
            } => {
                clock.tokens(metrics, token_ids.len());
                out.text.push_str(&text);
                out.token_ids.extend(token_ids);
                out.logprobs.extend(logprobs);
                out.top_logprobs.extend(top_logprobs);
            }
            EngineEvent::PromptLogprobs {
                token_ids,
                logprobs,
                top_logprobs,
            } => {
                out.prompt = Some(PromptScores {
                    token_ids,
                    logprobs,
                    top_logprobs,
                })
            }
            EngineEvent::Finished {
                reason,
                usage,
                stop_string,
            } => {
                out.finish = Some(reason);
                out.usage = usage;
                out.stop_string = stop_string;
            }
            EngineEvent::Error(e) => return Err(e.into()),
        }
    }
    if out.finish.is_none() {
        return Err(EngineError::Internal("the request ended without finishing".into()).into());
    }
    Ok(out)
}

/// OpenAI's name for a finish reason.
pub fn finish_reason(reason: FinishReason, tool_calls: bool) -> String {
    match reason {
        FinishReason::Stop if tool_calls => "tool_calls",
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Cancelled => "cancelled",
    }
    .to_string()
}

/// Usage over all choices: the prompt counted once, completions summed.
pub fn usage(per_choice: &[EngineUsage]) -> Usage {
    let first = per_choice.first().copied().unwrap_or_default();
    let completion_tokens = per_choice.iter().map(|u| u.completion_tokens).sum();
    Usage {
        prompt_tokens: first.prompt_tokens,
        completion_tokens,
        total_tokens: first.prompt_tokens + completion_tokens,
        prompt_tokens_details: PromptTokensDetails {
            cached_tokens: first.cached_tokens,
        },
        completion_tokens_details: CompletionTokensDetails {
            accepted_prediction_tokens: per_choice.iter().map(|u| u.accepted_draft_tokens).sum(),
            rejected_prediction_tokens: per_choice
                .iter()
                .map(|u| u.draft_tokens - u.accepted_draft_tokens)
                .sum(),
        },
        max_tokens_clamped: first.max_tokens_cut,
    }
}

/// Counts one finished choice's tokens in the metrics.
pub fn count_usage(metrics: &Metrics, usage: &EngineUsage) {
    let u = self::usage(std::slice::from_ref(usage));
    metrics.count_usage(
        u.prompt_tokens,
        u.prompt_tokens_details.cached_tokens,
        u.completion_tokens,
    );
}

/// llama.cpp's `timings` for the first choice.
pub fn timings(u: &EngineUsage) -> Timings {
    let per_second = |n: usize, ms: f64| if ms > 0.0 { n as f64 * 1e3 / ms } else { 0.0 };
    let prompt_n = u.prompt_tokens.saturating_sub(u.cached_tokens);
    Timings {
        cache_n: u.cached_tokens,
        prompt_n,
        prompt_ms: u.prompt_ms,
        prompt_per_second: per_second(prompt_n, u.prompt_ms),
        predicted_n: u.completion_tokens,
        predicted_ms: u.decode_ms,
        predicted_per_second: per_second(u.completion_tokens.saturating_sub(1), u.decode_ms),
        draft_n: u.draft_tokens,
        draft_n_accepted: u.accepted_draft_tokens,
        draft_by_depth: u
            .draft_by_depth
            .iter()
            .enumerate()
            .take_while(|(_, [drafted, _])| *drafted > 0)
            .map(|(d, &[drafted, accepted])| DepthAcceptance {
                depth: d + 1,
                drafted,
                accepted,
            })
            .collect(),
    }
}

/// A response id: `prefix-` and 24 random letters and digits.
pub fn new_id(prefix: &str) -> String {
    use rand::distr::{Alphanumeric, SampleString};
    format!(
        "{prefix}-{}",
        Alphanumeric.sample_string(&mut rand::rng(), 24)
    )
}

/// Merges the choices' event streams into one of `(choice index, event)`.
pub fn merge(
    streams: Vec<EventStream>,
) -> futures::stream::SelectAll<futures::stream::BoxStream<'static, (usize, EngineEvent)>> {
    use futures::StreamExt;
    futures::stream::select_all(streams.into_iter().enumerate().map(|(i, rx)| {
        futures::stream::unfold(rx, move |mut rx| async move {
            rx.recv().await.map(|event| ((i, event), rx))
        })
        .boxed()
    }))
}

/// A reply written frame by frame from one request's engine events (Ollama's NDJSON lines,
/// Anthropic's SSE events).
pub trait EventFrames: 'static {
    /// Handles one event, queueing its frames; `true` when the reply is over.
    fn on_event(&mut self, event: EngineEvent, queue: &mut VecDeque<Bytes>) -> bool;
}

/// The frames already in `queue`, then those `reply` makes of `events` until it says the reply
/// is over (or the events end). The token timings and the usage go to the server's metrics
/// here, once for every streamed shape.
pub fn event_frames<R: EventFrames>(
    reply: R,
    events: EventStream,
    queue: VecDeque<Bytes>,
    state: actix_web::web::Data<super::AppState>,
) -> futures::stream::LocalBoxStream<'static, Bytes> {
    use futures::StreamExt;
    let clock = TokenClock::start();
    futures::stream::unfold(
        (reply, events, queue, false, clock),
        move |(mut reply, mut events, mut queue, mut ended, mut clock)| {
            let state = state.clone();
            async move {
                loop {
                    if let Some(frame) = queue.pop_front() {
                        return Some((frame, (reply, events, queue, ended, clock)));
                    }
                    if ended {
                        return None;
                    }
                    let Some(event) = events.recv().await else {
                        ended = true;
                        continue;
                    };
                    match &event {
                        EngineEvent::Delta { token_ids, .. } => {
                            clock.tokens(&state.metrics, token_ids.len())
                        }
                        EngineEvent::Finished { usage, .. } => count_usage(&state.metrics, usage),
                        _ => {}
                    }
                    ended = reply.on_event(event, &mut queue);
                }
            }
        },
    )
    .boxed_local()
}
