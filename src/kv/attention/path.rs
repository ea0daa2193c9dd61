//! Which arithmetic a block's two products use ([`AttentionPath`]), and how the default is
//! chosen for the CPU and the K/V element type.

use crate::kernels::{cpu_is_amd, Dispatch};
use crate::kv::storage::KvDtype;
use std::sync::OnceLock;

/// How a block's two products are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionPath {
    /// f32 multiply-adds on an instruction-set path.
    F32(Dispatch),
    /// Both products with AVX-512 BF16 dot products (twice the multiply-adds of an f32 FMA per
    /// instruction): the scores from Q and block-centred K rounded to bf16 (8 significant bits)
    /// plus an f32 dot product with the block's first key, the weighted values from softmax
    /// weights and V rounded to bf16; every sum in f32.
    Bf16,
    /// The same operands and softmax as `Bf16`, both products on AMX tiles (16 lanes × 16
    /// keys or dimensions × 32 terms an instruction).
    Amx,
    /// For q8 K/V: both products as integer dot products of the stored integers (AVX-512 VNNI),
    /// queries quantised to int8 and softmax weights to int16, sums exact in int32 (see
    /// `int8`). With f16 or f32 K/V it runs as `Bf16`.
    Int8,
    /// For f16 K/V: the `Bf16` path's operands and softmax with fp16 in place of bf16, both
    /// products as AVX-512 FP16 multiply-adds (32 a vector) summed in fp16 within a block (see
    /// `fp16`). With q8 or f32 K/V it runs as `F32`.
    F16,
}

impl AttentionPath {
    /// Whether this CPU can run the path.
    pub fn is_supported(self) -> bool {
        match self {
            AttentionPath::F32(d) => d.is_supported(),
            AttentionPath::Bf16 => bf16_supported(),
            AttentionPath::Amx => amx_supported(),
            AttentionPath::Int8 => int8_supported(),
            AttentionPath::F16 => fp16_supported(),
        }
    }

    /// The paths this CPU can run.
    pub fn supported() -> Vec<AttentionPath> {
        let f32s = Dispatch::supported().into_iter().map(AttentionPath::F32);
        f32s.chain(bf16_supported().then_some(AttentionPath::Bf16))
            .chain(amx_supported().then_some(AttentionPath::Amx))
            .chain(int8_supported().then_some(AttentionPath::Int8))
            .chain(fp16_supported().then_some(AttentionPath::F16))
            .collect()
    }

    /// The path for K/V stored as `dtype`, unless the cache is f32 (which asks for f32
    /// precision) or the matmul kernels do not run AVX-512: for q8 K/V on CPUs with VNNI and
    /// VBMI, the integer products (one decode row over a long context ~25% faster than bf16 on
    /// a Zen 5, ~2× f32 on a Xeon without AMX, ~2× AMX's bf16 tiles on a Xeon with AMX, where
    /// rows of several lane chunks take AMX-INT8 tiles and a 50-row continuation's attention
    /// costs ~1.15× AMX-BF16's); AMX where the CPU has it; for f16 K/V on CPUs
    /// with AVX-512 FP16 (Intel since Sapphire Rapids, where AMX is not exposed), the fp16
    /// products (a continuation's attention ~2× f32 there); AVX-512 BF16 on AMD CPUs, whose
    /// `vdpbf16ps` does twice the multiply-adds of an f32 FMA (on Intel's it does not, and the
    /// conversions make it slower than f32: measured on a Xeon with AMX, a continuation's
    /// attention took 1.65× as long); f32 otherwise.
    /// `MTPX_ATTENTION=f32|bf16|amx|int8|fp16` (read once) overrides where the CPU can.
    pub fn for_kv(dtype: KvDtype) -> AttentionPath {
        let f32_path = AttentionPath::F32(Dispatch::active());
        let avx512 = Dispatch::active() == Dispatch::Avx512;
        let bf16_ok = bf16_supported() && avx512;
        let amx_ok = amx_supported() && avx512;
        let int8_ok = int8_supported() && avx512;
        let fp16_ok = fp16_supported() && avx512;
        match *ATTENTION_ENV.get_or_init(attention_from_env) {
            Some(AttentionPath::Amx) if amx_ok => AttentionPath::Amx,
            Some(AttentionPath::Int8) if int8_ok => AttentionPath::Int8,
            Some(AttentionPath::Bf16) if bf16_ok => AttentionPath::Bf16,
            Some(AttentionPath::F16) if fp16_ok => AttentionPath::F16,
            Some(_) => f32_path,
            None if dtype == KvDtype::F32 => f32_path,
            None if dtype == KvDtype::Q8 && int8_ok => AttentionPath::Int8,
            None if amx_ok => AttentionPath::Amx,
            None if dtype == KvDtype::F16 && fp16_ok => AttentionPath::F16,
            None if bf16_ok && cpu_is_amd() => AttentionPath::Bf16,
            None => f32_path,
        }
    }

