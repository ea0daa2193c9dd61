//! llama.cpp's two stops for completions in an editor, which llama.vim and llama.vscode send
//! with every request:
//!
//! - `t_max_predict_ms`: stop at a newline generated after generation has run this long (a
//!   suggestion must come back while the user still waits, and end at a line's end);
//! - `n_indent`: after the first newline, stop at a line indented less than this (the
//!   completion left the block it was in), cutting that line after its indentation.
//!
//! Both end the reply as `n_predict` does (`stop_type: "limit"`). They watch the reply's text,
//! so they run between the engine and the reply: [`EditorStops::watch`] forwards a request's
//! events, holds back the start of a line until its indentation is known (a streamed reply
//! then never sends what the cut removes), and on a stop finishes the reply itself and drops
//! the engine's stream, which cancels the sequence at the next step.

use super::super::errors::ApiError;
use crate::engine::{EngineEvent, EventStream};
use crate::scheduler::{FinishReason, Usage};
use serde_json::Value;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::unbounded_channel;

/// The stops a request asked for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EditorStops {
    t_max_predict: Option<Duration>,
    n_indent: usize,
}

impl EditorStops {
    /// `t_max_predict_ms` and `n_indent` from a request (0 or absent: off); `None` when both are
    /// off.
    pub fn from_body(body: &Value) -> Result<Option<Self>, ApiError> {
        let field = |name: &str| match body.get(name) {
            None | Some(Value::Null) => Ok(0),
            Some(v) => v.as_u64().ok_or_else(|| {
                ApiError::invalid(
                    Some(name),
                    format!("`{name}` must be a non-negative integer, got `{v}`"),
                )
            }),
        };
        let (t_max, n_indent) = (field("t_max_predict_ms")?, field("n_indent")?);
        let stops = Self {
            t_max_predict: (t_max > 0).then(|| Duration::from_millis(t_max)),
            n_indent: n_indent as usize,
        };
        Ok((t_max > 0 || n_indent > 0).then_some(stops))
    }

    /// `events` with these stops applied.
    pub fn watch(self, mut events: EventStream) -> EventStream {
        let (tx, rx) = unbounded_channel();
        actix_rt::spawn(async move {
            let mut lines = Lines::new(self.n_indent);
            let (start, mut first_token) = (Instant::now(), None::<Instant>);
            let mut usage = Usage::default();
            loop {
                // A client that leaves is noticed at once, not at the next event: a queued or
                // prefilling request sends none for a while, and dropping `events` is what
                // cancels it.
                let event = tokio::select! {
                    event = events.recv() => event,
                    () = tx.closed() => return,
                };
                let Some(event) = event else { return };
                let event = match event {
                    EngineEvent::Started {
                        prompt_tokens,
                        cached_tokens,
                    } => {
                        (usage.prompt_tokens, usage.cached_tokens) = (prompt_tokens, cached_tokens);
                        event
                    }
                    EngineEvent::Delta {
                        text,
                        token_ids,
                        logprobs,
                        top_logprobs,
                        draft_depths,
                    } => {
                        let now = Instant::now();
                        let first = *first_token.get_or_insert(now);
                        usage.completion_tokens += token_ids.len();
                        let newline = text.contains('\n');
                        let (mut text, cut) = lines.push(&text);
                        let out_of_time = self
                            .t_max_predict
                            .is_some_and(|t| newline && now - first > t);
                        let stop = cut || out_of_time;
                        if stop {
                            text.push_str(&lines.release());
                        }
                        let delta = EngineEvent::Delta {
                            text,
                            token_ids,
                            logprobs,
                            top_logprobs,
                            draft_depths,
                        };
                        if stop {
                            usage.prompt_ms = (first - start).as_secs_f64() * 1e3;
                            usage.decode_ms = (now - first).as_secs_f64() * 1e3;
                            let finished = EngineEvent::Finished {
                                reason: FinishReason::Length,
                                usage,
                                stop_string: None,
                            };
                            if tx.send(delta).is_ok() {
                                let _ = tx.send(finished);
                            }
                            return; // dropping `events` cancels the sequence
                        }
                        delta
                    }
                    EngineEvent::Finished { .. } => {
                        let held = lines.release();
                        if !held.is_empty() && tx.send(text_delta(held)).is_err() {
                            return;
                        }
                        event
                    }
                    other => other,
                };
                if tx.send(event).is_err() {
                    return; // the client left
                }
            }
        });
        rx
    }
}

