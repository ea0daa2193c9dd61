//! Which instruction set the kernels use: detected once, pinnable by `MTPX_KERNEL` or `force`.
//!
//! Every path computes bit-identical results (integer dot products are exact and the float
//! epilogue does the same operations in the same order), so pinning a path changes speed only.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

/// An instruction-set path for the matmul kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dispatch {
    /// Portable Rust; runs everywhere and is what every test also runs.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C (`vpmaddubsw` dot products).
    Avx2,
    /// x86-64 AVX-512 F/BW/VL + VNNI (`vpdpbusd` dot products).
    Avx512,
    /// AArch64 baseline NEON (`smull`/`smlal` + pairwise adds).
    Neon,
    /// AArch64 NEON + dotprod (`sdot` dot products).
    NeonDot,
}

/// Whether the CPU is AMD's: a few choices measured differently on AMD Zen 4 and Intel Xeon
/// (which attention path is fastest, which prefetch hint helps) follow it.
pub fn cpu_is_amd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static AMD: OnceLock<bool> = OnceLock::new();
        *AMD.get_or_init(|| {
            let leaf = std::arch::x86_64::__cpuid(0);
            // "AuthenticAMD" in EBX, EDX, ECX.
            (leaf.ebx, leaf.edx, leaf.ecx) == (0x6874_7541, 0x6974_6e65, 0x444d_4163)
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// 0 = no override; otherwise `Dispatch::code()`.
static FORCED: AtomicU8 = AtomicU8::new(0);

impl Dispatch {
    /// All paths; among those of one architecture, slowest first.
    pub const ALL: [Dispatch; 5] = [
        Dispatch::Scalar,
        Dispatch::Avx2,
        Dispatch::Avx512,
        Dispatch::Neon,
        Dispatch::NeonDot,
    ];

    /// Whether this CPU can run the path.
    pub fn is_supported(self) -> bool {
        match self {
            Dispatch::Scalar => true,
            Dispatch::Avx2 => has_avx2(),
            Dispatch::Avx512 => has_avx512(),
            Dispatch::Neon => has_neon(),
            Dispatch::NeonDot => has_neon_dot(),
        }
    }

    /// The paths this CPU can run, slowest first.
    pub fn supported() -> Vec<Dispatch> {
        Self::ALL.into_iter().filter(|d| d.is_supported()).collect()
    }

    /// The fastest path this CPU supports.
    pub fn best() -> Dispatch {
        *Self::supported().last().unwrap_or(&Dispatch::Scalar)
    }

    /// The path `matmul` uses: `force` if set, else `MTPX_KERNEL` (read once), else `best()`.
    pub fn active() -> Dispatch {
        match FORCED.load(Ordering::Relaxed) {
            0 => *FROM_ENV.get_or_init(from_env),
            code => Self::from_code(code),
        }
    }

    /// Pins the process-wide path (`None` restores the default). Refuses a path this CPU lacks.
    pub fn force(path: Option<Dispatch>) -> Result<(), String> {
        if let Some(d) = path {
            if !d.is_supported() {
                return Err(format!("kernel path {d:?} is not supported by this CPU"));
            }
        }
        FORCED.store(path.map_or(0, Dispatch::code), Ordering::Relaxed);
        Ok(())
    }

    /// Parses `scalar`, `avx2`, `avx512`, `neon` or `neondot` (the `MTPX_KERNEL` values).
    pub fn parse(name: &str) -> Option<Dispatch> {
        match name.trim().to_ascii_lowercase().as_str() {
            "scalar" => Some(Dispatch::Scalar),
            "avx2" => Some(Dispatch::Avx2),
            "avx512" => Some(Dispatch::Avx512),
            "neon" => Some(Dispatch::Neon),
            "neondot" => Some(Dispatch::NeonDot),
            _ => None,
        }
    }

    fn code(self) -> u8 {
        match self {
            Dispatch::Scalar => 1,
            Dispatch::Avx2 => 2,
            Dispatch::Avx512 => 3,
            Dispatch::Neon => 4,
            Dispatch::NeonDot => 5,
        }
    }

    fn from_code(code: u8) -> Dispatch {
        match code {
            2 => Dispatch::Avx2,
            3 => Dispatch::Avx512,
            4 => Dispatch::Neon,
            5 => Dispatch::NeonDot,
            _ => Dispatch::Scalar,
        }
    }
}

static FROM_ENV: OnceLock<Dispatch> = OnceLock::new();

fn from_env() -> Dispatch {
    let Ok(name) = std::env::var("MTPX_KERNEL") else {
        return Dispatch::best();
    };
    match Dispatch::parse(&name) {
        Some(d) if d.is_supported() => d,
        Some(d) => {
            eprintln!(
                "MTPX_KERNEL={name}: {d:?} is not supported by this CPU; using the best path"
            );
            Dispatch::best()
        }
        None => {
            eprintln!(
                "MTPX_KERNEL={name}: expected scalar, avx2, avx512, neon or neondot; using the best path"
            );
            Dispatch::best()
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    has_avx2()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
}

#[cfg(not(target_arch = "x86_64"))]
fn has_avx2() -> bool {
    false
}

#[cfg(not(target_arch = "x86_64"))]
fn has_avx512() -> bool {
    false
}

#[cfg(target_arch = "aarch64")]
fn has_neon() -> bool {
    std::arch::is_aarch64_feature_detected!("neon")
}

#[cfg(target_arch = "aarch64")]
fn has_neon_dot() -> bool {
    has_neon() && std::arch::is_aarch64_feature_detected!("dotprod")
}

#[cfg(not(target_arch = "aarch64"))]
fn has_neon() -> bool {
    false
}

#[cfg(not(target_arch = "aarch64"))]
fn has_neon_dot() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_env_names() {
        assert_eq!(Dispatch::parse("AVX512"), Some(Dispatch::Avx512));
        assert_eq!(Dispatch::parse(" scalar "), Some(Dispatch::Scalar));
        assert_eq!(Dispatch::parse("Neon"), Some(Dispatch::Neon));
        assert_eq!(Dispatch::parse("neondot"), Some(Dispatch::NeonDot));
        assert_eq!(Dispatch::parse("sve"), None);
    }

    #[test]
    fn scalar_is_always_supported_and_best_is_supported() {
        assert!(Dispatch::Scalar.is_supported());
        assert!(Dispatch::best().is_supported());
    }

    #[test]
    fn codes_round_trip() {
        for d in Dispatch::ALL {
            assert_eq!(Dispatch::from_code(d.code()), d);
        }
    }

    /// The paths of the other architecture must never be offered (their kernels are not even
    /// compiled in), and a NEON path is the best one wherever NEON exists.
    #[test]
    fn only_this_architectures_paths_are_supported() {
        if cfg!(target_arch = "aarch64") {
            assert!(!Dispatch::Avx2.is_supported() && !Dispatch::Avx512.is_supported());
            assert!(matches!(
                Dispatch::best(),
                Dispatch::Neon | Dispatch::NeonDot
            ));
        } else {
            assert!(!Dispatch::Neon.is_supported() && !Dispatch::NeonDot.is_supported());
        }
    }
}
