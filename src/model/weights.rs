//! Reading tensors out of a GGUF file: quantized matrices become [`Linear`] layers, norms and
//! biases become plain f32 vectors. A missing tensor is an error that names it.

use super::layers::Linear;
use crate::kernels::QuantMatrix;
use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;
use std::fs::File;

pub struct GgufWeights<'a> {
    pub content: &'a Content,
    file: File,
    path: String,
    format: WeightFormat,
}

/// How matrices are kept in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightFormat {
    /// As stored (quantized); activations are quantized to 8 bits for the integer dot products.
    #[default]
    Quantized,
    /// Dequantized to f32 at load: slow and large, but free of activation quantization. The
    /// reference-parity tests use it to check the architecture itself to float precision.
    Dequantized,
}

impl<'a> GgufWeights<'a> {
    pub fn new(content: &'a Content, file: File, path: &str, format: WeightFormat) -> Self {
        Self {
            content,
            file,
            path: path.to_string(),
            format,
        }
    }

    pub fn has(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    pub fn qtensor(&mut self, name: &str) -> Result<QTensor> {
        if !self.has(name) {
            bail!("model file {} lacks tensor `{name}`", self.path);
        }
        self.content
            .tensor(&mut self.file, name, &Device::Cpu)
            .with_context(|| format!("reading tensor `{name}` from {}", self.path))
    }

    /// A 1-D tensor (norm weight, bias) as f32.
    pub fn vector(&mut self, name: &str) -> Result<Vec<f32>> {
        let t = self.qtensor(name)?.dequantize(&Device::Cpu)?;
        Ok(t.flatten_all()?.to_vec1::<f32>()?)
    }

    pub fn optional_vector(&mut self, name: &str) -> Result<Option<Vec<f32>>> {
        if self.has(name) {
            self.vector(name).map(Some)
        } else {
            Ok(None)
        }
    }

    /// A matrix `[out, in]` as a linear layer, with an optional bias tensor.
    pub fn linear(&mut self, name: &str, bias: Option<&str>) -> Result<Linear> {
        let qt = self.qtensor(name)?;
        let bias = match bias {
            Some(b) => self.optional_vector(b)?,
            None => None,
        };
        linear_from_qtensor(qt, bias, self.format)
    }
}

pub fn linear_from_qtensor(
    qt: QTensor,
    bias: Option<Vec<f32>>,
    format: WeightFormat,
) -> Result<Linear> {
    let qt = match format {
        WeightFormat::Dequantized => {
            QTensor::quantize(&qt.dequantize(&Device::Cpu)?, GgmlDType::F32)?
        }
        WeightFormat::Quantized => qt,
    };
    let matrix = QuantMatrix::from_qtensor(&qt).map_err(anyhow::Error::msg)?;
    Ok(Linear::new(matrix, bias))
}
