//! Starts the real `sipp serve` on a loopback port for tests.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use parking_lot::{ReentrantMutex, ReentrantMutexGuard};

/// One test at a time runs servers. Each server decodes with 2 threads, as many
/// as the machine has cores; two tests running servers side by side would
/// oversubscribe the cores, and llama.cpp's spinning thread pools then slow
/// each other down by orders of magnitude (a CI run saw a 200-token request
/// take over 30 s). Re-entrant, so a test that starts several servers (a
/// gateway and its upstream) holds it once.
static SERVERS: ReentrantMutex<()> = parking_lot::const_reentrant_mutex(());

/// This thread's claim on running servers; a test that spawns `sipp serve`
/// itself holds one for as long as the process lives.
pub struct ServerTurn(ReentrantMutexGuard<'static, ()>);

impl ServerTurn {
    /// Waits until no other test runs a server.
    pub fn take() -> ServerTurn {
        ServerTurn(SERVERS.lock())
    }
}

/// A running server; killed on drop.
pub struct Server {
    pub child: Child,
    pub base: String,
    pub log: Arc<Mutex<String>>,
    /// Released after the process is killed (fields drop after `drop`).
    _turn: ServerTurn,
    /// A temporary folder the server reads (its config), removed after the
    /// process is killed.
    dir: Option<tempfile::TempDir>,
}

impl Server {
    /// Starts `sipp serve --port 0 ARGS` and waits until /health is 200.
    pub fn start(args: &[&str]) -> Server {
        Self::start_with_env(args, &[])
    }

    /// Like [`Server::start`], with extra environment variables.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Server {
        let turn = ServerTurn::take();
        let fetch = Command::new(env!("CARGO_BIN_EXE_sipp"))
            .args(["models", "fetch", "default"])
            .output()
            .expect("fetch");
        assert!(fetch.status.success());
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sipp"));
        cmd.args(["serve", "--port", "0", "--threads", "2"])
            .args(args);
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.env_remove("SIPP_API_KEY");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("sipp serve starts");
        let stderr = child.stderr.take().expect("stderr");
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let log2 = log.clone();
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix("listening on ") {
                    if let Some(t) = tx.take() {
                        let _ = t.send(
                            rest.split_whitespace()
                                .next()
                                .unwrap_or_default()
                                .to_string(),
                        );
                    }
                }
                if let Ok(mut l) = log2.lock() {
                    l.push_str(&line);
                    l.push('\n');
                }
            }
        });
        let base = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("server printed its address");
        let server = Server {
            child,
            base,
            log,
            _turn: turn,
            dir: None,
        };
        server.wait_healthy();
        server
    }

    /// The server, holding `dir` until it is killed.
    pub fn keeping(mut self, dir: tempfile::TempDir) -> Server {
        self.dir = Some(dir);
        self
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub fn wait_healthy(&self) {
        let client = reqwest::blocking::Client::new();
        let start = Instant::now();
        loop {
            if let Ok(r) = client.get(self.url("/health")).send() {
                if r.status() == 200 {
                    return;
                }
            }
            assert!(
                start.elapsed() < Duration::from_secs(120),
                "server never became healthy: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn log(&self) -> String {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// A metric's value from /metrics (first sample whose line starts with `prefix`).
    pub fn metric(&self, prefix: &str) -> Option<f64> {
        self.metric_with_key(prefix, None)
    }

    /// [`Server::metric`] on a server that requires an API key.
    pub fn metric_with_key(&self, prefix: &str, key: Option<&str>) -> Option<f64> {
        metric_at(&self.base, prefix, key)
    }
}

/// A metric's value from the /metrics of the server at `base` (first sample
/// whose line starts with `prefix`).
pub fn metric_at(base: &str, prefix: &str, key: Option<&str>) -> Option<f64> {
    let mut req = reqwest::blocking::Client::new().get(format!("{base}/metrics"));
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let text = req.send().ok()?.text().ok()?;
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls until `f` holds or the timeout passes.
pub fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    f()
}

/// A two-model config: the default chat model and MiniLM for embeddings.
pub fn two_model_config(dir: &std::path::Path, extra_server: &str) -> std::path::PathBuf {
    let minilm = Command::new(env!("CARGO_BIN_EXE_sipp"))
        .args(["models", "fetch", "minilm"])
        .output()
        .expect("fetch");
    assert!(
        minilm.status.success(),
        "{}",
        String::from_utf8_lossy(&minilm.stderr)
    );
    let path = dir.join("sipp.toml");
    std::fs::write(
        &path,
        format!(
            r#"
[server]
{extra_server}

[[models]]
id = "smol"
model = "default"
default = true
aliases = ["SmolLM2-135M-Instruct.Q4_1"]
[models.runtime.context]
n_ctx = 2048
n_parallel = 4

[[models]]
id = "minilm"
model = "minilm"
[models.runtime.context]
embeddings = true
n_parallel = 4
"#
        ),
    )
    .expect("write config");
    path
}

/// This crate's folder. `cargo test` sets `CARGO_MANIFEST_DIR` when it runs a
/// test; read at run time it names the checkout being tested even when the
/// binary was compiled from another checkout into a shared target directory.
pub fn manifest_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| env!("CARGO_MANIFEST_DIR").into(), Into::into)
}

/// `sipp serve` on the two-model config (`two_model_config`) with the API
/// key `sk-local`; `tag` names its temporary folder.
pub fn two_model_server(tag: &str) -> Server {
    let dir = temp_dir(tag);
    let cfg = two_model_config(dir.path(), "api_keys = [\"sk-local\"]");
    Server::start(&["--config", cfg.to_str().expect("utf8")]).keeping(dir)
}

/// A new temporary folder named after `tag`, removed when the handle drops.
pub fn temp_dir(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("sipp-{tag}-"))
        .tempdir()
        .expect("temporary folder")
}

