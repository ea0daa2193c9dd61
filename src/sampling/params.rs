//! Per-request sampling parameters and their validation.
//!
//! The API layer deserialises these (OpenAI field names and meanings) and calls
//! [`SamplingParams::validate`] and [`SamplingParams::validate_for_vocab`] before any inference,
//! so a bad value becomes an HTTP 400 naming the field rather than an error mid-generation.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The most alternatives a response may ask for per position (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// A `logit_bias` at or below this value bans the token outright (its logit becomes `-inf`),
/// which is what OpenAI documents for -100.
pub const BAN_BIAS: f32 = -100.0;

/// How to turn one row of logits into the next token.
///
/// Defaults are OpenAI's: temperature 1, every filter off, no penalties. Temperature 0 means
/// greedy decoding. See the module docs for the order in which the fields are applied.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Divides the logits before the softmax; 0 means greedy (argmax). Range `0..=2`.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 turns it off. Signed so that a negative value
    /// from a client gets a validation error naming the field rather than a parse error.
    pub top_k: i32,
    /// Nucleus sampling: keep the smallest set of most likely tokens whose mass is at least
    /// `top_p`; 1 turns it off. Range `(0, 1]`.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the most likely token's; 0 turns it
    /// off. Range `[0, 1]`.
    pub min_p: f32,
    /// HF / llama.cpp repetition penalty over prompt and generated tokens: a positive logit is
    /// divided by it, a negative one multiplied. 1 turns it off; must be > 0.
    pub repetition_penalty: f32,
    /// How many of the most recent tokens (prompt followed by generated) the repetition penalty
    /// looks at; 0 means all of them (HF's behaviour; llama.cpp's `repeat_last_n` is 64).
    pub repetition_window: u32,
    /// OpenAI presence penalty: subtracted once from every token already generated. `-2..=2`.
    pub presence_penalty: f32,
    /// OpenAI frequency penalty: subtracted once per earlier generation of the token. `-2..=2`.
    pub frequency_penalty: f32,
    /// Token id to an additive bias in `-100..=100`; -100 bans the token.
    pub logit_bias: BTreeMap<u32, f32>,
    /// Seeds the sampler's RNG; `None` picks a random seed (readable from the sampler).
    pub seed: Option<u64>,
    /// Report the log-probability of each chosen token.
    pub logprobs: bool,
    /// How many most likely alternatives to report per position, `0..=20`; needs `logprobs`.
    pub top_logprobs: u32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            repetition_window: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: BTreeMap::new(),
            seed: None,
            logprobs: false,
            top_logprobs: 0,
        }
    }
}

/// Why a [`SamplingParams`] was refused. Every variant names the offending request field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingParamsError {
    /// A number outside its documented range (NaN is always out of range).
    #[error("`{field}` must be {expected}, got {value}")]
    OutOfRange {
        field: &'static str,
        expected: &'static str,
        value: String,
    },
    /// `top_logprobs` was set without `logprobs` (OpenAI refuses this too).
    #[error("`top_logprobs` requires `logprobs` to be true")]
    TopLogprobsWithoutLogprobs,
    /// A `logit_bias` key that is not a token of this model.
    #[error("`logit_bias` names token {token_id}, but the vocabulary has {num_vocab} tokens")]
    BiasTokenOutOfVocab { token_id: u32, num_vocab: usize },
}

impl SamplingParamsError {
    /// The request field at fault, for the OpenAI error's `param`.
    pub fn field(&self) -> &'static str {
        match self {
            Self::OutOfRange { field, .. } => field,
            Self::TopLogprobsWithoutLogprobs => "top_logprobs",
            Self::BiasTokenOutOfVocab { .. } => "logit_bias",
        }
    }
}

impl SamplingParams {
    /// Greedy parameters: temperature 0, everything else default.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// True when decoding is deterministic argmax (temperature 0).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Checks every range that does not depend on the model.
    pub fn validate(&self) -> Result<(), SamplingParamsError> {
        check("temperature", self.temperature, "in 0..=2", |v| {
            (0.0..=2.0).contains(&v)
        })?;
        if self.top_k < 0 {
            return Err(out_of_range("top_k", ">= 0 (0 = off)", self.top_k));
        }
        check("top_p", self.top_p, "in (0, 1]", |v| v > 0.0 && v <= 1.0)?;
        check("min_p", self.min_p, "in [0, 1]", |v| {
            (0.0..=1.0).contains(&v)
        })?;
        check("repetition_penalty", self.repetition_penalty, "> 0", |v| {
            v > 0.0 && v.is_finite()
        })?;
        let penalty_range = |v: f32| (-2.0..=2.0).contains(&v);
        check(
            "presence_penalty",
            self.presence_penalty,
            "in -2..=2",
            penalty_range,
        )?;
        check(
            "frequency_penalty",
            self.frequency_penalty,
            "in -2..=2",
            penalty_range,
        )?;
        for &bias in self.logit_bias.values() {
            check("logit_bias", bias, "in -100..=100", |v| {
                (-100.0..=100.0).contains(&v)
            })?;
        }
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return Err(out_of_range("top_logprobs", "in 0..=20", self.top_logprobs));
        }
        if self.top_logprobs > 0 && !self.logprobs {
            return Err(SamplingParamsError::TopLogprobsWithoutLogprobs);
        }
        Ok(())
    }

    /// Checks the fields that depend on the model: every `logit_bias` key is a token id.
    pub fn validate_for_vocab(&self, num_vocab: usize) -> Result<(), SamplingParamsError> {
        match self.logit_bias.keys().find(|&&id| id as usize >= num_vocab) {
            Some(&token_id) => Err(SamplingParamsError::BiasTokenOutOfVocab {
                token_id,
                num_vocab,
            }),
            None => Ok(()),
        }
    }

    /// True when sampling reads the tokens seen so far (a penalty is on).
    pub fn reads_history(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }

    /// True when some logit may change before selection (bias or a penalty is on).
    pub(crate) fn modifies_logits(&self) -> bool {
        !self.logit_bias.is_empty()
            || self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }
}

