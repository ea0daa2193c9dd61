//! Text ⇄ tokens at the edge of the engine.
//!
//! Owns: building the model's tokenizer (from GGUF `tokenizer.ggml.*` metadata, or a
//! `tokenizer.json` beside the weights), rendering chat templates (minijinja configured as
//! transformers configures Jinja2), and incremental detokenisation of generated tokens into
//! UTF-8-safe text deltas.
//!
//! Never touches: sessions, KV pages, scheduling or sampling. Everything here is plain data in,
//! plain data out (no actors, no shared state), so the tokenizer actor and tests can call it
//! directly. Depends only on external crates.
//!
//! Special tokens: GGUF control tokens (e.g. `<|im_start|>`, `<|im_end|>`) are *special*: never
//! split when encoding and skipped by `decode(.., skip_special_tokens = true)`. User-defined
//! tokens (e.g. Qwen's `<tool_call>`) are never split either but are always decoded, because
//! tool-call parsing downstream needs to see them.

pub mod actor;
mod gguf;
mod incremental;
mod pyjson;
pub(crate) mod template;

pub use gguf::{load_tokenizer, tokenizer_from_gguf};
pub use incremental::IncrementalDecoder;
pub use template::ChatTemplate;
