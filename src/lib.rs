//! mtpx: a local inference server for coding agents and chat.
//!
//! Data flows from the edge inwards, and the folders follow it:
//! `tokenizer` (text ⇄ ids, chat templates) → `kv` (page pool, page tables, paged attention) →
//! `runner` (ragged batches) → `model` (GGUF weights, the transformer) → `sampling` (logits →
//! next token) → `spec` (drafts verified in the same forward, exact acceptance, rollback). `pull`
//! fetches real models; `cli` wires the commands together.

pub mod api;
pub mod cli;
pub mod client;
pub mod config;
pub mod engine;
pub mod error;
pub mod kernels;
pub mod kv;
pub mod model;
pub mod pull;
pub mod runner;
pub mod sampling;
pub mod scheduler;
pub mod session;
pub mod spec;
pub mod tokenizer;
