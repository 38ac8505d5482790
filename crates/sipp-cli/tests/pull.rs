//! `sipp pull`, `sipp list`, `sipp rm` and `--model owner/repo:QUANT` against a
//! stand-in for the Hugging Face hub on loopback (the hub itself is not
//! reachable from these machines). It answers as the hub does: the file list
//! at `/api/models/{repo}/revision/{rev}`; `/{repo}/resolve/{rev}/{file}`
//! redirected (302) to a file host on a second loopback address with
//! `X-Repo-Commit`, `X-Linked-Etag` (the sha256) and `X-Linked-Size`; byte
//! ranges honoured on the file host.

use axum::body::Body;
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::routing::get;
use axum::Router;
use sha2::{Digest, Sha256};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};

const COMMIT: &str = "5f0c6a1e2b3d4c5e6f708192a3b4c5d6e7f80912";

/// One request as a server saw it.
#[derive(Debug, Clone)]
struct Seen {
    path: String,
    range: Option<String>,
    auth: Option<String>,
}

struct File {
    bytes: Arc<Vec<u8>>,
    /// The sha256 the hub publishes (wrong on purpose for the broken repo).
    etag: String,
}

struct Hub {
    repos: HashMap<String, Vec<(String, File)>>,
    cdn: String,
    /// Blobs whose first full download is cut after this many bytes.
    cut: Mutex<HashSet<String>>,
    cut_at: usize,
    api_log: Mutex<Vec<Seen>>,
    cdn_log: Mutex<Vec<Seen>>,
}

fn seen(path: String, h: &HeaderMap) -> Seen {
    let get = |k: &str| h.get(k).and_then(|v| v.to_str().ok()).map(String::from);
    Seen {
        path,
        range: get("range"),
        auth: get("authorization"),
    }
}

fn sha(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

async fn revision(
    State(hub): State<Arc<Hub>>,
    UrlPath((owner, name, _rev)): UrlPath<(String, String, String)>,
    headers: HeaderMap,
) -> Response {
    let repo = format!("{owner}/{name}");
    hub.api_log
        .lock()
        .expect("log")
        .push(seen(format!("/api/models/{repo}"), &headers));
    let Some(files) = hub.repos.get(&repo) else {
        return Response::builder()
            .status(404)
            .body(Body::from("{\"error\":\"Repository not found\"}"))
            .expect("response");
    };
    let siblings: Vec<serde_json::Value> = files
        .iter()
        .map(|(n, _)| serde_json::json!({ "rfilename": n }))
        .chain(std::iter::once(
            serde_json::json!({"rfilename": "README.md"}),
        ))
        .collect();
    let body = serde_json::json!({ "id": repo, "sha": COMMIT, "siblings": siblings });
    Response::builder()
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .expect("response")
}

async fn resolve(
    State(hub): State<Arc<Hub>>,
    UrlPath((owner, name, _rev, file)): UrlPath<(String, String, String, String)>,
    headers: HeaderMap,
) -> Response {
    let repo = format!("{owner}/{name}");
    hub.api_log
        .lock()
        .expect("log")
        .push(seen(format!("/{repo}/resolve/{file}"), &headers));
    let found = hub
        .repos
        .get(&repo)
        .and_then(|fs| fs.iter().find(|(n, _)| *n == file));
    let Some((_, f)) = found else {
        return Response::builder()
            .status(404)
            .body(Body::empty())
            .expect("response");
    };
    Response::builder()
        .status(StatusCode::FOUND)
        .header("location", format!("{}/blobs/{}", hub.cdn, sha(&f.bytes)))
        .header("x-repo-commit", COMMIT)
        .header("x-linked-etag", format!("\"{}\"", f.etag))
        .header("x-linked-size", f.bytes.len().to_string())
        .header("etag", "\"0123456789012345678901234567890123456789\"")
        .body(Body::empty())
        .expect("response")
}

/// The file host: blobs by content hash, ranges honoured, and a first full
/// download of a marked blob cut off part-way.
async fn blob(
    State(hub): State<Arc<Hub>>,
    UrlPath(key): UrlPath<String>,
    headers: HeaderMap,
) -> Response {
    let s = seen(format!("/blobs/{key}"), &headers);
    hub.cdn_log.lock().expect("log").push(s.clone());
    let bytes = hub
        .repos
        .values()
        .flatten()
        .map(|(_, f)| &f.bytes)
        .find(|b| sha(b) == key)
        .cloned();
    let Some(bytes) = bytes else {
        return Response::builder()
            .status(404)
            .body(Body::empty())
            .expect("response");
    };
    let total = bytes.len();
    let start = s
        .range
        .as_deref()
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.strip_suffix('-'))
        .and_then(|n| n.parse::<usize>().ok());
    if let Some(start) = start {
        if start >= total {
            return Response::builder()
                .status(416)
                .header("content-range", format!("bytes */{total}"))
                .body(Body::empty())
                .expect("response");
        }
        return Response::builder()
            .status(206)
            .header(
                "content-range",
                format!("bytes {start}-{}/{total}", total - 1),
            )
            .header("content-length", (total - start).to_string())
            .body(Body::from(bytes[start..].to_vec()))
            .expect("response");
    }
    if hub.cut.lock().expect("cut").remove(&key) {
        // Sends the first bytes, then the connection breaks.
        let head = bytes[..hub.cut_at].to_vec();
        let chunks: Vec<Result<Vec<u8>, std::io::Error>> = vec![
            Ok(head),
            Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionReset,
                "cut",
            )),
        ];
        return Response::builder()
            .header("content-length", total.to_string())
            .body(Body::from_stream(futures::stream::iter(chunks)))
            .expect("response");
    }
    Response::builder()
        .header("content-length", total.to_string())
        .body(Body::from(bytes.to_vec()))
        .expect("response")
}

