//! The engine: the actors wired together behind one handle, and the in-process API the HTTP
//! and WebSocket layers call (`Engine::submit` → a stream of events).
//!
//! Admission happens here, before any inference: the context window (the advertised one is
//! the enforced one, and never more than the KV budget can hold), the KV budget, and the queue.

mod embed;
pub mod request;
mod stream;

pub use crate::runner::embed::Pooling;
pub use embed::{EmbedRequest, Embedding};
pub use request::{EngineEvent, GenerateRequest, Prompt};

use crate::config::KvMemory;
use crate::error::EngineError;
use crate::kv::pool_actor::{ClearCache, GetPoolStats, PagePoolActor, PoolSnapshot};
use crate::kv::KvDtype;
use crate::model::ModelBundle;
use crate::runner::worker::{KvBytes, ModelWorker};
use crate::sampling::{Grammars, OutputFormat, Sampler};
use crate::scheduler::{
    Enqueue, GetSchedulerStats, MaxTokensCut, SchedulerActor, SchedulerConfig, SchedulerParts,
    SchedulerStats, Settle, Submission,
};
use crate::session::registry::{ExpireAll, GetOrCreate, ListSessions};
use crate::session::{
    BeginTurn, EndTurn, History, ReleaseAll, SessionActor, SessionInfo, SessionLeftMemory,
    SessionRegistry, SessionStore,
};
use crate::spec::cost::{measure_mtp_step, measure_row_cost, measure_step, DraftModelCosts};
use crate::spec::draft_model::{check_same_vocabulary, DraftWorker};
use crate::spec::drafter_kv::{ClearIdleDrafts, GetDraftPoolStats};
use crate::spec::mtp::MtpWorker;
use crate::spec::{
    DraftSource::{DraftModel, Mtp},
    SeqSpec, SpecConfig, Verification,
};
use crate::tokenizer::actor::{Encode, EncodeChat, EncodeLiteral, Realign, TokenizerActor};
use actix::prelude::*;
use anyhow::{bail, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use stream::StreamTask;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub page_size: usize,
    pub kv_memory: KvMemory,
    pub kv_dtype: KvDtype,
    /// Caps the model's own context length.
    pub context_window: Option<usize>,
    pub max_batch_tokens: usize,
    pub max_seqs: usize,
    pub prefill_chunk: usize,
    /// Most requests waiting for their first step; beyond it, `Overloaded`.
    pub max_queue: usize,
    pub session_ttl: Duration,
    /// Speculative decoding (off unless asked for).
    pub speculative: SpecConfig,
    /// A draft model for speculative decoding: a GGUF file with the target's vocabulary.
    pub draft_model: Option<std::path::PathBuf>,
    /// How embeddings pool a text's hidden states.
    pub pooling: crate::runner::embed::Pooling,
    /// Refuse `prompt + max_tokens` beyond the window (OpenAI's rule) instead of serving the
    /// request up to the window (`--strict-max-tokens`).
    pub strict_max_tokens: bool,
    /// Hold a tool call the model opens under `tool_choice: "auto"` to the tools' grammar
    /// (`--no-tool-grammar` turns it off: calls are then only parsed).
    pub lazy_tool_grammar: bool,
    /// The seed of requests that give none (`--seed`): sampled replies become reproducible.
    pub default_seed: Option<u64>,
    /// Sessions on disk too (`--session-dir`): `None` keeps them in memory only.
    pub session_store: Option<crate::session::store::StoreConfig>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            page_size: 16,
            kv_memory: KvMemory::default(),
            kv_dtype: KvDtype::F16,
            context_window: None,
            max_batch_tokens: 2048,
            max_seqs: 64,
            prefill_chunk: 512,
            max_queue: 256,
            session_ttl: Duration::from_secs(3600),
            speculative: SpecConfig::default(),
            draft_model: None,
            pooling: crate::runner::embed::Pooling::default(),
            strict_max_tokens: false,
            lazy_tool_grammar: true,
            default_seed: None,
            session_store: None,
        }
    }
}

