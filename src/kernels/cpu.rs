//! What this CPU is and which of the instruction sets mtpx's kernels can use it has, for
//! `mtpx --version`, `/metrics` and bug reports: a binary built for one CPU and run on another
//! picks its paths at run time, so the build flags alone do not say what ran.

/// The features the kernels and attention paths dispatch on, in the order reports list them.
#[cfg(target_arch = "x86_64")]
const DISPATCHED: &[&str] = &[
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512vnni",
    "avx512vbmi",
    "avx512bf16",
    "avx512fp16",
];
#[cfg(target_arch = "aarch64")]
const DISPATCHED: &[&str] = &["neon", "dotprod"];
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const DISPATCHED: &[&str] = &[];

/// The CPU's brand string (`AMD EPYC 9R14`, `Intel(R) Xeon(R) Platinum 8488C`) with its family
/// and model numbers, or the architecture's name where the CPU does not say.
pub fn cpu_name() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::__cpuid;
        // Leaves 0x8000_0002..=4 hold the brand string where 0x8000_0000 reports them.
        let max = __cpuid(0x8000_0000).eax;
        if max >= 0x8000_0004 {
            let mut bytes = Vec::with_capacity(48);
            for leaf in 0x8000_0002u32..=0x8000_0004 {
                let r = __cpuid(leaf);
                for reg in [r.eax, r.ebx, r.ecx, r.edx] {
                    bytes.extend_from_slice(&reg.to_le_bytes());
                }
            }
            let name = String::from_utf8_lossy(&bytes);
            let name = name.trim_matches(|c: char| c == '\0' || c.is_whitespace());
            if !name.is_empty() {
                // Family and model tell a Zen 3 from a Zen 4 where VMs shorten the brand.
                let sig = __cpuid(1).eax;
                let family = ((sig >> 8) & 0xF) + ((sig >> 20) & 0xFF);
                let model = ((sig >> 4) & 0xF) | ((sig >> 12) & 0xF0);
                let name = name.split_whitespace().collect::<Vec<_>>().join(" ");
                return format!("{name} (family {family} model {model})");
            }
        }
    }
    std::env::consts::ARCH.to_string()
}

/// The dispatched-on features this CPU has (detected at run time).
pub fn detected_features() -> Vec<&'static str> {
    DISPATCHED
        .iter()
        .copied()
        .filter(|&f| is_detected(f))
        .collect()
}

/// The dispatched-on features the build assumes of every CPU it runs on (`-C target-cpu`).
/// The kernels never rely on them: each SIMD function enables its own features and is reached
/// only after they are detected. Listed because dependencies (candle) gate code at build time.
pub fn built_features() -> Vec<&'static str> {
    DISPATCHED
        .iter()
        .copied()
        .filter(|&f| is_built(f))
        .collect()
}

#[cfg(target_arch = "x86_64")]
fn is_detected(feature: &str) -> bool {
    match feature {
        "avx2" => is_x86_feature_detected!("avx2"),
        "fma" => is_x86_feature_detected!("fma"),
        "f16c" => is_x86_feature_detected!("f16c"),
        "avx512f" => is_x86_feature_detected!("avx512f"),
        "avx512bw" => is_x86_feature_detected!("avx512bw"),
        "avx512vl" => is_x86_feature_detected!("avx512vl"),
        "avx512vnni" => is_x86_feature_detected!("avx512vnni"),
        "avx512vbmi" => is_x86_feature_detected!("avx512vbmi"),
        "avx512bf16" => is_x86_feature_detected!("avx512bf16"),
        "avx512fp16" => is_x86_feature_detected!("avx512fp16"),
        _ => false,
    }
}

#[cfg(target_arch = "aarch64")]
fn is_detected(feature: &str) -> bool {
    match feature {
        "neon" => std::arch::is_aarch64_feature_detected!("neon"),
        "dotprod" => std::arch::is_aarch64_feature_detected!("dotprod"),
        _ => false,
    }
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn is_detected(_: &str) -> bool {
    false
}

fn is_built(feature: &str) -> bool {
    match feature {
        "avx2" => cfg!(target_feature = "avx2"),
        "fma" => cfg!(target_feature = "fma"),
        "f16c" => cfg!(target_feature = "f16c"),
        "avx512f" => cfg!(target_feature = "avx512f"),
        "avx512bw" => cfg!(target_feature = "avx512bw"),
        "avx512vl" => cfg!(target_feature = "avx512vl"),
        "avx512vnni" => cfg!(target_feature = "avx512vnni"),
        "avx512vbmi" => cfg!(target_feature = "avx512vbmi"),
        "avx512bf16" => cfg!(target_feature = "avx512bf16"),
        "avx512fp16" => cfg!(target_feature = "avx512fp16"),
        "neon" => cfg!(target_feature = "neon"),
        "dotprod" => cfg!(target_feature = "dotprod"),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_build_assumes_nothing_the_cpu_lacks() {
        // A binary that started at all runs on a CPU with every feature it was built for.
        let detected = detected_features();
        for f in built_features() {
            assert!(detected.contains(&f), "built for {f}, not detected");
        }
        assert!(!cpu_name().is_empty());
    }
}