/// Starts the hub on 127.0.0.1 and its file host on 127.0.0.2 (another host,
/// as the real hub's CDN is) on a thread of their own.
fn start_hub(repos: HashMap<String, Vec<(String, File)>>, cut: &[String]) -> (String, Arc<Hub>) {
    let (tx, rx) = std::sync::mpsc::channel();
    let cut: HashSet<String> = cut.iter().cloned().collect();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().expect("runtime");
        rt.block_on(async move {
            let cdn_l = tokio::net::TcpListener::bind("127.0.0.2:0")
                .await
                .expect("bind 127.0.0.2");
            let api_l = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let hub = Arc::new(Hub {
                repos,
                cdn: format!("http://{}", cdn_l.local_addr().expect("addr")),
                cut: Mutex::new(cut),
                cut_at: 4 << 20,
                api_log: Mutex::default(),
                cdn_log: Mutex::default(),
            });
            let api = Router::new()
                .route("/api/models/{owner}/{name}/revision/{rev}", get(revision))
                .route("/{owner}/{name}/resolve/{rev}/{*file}", get(resolve))
                .with_state(hub.clone());
            let cdn = Router::new()
                .route("/blobs/{key}", get(blob))
                .with_state(hub.clone());
            tx.send((
                format!("http://{}", api_l.local_addr().expect("addr")),
                hub.clone(),
            ))
            .expect("send");
            let a = axum::serve(api_l, api);
            let c = axum::serve(cdn_l, cdn);
            let _ = tokio::join!(a, c);
        });
    });
    rx.recv().expect("hub started")
}

fn file(bytes: Vec<u8>) -> File {
    let etag = sha(&bytes);
    File {
        bytes: Arc::new(bytes),
        etag,
    }
}

fn noise(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn default_model() -> PathBuf {
    let o = Command::new(env!("CARGO_BIN_EXE_sipp"))
        .args(["models", "fetch", "default"])
        .output()
        .expect("sipp runs");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    PathBuf::from(out.trim().trim_start_matches("default: "))
}

/// A new temporary folder, removed when the handle drops.
fn tmp(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("sipp-pull-{name}-"))
        .tempdir()
        .expect("tmp")
}

/// Runs `sipp` against the stand-in hub with its own store.
fn sipp(endpoint: &str, store: &Path, extra_env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sipp"));
    cmd.args(args)
        .env("HF_ENDPOINT", endpoint)
        .env("HF_HUB_CACHE", store)
        .env("HF_TOKEN", "hf_secret_token")
        .env_remove("HF_HUB_OFFLINE")
        .env_remove("HF_HOME");
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    cmd.output().expect("sipp runs")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn files_under(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            out.push(e.file_name().to_string_lossy().into_owned());
        }
    }
    out.sort();
    out
}

