//! Models pulled from a Hugging Face-style hub into a local store.
//!
//! A reference names a repository and, optionally, a file or a quantization:
//! `hf://owner/repo/file.gguf`, `owner/repo:Q4_K_M` or `owner/repo` (Q4_K_M
//! when the repository has it, else its first GGUF). [`pull`] asks the hub
//! for the repository's file list at a revision, picks the file (every part of
//! a split GGUF `-0000N-of-0000M`, and a projector `mmproj*.gguf` next to it),
//! and downloads each into the store: resumable with HTTP ranges, checked
//! against the size and sha256 the hub publishes (`X-Linked-Size`,
//! `X-Linked-Etag`), following the hub's redirect to its file host.
//!
//! The store is the Hugging Face cache layout (`models--owner--repo/{blobs,
//! snapshots,refs}`), so files pulled by `huggingface-cli` or llama.cpp's
//! `-hf` are found, and the other way round. The environment is the hub
//! library's: `HF_ENDPOINT`, `HF_TOKEN` (sent to the hub only, never to the
//! host it redirects to), `HF_HUB_OFFLINE` (the store only, no request) and
//! `HF_HUB_CACHE` / `HF_HOME`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::ModelError;

/// Where the hub is and how to talk to it, read from the environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubSettings {
    /// Base address of the hub (`HF_ENDPOINT`, default `https://huggingface.co`).
    pub endpoint: String,
    /// Access token (`HF_TOKEN`, or `HUGGING_FACE_HUB_TOKEN`).
    pub token: Option<String>,
    /// No network: resolve from the store only (`HF_HUB_OFFLINE=1`).
    pub offline: bool,
    /// The store: the Hugging Face hub cache directory.
    pub cache: PathBuf,
}

impl HubSettings {
    /// Settings from the environment, as the Hugging Face libraries read it.
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let endpoint = var("HF_ENDPOINT")
            .unwrap_or_else(|| "https://huggingface.co".into())
            .trim_end_matches('/')
            .to_string();
        let token = var("HF_TOKEN").or_else(|| var("HUGGING_FACE_HUB_TOKEN"));
        let offline = var("HF_HUB_OFFLINE").is_some_and(|v| {
            matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on")
        });
        let cache = if let Some(c) = var("HF_HUB_CACHE") {
            PathBuf::from(c)
        } else if let Some(h) = var("HF_HOME") {
            PathBuf::from(h).join("hub")
        } else {
            let base = var("XDG_CACHE_HOME").map(PathBuf::from).unwrap_or_else(|| {
                std::env::var_os("HOME")
                    .map_or_else(|| PathBuf::from("."), PathBuf::from)
                    .join(".cache")
            });
            base.join("huggingface").join("hub")
        };
        Self {
            endpoint,
            token,
            offline,
            cache,
        }
    }
}

/// Which file of a repository a reference asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selector {
    /// An exact path inside the repository (`hf://owner/repo/file.gguf`).
    File(String),
    /// A quantization tag (`owner/repo:Q4_K_M`); none means the default pick.
    Quant(Option<String>),
}

/// A parsed model reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubRef {
    /// `owner/repo`.
    pub repo: String,
    /// Branch, tag or commit (`main` unless `@rev` was given).
    pub revision: String,
    /// The file wanted.
    pub selector: Selector,
}

impl std::fmt::Display for HubRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let rev = if self.revision == "main" {
            String::new()
        } else {
            format!("@{}", self.revision)
        };
        match &self.selector {
            Selector::File(p) => write!(f, "hf://{}{rev}/{p}", self.repo),
            Selector::Quant(Some(q)) => write!(f, "{}{rev}:{q}", self.repo),
            Selector::Quant(None) => write!(f, "{}{rev}", self.repo),
        }
    }
}

