//! Settings shared by the CLI commands: the KV memory budget and how it turns into pages.

use anyhow::{bail, Context, Result};
use std::str::FromStr;

/// The KV cache budget: an absolute size or a fraction of the machine's memory.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvMemory {
    Bytes(u64),
    FractionOfRam(f64),
}

impl Default for KvMemory {
    fn default() -> Self {
        KvMemory::FractionOfRam(0.25)
    }
}

impl FromStr for KvMemory {
    type Err = anyhow::Error;

    /// Accepts `0.25` (a fraction of RAM), `25%`, or a size such as `2GiB`, `512MB`, `1e9`.
    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        if let Some(p) = s.strip_suffix('%') {
            let pct: f64 = p.trim().parse().context("bad percentage")?;
            return fraction(pct / 100.0);
        }
        let lower = s.to_ascii_lowercase();
        let units: [(&str, f64); 9] = [
            ("gib", 1024f64.powi(3)),
            ("mib", 1024f64.powi(2)),
            ("kib", 1024.0),
            ("gb", 1e9),
            ("mb", 1e6),
            ("kb", 1e3),
            ("g", 1024f64.powi(3)),
            ("m", 1024f64.powi(2)),
            ("b", 1.0),
        ];
        for (suffix, scale) in units {
            if let Some(num) = lower.strip_suffix(suffix) {
                let v: f64 = num
                    .trim()
                    .parse()
                    .with_context(|| format!("bad size `{s}`"))?;
                return Ok(KvMemory::Bytes((v * scale) as u64));
            }
        }
        let v: f64 = s
            .parse()
            .with_context(|| format!("bad KV memory `{s}` (try 0.25, 25%, 4GiB)"))?;
        if v <= 1.0 {
            fraction(v)
        } else {
            Ok(KvMemory::Bytes(v as u64))
        }
    }
}

fn fraction(f: f64) -> Result<KvMemory> {
    if !(f > 0.0 && f <= 0.95) {
        bail!("a KV memory fraction must be in (0, 0.95], got {f}");
    }
    Ok(KvMemory::FractionOfRam(f))
}

impl KvMemory {
    pub fn bytes(self) -> u64 {
        match self {
            KvMemory::Bytes(b) => b,
            KvMemory::FractionOfRam(f) => (total_ram_bytes() as f64 * f) as u64,
        }
    }
}

/// Physical memory from `/proc/meminfo` (8 GiB when it cannot be read).
pub fn total_ram_bytes() -> u64 {
    read_meminfo_kib("MemTotal:").map_or(8 << 30, |kib| kib * 1024)
}

/// Peak resident set size of this process, from `/proc/self/status` (`VmHWM`).
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_kib_line(&status, "VmHWM:").map(|k| k * 1024)
}

fn read_meminfo_kib(key: &str) -> Option<u64> {
    parse_kib_line(&std::fs::read_to_string("/proc/meminfo").ok()?, key)
}

fn parse_kib_line(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    line[key.len()..].split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_fractions_parse() {
        assert_eq!(
            "2GiB".parse::<KvMemory>().unwrap(),
            KvMemory::Bytes(2 << 30)
        );
        assert_eq!(
            "512MB".parse::<KvMemory>().unwrap(),
            KvMemory::Bytes(512_000_000)
        );
        assert_eq!(
            "0.5".parse::<KvMemory>().unwrap(),
            KvMemory::FractionOfRam(0.5)
        );
        assert_eq!(
            "25%".parse::<KvMemory>().unwrap(),
            KvMemory::FractionOfRam(0.25)
        );
        assert_eq!(
            "3000000".parse::<KvMemory>().unwrap(),
            KvMemory::Bytes(3_000_000)
        );
        assert!("lots".parse::<KvMemory>().is_err());
        assert!("0".parse::<KvMemory>().is_err());
    }
}
