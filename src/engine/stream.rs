//! Turns a sequence's committed token ids into text deltas (through the tokenizer actor) and
//! applies stop strings. A stop string ends the request the same way a disconnect does: this
//! task closes the scheduler's channel, and the scheduler frees the pages at its next step;
//! the reply's end waits for that, so the client's next turn finds its session free. A client
//! that drops its stream is noticed at once, whether or not a token is on its way.
//!
//! Tokens travel with their text: a token is sent once some of its text is (text that could
//! still begin a stop string is held back, and so are its tokens), and the tokens that only
//! spell a matched stop string are never sent, so `token_ids` and `logprobs` describe the
//! returned text (as llama.cpp's server does). `completion_tokens` still counts every token
//! generated.

use super::request::EngineEvent;
use crate::scheduler::{FinishReason, MaxTokensCut, SeqEvent, Usage};
use crate::tokenizer::actor::{Detokenize, TokenizerActor};
use actix::Addr;
use std::time::Instant;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

pub struct StreamTask {
    pub stream_id: u64,
    pub tokenizer: Addr<TokenizerActor>,
    pub stop: Vec<String>,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    /// The request's `max_tokens`, when the engine cut it to the window (reported in usage).
    pub max_tokens_cut: Option<MaxTokensCut>,
    pub from_scheduler: UnboundedReceiver<SeqEvent>,
    /// Resolves once the scheduler has let the sequence go (see `Submission::turn_ended`).
    pub turn_end: tokio::sync::oneshot::Receiver<()>,
    pub to_client: UnboundedSender<EngineEvent>,
}

/// A generated token whose text has not been sent yet.
struct HeldToken {
    token_id: u32,
    logprob: Option<f32>,
    top_logprobs: Vec<(u32, f32)>,
    draft_depth: u8,
    /// Where its text starts in the held text.
    start: usize,
}

/// The held tokens to send with `emitted` bytes of text, once `split_at_stop` has taken them
/// and left `still_held` bytes. All text out: all tokens go (those with no text of their own
/// too). Otherwise the tokens whose text starts in what was emitted go; the ones that spell
/// only the held text stay (and are dropped with it when it was a matched stop string).
fn release(
    held: &mut Vec<HeldToken>,
    emitted: usize,
    still_held: usize,
    stopped: bool,
) -> Vec<HeldToken> {
    if !stopped && still_held == 0 {
        return std::mem::take(held);
    }
    let n = held.iter().take_while(|t| t.start < emitted).count();
    let released: Vec<HeldToken> = held.drain(..n).collect();
    for t in held.iter_mut() {
        t.start -= emitted;
    }
    released
}

fn delta(text: String, tokens: Vec<HeldToken>) -> EngineEvent {
    EngineEvent::Delta {
        text,
        token_ids: tokens.iter().map(|t| t.token_id).collect(),
        logprobs: tokens.iter().map(|t| t.logprob).collect(),
        draft_depths: tokens.iter().map(|t| t.draft_depth).collect(),
        top_logprobs: tokens.into_iter().map(|t| t.top_logprobs).collect(),
    }
}

