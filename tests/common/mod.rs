//! Shared helpers for the engine tests: a generated test model, an engine over it, and a way to
//! drain a request's events.
#![allow(dead_code)]

use mtpx::engine::{Engine, EngineConfig, EngineEvent, EventStream, GenerateRequest, Prompt};
use mtpx::error::EngineError;
use mtpx::model::test_model::{write_test_model, TestModelSpec};
use mtpx::model::ModelBundle;
use mtpx::sampling::SamplingParams;
use mtpx::scheduler::{FinishReason, Usage};

/// An HTTP server on loopback of the pulled Qwen2.5-Coder-0.5B-Instruct: a 2,048-token window,
/// f16 K/V in 128 MiB (the API suites of other clients' shapes).
pub fn small_qwen_server() -> mtpx::api::testing::TestServer {
    let engine = EngineConfig {
        context_window: Some(2048),
        kv_memory: mtpx::config::KvMemory::Bytes(128 << 20),
        kv_dtype: mtpx::kv::KvDtype::F16,
        ..EngineConfig::default()
    };
    let model = pulled_model("qwen2.5-coder-0.5b");
    mtpx::api::testing::TestServer::start_model(model, engine, mtpx::api::testing::test_config())
        .unwrap()
}

/// A model `mtpx pull` put in `$MTPX_HOME/models` (default `~/.cache/mtpx`); `tests/run.sh`
/// pulls the ones the tests use.
pub fn pulled_model(name: &str) -> std::path::PathBuf {
    let home = std::env::var_os("MTPX_HOME")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/mtpx")
        });
    let path = home.join("models").join(format!("{name}.gguf"));
    assert!(
        path.exists(),
        "{} is missing: run `mtpx pull {name}` (tests/run.sh does)",
        path.display()
    );
    path
}

pub struct TestEngine {
    pub engine: Engine,
    _dir: tempfile::TempDir,
}

pub fn start_engine(spec: &TestModelSpec, cfg: EngineConfig) -> TestEngine {
    let dir = tempfile::tempdir().unwrap();
    let path = write_test_model(dir.path(), spec).unwrap();
    let bundle = ModelBundle::load(&path).unwrap();
    TestEngine {
        engine: Engine::start(bundle, cfg).unwrap(),
        _dir: dir,
    }
}

/// An engine over the test model `spec` with a second generated model `draft` drafting for it.
pub fn start_engine_with_draft(
    spec: &TestModelSpec,
    draft: &TestModelSpec,
    mut cfg: EngineConfig,
) -> TestEngine {
    let dir = tempfile::tempdir().unwrap();
    let path = write_test_model(dir.path(), spec).unwrap();
    cfg.draft_model = Some(write_test_model(&dir.path().join("draft"), draft).unwrap());
    let bundle = ModelBundle::load(&path).unwrap();
    TestEngine {
        engine: Engine::start(bundle, cfg).unwrap(),
        _dir: dir,
    }
}

/// A pulled real model's file (`mtpx pull NAME`; tests/run.sh pulls the CI models).
pub fn real_model(name: &str) -> std::path::PathBuf {
    let home = std::env::var_os("MTPX_HOME")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/mtpx")
        });
    let path = home.join(format!("models/{name}.gguf"));
    assert!(path.exists(), "run `mtpx pull {name}` first");
    path
}

#[derive(Debug, Default, Clone)]
pub struct Outcome {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub text: String,
    pub token_ids: Vec<u32>,
    /// With `sampling.logprobs` on: the log-probability of each generated token.
    pub logprobs: Vec<Option<f32>>,
    pub finish: Option<FinishReason>,
    pub usage: Usage,
    pub error: Option<EngineError>,
    /// With `prompt_logprobs`: the prompt's token ids, their logprobs and top alternatives.
    pub prompt_logprobs: Option<ScoredPrompt>,
}

/// A prompt's token ids, their log-probabilities and top alternatives.
pub type ScoredPrompt = (Vec<u32>, Vec<Option<f32>>, Vec<Vec<(u32, f32)>>);

pub async fn drain(mut stream: EventStream) -> Outcome {
    let mut out = Outcome::default();
    while let Some(event) = stream.recv().await {
        match event {
            EngineEvent::Started {
                prompt_tokens,
                cached_tokens,
            } => {
                out.prompt_tokens = prompt_tokens;
                out.cached_tokens = cached_tokens;
            }
            EngineEvent::Delta {
                text,
                token_ids,
                logprobs,
                ..
            } => {
                out.text.push_str(&text);
                out.token_ids.extend(token_ids);
                out.logprobs.extend(logprobs);
            }
            EngineEvent::PromptLogprobs {
                token_ids,
                logprobs,
                top_logprobs,
            } => {
                assert!(
                    out.token_ids.is_empty() && out.prompt_logprobs.is_none(),
                    "the prompt's scores come once, before the first generated token"
                );
                out.prompt_logprobs = Some((token_ids, logprobs, top_logprobs));
            }
            EngineEvent::Finished { reason, usage, .. } => {
                out.finish = Some(reason);
                out.usage = usage;
            }
            EngineEvent::Error(e) => out.error = Some(e),
        }
    }
    out
}

pub fn greedy_tokens(tokens: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    let mut req = GenerateRequest::new(Prompt::Tokens(tokens));
    req.max_tokens = Some(max_tokens);
    req.sampling = SamplingParams::greedy();
    // The random test model may emit an end-of-turn token anywhere; ban the special tokens (the
    // last 9 ids of its vocabulary) so lengths are predictable.
    req.sampling.logit_bias = (503..512).map(|id| (id, -100.0)).collect();
    req
}

/// Greedy, with each token's log-probability: reused K/V that is slightly wrong shows in the
/// log-probabilities long before it changes an argmax.
pub fn greedy_with_logprobs(tokens: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    let mut req = greedy_tokens(tokens, max_tokens);
    req.sampling.logprobs = true;
    req
}

/// The same tokens with log-probabilities within `tol` of each other.
pub fn assert_same_generation(a: &Outcome, b: &Outcome, tol: f32) {
    assert_eq!(a.token_ids, b.token_ids);
    assert_eq!(a.logprobs.len(), b.logprobs.len());
    for (i, (x, y)) in a.logprobs.iter().zip(&b.logprobs).enumerate() {
        let (x, y) = (
            x.expect("logprobs asked for"),
            y.expect("logprobs asked for"),
        );
        assert!((x - y).abs() <= tol, "token {i}: logprob {x} vs {y}");
    }
}

pub async fn run(engine: &Engine, req: GenerateRequest) -> Outcome {
    match engine.submit(req).await {
        Ok(stream) => drain(stream).await,
        Err(e) => Outcome {
            error: Some(e),
            ..Outcome::default()
        },
    }
}

/// Deterministic pseudo-random token ids below `vocab` (avoiding the special tokens at the end).
pub fn token_ids(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % 500) as u32
        })
        .collect()
}