fn is_name(s: &str) -> bool {
    !s.is_empty()
        && !s.starts_with(['.', '-'])
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn split_rev(repo: &str) -> (&str, Option<&str>) {
    match repo.split_once('@') {
        Some((r, rev)) => (r, Some(rev)),
        None => (repo, None),
    }
}

fn checked_repo(repo: &str) -> Option<String> {
    let (owner, name) = repo.split_once('/')?;
    (is_name(owner) && is_name(name)).then(|| repo.to_string())
}

/// Parses a hub reference; `None` when the text is not one (a local path).
///
/// `hf://owner/repo[@rev]/path/file.gguf` names a file; `owner/repo[@rev][:QUANT]`
/// (also with an `hf.co/` or `huggingface.co/` prefix, as Ollama writes them)
/// names a quantization. A bare `owner/repo` ending in `.gguf` is a path.
pub fn parse_ref(text: &str) -> Option<HubRef> {
    if let Some(rest) = text.strip_prefix("hf://") {
        let mut parts = rest.splitn(3, '/');
        let (owner, name, file) = (parts.next()?, parts.next()?, parts.next()?);
        let (name, rev) = split_rev(name);
        let repo = checked_repo(&format!("{owner}/{name}"))?;
        if file.is_empty() || file.split('/').any(|s| s.is_empty() || s == "..") {
            return None;
        }
        return Some(HubRef {
            repo,
            revision: rev.filter(|r| is_name(r)).unwrap_or("main").to_string(),
            selector: Selector::File(file.to_string()),
        });
    }
    let rest = text
        .strip_prefix("hf.co/")
        .or_else(|| text.strip_prefix("huggingface.co/"))
        .unwrap_or(text);
    if rest.to_ascii_lowercase().ends_with(".gguf") {
        return None;
    }
    let (repo_rev, quant) = match rest.rsplit_once(':') {
        Some((r, q)) if is_name(q) => (r, Some(q.to_string())),
        Some(_) => return None,
        None => (rest, None),
    };
    let (repo, rev) = split_rev(repo_rev);
    if rev.is_some_and(|r| !is_name(r)) {
        return None;
    }
    Some(HubRef {
        repo: checked_repo(repo)?,
        revision: rev.unwrap_or("main").to_string(),
        selector: Selector::Quant(quant),
    })
}

/// The files a reference resolves to in a repository's file list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chosen {
    /// The model: one file, or every part of a split GGUF in order.
    pub model: Vec<String>,
    /// A projector file next to it, for vision models.
    pub mmproj: Option<String>,
}

fn base_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

fn dir_name(path: &str) -> &str {
    path.rsplit_once('/').map_or("", |(d, _)| d)
}

fn is_mmproj(path: &str) -> bool {
    base_name(path).to_ascii_lowercase().starts_with("mmproj")
}

/// `(prefix, index, count)` for `prefix-0000N-of-0000M.gguf`.
fn split_part(path: &str) -> Option<(&str, u32, u32)> {
    let stem = path.strip_suffix(".gguf")?;
    let (head, count) = stem.rsplit_once("-of-")?;
    let (prefix, index) = head.rsplit_once('-')?;
    if index.len() != 5 || count.len() != 5 {
        return None;
    }
    Some((prefix, index.parse().ok()?, count.parse().ok()?))
}

/// Whether a file name carries a quantization tag, as a whole word
/// (`Q4_K` does not match `Q4_K_M`).
fn has_quant(path: &str, quant: &str) -> bool {
    let name = base_name(path).to_ascii_uppercase();
    let q = quant.to_ascii_uppercase();
    let bytes = name.as_bytes();
    let boundary = |i: usize| i >= bytes.len() || matches!(bytes[i], b'-' | b'.');
    let mut from = 0;
    while let Some(pos) = name[from..].find(&q) {
        let start = from + pos;
        let end = start + q.len();
        if (start == 0 || matches!(bytes[start - 1], b'-' | b'.' | b'_')) && boundary(end) {
            return true;
        }
        from = start + 1;
    }
    false
}

/// Picks the model file(s) and projector for a selector from a file list.
pub fn choose(files: &[String], selector: &Selector) -> Result<Chosen, String> {
    let ggufs: Vec<&String> = files
        .iter()
        .filter(|f| f.to_ascii_lowercase().ends_with(".gguf"))
        .collect();
    let models: Vec<&String> = ggufs.iter().copied().filter(|f| !is_mmproj(f)).collect();
    // A candidate is a whole file or the first part of a split one.
    let firsts = |list: Vec<&String>| -> Vec<String> {
        let mut v: Vec<String> = list
            .into_iter()
            .filter(|f| split_part(f).is_none_or(|(_, i, _)| i == 1))
            .cloned()
            .collect();
        v.sort();
        v
    };
    let first = match selector {
        Selector::File(path) => {
            if !files.iter().any(|f| f == path) {
                return Err(format!("the repository has no file `{path}`"));
            }
            match split_part(path) {
                Some((prefix, _, count)) => format!("{prefix}-00001-of-{count:05}.gguf"),
                None => path.clone(),
            }
        }
        Selector::Quant(quant) => {
            let q = quant.clone().unwrap_or_else(|| "Q4_K_M".into());
            let matching = firsts(
                models
                    .iter()
                    .copied()
                    .filter(|f| has_quant(f, &q))
                    .collect(),
            );
            match (matching.first(), quant) {
                (Some(f), _) => f.clone(),
                (None, None) => firsts(models.clone())
                    .first()
                    .cloned()
                    .ok_or_else(|| "the repository has no GGUF file".to_string())?,
                (None, Some(q)) => {
                    let mut tags: Vec<String> = firsts(models.clone())
                        .iter()
                        .map(|f| base_name(f).to_string())
                        .collect();
                    tags.dedup();
                    return Err(format!(
                        "no GGUF file for quantization `{q}` (files: {})",
                        if tags.is_empty() {
                            "none".into()
                        } else {
                            tags.join(", ")
                        }
                    ));
                }
            }
        }
    };
    let model = match split_part(&first) {
        Some((prefix, _, count)) => {
            let parts: Vec<String> = (1..=count)
                .map(|i| format!("{prefix}-{i:05}-of-{count:05}.gguf"))
                .collect();
            if let Some(missing) = parts.iter().find(|p| !files.contains(p)) {
                return Err(format!("split GGUF part `{missing}` is missing"));
            }
            parts
        }
        None => vec![first.clone()],
    };
    let dir = dir_name(&first);
    let mut projectors: Vec<&String> = ggufs
        .iter()
        .copied()
        .filter(|f| is_mmproj(f) && dir_name(f) == dir)
        .collect();
    projectors.sort_by_key(|f| {
        (
            !f.to_ascii_lowercase().contains("f16"),
            f.len(),
            (*f).clone(),
        )
    });
    Ok(Chosen {
        model,
        mmproj: projectors.first().map(|s| (*s).clone()),
    })
}