#[test]
fn pull_by_quant_resumes_a_cut_download_and_runs_offline() {
    let model = std::fs::read(default_model()).expect("default model");
    let model_sha = sha(&model);
    let mut repos = HashMap::new();
    repos.insert(
        "acme/smol-GGUF".to_string(),
        vec![
            ("smol-Q4_1.gguf".to_string(), file(model.clone())),
            ("smol-Q8_0.gguf".to_string(), file(noise(300_000, 1))),
            ("mmproj-smol-f16.gguf".to_string(), file(noise(70_000, 2))),
        ],
    );
    let (endpoint, hub) = start_hub(repos, std::slice::from_ref(&model_sha));
    let scratch = tmp("store");
    let store = scratch.path();

    let o = sipp(&endpoint, &store, &[], &["pull", "acme/smol-GGUF:Q4_1"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "pull failed: {err}");
    let repo = store.join("models--acme--smol-GGUF");
    let snap = repo.join("snapshots").join(COMMIT);
    let pulled = snap.join("smol-Q4_1.gguf");
    assert!(out.contains(&pulled.display().to_string()), "{out}");
    assert_eq!(
        sha(&std::fs::read(&pulled).expect("pulled file")),
        model_sha,
        "the store holds the hub's bytes"
    );
    assert!(
        snap.join("mmproj-smol-f16.gguf").is_file(),
        "the projector comes along"
    );
    assert!(
        !snap.join("smol-Q8_0.gguf").exists(),
        "other quantizations stay"
    );
    assert_eq!(
        std::fs::read_to_string(repo.join("refs/main"))
            .expect("ref")
            .trim(),
        COMMIT
    );
    let blobs = files_under(&repo.join("blobs"));
    assert!(blobs.contains(&model_sha), "{blobs:?}");
    assert!(
        !blobs.iter().any(|b| b.ends_with(".incomplete")),
        "{blobs:?}"
    );

    // The first download was cut; the next asked for the rest with a range.
    let cdn: Vec<Seen> = hub.cdn_log.lock().expect("log").clone();
    let model_gets: Vec<&Seen> = cdn
        .iter()
        .filter(|s| s.path.ends_with(&model_sha))
        .collect();
    assert!(model_gets.len() >= 2, "{model_gets:?}");
    assert_eq!(model_gets[0].range, None);
    let resumed_from: usize = model_gets[1]
        .range
        .as_deref()
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.strip_suffix('-'))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("resumed with a range: {model_gets:?}"));
    assert!(
        resumed_from > 0 && resumed_from <= 4 << 20,
        "{resumed_from}"
    );
    // The token goes to the hub, never to the host it redirects to.
    assert!(cdn.iter().all(|s| s.auth.is_none()), "{cdn:?}");
    let api: Vec<Seen> = hub.api_log.lock().expect("log").clone();
    assert!(
        api.iter()
            .all(|s| s.auth.as_deref() == Some("Bearer hf_secret_token")),
        "{api:?}"
    );

    // Pulling again downloads nothing.
    let before = hub.cdn_log.lock().expect("log").len();
    let o = sipp(
        &endpoint,
        &store,
        &[],
        &["pull", "-q", "acme/smol-GGUF:Q4_1"],
    );
    assert!(o.status.success(), "{}", text(&o).1);
    assert_eq!(hub.cdn_log.lock().expect("log").len(), before);

    let o = sipp(&endpoint, &store, &[], &["list"]);
    let (out, _) = text(&o);
    assert!(out.contains("hf://acme/smol-GGUF/smol-Q4_1.gguf"), "{out}");

    // Offline: the store only, and not one request.
    let requests = hub.api_log.lock().expect("log").len() + hub.cdn_log.lock().expect("log").len();
    let offline = [("HF_HUB_OFFLINE", "1")];
    let o = sipp(
        &endpoint,
        &store,
        &offline,
        &[
            "run",
            "--model",
            "acme/smol-GGUF:Q4_1",
            "--threads",
            "2",
            "--max-tokens",
            "8",
            "--temperature",
            "0",
            "The capital of France is",
        ],
    );
    let (out, err) = text(&o);
    assert!(o.status.success(), "run from the store failed: {err}");
    assert!(!out.trim().is_empty(), "the model generated text");
    let o = sipp(
        &endpoint,
        &store,
        &offline,
        &["pull", "acme/smol-GGUF:Q8_0"],
    );
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(err.contains("offline"), "{err}");
    let after = hub.api_log.lock().expect("log").len() + hub.cdn_log.lock().expect("log").len();
    assert_eq!(after, requests, "offline mode sent requests");

    // Removing a quantization removes its file and blob.
    let o = sipp(&endpoint, &store, &[], &["rm", "acme/smol-GGUF:Q4_1"]);
    assert!(o.status.success(), "{}", text(&o).1);
    assert!(!pulled.exists());
    assert!(!files_under(&repo.join("blobs")).contains(&model_sha));
    let o = sipp(&endpoint, &store, &[], &["list"]);
    assert!(!text(&o).0.contains("smol-Q4_1"), "{}", text(&o).0);
    let o = sipp(&endpoint, &store, &[], &["rm", "acme/smol-GGUF"]);
    assert!(o.status.success(), "{}", text(&o).1);
    assert!(!repo.exists());
}