fn check(
    field: &'static str,
    value: f32,
    expected: &'static str,
    ok: impl Fn(f32) -> bool,
) -> Result<(), SamplingParamsError> {
    if ok(value) {
        Ok(())
    } else {
        Err(out_of_range(field, expected, value))
    }
}

fn out_of_range(
    field: &'static str,
    expected: &'static str,
    value: impl ToString,
) -> SamplingParamsError {
    SamplingParamsError::OutOfRange {
        field,
        expected,
        value: value.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(params: SamplingParams) -> &'static str {
        params.validate().unwrap_err().field()
    }

    #[test]
    fn defaults_are_openai_defaults_and_valid() {
        let params = SamplingParams::default();
        assert_eq!(params.temperature, 1.0);
        assert!(!params.is_greedy());
        assert!(params.validate().is_ok());
        assert!(SamplingParams::greedy().is_greedy());
    }

    #[test]
    fn each_out_of_range_value_names_its_field() {
        let base = SamplingParams::default;
        let cases: Vec<(SamplingParams, &str)> = vec![
            (
                SamplingParams {
                    temperature: 2.5,
                    ..base()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: -0.1,
                    ..base()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..base()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    top_k: -1,
                    ..base()
                },
                "top_k",
            ),
            (
                SamplingParams {
                    top_p: 0.0,
                    ..base()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    top_p: 1.01,
                    ..base()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    min_p: -0.5,
                    ..base()
                },
                "min_p",
            ),
            (
                SamplingParams {
                    min_p: 1.5,
                    ..base()
                },
                "min_p",
            ),
            (
                SamplingParams {
                    repetition_penalty: 0.0,
                    ..base()
                },
                "repetition_penalty",
            ),
            (
                SamplingParams {
                    presence_penalty: 2.1,
                    ..base()
                },
                "presence_penalty",
            ),
            (
                SamplingParams {
                    frequency_penalty: -2.1,
                    ..base()
                },
                "frequency_penalty",
            ),
            (
                SamplingParams {
                    top_logprobs: 21,
                    logprobs: true,
                    ..base()
                },
                "top_logprobs",
            ),
            (
                SamplingParams {
                    top_logprobs: 3,
                    ..base()
                },
                "top_logprobs",
            ),
            (
                SamplingParams {
                    logit_bias: BTreeMap::from([(5, 101.0)]),
                    ..base()
                },
                "logit_bias",
            ),
        ];
        for (params, field) in cases {
            assert_eq!(field_of(params.clone()), field, "{params:?}");
        }
    }

    #[test]
    fn boundary_values_are_accepted() {
        let params = SamplingParams {
            temperature: 2.0,
            top_p: 1.0,
            min_p: 1.0,
            presence_penalty: -2.0,
            frequency_penalty: 2.0,
            logit_bias: BTreeMap::from([(0, -100.0), (1, 100.0)]),
            logprobs: true,
            top_logprobs: 20,
            ..SamplingParams::default()
        };
        assert_eq!(params.validate(), Ok(()));
    }

    #[test]
    fn error_message_is_precise() {
        let err = SamplingParams {
            top_p: 0.0,
            ..SamplingParams::default()
        }
        .validate()
        .unwrap_err();
        assert_eq!(err.to_string(), "`top_p` must be in (0, 1], got 0");
    }

    #[test]
    fn bias_keys_are_checked_against_the_vocabulary() {
        let params = SamplingParams {
            logit_bias: BTreeMap::from([(3, 1.0), (10, 1.0)]),
            ..SamplingParams::default()
        };
        assert!(params.validate_for_vocab(11).is_ok());
        assert_eq!(
            params.validate_for_vocab(10),
            Err(SamplingParamsError::BiasTokenOutOfVocab {
                token_id: 10,
                num_vocab: 10
            })
        );
    }

    #[test]
    fn deserialises_openai_shaped_json_with_string_bias_keys() {
        let json = r#"{"temperature":0.7,"top_p":0.9,"seed":42,"logit_bias":{"50256":-100}}"#;
        let params: SamplingParams = serde_json::from_str(json).unwrap();
        assert_eq!(params.temperature, 0.7);
        assert_eq!(params.seed, Some(42));
        assert_eq!(params.logit_bias.get(&50256), Some(&-100.0));
        assert_eq!(params.top_k, 0, "missing fields take their defaults");
    }
}