/// What a pull put in the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pulled {
    /// `owner/repo`.
    pub repo: String,
    /// The commit the files come from.
    pub commit: String,
    /// The model: the file to load (the first part of a split GGUF).
    pub model: PathBuf,
    /// Every file of the model, in order.
    pub parts: Vec<PathBuf>,
    /// The projector, when the repository has one.
    pub mmproj: Option<PathBuf>,
}

impl Pulled {
    /// The paths of the chosen files in a snapshot folder.
    fn at(r: &HubRef, commit: String, snap: &Path, chosen: Chosen) -> Self {
        let parts: Vec<PathBuf> = chosen.model.iter().map(|f| snap.join(f)).collect();
        Self {
            repo: r.repo.clone(),
            commit,
            model: parts[0].clone(),
            parts,
            mmproj: chosen.mmproj.map(|f| snap.join(f)),
        }
    }
}

/// Told how a download goes; called from the thread that pulls.
pub trait PullProgress: Send {
    /// A file starts: its size and how much of it is already here.
    fn start(&mut self, file: &str, total: u64, already: u64);
    /// More bytes arrived.
    fn advance(&mut self, bytes: u64);
    /// The file is in the store.
    fn finish(&mut self, file: &str);
}

/// A progress sink that only logs each file (tracing, info level).
pub struct Quiet;

impl PullProgress for Quiet {
    fn start(&mut self, file: &str, total: u64, already: u64) {
        tracing::info!(file, total, already, "downloading");
    }
    fn advance(&mut self, _bytes: u64) {}
    fn finish(&mut self, file: &str) {
        tracing::info!(file, "downloaded");
    }
}

/// The store folder of a repository.
pub fn repo_dir(cache: &Path, repo: &str) -> PathBuf {
    cache.join(format!("models--{}", repo.replace('/', "--")))
}

fn is_commit(rev: &str) -> bool {
    rev.len() == 40 && rev.bytes().all(|b| b.is_ascii_hexdigit())
}

fn hub_error(r: &HubRef, message: impl Into<String>) -> ModelError {
    ModelError::Fetch {
        name: r.to_string(),
        message: message.into(),
    }
}

/// Every file under a snapshot, as repository paths.
fn snapshot_files(dir: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(root, &p, out);
            } else if p.exists() {
                if let Ok(rel) = p.strip_prefix(root) {
                    out.push(rel.to_string_lossy().replace('\\', "/"));
                }
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// Resolves a reference from the store alone (no request).
pub fn from_store(settings: &HubSettings, r: &HubRef) -> Result<Pulled, ModelError> {
    let dir = repo_dir(&settings.cache, &r.repo);
    let not_here = || ModelError::NotFetched {
        name: r.to_string(),
        path: dir.display().to_string(),
    };
    let commit = if is_commit(&r.revision) {
        r.revision.clone()
    } else {
        std::fs::read_to_string(dir.join("refs").join(&r.revision))
            .map_err(|_| not_here())?
            .trim()
            .to_string()
    };
    let snap = dir.join("snapshots").join(&commit);
    let files = snapshot_files(&snap);
    let chosen = choose(&files, &r.selector).map_err(|_| not_here())?;
    let pulled = Pulled::at(r, commit, &snap, chosen);
    if pulled.parts.iter().any(|p| !p.is_file()) {
        return Err(not_here());
    }
    Ok(pulled)
}

/// Resolves a reference for loading: the store when it has it, else a pull
/// (or, offline, an error saying it is not in the store).
pub fn resolve(
    settings: &HubSettings,
    r: &HubRef,
    progress: &mut dyn PullProgress,
) -> Result<PathBuf, ModelError> {
    match from_store(settings, r) {
        Ok(p) => Ok(p.model),
        Err(e) if settings.offline => Err(match e {
            ModelError::NotFetched { name, path } => ModelError::Fetch {
                name,
                message: format!(
                    "not in the local store ({path}) and offline mode is on (HF_HUB_OFFLINE)"
                ),
            },
            e => e,
        }),
        Err(_) => pull(settings, r, progress).map(|p| p.model),
    }
}

/// Pulls a reference into the store: asks the hub for the revision's files,
/// downloads what is missing, and returns the paths. Offline, the store only.
pub fn pull(
    settings: &HubSettings,
    r: &HubRef,
    progress: &mut dyn PullProgress,
) -> Result<Pulled, ModelError> {
    if settings.offline {
        return from_store(settings, r).map_err(|_| {
            hub_error(
                r,
                "not in the local store and offline mode is on (HF_HUB_OFFLINE)",
            )
        });
    }
    // The pull runs on its own thread with its own runtime, so it can be
    // called from anywhere, inside an async runtime or not.
    std::thread::scope(|s| {
        s.spawn(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| hub_error(r, e.to_string()))?;
            rt.block_on(pull_async(settings, r, progress))
        })
        .join()
        .unwrap_or_else(|_| Err(hub_error(r, "the download thread panicked")))
    })
}