#[test]
fn split_parts_come_whole_and_bad_checksums_leave_nothing() {
    let mut repos = HashMap::new();
    let part1 = noise(1_500_000, 3);
    let part2 = noise(900_000, 4);
    repos.insert(
        "acme/big-GGUF".to_string(),
        vec![
            (
                "big-Q4_K_M-00002-of-00002.gguf".to_string(),
                file(part2.clone()),
            ),
            (
                "big-Q4_K_M-00001-of-00002.gguf".to_string(),
                file(part1.clone()),
            ),
            ("big-Q8_0.gguf".to_string(), file(noise(10_000, 5))),
        ],
    );
    let mut broken = file(noise(2_000_000, 6));
    broken.etag = sha(b"something else");
    repos.insert(
        "bad/broken-GGUF".to_string(),
        vec![("broken-Q8_0.gguf".to_string(), broken)],
    );
    let (endpoint, hub) = start_hub(repos, &[]);
    let scratch = tmp("split");
    let store = scratch.path();

    // No tag: Q4_K_M, every part, in order.
    let o = sipp(&endpoint, &store, &[], &["pull", "acme/big-GGUF"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let snap = store.join("models--acme--big-GGUF/snapshots").join(COMMIT);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert!(
        lines[0].ends_with("big-Q4_K_M-00001-of-00002.gguf"),
        "{out}"
    );
    assert!(
        lines[1].ends_with("big-Q4_K_M-00002-of-00002.gguf"),
        "{out}"
    );
    assert_eq!(
        std::fs::read(snap.join("big-Q4_K_M-00001-of-00002.gguf")).expect("1"),
        part1
    );
    assert_eq!(
        std::fs::read(snap.join("big-Q4_K_M-00002-of-00002.gguf")).expect("2"),
        part2
    );
    assert!(!snap.join("big-Q8_0.gguf").exists());

    // A file whose bytes do not match the published sha256 is refused, and
    // nothing of it stays in the store.
    let o = sipp(&endpoint, &store, &[], &["pull", "bad/broken-GGUF:Q8_0"]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(err.contains("sha256"), "{err}");
    let bad = store.join("models--bad--broken-GGUF");
    assert_eq!(files_under(&bad.join("blobs")), Vec::<String>::new());
    assert!(!bad
        .join("snapshots")
        .join(COMMIT)
        .join("broken-Q8_0.gguf")
        .exists());
    assert!(hub
        .cdn_log
        .lock()
        .expect("log")
        .iter()
        .any(|s| s.path.ends_with(&sha(&noise(2_000_000, 6)))));

    // Clear errors: an unknown quantization names what there is; an unknown
    // repository says it was not found; a missing store entry says how to pull.
    let o = sipp(&endpoint, &store, &[], &["pull", "acme/big-GGUF:Q2_K"]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(
        err.contains("Q2_K") && err.contains("big-Q8_0.gguf"),
        "{err}"
    );
    let o = sipp(&endpoint, &store, &[], &["pull", "nobody/nothing-GGUF"]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(err.contains("404"), "{err}");
    let o = sipp(&endpoint, &store, &[], &["pull", "not a reference"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o).1);
}