    /// The name `mtpx bench` reports.
    pub fn name(self) -> String {
        match self {
            AttentionPath::F32(d) => format!("f32 ({d:?})").to_lowercase(),
            AttentionPath::Bf16 => "bf16 (avx512-bf16)".into(),
            AttentionPath::Amx => "bf16 (amx)".into(),
            AttentionPath::Int8 => "int8 (avx512-vnni)".into(),
            AttentionPath::F16 => "fp16 (avx512-fp16)".into(),
        }
    }
}

/// The path `MTPX_ATTENTION` asks for (`F32` standing for every f32 path), `None` when unset.
static ATTENTION_ENV: OnceLock<Option<AttentionPath>> = OnceLock::new();

fn attention_from_env() -> Option<AttentionPath> {
    let name = std::env::var("MTPX_ATTENTION").ok()?;
    match name.trim().to_ascii_lowercase().as_str() {
        "amx" => Some(AttentionPath::Amx),
        "bf16" => Some(AttentionPath::Bf16),
        "int8" => Some(AttentionPath::Int8),
        "fp16" => Some(AttentionPath::F16),
        "f32" => Some(AttentionPath::F32(Dispatch::Scalar)),
        _ => {
            eprintln!(
                "MTPX_ATTENTION={name}: expected f32, bf16, amx, int8 or fp16; using the default"
            );
            None
        }
    }
}

fn amx_supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    return super::amx::is_supported();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

fn int8_supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    return super::int8::is_supported() && super::bf16::is_supported();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

fn fp16_supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    return super::fp16::is_supported();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

fn bf16_supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    return super::bf16::is_supported();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Which paths this process takes on this CPU: the matmul kernels' and, for each K/V element
/// type, attention's. What `mtpx --version` prints and `/metrics` exports, so that a report
/// from another machine says which code ran.
#[derive(Debug, Clone)]
pub struct SimdReport {
    pub cpu: String,
    /// Dispatched-on features the CPU has.
    pub detected: Vec<&'static str>,
    /// Dispatched-on features the binary was built to assume (`-C target-cpu`).
    pub built_for: Vec<&'static str>,
    pub kernel: Dispatch,
    pub attention: Vec<(KvDtype, AttentionPath)>,
}

impl SimdReport {
    pub fn current() -> SimdReport {
        use crate::kernels::cpu;
        SimdReport {
            cpu: cpu::cpu_name(),
            detected: cpu::detected_features(),
            built_for: cpu::built_features(),
            kernel: Dispatch::active(),
            attention: [KvDtype::F16, KvDtype::Q8, KvDtype::F32]
                .into_iter()
                .map(|d| (d, AttentionPath::for_kv(d)))
                .collect(),
        }
    }

    /// The kernel path's name as `MTPX_KERNEL` spells it.
    pub fn kernel_name(&self) -> String {
        format!("{:?}", self.kernel).to_lowercase()
    }
}

impl std::fmt::Display for SimdReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = |v: &[&str]| {
            if v.is_empty() {
                "none".to_string()
            } else {
                v.join(" ")
            }
        };
        writeln!(f, "cpu: {}", self.cpu)?;
        writeln!(f, "cpu features: {}", list(&self.detected))?;
        writeln!(f, "built for: {}", list(&self.built_for))?;
        writeln!(f, "matmul kernels: {}", self.kernel_name())?;
        let attention: Vec<String> = self
            .attention
            .iter()
            .map(|(d, p)| format!("{} K/V {}", format!("{d:?}").to_lowercase(), p.name()))
            .collect();
        write!(f, "attention: {}", attention.join(", "))
    }
}