/// Facts about the running engine that clients may be told.
#[derive(Debug, Clone, serde::Serialize)]
pub struct EngineInfo {
    pub model_path: String,
    /// The enforced window: min(model context, --context-window, what the KV budget holds).
    pub context_window: usize,
    pub model_context_length: usize,
    pub num_pages: usize,
    pub page_size: usize,
    pub kv_dtype: KvDtype,
    /// K/V bytes the budget holds: the model's pages and its drafters' (draft model, MTP heads).
    pub kv_budget_bytes: u64,
    pub vocab_size: usize,
    /// Most tokens computed in one step (`--max-batch-tokens`): llama.cpp's `n_batch`, which
    /// `/infill` sizes its context by.
    pub max_batch_tokens: usize,
    /// Length of an embedding: the model's hidden size.
    pub embedding_size: usize,
    /// How embeddings pool a text's hidden states (`--pooling`).
    pub pooling: crate::runner::embed::Pooling,
    /// With speculation on: the cost of an extra verify row relative to a decode step.
    pub spec_row_cost: Option<f64>,
    /// The drafters the server runs (`prediction`, `ngram`, `draft`, `mtp`).
    pub drafters: Vec<&'static str>,
    /// `max_tokens` past the window is refused rather than cut (see [`EngineConfig`]).
    pub strict_max_tokens: bool,
    /// Calls opened under `tool_choice: "auto"` follow the tools' grammar (see [`EngineConfig`]).
    pub lazy_tool_grammar: bool,
    /// The seed of requests that give none (see [`EngineConfig`]).
    pub default_seed: Option<u64>,
    /// The speculation settings in force (what a request's `speculative` is checked against).
    #[serde(skip)]
    pub speculative: SpecConfig,
    /// The draft model's file, when one is loaded.
    pub draft_model_path: Option<String>,
    /// Fill-in-the-middle tokens (`suffix` on `/v1/completions`), when the model has them.
    pub fim: Option<crate::model::FimTokens>,
    /// At start-up: a draft-model step relative to a target decode step.
    pub draft_cost: Option<f64>,
    /// What the model file says about itself (architecture, size, quantization, template).
    #[serde(skip)]
    pub facts: crate::model::ModelFacts,
}

/// A sampling parameter's refusal, naming the field.
fn invalid_param(e: crate::sampling::SamplingParamsError) -> EngineError {
    EngineError::InvalidParam {
        param: e.field(),
        message: e.to_string(),
    }
}

/// Threads encoding prompts: a huge prompt takes one, the others keep serving.
const ENCODER_THREADS: usize = 2;

pub struct Engine {
    info: EngineInfo,
    scheduler: Addr<SchedulerActor>,
    /// The streams' detokenisers (one thread).
    tokenizer: Addr<TokenizerActor>,
    /// Prompt encoding, on threads of its own.
    encoders: Addr<TokenizerActor>,
    registry: Addr<SessionRegistry>,
    pool: Addr<PagePoolActor>,
    worker: Addr<ModelWorker>,
    draft: Option<Addr<DraftWorker>>,
    mtp: Option<Addr<MtpWorker>>,
    /// Compiles `response_format` grammars over the model's vocabulary.
    grammars: Arc<Grammars>,
    /// The tokens that end a reply (banned for a request with `ignore_eos`).
    stop_token_ids: Arc<[u32]>,
    next_stream_id: AtomicU64,
    /// Sessions' pages and histories on disk (`--session-dir`).
    store: Option<Arc<SessionStore>>,
}

/// A request's events; dropping it cancels the request.
pub type EventStream = UnboundedReceiver<EngineEvent>;

