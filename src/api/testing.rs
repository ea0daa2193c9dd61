//! A real HTTP server on loopback over the generated test model, for integration tests of this
//! crate and of clients built on it (WebSocket, playground). Call inside an actix system
//! (`#[actix_rt::test]`).

use super::{detokenizer_of, http_server, ApiConfig, AppState};
use crate::engine::{Engine, EngineConfig};
use crate::model::test_model::{write_test_model, TestModelSpec};
use crate::model::ModelBundle;
use actix_web::dev::ServerHandle;
use actix_web::web;
use anyhow::Result;
use std::path::PathBuf;

/// The id the test server serves its model as.
pub const TEST_MODEL_ID: &str = "test-model";

pub struct TestServer {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    pub state: web::Data<AppState>,
    pub model_path: PathBuf,
    handle: ServerHandle,
    _dir: Option<tempfile::TempDir>,
}

impl TestServer {
    /// A ready server: test model written, engine started, HTTP bound to 127.0.0.1:0.
    pub fn start(spec: &TestModelSpec, engine: EngineConfig, config: ApiConfig) -> Result<Self> {
        let server = Self::start_loading(spec, config)?;
        server.load(engine)?;
        Ok(server)
    }

    /// A ready server over a model file of its own (a pulled real model).
    pub fn start_model(
        model_path: PathBuf,
        engine: EngineConfig,
        config: ApiConfig,
    ) -> Result<Self> {
        let server = Self::bind(model_path, None, config)?;
        server.load(engine)?;
        Ok(server)
    }

    /// A server that is still "loading" (503) until [`TestServer::load`].
    pub fn start_loading(spec: &TestModelSpec, config: ApiConfig) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let model_path = write_test_model(dir.path(), spec)?;
        Self::bind(model_path, Some(dir), config)
    }

    fn bind(
        model_path: PathBuf,
        dir: Option<tempfile::TempDir>,
        config: ApiConfig,
    ) -> Result<Self> {
        let state = web::Data::new(AppState::new(config));
        let (server, addr) = http_server(state.clone(), ("127.0.0.1", 0), 2, false)?;
        let handle = server.handle();
        actix_rt::spawn(server);
        Ok(Self {
            url: format!("http://{addr}"),
            state,
            model_path,
            handle,
            _dir: dir,
        })
    }

    /// Loads the model and starts the engine; `/health` turns 200.
    pub fn load(&self, engine: EngineConfig) -> Result<()> {
        let bundle = ModelBundle::load(&self.model_path)?;
        let detokenizer = detokenizer_of(&bundle);
        self.state
            .set_ready(Engine::start(bundle, engine)?, detokenizer);
        Ok(())
    }

    pub fn engine(&self) -> &Engine {
        self.state.engine().expect("the test server is not loaded")
    }

    /// `self.url` + `path`.
    pub fn at(&self, path: &str) -> String {
        format!("{}{path}", self.url)
    }

    pub async fn stop(self) {
        self.handle.stop(true).await;
    }
}

/// `ApiConfig` for tests: serves [`TEST_MODEL_ID`], keep-alive every 200 ms.
pub fn test_config() -> ApiConfig {
    let mut c = ApiConfig::new(TEST_MODEL_ID);
    c.keep_alive = std::time::Duration::from_millis(200);
    c
}
