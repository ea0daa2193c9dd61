//! Reading tensors out of a GGUF file: quantized matrices become [`Linear`] layers, norms and
//! biases become plain f32 vectors. A missing tensor is an error that names it.

use super::layers::Linear;
use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::Device;
use std::borrow::Cow;
use std::fs::File;
use std::sync::Arc;

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
    let (out_dim, in_dim) = qt.shape().dims2()?;
    let weight = match (format, qt.dtype()) {
        (WeightFormat::Dequantized, _) => QMatMul::Tensor(qt.dequantize(&Device::Cpu)?),
        (WeightFormat::Quantized, GgmlDType::Q5_0) => {
            QMatMul::from_arc(Arc::new(q5_0_to_q8_0(&qt)?))?
        }
        (WeightFormat::Quantized, _) => QMatMul::from_arc(Arc::new(qt))?,
    };
    Ok(Linear::new(weight, bias, out_dim, in_dim))
}

/// Re-encodes Q5_0 blocks as Q8_0 without loss: a Q5_0 value is `(q − 16) · d` with
/// `q − 16 ∈ [−16, 15]`, which an int8 with the same scale `d` holds exactly. candle's Q8_0
/// kernels are several times faster than its Q5_0 ones, at 34 instead of 22 bytes per block.
fn q5_0_to_q8_0(qt: &QTensor) -> Result<QTensor> {
    const Q5_0_BYTES: usize = 22;
    const Q8_0_BYTES: usize = 34;
    let src = qt.data()?;
    let num_blocks = src.len() / Q5_0_BYTES;
    let mut dst = vec![0u8; num_blocks * Q8_0_BYTES];
    for (s, d) in src
        .chunks_exact(Q5_0_BYTES)
        .zip(dst.chunks_exact_mut(Q8_0_BYTES))
    {
        d[..2].copy_from_slice(&s[..2]); // f16 scale
        let qh = u32::from_le_bytes([s[2], s[3], s[4], s[5]]);
        let qs = &s[6..22];
        for j in 0..16 {
            let high0 = (((qh >> j) << 4) & 0x10) as u8;
            let high1 = ((qh >> (j + 12)) & 0x10) as u8;
            let lo = ((qs[j] & 0x0f) | high0) as i16 - 16;
            let hi = ((qs[j] >> 4) | high1) as i16 - 16;
            d[2 + j] = lo as i8 as u8;
            d[2 + j + 16] = hi as i8 as u8;
        }
    }
    let storage = QStorage::from_data(Cow::Owned(dst), &Device::Cpu, GgmlDType::Q8_0)?;
    Ok(QTensor::new(storage, qt.shape().clone())?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Tensor;

    #[test]
    fn q5_0_to_q8_0_is_lossless() {
        let values: Vec<f32> = (0..256)
            .map(|i| ((i * 37) % 61) as f32 / 7.0 - 4.0)
            .collect();
        let t = Tensor::from_vec(values, (4, 64), &Device::Cpu).unwrap();
        let q5 = QTensor::quantize(&t, GgmlDType::Q5_0).unwrap();
        let q8 = q5_0_to_q8_0(&q5).unwrap();
        let a = q5.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap();
        let b = q8.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap();
        assert_eq!(a.to_vec1::<f32>().unwrap(), b.to_vec1::<f32>().unwrap());
    }
}