impl Engine {
    /// Starts the actors. Must run inside an actix system (actix-web's runtime is one).
    pub fn start(bundle: ModelBundle, cfg: EngineConfig) -> Result<Self> {
        let draft = match &cfg.draft_model {
            Some(path) => {
                let draft = ModelBundle::load(path)?;
                check_same_vocabulary(&bundle, &draft)?;
                Some(Arc::new(draft.transformer))
            }
            None => None,
        };
        let mut speculative = cfg.speculative.clone();
        speculative.has_draft_model = draft.is_some();
        speculative.has_mtp = bundle.transformer.num_mtp_modules() > 0;
        speculative.mtp_cost = bundle.transformer.mtp_relative_cost();
        let uses_mtp = speculative.drafters().contains(Mtp);
        // The budget covers every K/V: the target's, and the draft model's and MTP heads', whose
        // pools hold as many tokens as the target's. A page of the budget is all three.
        let target_page_bytes = bundle
            .transformer
            .kv_shape(cfg.page_size)
            .page_bytes(cfg.kv_dtype);
        let drafter_page_bytes = draft
            .as_ref()
            .map_or(0, |d| d.kv_shape(cfg.page_size).page_bytes(cfg.kv_dtype))
            + if uses_mtp {
                bundle
                    .transformer
                    .mtp_kv_shape(cfg.page_size)
                    .page_bytes(cfg.kv_dtype)
            } else {
                0
            };
        let page_bytes = (target_page_bytes + drafter_page_bytes) as u64;
        let budget = cfg.kv_memory.bytes();
        let num_pages = (budget / page_bytes) as usize;
        if num_pages == 0 {
            bail!(
                "--kv-memory {budget} bytes cannot hold one KV page ({target_page_bytes} bytes \
                 for the model, {drafter_page_bytes} for its drafters)"
            );
        }
        let model_ctx = bundle.transformer.config.context_length;
        let context_window = [
            Some(model_ctx),
            cfg.context_window,
            Some(num_pages * cfg.page_size),
        ]
        .into_iter()
        .flatten()
        .min()
        .unwrap();
        let mut draft_costs = None;
        if speculative.is_on() && speculative.depth.is_none() {
            let t = &bundle.transformer;
            let target_step = measure_step(t, cfg.page_size, cfg.kv_dtype, 1)?;
            speculative.row_cost = measure_row_cost(t, cfg.page_size, cfg.kv_dtype, target_step)?;
            tracing::info!(
                row_cost = speculative.row_cost,
                "measured the verify cost per extra row"
            );
            if uses_mtp {
                let mtp_step = measure_mtp_step(t, cfg.page_size, cfg.kv_dtype)?;
                speculative.mtp_cost = (mtp_step.as_secs_f64()
                    / target_step.as_secs_f64().max(1e-9))
                .clamp(0.005, 4.0);
                tracing::info!(
                    mtp_cost = speculative.mtp_cost,
                    estimate = t.mtp_relative_cost(),
                    "measured an MTP module step against a target decode step"
                );
            }
            if let (Some(d), true) = (&draft, speculative.drafters().contains(DraftModel)) {
                let draft_step = measure_step(d, cfg.page_size, cfg.kv_dtype, 1)?;
                let costs = DraftModelCosts::new(target_step, draft_step);
                speculative.draft_cost = costs.relative_draft_cost();
                tracing::info!(
                    draft_cost = speculative.draft_cost,
                    "measured a draft-model step against a target decode step"
                );
                draft_costs = Some(costs);
            }
        }
        let info = EngineInfo {
            fim: bundle.fim_tokens(),
            facts: bundle.facts.clone(),
            model_path: bundle.path.display().to_string(),
            context_window,
            model_context_length: model_ctx,
            num_pages,
            page_size: cfg.page_size,
            kv_dtype: cfg.kv_dtype,
            kv_budget_bytes: num_pages as u64 * page_bytes,
            vocab_size: bundle.transformer.config.vocab_size,
            max_batch_tokens: cfg.max_batch_tokens,
            embedding_size: bundle.transformer.config.hidden_size,
            pooling: cfg.pooling,
            spec_row_cost: speculative.is_on().then_some(speculative.row_cost),
            drafters: speculative.drafters().names(),
            strict_max_tokens: cfg.strict_max_tokens,
            lazy_tool_grammar: cfg.lazy_tool_grammar,
            default_seed: cfg.default_seed,
            speculative: speculative.clone(),
            draft_model_path: cfg.draft_model.as_ref().map(|p| p.display().to_string()),
            draft_cost: draft_costs.as_ref().map(|c| c.relative_draft_cost()),
        };
        // The draft model's K/V holds as many tokens as the target's.
        let draft = draft.map(|d| DraftWorker::start(d, cfg.page_size, cfg.kv_dtype, num_pages));
        let model = Arc::new(bundle.transformer);
        // The MTP heads' K/V, like the draft model's, holds as many tokens as the target's.
        let mtp = uses_mtp
            .then(|| MtpWorker::start(model.clone(), cfg.page_size, cfg.kv_dtype, num_pages));
        let worker = ModelWorker::start(model.clone(), cfg.page_size, cfg.kv_dtype, num_pages);
        let store = match &cfg.session_store {
            Some(store_cfg) => Some(open_store(
                store_cfg,
                &bundle.path,
                model,
                &cfg,
                num_pages,
                &worker,
            )?),
            None => None,
        };
        let (text_tokenizer, template) =
            (Arc::new(bundle.tokenizer), bundle.template.map(Arc::new));
        let grammars = Arc::new(Grammars::new(
            text_tokenizer.clone(),
            info.vocab_size,
            &bundle.stop_token_ids,
        ));
        {
            let grammars = grammars.clone();
            std::thread::spawn(move || {
                let started = std::time::Instant::now();
                match grammars.prepare() {
                    Ok(()) => tracing::info!(
                        "structured outputs ready in {:.2} s",
                        started.elapsed().as_secs_f64()
                    ),
                    Err(e) => tracing::warn!("{e}"),
                }
            });
        }
        let tokenizer = TokenizerActor::start(text_tokenizer.clone(), template.clone());
        let encoders = TokenizerActor::start_encoders(ENCODER_THREADS, text_tokenizer, template);
        let pool = PagePoolActor::new(num_pages, cfg.page_size).start();
        let mut drafters: Vec<Recipient<SessionLeftMemory>> = Vec::new();
        drafters.extend(draft.clone().map(|d| d.recipient()));
        drafters.extend(mtp.clone().map(|m| m.recipient()));
        let registry = SessionRegistry::new(pool.clone(), cfg.page_size, cfg.session_ttl)
            .with_store(store.clone())
            .with_drafters(drafters)
            .start();
        let scheduler = SchedulerActor::new(SchedulerParts {
            cfg: SchedulerConfig {
                max_batch_tokens: cfg.max_batch_tokens,
                max_seqs: cfg.max_seqs,
                prefill_chunk: cfg.prefill_chunk,
                page_size: cfg.page_size,
            },
            max_queue: cfg.max_queue,
            context_window,
            stop_token_ids: bundle.stop_token_ids.clone(),
            spec: speculative,
            worker: worker.clone(),
            pool: pool.clone(),
            registry: registry.clone(),
            draft: draft.clone(),
            mtp: mtp.clone(),
            draft_costs,
        })
        .start();
        Ok(Self {
            info,
            scheduler,
            tokenizer,
            encoders,
            registry,
            pool,
            worker,
            draft,
            mtp,
            grammars,
            stop_token_ids: bundle.stop_token_ids.into(),
            next_stream_id: AtomicU64::new(0),
            store,
        })
    }

    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// The session store, when sessions are kept on disk.
    pub fn session_store(&self) -> Option<&Arc<SessionStore>> {
        self.store.as_ref()
    }

