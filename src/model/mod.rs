//! Models from GGUF files: hyper-parameters, weights, the shared numeric layers, the
//! transformer for llama / qwen2 / qwen3, and the generator of the project's tiny test model.

pub mod bundle;
pub mod config;
pub mod layers;
pub mod test_model;
pub mod transformer;
pub mod weights;

pub use bundle::{FimTokens, ModelBundle, ModelFacts};
pub use config::{Arch, ModelConfig, RopeStyle};
pub use transformer::Transformer;
