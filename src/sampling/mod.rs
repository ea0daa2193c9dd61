//! Sampling: turns one row of logits (`[num_vocab]`, up to 151,936 entries) into the next token.
//!
//! Owns: [`SamplingParams`] and their validation, the per-sequence [`Sampler`] (its seeded
//! ChaCha20 RNG and its scratch buffers), and the final [`Distribution`] the speculative verifier
//! reads `p(x)` and the residual `(p − q)+` from. Never touches: the model, tensors, KV pages,
//! or wire types — the caller hands in a plain `&[f32]` row and token ids.
//!
//! # Order of processing
//!
//! 1. `logit_bias` (a bias of -100 sets the logit to `-inf`: an exact ban),
//! 2. repetition penalty (prompt + generated tokens in the window), then presence and frequency
//!    penalties (generated tokens only, OpenAI semantics),
//!    then the output grammar (`response_format`, see [`constraint`]): tokens it does not allow
//!    next become `-inf`,
//! 3. greedy (temperature 0): argmax, ties to the lowest token id — done;
//! 4. top-k, 5. temperature, 6. softmax, 7. top-p, 8. min-p (relative to the most likely token),
//!    9. renormalise, 10. draw with the sampler's RNG.
//!
//! This is llama.cpp's default chain (penalties → top-k → top-p → min-p → temperature → draw)
//! except that the temperature comes before top-p and min-p, as in HF transformers and vLLM, so
//! top-p's mass and min-p's ratio are measured on the distribution actually sampled from.
//! Reported log-probabilities are OpenAI's: the model distribution after bias and penalties at
//! temperature 1, before any filter, so they do not change with the sampling settings.
//!
//! NaN logits are treated like `-inf` (never chosen); `+inf` like the largest finite logit.
//!
//! # Cost
//!
//! No call sorts the vocabulary. Greedy is one vectorised pass; top-k one pass with a k-sized
//! heap that skips blocks below its worst entry; the softmax one vectorised pass with a
//! branch-free `exp` (AVX2 when the CPU has it, same results either way); top-p looks at the
//! best 64 tokens and, only when they hold too little mass, buckets the probabilities and
//! partially sorts the one bucket where the mass crosses `top_p`; min-p is a filter. Bias and
//! penalties copy the row once and touch only the affected tokens. A `Sampler`'s buffers are
//! reused, so it allocates only on its first call (and for the `top_logprobs` list when asked
//! for). Building a [`Distribution`] sorts the surviving candidates by id, which costs more when
//! top-p keeps much of the vocabulary; only the speculative verifier needs one.

mod constraint;
mod distribution;
pub mod gbnf;
mod kernels;
mod lazy_calls;
mod params;
mod penalties;
mod sampler;
mod select;
#[cfg(test)]
mod stats_tests;

pub use constraint::{prepare_json_schema, Grammars, OutputFormat, TokenConstraint};
pub use distribution::Distribution;
pub use params::{SamplingParams, SamplingParamsError, BAN_BIAS, MAX_TOP_LOGPROBS};
pub use penalties::TokenHistory;
pub(crate) use sampler::token_logprobs;
pub use sampler::{SampleOutput, Sampler, SamplingError};