fn text_delta(text: String) -> EngineEvent {
    EngineEvent::Delta {
        text,
        token_ids: Vec::new(),
        logprobs: Vec::new(),
        top_logprobs: Vec::new(),
        draft_depths: Vec::new(),
    }
}

/// The reply's text as it grows: where lines start and how far each is indented.
struct Lines {
    n_indent: usize,
    /// Text of the current line not yet released: its indentation, while undecided.
    held: String,
    /// The current line's indentation is still being read (after a newline, with `n_indent`).
    reading_indent: bool,
}

impl Lines {
    fn new(n_indent: usize) -> Self {
        Self {
            n_indent,
            held: String::new(),
            reading_indent: false,
        }
    }

    /// Takes new text; returns what may be sent now, and whether `n_indent` cut the reply
    /// there (the rest of `text` dropped).
    fn push(&mut self, text: &str) -> (String, bool) {
        let mut out = String::new();
        for c in text.chars() {
            if self.reading_indent {
                if c == ' ' || c == '\t' {
                    self.held.push(c);
                    continue;
                }
                // llama.cpp counts spaces and tabs alike; any other character (a newline
                // too: an empty line) ends the indentation.
                let indent = self.held.chars().count();
                out.push_str(&std::mem::take(&mut self.held));
                self.reading_indent = false;
                if indent < self.n_indent {
                    return (out, true);
                }
            }
            out.push(c);
            if c == '\n' {
                self.reading_indent = self.n_indent > 0;
            }
        }
        (out, false)
    }

    /// What is held back, released (the reply ends).
    fn release(&mut self) -> String {
        self.reading_indent = false;
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds pieces in turn; returns the text sent and whether it was cut.
    fn run(n_indent: usize, pieces: &[&str]) -> (String, bool) {
        let mut lines = Lines::new(n_indent);
        let mut sent = String::new();
        for piece in pieces {
            let (text, cut) = lines.push(piece);
            sent.push_str(&text);
            if cut {
                return (sent, true);
            }
        }
        sent.push_str(&lines.release());
        (sent, false)
    }

    #[test]
    fn a_line_indented_less_than_n_indent_ends_the_reply_after_its_indentation() {
        // The first line is never checked (it continues the cursor's line).
        let pieces = ["return", " a + b", "\n", "  ", "print", "(x)"];
        assert_eq!(run(4, &pieces), ("return a + b\n  ".into(), true));
        // An empty line counts as indentation 0, as in llama.cpp.
        assert_eq!(run(4, &["x = 1\n", "\n", "y"]), ("x = 1\n".into(), true));
        // Deep enough: everything passes, in any split.
        let deep = ["if x:\n", "    ", "  y = 1\n", "\t\t\t\tz"];
        assert_eq!(
            run(4, &deep),
            ("if x:\n      y = 1\n\t\t\t\tz".into(), false)
        );
        let whole: String = deep.concat();
        assert_eq!(run(4, &[&whole]), (whole.clone(), false));
        // Off: no cut.
        assert_eq!(run(0, &["a\nb"]), ("a\nb".into(), false));
    }

    #[test]
    fn indentation_still_undecided_is_held_back_then_released_at_the_end() {
        let mut lines = Lines::new(4);
        assert_eq!(lines.push("a\n  "), ("a\n".into(), false));
        assert_eq!(lines.release(), "  ");
    }

    #[test]
    fn fields_are_read_and_checked() {
        use serde_json::json;
        assert_eq!(EditorStops::from_body(&json!({})).unwrap(), None);
        assert_eq!(
            EditorStops::from_body(&json!({"t_max_predict_ms": 0, "n_indent": 0})).unwrap(),
            None
        );
        let stops = EditorStops::from_body(&json!({"t_max_predict_ms": 250, "n_indent": 4}))
            .unwrap()
            .unwrap();
        assert_eq!(stops.t_max_predict, Some(Duration::from_millis(250)));
        assert_eq!(stops.n_indent, 4);
        let refused = EditorStops::from_body(&json!({"n_indent": -1})).unwrap_err();
        assert_eq!(refused.param.as_deref(), Some("n_indent"));
    }
}