/// Attempts per file when the connection is cut.
const RETRIES: u32 = 5;

#[derive(serde::Deserialize)]
struct RepoInfo {
    sha: Option<String>,
    #[serde(default)]
    siblings: Vec<Sibling>,
}

#[derive(serde::Deserialize)]
struct Sibling {
    rfilename: String,
}

/// What the hub says about one file.
struct FileMeta {
    commit: Option<String>,
    etag: String,
    size: Option<u64>,
    url: reqwest::Url,
}

struct Hub<'a> {
    settings: &'a HubSettings,
    http: reqwest::Client,
    host: Option<(String, Option<u16>)>,
}

impl Hub<'_> {
    fn request(&self, method: reqwest::Method, url: reqwest::Url) -> reqwest::RequestBuilder {
        let same_host = self
            .host
            .as_ref()
            .is_some_and(|(h, p)| url.host_str() == Some(h) && url.port_or_known_default() == *p);
        let mut req = self
            .http
            .request(method, url)
            .header("user-agent", concat!("sipp/", env!("CARGO_PKG_VERSION")));
        if same_host {
            if let Some(t) = &self.settings.token {
                req = req.bearer_auth(t);
            }
        }
        req
    }
}

fn status_error(r: &HubRef, what: &str, status: reqwest::StatusCode) -> ModelError {
    let hint = match status.as_u16() {
        401 | 403 => ": access denied (a gated or private repository needs HF_TOKEN)",
        404 => ": not found",
        _ => "",
    };
    hub_error(r, format!("{what}: HTTP {status}{hint}"))
}

fn header(h: &reqwest::header::HeaderMap, name: &str) -> Option<String> {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .map(|s| s.trim().to_string())
}

fn clean_etag(tag: &str) -> String {
    tag.trim_start_matches("W/").trim_matches('"').to_string()
}

async fn pull_async(
    settings: &HubSettings,
    r: &HubRef,
    progress: &mut dyn PullProgress,
) -> Result<Pulled, ModelError> {
    let base = reqwest::Url::parse(&format!("{}/", settings.endpoint))
        .map_err(|e| hub_error(r, format!("bad HF_ENDPOINT `{}`: {e}", settings.endpoint)))?;
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .connect_timeout(Duration::from_secs(20))
        .read_timeout(Duration::from_secs(60))
        .build()
        .map_err(|e| hub_error(r, e.to_string()))?;
    let hub = Hub {
        settings,
        http,
        host: base
            .host_str()
            .map(|h| (h.to_string(), base.port_or_known_default())),
    };
    let info_url = base
        .join(&format!("api/models/{}/revision/{}", r.repo, r.revision))
        .map_err(|e| hub_error(r, e.to_string()))?;
    let resp = hub
        .request(reqwest::Method::GET, info_url)
        .send()
        .await
        .map_err(|e| hub_error(r, format!("cannot reach {}: {e}", settings.endpoint)))?;
    if !resp.status().is_success() {
        return Err(status_error(r, "listing the repository", resp.status()));
    }
    let info: RepoInfo = resp
        .json()
        .await
        .map_err(|e| hub_error(r, format!("the hub's file list is not valid: {e}")))?;
    let files: Vec<String> = info.siblings.into_iter().map(|s| s.rfilename).collect();
    let chosen = choose(&files, &r.selector).map_err(|m| hub_error(r, m))?;
    let wanted: Vec<String> = chosen
        .model
        .iter()
        .cloned()
        .chain(chosen.mmproj.clone())
        .collect();
    let dir = repo_dir(&settings.cache, &r.repo);
    let mut commit = info.sha.filter(|s| is_commit(s));
    let mut linked = Vec::new();
    for file in &wanted {
        let meta = file_meta(&hub, &base, r, file).await?;
        if commit.is_none() {
            commit = meta.commit.clone();
        }
        let blob = download(&hub, r, &dir, file, &meta, progress).await?;
        linked.push((file.clone(), blob));
    }
    let commit = commit
        .or_else(|| is_commit(&r.revision).then(|| r.revision.clone()))
        .ok_or_else(|| hub_error(r, "the hub named no commit for this revision"))?;
    let snap = dir.join("snapshots").join(&commit);
    for (file, blob) in &linked {
        link_into_snapshot(&snap, file, blob).map_err(|e| hub_error(r, e.to_string()))?;
    }
    if !is_commit(&r.revision) || r.revision != commit {
        let refs = dir.join("refs");
        std::fs::create_dir_all(&refs).map_err(|e| hub_error(r, e.to_string()))?;
        std::fs::write(refs.join(&r.revision), &commit).map_err(|e| hub_error(r, e.to_string()))?;
    }
    Ok(Pulled::at(r, commit, &snap, chosen))
}

