//! The agent regression over HTTP on the test model, to a 66,560-token window: system prompt
//! and tool definitions, a task, the assistant's `write` tool call carrying a 3,400-token file,
//! the tool result, then continuation turns past 16,384 and 19,295 tokens toward the window,
//! all in one `X-Session-Id` (the session itself is `fixtures/api/agent_session.rs`, shared
//! with the Qwen2.5-Coder-0.5B run in `api_real_model.rs`).

#[path = "fixtures/agent.rs"]
mod agent;
#[path = "fixtures/api/agent_session.rs"]
mod agent_session;
#[path = "fixtures/api/client.rs"]
mod client;

use agent::WINDOW;
use agent_session::{agent_session, AgentPlan};
use mtpx::api::testing::{test_config, TestServer};
use mtpx::config::KvMemory;
use mtpx::engine::EngineConfig;
use mtpx::kv::KvDtype;
use mtpx::model::test_model::TestModelSpec;

#[actix_rt::test]
async fn an_agent_session_over_http_grows_past_16k_and_19k_to_a_66k_window() {
    let spec = TestModelSpec {
        layers: 1,
        hidden: 32,
        heads: 2,
        kv_heads: 1,
        head_dim: 16,
        intermediate: 64,
        ..TestModelSpec::default()
    };
    let cfg = EngineConfig {
        context_window: Some(WINDOW),
        kv_memory: KvMemory::Bytes(256 << 20),
        kv_dtype: KvDtype::F16,
        ..EngineConfig::default()
    };
    let s = TestServer::start(&spec, cfg, test_config()).unwrap();
    let plan = AgentPlan {
        window: WINDOW,
        tool_result_tokens: 5_000,
        max_tokens: 32,
        stop_within: 6_000,
        min_last_prompt: 60_000,
    };
    agent_session(&s, &plan).await;
    s.stop().await;
}