    /// Tokenizes text with its special-token text left as text (see [`EncodeLiteral`]): for
    /// user code placed between the special tokens of a prompt built token by token.
    pub async fn tokenize_literal(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        if text.is_empty() {
            return Ok(Vec::new());
        }
        self.encoders
            .send(EncodeLiteral {
                text: text.to_string(),
            })
            .await?
    }

    /// Tokenizes a prompt the way `submit` would (for counting and budget checks).
    pub async fn tokenize(&self, prompt: &Prompt) -> Result<Vec<u32>, EngineError> {
        match prompt {
            Prompt::Tokens(t) => Ok(t.clone()),
            Prompt::Text(text) => self.encoders.send(Encode { text: text.clone() }).await?,
            Prompt::Chat { messages, tools } => {
                self.encoders
                    .send(EncodeChat {
                        messages: messages.clone(),
                        tools: tools.clone(),
                        add_generation_prompt: true,
                        assistant_prefix: String::new(),
                    })
                    .await?
            }
            Prompt::ChatContinued {
                messages,
                tools,
                assistant_prefix,
            } => {
                self.encoders
                    .send(EncodeChat {
                        messages: messages.clone(),
                        tools: tools.clone(),
                        add_generation_prompt: true,
                        assistant_prefix: assistant_prefix.clone(),
                    })
                    .await?
            }
        }
    }

