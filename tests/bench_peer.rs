//! `mtpx bench-spec --peer`: the benchmark's requests sent to another OpenAI-compatible server
//! on loopback. The peer is mtpx itself serving the same generated test model, so its greedy
//! text must equal bench-spec's own plain output; a second peer that refuses connections must be
//! reported by name without stopping the run.

use mtpx::api::testing::{test_config, TestServer};
use mtpx::config::KvMemory;
use mtpx::engine::EngineConfig;
use mtpx::model::test_model::TestModelSpec;
use serde_json::Value;
use std::process::Command;

#[actix_rt::test]
async fn bench_spec_measures_peers_in_the_same_run() {
    // The engine bench-spec builds for its plain rows: f16 KV, 16-token pages, no speculation.
    let cfg = EngineConfig {
        kv_memory: KvMemory::Bytes(64 << 20),
        ..EngineConfig::default()
    };
    let server = TestServer::start(&TestModelSpec::default(), cfg, test_config()).unwrap();
    // A loopback port nobody listens on.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let gone = format!("http://127.0.0.1:{closed}");
    let args = vec![
        "bench-spec".to_string(),
        "--model".into(),
        server.model_path.display().to_string(),
        "--kv-memory".into(),
        "64MiB".into(),
        "--tokens".into(),
        "16".into(),
        "--json".into(),
        "--peer".into(),
        format!("self={}", server.url),
        "--peer".into(),
        format!("gone={gone}"),
    ];
    let out = actix_rt::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_mtpx"))
            .args(&args)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // The unreachable peer fails the command, after every row is printed.
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains(&format!("peer gone ({gone}) on task edit")),
        "{stderr}"
    );
    let report: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    let runs = report["runs"].as_array().unwrap();
    for task in ["edit", "free-form"] {
        let plain = runs
            .iter()
            .find(|r| r["task"] == task && r["speculative"] == false)
            .unwrap_or_else(|| panic!("no plain row for {task}: {stdout}"));
        let peer = runs
            .iter()
            .find(|r| r["task"] == task && r["peer"] == "self")
            .unwrap_or_else(|| panic!("no peer row for {task}: {stdout}"));
        assert_eq!(peer["url"], server.url.as_str());
        // mtpx's API sends llama.cpp-style timings.
        assert_eq!(peer["timing"], "server", "{peer}");
        let n = peer["completion_tokens"].as_u64().unwrap();
        assert!(n > 0, "{peer}");
        assert_eq!(n, plain["completion_tokens"].as_u64().unwrap(), "{peer}");
        assert_eq!(peer["prompt_tokens"], plain["prompt_tokens"], "{peer}");
        if n > 1 {
            assert!(peer["decode_tok_s"].as_f64().unwrap() > 0.0, "{peer}");
            assert!(peer["speedup"].as_f64().unwrap() > 0.0, "{peer}");
            assert_eq!(peer["speedup_vs_first_peer"], 1.0, "{peer}");
        }
        assert_eq!(peer["same_text"], true, "{peer}");
        assert_eq!(peer["drafted"], 0, "{peer}");
        let failed = runs
            .iter()
            .find(|r| r["task"] == task && r["peer"] == "gone")
            .unwrap_or_else(|| panic!("no row for the failed peer on {task}: {stdout}"));
        assert!(
            failed["error"].as_str().unwrap().contains(&gone),
            "{failed}"
        );
    }
    server.stop().await;
}
