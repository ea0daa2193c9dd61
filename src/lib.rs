//! mtpx: a local inference server for coding agents and chat.
//!
//! Data flows from the edge inwards: tokenizer → session page tables (`kv`) → scheduler →
//! model runner (`runner`, `model`) → sampler (`sampling`). Each folder owns one stage; see
//! `DESIGN.md` in the shared docs for the whole picture.

pub mod error;
pub mod kv;
pub mod model;
pub mod runner;