    /// Checks the request against the window and the KV budget; returns `max_tokens` and, when
    /// the request's was cut to the room the window leaves, how ([`MaxTokensCut`]). A request's
    /// `max_tokens` is a ceiling (as agents expect, and llama.cpp's server and Ollama serve it)
    /// unless the server is strict (`--strict-max-tokens`) and the API is not Ollama's (see
    /// [`GenerateRequest::max_tokens_ceiling`]); a prompt that leaves no room is refused either way.
    fn admit(
        &self,
        prompt_tokens: usize,
        requested: Option<usize>,
        ceiling: bool,
    ) -> Result<(usize, Option<MaxTokensCut>), EngineError> {
        let max_tokens = requested;
        let ceiling = ceiling || !self.info.strict_max_tokens;
        let window = self.info.context_window;
        if prompt_tokens == 0 {
            return Err(EngineError::InvalidRequest("the prompt is empty".into()));
        }
        if max_tokens == Some(0) {
            return Err(EngineError::InvalidRequest(
                "max_tokens must be at least 1".into(),
            ));
        }
        let room = window.saturating_sub(prompt_tokens).max(1);
        let max_tokens = match max_tokens {
            Some(n) if ceiling => n.min(room),
            Some(n) => n,
            None => room,
        };
        self.check_fits(prompt_tokens, max_tokens)?;
        let cut = requested
            .filter(|&n| n > max_tokens)
            .map(|requested| MaxTokensCut {
                requested,
                served: max_tokens,
            });
        if let Some(cut) = cut {
            tracing::debug!(
                prompt_tokens,
                requested = cut.requested,
                served = cut.served,
                "max_tokens cut to the room the {window}-token window leaves after the prompt"
            );
        }
        Ok((max_tokens, cut))
    }

    /// Refuses `prompt_tokens + max_tokens` beyond the window or the whole KV budget.
    fn check_fits(&self, prompt_tokens: usize, max_tokens: usize) -> Result<(), EngineError> {
        let window = self.info.context_window;
        if prompt_tokens + max_tokens > window {
            return Err(EngineError::ContextLengthExceeded {
                prompt_tokens,
                max_tokens,
                context_window: window,
            });
        }
        let budget_tokens = self.info.num_pages * self.info.page_size;
        let needed_tokens = prompt_tokens + max_tokens;
        if needed_tokens.div_ceil(self.info.page_size) > self.info.num_pages {
            return Err(EngineError::InsufficientKvMemory {
                needed_tokens,
                budget_tokens,
            });
        }
        Ok(())
    }

    /// A session's prompt sent as text, spelled with the session's own tokens where they say the
    /// same (see [`crate::tokenizer::realign`]), when that reuses more of its K/V and still
    /// fits the window.
    async fn realigned(
        &self,
        session: &Addr<SessionActor>,
        tokens: Vec<u32>,
        max_tokens: usize,
    ) -> Vec<u32> {
        let history = match session.send(History).await {
            Ok(history) if !history.is_empty() => history,
            _ => return tokens,
        };
        let prompt = tokens.clone();
        match self.encoders.send(Realign { history, prompt }).await {
            Ok(Some(t)) if self.check_fits(t.len(), max_tokens).is_ok() => t,
            _ => tokens,
        }
    }

    /// Hands an admitted request to the scheduler; on a refusal (a full queue) its session's
    /// turn ends unpublished, and a throwaway session lets its pages go.
    async fn enqueue(&self, submission: Submission) -> Result<(), EngineError> {
        let (session, ephemeral) = (submission.session.clone(), submission.ephemeral);
        let refused = self.scheduler.send(Enqueue(submission)).await?;
        if refused.is_err() {
            session.do_send(EndTurn { publish: false });
            if ephemeral {
                session.do_send(ReleaseAll);
            }
        }
        refused
    }