/// HEAD on the file's resolve address, without following the redirect: the
/// hub answers there with the commit, the LFS sha256 and the size.
async fn file_meta(
    hub: &Hub<'_>,
    base: &reqwest::Url,
    r: &HubRef,
    file: &str,
) -> Result<FileMeta, ModelError> {
    let url = base
        .join(&format!("{}/resolve/{}/{}", r.repo, r.revision, file))
        .map_err(|e| hub_error(r, e.to_string()))?;
    let resp = hub
        .request(reqwest::Method::HEAD, url.clone())
        .send()
        .await
        .map_err(|e| hub_error(r, format!("cannot reach {}: {e}", hub.settings.endpoint)))?;
    let status = resp.status();
    if !(status.is_success() || status.is_redirection()) {
        return Err(status_error(r, &format!("looking up `{file}`"), status));
    }
    let h = resp.headers();
    let etag = header(h, "x-linked-etag")
        .or_else(|| header(h, "etag"))
        .map(|t| clean_etag(&t))
        .filter(|t| is_name(t))
        .ok_or_else(|| hub_error(r, format!("the hub gave no ETag for `{file}`")))?;
    let size = header(h, "x-linked-size")
        .or_else(|| {
            status
                .is_success()
                .then(|| header(h, "content-length"))
                .flatten()
        })
        .and_then(|s| s.parse().ok());
    let target = match header(h, "location").filter(|_| status.is_redirection()) {
        Some(loc) => url
            .join(&loc)
            .map_err(|e| hub_error(r, format!("bad redirect `{loc}`: {e}")))?,
        None => url,
    };
    Ok(FileMeta {
        commit: header(h, "x-repo-commit").filter(|c| is_commit(c)),
        etag,
        size,
        url: target,
    })
}

/// The sha256 an LFS ETag stands for (git blob ids of small files are not).
fn etag_sha256(etag: &str) -> Option<&str> {
    (etag.len() == 64 && etag.bytes().all(|b| b.is_ascii_hexdigit())).then_some(etag)
}

/// Downloads one file into `blobs/{etag}` (resuming `{etag}.incomplete`),
/// verifies it and returns the blob's path.
async fn download(
    hub: &Hub<'_>,
    r: &HubRef,
    dir: &Path,
    file: &str,
    meta: &FileMeta,
    progress: &mut dyn PullProgress,
) -> Result<PathBuf, ModelError> {
    let fail = |m: String| hub_error(r, format!("`{file}`: {m}"));
    let blobs = dir.join("blobs");
    std::fs::create_dir_all(&blobs).map_err(|e| fail(e.to_string()))?;
    let blob = blobs.join(&meta.etag);
    let size_ok =
        |p: &Path| std::fs::metadata(p).is_ok_and(|m| meta.size.is_none_or(|s| m.len() == s));
    if blob.is_file() && size_ok(&blob) {
        progress.start(file, meta.size.unwrap_or(0), meta.size.unwrap_or(0));
        progress.finish(file);
        return Ok(blob);
    }
    let partial = blobs.join(format!("{}.incomplete", meta.etag));
    let mut attempt = 0;
    let mut started = false;
    loop {
        attempt += 1;
        let have = std::fs::metadata(&partial).map_or(0, |m| m.len());
        if meta.size.is_some_and(|s| have > s) {
            let _ = std::fs::remove_file(&partial);
            continue;
        }
        if !started {
            progress.start(file, meta.size.unwrap_or(0), have);
            started = true;
        }
        match fetch_range(hub, meta, &partial, have, progress).await {
            Ok(()) => break,
            Err(Cut::Fatal(m)) => return Err(fail(m)),
            Err(Cut::Retry(m)) if attempt >= RETRIES => {
                return Err(fail(format!("{m} (gave up after {RETRIES} attempts)")));
            }
            Err(Cut::Retry(m)) => {
                tracing::warn!(file, attempt, "download interrupted ({m}); resuming");
                tokio::time::sleep(Duration::from_millis(200 * u64::from(attempt))).await;
            }
        }
    }
    let len = std::fs::metadata(&partial).map_or(0, |m| m.len());
    if let Some(s) = meta.size.filter(|s| *s != len) {
        let _ = std::fs::remove_file(&partial);
        return Err(fail(format!("size {len} bytes, the hub says {s}")));
    }
    if let Some(expected) = etag_sha256(&meta.etag) {
        let actual = super::sha256_file(&partial).map_err(|e| fail(e.to_string()))?;
        if actual != expected {
            let _ = std::fs::remove_file(&partial);
            return Err(ModelError::HashMismatch {
                name: format!("{r} ({file})"),
                expected: expected.to_string(),
                actual,
            });
        }
    }
    std::fs::rename(&partial, &blob).map_err(|e| fail(e.to_string()))?;
    progress.finish(file);
    Ok(blob)
}