impl StreamTask {
    pub async fn run(mut self) {
        let started = Instant::now();
        let mut held = String::new();
        let mut held_tokens: Vec<HeldToken> = Vec::new();
        let mut num_generated = 0usize;
        let mut first_token_at = None;
        // Whether the tokenizer was told the stream ended (it then forgets its decoder).
        let mut decoder_forgotten = false;
        loop {
            // A client that drops its stream while nothing is sent (in the queue, during the
            // prefill) cancels as surely as one that drops it between tokens.
            let event = tokio::select! {
                event = self.from_scheduler.recv() => event,
                () = self.to_client.closed() => break,
            };
            let Some(event) = event else { break };
            match event {
                SeqEvent::Token {
                    token_id,
                    logprob,
                    top_logprobs,
                    draft_depth,
                    drafts,
                } => {
                    num_generated += 1;
                    first_token_at.get_or_insert_with(Instant::now);
                    let text = self.detokenize(vec![token_id], false).await;
                    held_tokens.push(HeldToken {
                        token_id,
                        logprob,
                        top_logprobs,
                        draft_depth,
                        start: held.len(),
                    });
                    held.push_str(&text);
                    let (emit, stop_string) = self.split_at_stop(&mut held, false);
                    let stopped = stop_string.is_some();
                    let tokens = release(&mut held_tokens, emit.len(), held.len(), stopped);
                    if (!emit.is_empty() || !tokens.is_empty())
                        && self.to_client.send(delta(emit, tokens)).is_err()
                    {
                        break; // the client is gone: dropping our receiver cancels the sequence
                    }
                    if stopped {
                        let first = first_token_at.unwrap_or(started);
                        let usage = Usage {
                            prompt_tokens: self.prompt_tokens,
                            completion_tokens: num_generated,
                            cached_tokens: self.cached_tokens,
                            prompt_ms: first.duration_since(started).as_secs_f64() * 1e3,
                            decode_ms: first.elapsed().as_secs_f64() * 1e3,
                            max_tokens_cut: self.max_tokens_cut,
                            ..Usage::default()
                        }
                        .with_drafts(drafts);
                        // Cancel the sequence and let its turn end before the reply does.
                        self.from_scheduler.close();
                        let _ = (&mut self.turn_end).await;
                        self.detokenize(Vec::new(), true).await;
                        decoder_forgotten = true;
                        log_finished(self.stream_id, FinishReason::Stop, &usage);
                        let _ = self.to_client.send(EngineEvent::Finished {
                            reason: FinishReason::Stop,
                            usage,
                            stop_string,
                        });
                        break;
                    }
                }
                SeqEvent::PromptLogprobs {
                    token_ids,
                    logprobs,
                    top_logprobs,
                } => {
                    let event = EngineEvent::PromptLogprobs {
                        token_ids,
                        logprobs,
                        top_logprobs,
                    };
                    if self.to_client.send(event).is_err() {
                        break;
                    }
                }
                // Embedding requests are answered by `Engine::embed`, not by a stream.
                SeqEvent::Embedding { .. } => {}
                SeqEvent::Finished { reason, mut usage } => {
                    usage.max_tokens_cut = self.max_tokens_cut;
                    held.push_str(&self.detokenize(Vec::new(), true).await);
                    decoder_forgotten = true;
                    let (emit, stop_string) = self.split_at_stop(&mut held, true);
                    let stopped = stop_string.is_some();
                    let tokens = release(&mut held_tokens, emit.len(), held.len(), stopped);
                    if !emit.is_empty() || !tokens.is_empty() {
                        let _ = self.to_client.send(delta(emit, tokens));
                    }
                    let reason = if stopped { FinishReason::Stop } else { reason };
                    log_finished(self.stream_id, reason, &usage);
                    let _ = self.to_client.send(EngineEvent::Finished {
                        reason,
                        usage,
                        stop_string,
                    });
                    break;
                }
                SeqEvent::Error(e) => {
                    self.detokenize(Vec::new(), true).await;
                    decoder_forgotten = true;
                    let _ = self.to_client.send(EngineEvent::Error(e));
                    break;
                }
            }
        }
        // A client that left mid-stream: its decoder must not stay behind (a long-running
        // server sees thousands of dropped streams).
        if !decoder_forgotten {
            self.tokenizer.do_send(Detokenize {
                stream_id: self.stream_id,
                token_ids: Vec::new(),
                finish: true,
            });
        }
    }

    async fn detokenize(&self, token_ids: Vec<u32>, finish: bool) -> String {
        self.tokenizer
            .send(Detokenize {
                stream_id: self.stream_id,
                token_ids,
                finish,
            })
            .await
            .unwrap_or_default()
    }

    /// Takes from `held` the text that can be emitted: everything before a stop string (then
    /// that string: the earliest match, the longest of those starting there), or everything
    /// except a tail that could still become one. At the end of the stream (`last`) nothing is
    /// held back.
    fn split_at_stop(&self, held: &mut String, last: bool) -> (String, Option<String>) {
        let matched = self
            .stop
            .iter()
            .filter_map(|s| {
                held.find(s.as_str())
                    .map(|at| (at, std::cmp::Reverse(s.len()), s))
            })
            .min();
        if let Some((at, _, stop)) = matched {
            let emit = held[..at].to_string();
            held.clear();
            return (emit, Some(stop.clone()));
        }
        if last {
            return (std::mem::take(held), None);
        }
        let keep = self
            .stop
            .iter()
            .map(|s| longest_suffix_prefix(held, s))
            .max()
            .unwrap_or(0);
        let cut = held.len() - keep;
        let emit = held[..cut].to_string();
        held.replace_range(..cut, "");
        (emit, None)
    }
}

/// Length in bytes of the longest suffix of `text` that is a proper prefix of `stop`.
fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    (1..stop.len())
        .rev()
        .filter(|&n| stop.is_char_boundary(n) && n <= text.len())
        .find(|&n| text.is_char_boundary(text.len() - n) && text.ends_with(&stop[..n]))
        .unwrap_or(0)
}

/// One line per finished request, as llama.cpp's server and vLLM log them: what was reused,
/// computed and generated, and how long it took (the agent tests read `cached_tokens` here).
fn log_finished(stream_id: u64, reason: FinishReason, u: &Usage) {
    tracing::info!(
        stream = stream_id,
        finish = ?reason,
        prompt_tokens = u.prompt_tokens,
        cached_tokens = u.cached_tokens,
        completion_tokens = u.completion_tokens,
        prompt_ms = u.prompt_ms.round() as u64,
        decode_ms = u.decode_ms.round() as u64,
        "request finished"
    );
}

#[cfg(test)]
mod tests {
    use super::longest_suffix_prefix;

    #[test]
    fn a_partial_stop_string_at_the_end_is_held_back() {
        assert_eq!(longest_suffix_prefix("hello EN", "END"), 2);
        assert_eq!(longest_suffix_prefix("hello", "END"), 0);
        assert_eq!(longest_suffix_prefix("x</to", "</tool>"), 4);
        assert_eq!(longest_suffix_prefix("héé", "ée"), 2);
    }
}