    /// Admits a request and returns its event stream, or refuses it before any inference.
    pub async fn submit(&self, mut req: GenerateRequest) -> Result<EventStream, EngineError> {
        let drafters = self
            .info
            .speculative
            .drafters_for(req.speculative.unwrap_or_default())
            .map_err(EngineError::InvalidRequest)?;
        let tokens = self.tokenize(&req.prompt).await?;
        let (max_tokens, max_tokens_cut) =
            self.admit(tokens.len(), req.max_tokens, req.max_tokens_ceiling)?;
        if req.ignore_eos {
            // llama.cpp's and vLLM's `ignore_eos`: the reply runs to `max_tokens` (or a stop
            // string, or the end of an output grammar, which still ends it).
            for &id in self.stop_token_ids.iter() {
                req.sampling
                    .logit_bias
                    .insert(id, crate::sampling::BAN_BIAS);
            }
        }
        if req.sampling.seed.is_none() {
            req.sampling.seed = self.info.default_seed;
        }
        req.sampling
            .validate_for_vocab(self.info.vocab_size)
            .map_err(invalid_param)?;
        let mut sampler = Sampler::new(req.sampling).map_err(invalid_param)?;
        let lazy_off = |f: &OutputFormat| {
            !self.info.lazy_tool_grammar && matches!(f, OutputFormat::LazyToolCalls { .. })
        };
        if let Some(format) = req.format.filter(|f| !lazy_off(f)) {
            let param = format.param();
            let grammars = self.grammars.clone();
            let constraint = actix_rt::task::spawn_blocking(move || grammars.constraint(&format))
                .await
                .map_err(|e| EngineError::Internal(format!("compiling the output grammar: {e}")))?
                .map_err(|message| EngineError::InvalidParam { param, message })?;
            tracing::debug!(?constraint, "output constrained");
            sampler = sampler.with_constraint(constraint);
        }
        let stream_id = self.next_stream_id.fetch_add(1, Ordering::Relaxed);
        let throwaway = || {
            let id = format!("request-{stream_id}");
            let session =
                SessionActor::new(id.clone(), self.pool.clone(), self.info.page_size).start();
            (session, true, id)
        };
        let (mut session, mut ephemeral, mut draft_key) = match req.session {
            Some(key) => {
                let draft_key = key.draft_key();
                let session = self.registry.send(GetOrCreate { key }).await?;
                (session, false, draft_key)
            }
            None => throwaway(),
        };
        let reuse = req.prompt_logprobs.is_none();
        let tokens = if !ephemeral && reuse && !matches!(req.prompt, Prompt::Tokens(_)) {
            self.realigned(&session, tokens, max_tokens).await
        } else {
            tokens
        };
        let begin = || BeginTurn {
            prompt: tokens.clone(),
            reuse,
        };
        let turn = match session.send(begin()).await? {
            Err(EngineError::SessionBusy { session_id }) if !req.exclusive_session => {
                tracing::debug!(
                    session_id,
                    "session busy with another turn: this request runs without it"
                );
                (session, ephemeral, draft_key) = throwaway();
                session.send(begin()).await??
            }
            turn => turn?,
        };
        let (seq_tx, seq_rx) = unbounded_channel();
        let (turn_ended, turn_end) = tokio::sync::oneshot::channel();
        let prompt_tokens = tokens.len();
        let verification = req
            .verification
            .unwrap_or(Verification::for_seed(sampler.params().seed));
        let submission = Submission {
            tokens,
            cached_tokens: turn.cached_tokens,
            num_pages: turn.num_pages,
            max_tokens,
            priority: req.priority,
            sampler,
            spec: SeqSpec::new(drafters, req.prediction).verified(verification),
            session: session.clone(),
            ephemeral,
            draft_key: draft_key.into(),
            prompt_logprobs: req.prompt_logprobs,
            embed: None,
            events: seq_tx,
            turn_ended,
        };
        self.enqueue(submission).await?;
        let (client_tx, client_rx) = unbounded_channel();
        let _ = client_tx.send(EngineEvent::Started {
            prompt_tokens,
            cached_tokens: turn.cached_tokens,
        });
        actix_rt::spawn(
            StreamTask {
                stream_id,
                tokenizer: self.tokenizer.clone(),
                stop: req.stop,
                prompt_tokens,
                cached_tokens: turn.cached_tokens,
                max_tokens_cut,
                from_scheduler: seq_rx,
                turn_end,
                to_client: client_tx,
            }
            .run(),
        );
        Ok(client_rx)
    }