enum Cut {
    /// Worth resuming: the connection broke or the server had a moment.
    Retry(String),
    /// Not worth repeating.
    Fatal(String),
}

/// One GET from `have` on, appended to the partial file; follows redirects
/// by hand so the token never leaves the hub's host.
async fn fetch_range(
    hub: &Hub<'_>,
    meta: &FileMeta,
    partial: &Path,
    have: u64,
    progress: &mut dyn PullProgress,
) -> Result<(), Cut> {
    if meta.size == Some(have) && have > 0 {
        return Ok(());
    }
    let mut url = meta.url.clone();
    let mut resp = None;
    for _ in 0..5 {
        let mut req = hub.request(reqwest::Method::GET, url.clone());
        if have > 0 {
            req = req.header("range", format!("bytes={have}-"));
        }
        let res = req.send().await.map_err(|e| Cut::Retry(e.to_string()))?;
        if res.status().is_redirection() {
            let loc = header(res.headers(), "location")
                .ok_or_else(|| Cut::Fatal("a redirect without a Location".into()))?;
            url = url
                .join(&loc)
                .map_err(|e| Cut::Fatal(format!("bad redirect `{loc}`: {e}")))?;
            continue;
        }
        resp = Some(res);
        break;
    }
    let resp = resp.ok_or_else(|| Cut::Fatal("too many redirects".into()))?;
    let status = resp.status();
    let append = match status.as_u16() {
        206 => true,
        200 => false,
        416 if meta.size == Some(have) => return Ok(()),
        s if s >= 500 || s == 429 => return Err(Cut::Retry(format!("HTTP {status}"))),
        _ => return Err(Cut::Fatal(format!("HTTP {status}"))),
    };
    if append {
        // The range must start where the file ends.
        let start = header(resp.headers(), "content-range")
            .and_then(|c| {
                c.strip_prefix("bytes ")?
                    .split('-')
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .ok_or_else(|| Cut::Fatal("a partial answer without Content-Range".into()))?;
        if start != have {
            return Err(Cut::Fatal(format!(
                "asked for bytes from {have}, got them from {start}"
            )));
        }
    } else if have > 0 {
        // The server ignored the range: start over.
        progress.start(
            meta.url.path().rsplit('/').next().unwrap_or(""),
            meta.size.unwrap_or(0),
            0,
        );
    }
    let mut out = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .append(append)
        .truncate(!append)
        .open(partial)
        .map_err(|e| Cut::Fatal(format!("{}: {e}", partial.display())))?;
    let mut resp = resp;
    loop {
        match resp.chunk().await {
            Ok(Some(bytes)) => {
                out.write_all(&bytes)
                    .map_err(|e| Cut::Fatal(format!("{}: {e}", partial.display())))?;
                progress.advance(bytes.len() as u64);
            }
            Ok(None) => break,
            Err(e) => {
                let _ = out.flush();
                return Err(Cut::Retry(format!("connection cut: {e}")));
            }
        }
    }
    out.flush()
        .map_err(|e| Cut::Fatal(format!("{}: {e}", partial.display())))?;
    let len = std::fs::metadata(partial).map_or(0, |m| m.len());
    match meta.size {
        Some(s) if len < s => Err(Cut::Retry(format!("ended at {len} of {s} bytes"))),
        _ => Ok(()),
    }
}

/// Links a blob into a snapshot as the Hugging Face cache does (a relative
/// symlink), or copies it where links are not available.
fn link_into_snapshot(snap: &Path, file: &str, blob: &Path) -> std::io::Result<()> {
    let dest = snap.join(file);
    if let Some(parent) = dest.parent() {
        std::fs::create_dir_all(parent)?;
    }
    if dest.symlink_metadata().is_ok() {
        std::fs::remove_file(&dest)?;
    }
    let depth = file.split('/').count() + 1;
    let mut rel = PathBuf::new();
    for _ in 0..depth {
        rel.push("..");
    }
    rel.push("blobs");
    rel.push(blob.file_name().unwrap_or_default());
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink(&rel, &dest)
    }
    #[cfg(not(unix))]
    {
        std::fs::copy(blob, &dest).map(|_| ())
    }
}

/// One GGUF in the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreEntry {
    /// `owner/repo`.
    pub repo: String,
    /// The snapshot's commit.
    pub commit: String,
    /// Path inside the repository.
    pub file: String,
    /// Size in bytes.
    pub size: u64,
    /// Where it is.
    pub path: PathBuf,
}