/// Runs the Python client `tests/<script>` against `s` (its base URL, then
/// `args`) with the interpreter named by the environment variable
/// `python_env` (python3 when unset), and asserts it succeeded and printed
/// `ok`; on failure `what` says what failed and what installs its packages.
pub fn run_python_client(s: &Server, python_env: &str, script: &str, args: &[&str], what: &str) {
    let python = std::env::var(python_env).unwrap_or_else(|_| "python3".into());
    let out = Command::new(&python)
        .arg(manifest_dir().join("tests").join(script))
        .arg(&s.base)
        .args(args)
        .output()
        .expect("python runs");
    // Figures the client printed show with `--nocapture`.
    print!("{}", String::from_utf8_lossy(&out.stdout));
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("ok"),
        "{what}:\nstdout: {}\nstderr: {}\nserver: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        s.log()
    );
}

/// llama.cpp's own llama-server (the reference build, named by
/// `SIPP_LLAMA_SERVER`) on a free loopback port, healthy; killed on drop.
pub struct LlamaServer {
    child: std::process::Child,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
}

impl LlamaServer {
    /// Starts `bin -m model --port P --host 127.0.0.1 ARGS...` and waits for
    /// its /health.
    pub fn start(bin: &str, model: &std::path::Path, args: &[&str]) -> LlamaServer {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .expect("port")
            .local_addr()
            .expect("addr")
            .port();
        let child = std::process::Command::new(bin)
            .args(["-m", &model.display().to_string()])
            .args(["--port", &port.to_string(), "--host", "127.0.0.1"])
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("llama-server starts");
        let server = LlamaServer {
            child,
            base: format!("http://127.0.0.1:{port}"),
        };
        let c = reqwest::blocking::Client::new();
        assert!(
            eventually(Duration::from_secs(60), || c
                .get(format!("{}/health", server.base))
                .send()
                .is_ok_and(|r| r.status() == 200)),
            "llama-server never became healthy"
        );
        server
    }
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// POSTs a JSON body to `url`: the status and the JSON answer (`Null`
/// when it is not JSON).
pub fn post_json(
    c: &reqwest::blocking::Client,
    url: &str,
    body: &serde_json::Value,
) -> (u16, serde_json::Value) {
    let r = c.post(url).json(body).send().expect("answered");
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(serde_json::Value::Null))
}

/// The Python that runs the repository's scripts (`SIPP_PYTHON`, the venv
/// `scripts/test.sh` makes, else `python3`).
pub fn python() -> String {
    std::env::var("SIPP_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// A tiny test model in the model cache, named `name`, written on first use
/// by `scripts/SCRIPT SRC OUT ARGS...` (a generator using the `gguf` package).
pub fn tiny_model(
    name: &str,
    script: &str,
    src: &std::path::Path,
    args: &[&str],
) -> std::path::PathBuf {
    generated(name, script, Some(src), args)
}

/// `scripts/SCRIPT [SRC] OUT ARGS...` run once, its output cached as `name`.
fn generated(
    name: &str,
    script: &str,
    src: Option<&std::path::Path>,
    args: &[&str],
) -> std::path::PathBuf {
    let out = sipp::models::cache_dir().join(name);
    if !out.exists() {
        let made = Command::new(python())
            .arg(manifest_dir().join("../../scripts").join(script))
            .args(src)
            .arg(&out)
            .args(args)
            .output()
            .expect("python runs");
        assert!(
            made.status.success(),
            "{script} failed (scripts/test.sh installs its packages into SIPP_PYTHON's venv): {}",
            String::from_utf8_lossy(&made.stderr)
        );
    }
    out
}

/// A tool from llama.cpp's reference build (scripts/reference-tools.sh):
/// `SIPP_LLAMA_BIN` (scripts/test.sh sets it), else the folder of
/// `SIPP_LLAMA_SERVER`. The comparisons that need one fail without it.
pub fn reference_tool(name: &str) -> std::path::PathBuf {
    let dir = std::env::var("SIPP_LLAMA_BIN")
        .map(std::path::PathBuf::from)
        .or_else(|_| {
            std::env::var("SIPP_LLAMA_SERVER").map(|s| {
                std::path::PathBuf::from(s)
                    .parent()
                    .map(std::path::Path::to_path_buf)
                    .unwrap_or_default()
            })
        })
        .expect(
            "SIPP_LLAMA_BIN names llama.cpp's reference tools (scripts/test.sh sets it; \
             scripts/reference-tools.sh builds them)",
        );
    let bin = dir.join(name);
    assert!(
        bin.is_file(),
        "{} is missing: run scripts/reference-tools.sh",
        bin.display()
    );
    bin
}

/// A tiny test model in the model cache, named `name`, written on first use
/// by `scripts/SCRIPT OUT ARGS...` (a generator that needs no source model).
pub fn tiny_model_from_scratch(name: &str, script: &str, args: &[&str]) -> std::path::PathBuf {
    generated(name, script, None, args)
}

/// An image encoded as PNG.
pub fn png_bytes(img: &image::RgbImage) -> Vec<u8> {
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png)
        .expect("png");
    out.into_inner()
}

/// Bytes as a base64 `data:` URL of the given MIME type.
pub fn data_url(bytes: &[u8], mime: &str) -> String {
    use base64::Engine as _;
    format!(
        "data:{mime};base64,{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}