    pub async fn sessions(&self) -> Vec<SessionInfo> {
        self.registry.send(ListSessions).await.unwrap_or_default()
    }

    /// How many streams' incremental decoders the tokenizer holds (0 once every stream ended).
    pub async fn stream_decoders(&self) -> usize {
        self.tokenizer
            .send(crate::tokenizer::actor::CountStreamDecoders)
            .await
            .unwrap_or_default()
    }

    pub async fn pool_stats(&self) -> PoolSnapshot {
        self.pool.send(GetPoolStats).await.unwrap_or_default()
    }

    pub async fn scheduler_stats(&self) -> SchedulerStats {
        self.scheduler
            .send(GetSchedulerStats)
            .await
            .unwrap_or_default()
    }

    /// The draft model's page pool, when one is loaded.
    pub async fn draft_pool_stats(&self) -> Option<crate::kv::PoolStats> {
        match &self.draft {
            Some(d) => d.send(GetDraftPoolStats).await.ok(),
            None => None,
        }
    }

    /// The MTP heads' page pool, when they are in use.
    pub async fn mtp_pool_stats(&self) -> Option<crate::kv::PoolStats> {
        match &self.mtp {
            Some(m) => m.send(GetDraftPoolStats).await.ok(),
            None => None,
        }
    }

    pub async fn kv_bytes_allocated(&self) -> usize {
        self.worker.send(KvBytes).await.unwrap_or(0)
    }

    /// Waits until every finished turn's session is on disk (graceful shutdown): the turns'
    /// ends have reached their sessions, whose pages were then handed to the store's writer.
    pub async fn persist_sessions(&self) {
        let Some(store) = self.store.clone() else {
            return;
        };
        let _ = self.scheduler.send(Settle).await;
        let _ = actix_rt::task::spawn_blocking(move || store.flush()).await;
    }

    /// Expires idle sessions and empties the prefix cache (what "caches cleared" means in the
    /// leak tests). Sessions with a turn in progress are kept.
    pub async fn clear_caches(&self) {
        // Finished requests' sessions release and publish their pages by message; wait until
        // those are in the pool's mailbox, or a publication could land after the clearing.
        let _ = self.scheduler.send(Settle).await;
        let _ = self.registry.send(ExpireAll).await;
        let _ = self.pool.send(ClearCache).await;
        if let Some(d) = &self.draft {
            let _ = d.send(ClearIdleDrafts).await;
        }
        if let Some(m) = &self.mtp {
            let _ = m.send(ClearIdleDrafts).await;
        }
    }
}

/// Opens the session store for this model's K/V: the model worker moves the pages, the
/// layout is the worker's storage's (q8's key scales come from the model's calibration).
fn open_store(
    store_cfg: &crate::session::store::StoreConfig,
    model_path: &std::path::Path,
    model: Arc<crate::model::Transformer>,
    cfg: &EngineConfig,
    num_pages: usize,
    worker: &Addr<ModelWorker>,
) -> Result<Arc<SessionStore>> {
    let (page_size, dtype) = (cfg.page_size, cfg.kv_dtype);
    let layout = move || {
        let kv = crate::runner::calibrate::kv_storage(&model, page_size, dtype, num_pages);
        crate::session::store::KvLayout::of(&kv)
    };
    let mover = crate::session::store::PageMover {
        export: worker.clone().recipient(),
        import: worker.clone().recipient(),
    };
    let store = SessionStore::open(
        store_cfg.clone(),
        model_path.to_path_buf(),
        Box::new(layout),
        mover,
    )
    .map_err(|e| anyhow::anyhow!("opening the session store {}: {e}", store_cfg.dir.display()))?;
    tracing::info!(dir = %store_cfg.dir.display(), "sessions are kept on disk too");
    Ok(store)
}