/// Every GGUF file in the store.
pub fn list(settings: &HubSettings) -> Vec<StoreEntry> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(&settings.cache) else {
        return out;
    };
    let mut repos: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
    repos.sort();
    for dir in repos {
        let Some(repo) = dir
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("models--"))
            .map(|n| n.replacen("--", "/", 1))
        else {
            continue;
        };
        let Ok(snaps) = std::fs::read_dir(dir.join("snapshots")) else {
            continue;
        };
        for snap in snaps.flatten() {
            let commit = snap.file_name().to_string_lossy().into_owned();
            for file in snapshot_files(&snap.path()) {
                if !file.to_ascii_lowercase().ends_with(".gguf") {
                    continue;
                }
                let path = snap.path().join(&file);
                let size = std::fs::metadata(&path).map_or(0, |m| m.len());
                out.push(StoreEntry {
                    repo: repo.clone(),
                    commit: commit.clone(),
                    file,
                    size,
                    path,
                });
            }
        }
    }
    out
}

/// Removes a reference from the store: a whole repository (`owner/repo`), or
/// the files a quantization or file reference names, with their blobs when
/// no other snapshot links them. Returns the paths removed.
pub fn remove(settings: &HubSettings, r: &HubRef) -> Result<Vec<PathBuf>, ModelError> {
    let dir = repo_dir(&settings.cache, &r.repo);
    if !dir.is_dir() {
        return Err(ModelError::NotFetched {
            name: r.to_string(),
            path: dir.display().to_string(),
        });
    }
    let io = |e: std::io::Error| hub_error(r, e.to_string());
    if r.selector == Selector::Quant(None) {
        std::fs::remove_dir_all(&dir).map_err(io)?;
        return Ok(vec![dir]);
    }
    let mut removed = Vec::new();
    let snaps: Vec<PathBuf> = std::fs::read_dir(dir.join("snapshots"))
        .map_err(io)?
        .flatten()
        .map(|e| e.path())
        .collect();
    let mut blobs = Vec::new();
    for snap in &snaps {
        let Ok(chosen) = choose(&snapshot_files(snap), &r.selector) else {
            continue;
        };
        for f in chosen.model.iter().chain(chosen.mmproj.iter()) {
            let p = snap.join(f);
            if let Ok(target) = std::fs::canonicalize(&p) {
                blobs.push(target);
            }
            std::fs::remove_file(&p).map_err(io)?;
            removed.push(p);
        }
    }
    if removed.is_empty() {
        return Err(ModelError::NotFetched {
            name: r.to_string(),
            path: dir.display().to_string(),
        });
    }
    // A blob goes when no remaining snapshot file points at it.
    let still: Vec<PathBuf> = snaps
        .iter()
        .flat_map(|s| snapshot_files(s).into_iter().map(move |f| s.join(f)))
        .filter_map(|p| std::fs::canonicalize(p).ok())
        .collect();
    for b in blobs {
        if !still.contains(&b) && b.starts_with(dir.join("blobs")) {
            std::fs::remove_file(&b).map_err(io)?;
            removed.push(b);
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    /// sha256 of bytes, hex (the ETag the hub publishes for an LFS file).
    fn sha256_hex(bytes: &[u8]) -> String {
        hex::encode(Sha256::digest(bytes))
    }

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn references_parse_and_paths_do_not() {
        let r = parse_ref("bartowski/Qwen2.5-0.5B-GGUF:Q8_0").expect("quant ref");
        assert_eq!(r.repo, "bartowski/Qwen2.5-0.5B-GGUF");
        assert_eq!(r.revision, "main");
        assert_eq!(r.selector, Selector::Quant(Some("Q8_0".into())));
        let r = parse_ref("hf://o/r@v1.0/sub/m-Q4_0.gguf").expect("file ref");
        assert_eq!((r.repo.as_str(), r.revision.as_str()), ("o/r", "v1.0"));
        assert_eq!(r.selector, Selector::File("sub/m-Q4_0.gguf".into()));
        assert_eq!(
            parse_ref("hf.co/o/r").map(|r| r.selector),
            Some(Selector::Quant(None))
        );
        for path in [
            "models/x.gguf",
            "/abs/path",
            "./o/r",
            "a/b/c",
            "default",
            "o/r:bad tag",
            "hf://o/r/../x.gguf",
            "hf://o/r",
        ] {
            assert_eq!(parse_ref(path), None, "{path}");
        }
        let r = parse_ref("o/r:q4_k_m").expect("ref");
        assert_eq!(r.to_string(), "o/r:q4_k_m");
    }

    #[test]
    fn quantization_picks_the_whole_word() {
        let files = names(&[
            "README.md",
            "m-Q4_K.gguf",
            "m-Q4_K_M.gguf",
            "m-Q8_0.gguf",
            "mmproj-m-Q8_0.gguf",
            "mmproj-m-f16.gguf",
        ]);
        let pick = |q: Option<&str>| choose(&files, &Selector::Quant(q.map(String::from)));
        assert_eq!(
            pick(Some("Q4_K")).expect("Q4_K").model,
            names(&["m-Q4_K.gguf"])
        );
        assert_eq!(
            pick(Some("q8_0")).expect("q8_0").model,
            names(&["m-Q8_0.gguf"])
        );
        let default = pick(None).expect("default");
        assert_eq!(default.model, names(&["m-Q4_K_M.gguf"]));
        assert_eq!(default.mmproj.as_deref(), Some("mmproj-m-f16.gguf"));
        let err = pick(Some("Q2_K")).expect_err("no such quant");
        assert!(err.contains("Q2_K") && err.contains("m-Q8_0.gguf"), "{err}");
        // Without Q4_K_M, the default is the first model file.
        let only = names(&["x.Q5_1.gguf", "x.Q3_K_S.gguf"]);
        assert_eq!(
            choose(&only, &Selector::Quant(None)).expect("first").model,
            names(&["x.Q3_K_S.gguf"])
        );
        assert!(choose(&names(&["README.md"]), &Selector::Quant(None)).is_err());
    }

    #[test]
    fn split_files_come_whole_and_in_order() {
        let files = names(&[
            "big-Q4_K_M-00002-of-00003.gguf",
            "big-Q4_K_M-00001-of-00003.gguf",
            "big-Q4_K_M-00003-of-00003.gguf",
            "small-Q8_0.gguf",
        ]);
        let want = names(&[
            "big-Q4_K_M-00001-of-00003.gguf",
            "big-Q4_K_M-00002-of-00003.gguf",
            "big-Q4_K_M-00003-of-00003.gguf",
        ]);
        let by_quant = choose(&files, &Selector::Quant(Some("Q4_K_M".into()))).expect("quant");
        assert_eq!(by_quant.model, want);
        // Naming any part names the whole model.
        let by_file = choose(
            &files,
            &Selector::File("big-Q4_K_M-00003-of-00003.gguf".into()),
        )
        .expect("file");
        assert_eq!(by_file.model, want);
        let missing = names(&["big-00001-of-00002.gguf"]);
        let err = choose(&missing, &Selector::Quant(None)).expect_err("part 2 missing");
        assert!(err.contains("big-00002-of-00002.gguf"), "{err}");
    }

    #[test]
    fn settings_follow_the_hub_libraries_environment() {
        // Only checks the pure parts: the cache folder naming and defaults.
        let dir = repo_dir(Path::new("/c"), "o/r");
        assert_eq!(dir, PathBuf::from("/c/models--o--r"));
        assert_eq!(clean_etag("W/\"abc\""), "abc");
        assert!(etag_sha256(&"a".repeat(64)).is_some());
        assert!(etag_sha256(&"a".repeat(40)).is_none());
    }

    #[test]
    fn store_resolves_list_and_remove() {
        let tmp = tempfile::Builder::new()
            .prefix("sipp-hub-unit-")
            .tempdir()
            .expect("dir");
        let root = tmp.path().to_path_buf();
        let settings = HubSettings {
            endpoint: "http://127.0.0.1:9".into(),
            token: None,
            offline: true,
            cache: root.clone(),
        };
        let dir = repo_dir(&root, "o/r");
        let commit = "0123456789abcdef0123456789abcdef01234567";
        std::fs::create_dir_all(dir.join("blobs")).expect("blobs");
        std::fs::create_dir_all(dir.join("refs")).expect("refs");
        std::fs::write(dir.join("refs/main"), commit).expect("ref");
        let snap = dir.join("snapshots").join(commit);
        for (name, body) in [
            ("m-Q8_0.gguf", b"eight".as_slice()),
            ("m-Q4_0.gguf", b"four"),
        ] {
            let etag = sha256_hex(body);
            std::fs::write(dir.join("blobs").join(&etag), body).expect("blob");
            link_into_snapshot(&snap, name, &dir.join("blobs").join(&etag)).expect("link");
        }
        let r = parse_ref("o/r:Q8_0").expect("ref");
        let got = from_store(&settings, &r).expect("in store");
        assert_eq!(std::fs::read(&got.model).expect("read"), b"eight");
        assert_eq!(got.commit, commit);
        // Offline, something missing is an error that says so.
        let missing = parse_ref("o/r:Q2_K").expect("ref");
        let err = resolve(&settings, &missing, &mut Quiet).expect_err("offline");
        assert!(err.to_string().contains("offline"), "{err}");
        assert_eq!(list(&settings).len(), 2);
        let removed = remove(&settings, &r).expect("removed");
        assert_eq!(removed.len(), 2, "{removed:?}");
        assert_eq!(list(&settings).len(), 1);
        assert!(from_store(&settings, &r).is_err());
        remove(&settings, &parse_ref("o/r").expect("ref")).expect("whole repo");
        assert!(!dir.exists());
    }
}
