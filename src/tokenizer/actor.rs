//! The tokenizer actor: owns the tokenizer and the chat template, encodes prompts, and keeps
//! each output stream's incremental detokeniser. It runs on its own thread so that encoding a
//! long prompt never holds up the scheduler.
//!
//! Two arbiters of it run: [`TokenizerActor::start`], one thread holding the streams'
//! detokenisers (their state must live in one instance), and [`TokenizerActor::start_encoders`],
//! a few threads that only encode. Encoding a huge prompt (a 12 MB body took 4-7 s) then holds
//! up neither every stream's text nor the other requests' prompts.

use super::{ChatTemplate, IncrementalDecoder};
use crate::error::EngineError;
use actix::prelude::*;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use tokenizers::Tokenizer;

pub struct TokenizerActor {
    tokenizer: Arc<Tokenizer>,
    /// The tokenizer with special-token text left as plain text, for [`EncodeLiteral`]; made
    /// on first use and shared by the arbiter's threads.
    literal: Arc<OnceLock<Tokenizer>>,
    template: Option<Arc<ChatTemplate>>,
    streams: HashMap<u64, IncrementalDecoder>,
}

impl TokenizerActor {
    /// One thread: per-stream decoder state must live in one instance.
    pub fn start(tokenizer: Arc<Tokenizer>, template: Option<Arc<ChatTemplate>>) -> Addr<Self> {
        Self::start_threads(1, tokenizer, template)
    }

    /// `threads` threads for [`Encode`] and [`EncodeChat`] only (they keep no state).
    pub fn start_encoders(
        threads: usize,
        tokenizer: Arc<Tokenizer>,
        template: Option<Arc<ChatTemplate>>,
    ) -> Addr<Self> {
        Self::start_threads(threads.max(1), tokenizer, template)
    }

    fn start_threads(
        threads: usize,
        tokenizer: Arc<Tokenizer>,
        template: Option<Arc<ChatTemplate>>,
    ) -> Addr<Self> {
        let literal = Arc::new(OnceLock::new());
        SyncArbiter::start(threads, move || TokenizerActor {
            tokenizer: tokenizer.clone(),
            literal: literal.clone(),
            template: template.clone(),
            streams: HashMap::new(),
        })
    }
}

impl Actor for TokenizerActor {
    type Context = SyncContext<Self>;
}

#[derive(Message)]
#[rtype(result = "Result<Vec<u32>, EngineError>")]
pub struct Encode {
    pub text: String,
}

impl Handler<Encode> for TokenizerActor {
    type Result = Result<Vec<u32>, EngineError>;
    fn handle(&mut self, msg: Encode, _: &mut SyncContext<Self>) -> Self::Result {
        encode(&self.tokenizer, &msg.text)
    }
}

/// Encode text whose special-token text (`<|endoftext|>`, `<|fim_middle|>` written in a source
/// file) stays plain text, as llama.cpp encodes what is not a prompt of its own (its
/// `parse_special = false`): code sent for completion must not inject control tokens.
/// User-defined tokens (Qwen's `<tool_call>`) are still matched, as in llama.cpp.
#[derive(Message)]
#[rtype(result = "Result<Vec<u32>, EngineError>")]
pub struct EncodeLiteral {
    pub text: String,
}

impl Handler<EncodeLiteral> for TokenizerActor {
    type Result = Result<Vec<u32>, EngineError>;
    fn handle(&mut self, msg: EncodeLiteral, _: &mut SyncContext<Self>) -> Self::Result {
        let literal = self.literal.get_or_init(|| {
            let mut t = (*self.tokenizer).clone();
            t.set_encode_special_tokens(true);
            t
        });
        encode(literal, &msg.text)
    }
}

fn encode(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, EngineError> {
    tokenizer
        .encode(text, false)
        .map(|e| e.get_ids().to_vec())
        .map_err(|e| EngineError::InvalidRequest(format!("cannot tokenize the prompt: {e}")))
}

/// Render a chat with the model's template and encode it.
#[derive(Message)]
#[rtype(result = "Result<Vec<u32>, EngineError>")]
pub struct EncodeChat {
    pub messages: serde_json::Value,
    pub tools: Option<serde_json::Value>,
    pub add_generation_prompt: bool,
    /// Text appended after the rendered prompt (the start of a forced assistant reply).
    pub assistant_prefix: String,
}

impl Handler<EncodeChat> for TokenizerActor {
    type Result = Result<Vec<u32>, EngineError>;
    fn handle(&mut self, msg: EncodeChat, _: &mut SyncContext<Self>) -> Self::Result {
        let template = self
            .template
            .as_ref()
            .ok_or_else(|| EngineError::InvalidRequest("this model has no chat template".into()))?;
        let text = template
            .render(
                &msg.messages,
                msg.tools.as_ref(),
                msg.add_generation_prompt,
                &serde_json::json!({}),
            )
            .map_err(|e| EngineError::InvalidRequest(format!("chat template: {e:#}")))?;
        encode(&self.tokenizer, &(text + &msg.assistant_prefix))
    }
}

/// A session's next prompt with the session's own tokens where they spell the same text (see
/// [`super::realign`]); `None` when that reuses nothing more.
#[derive(Message)]
#[rtype(result = "Option<Vec<u32>>")]
pub struct Realign {
    pub history: Vec<u32>,
    pub prompt: Vec<u32>,
}

impl Handler<Realign> for TokenizerActor {
    type Result = Option<Vec<u32>>;
    fn handle(&mut self, msg: Realign, _: &mut SyncContext<Self>) -> Self::Result {
        super::realign::realign_with(&self.tokenizer, &msg.history, &msg.prompt)
    }
}

/// Append generated tokens to stream `stream_id`; replies with the text they complete.
#[derive(Message)]
#[rtype(result = "String")]
pub struct Detokenize {
    pub stream_id: u64,
    pub token_ids: Vec<u32>,
    /// Flush what is held back and forget the stream.
    pub finish: bool,
}

/// How many streams' decoders are held (each forgotten when its stream ends, however it ends).
#[derive(Message)]
#[rtype(result = "usize")]
pub struct CountStreamDecoders;

impl Handler<CountStreamDecoders> for TokenizerActor {
    type Result = usize;
    fn handle(&mut self, _: CountStreamDecoders, _: &mut SyncContext<Self>) -> usize {
        self.streams.len()
    }
}

impl Handler<Detokenize> for TokenizerActor {
    type Result = String;
    fn handle(&mut self, msg: Detokenize, _: &mut SyncContext<Self>) -> String {
        let decoder = self.streams.entry(msg.stream_id).or_default();
        let mut text = String::new();
        for id in msg.token_ids {
            if let Some(t) = decoder.push(&self.tokenizer, id) {
                text.push_str(&t);
            }
        }
        if msg.finish {
            if let Some(t) = decoder.finish(&self.tokenizer) {
                text.push_str(&t);
            }
            self.streams.remove(&msg.stream_id);
        }
        text
    }
}
