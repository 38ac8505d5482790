//! Targets served from a supervised child process.
//!
//! A target whose model is spread over llama.cpp RPC servers
//! (`placement.rpc`) cannot run in this process: ggml's RPC client aborts the
//! whole process when a server drops or a call fails. So the server starts a
//! child, `sipp serve --supervised` with that one target, on a loopback port
//! with a key of its own, and forwards every request naming the target to it
//! ([`proxy`]). When the child dies, its in-flight requests fail with 503,
//! `/health` names the target and the reason, and the child is started again
//! with exponential backoff (1 s doubling to 30 s, back to 1 s once a child
//! became healthy); every other target keeps serving.
//!
//! The child prints one line on stdout, `{"listening": "127.0.0.1:PORT"}`, and
//! exits when its stdin closes, so it never outlives this process.

pub mod proxy;

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::config::{ModelTarget, ServeConfig, ServerSection};
use crate::state::{AppState, TargetState};

/// First wait before a restart; doubled after each failed start.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// Longest wait between restarts.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// How long a child may take to print its address.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(60);
/// How often a serving child's /health is read.
const HEALTH_INTERVAL: Duration = Duration::from_secs(2);

/// Whether a target runs in a supervised child: a local model on RPC servers.
pub fn is_supervised(m: &ModelTarget) -> bool {
    m.provider.is_none() && !m.runtime.placement.rpc.is_empty()
}

/// Where a healthy child listens, and how to reach it.
#[derive(Clone, Debug)]
pub struct ChildLink {
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// The key the child requires (random per start).
    pub key: Arc<str>,
    /// One connection pool per child.
    pub client: reqwest::Client,
}

/// Starts supervising `m`: its child is started now and again whenever it
/// exits, until this process ends.
pub fn spawn_supervisor(state: AppState, m: ModelTarget, server: Arc<ServerSection>) {
    tokio::spawn(async move {
        let Some(program) = child_program() else {
            state.set_target(
                &m.id,
                TargetState::Failed("cannot find the sipp executable to start a child".into()),
            );
            return;
        };
        let mut backoff = FIRST_BACKOFF;
        loop {
            state.set_target(&m.id, TargetState::Loading);
            state.metrics.record_child_start(&m.id);
            let outcome = run_child(&state, &m, &server, &program).await;
            if outcome.became_healthy {
                backoff = FIRST_BACKOFF;
            }
            let why = format!(
                "its child process {}; restarting in {}s",
                outcome.reason,
                backoff.as_secs()
            );
            tracing::error!(model = %m.id, "{why}");
            state.set_target(&m.id, TargetState::Failed(why));
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    });
}

/// This executable, run as `sipp serve` (`SIPP_CHILD_EXE` overrides it, for
/// hosts that embed the server in another program).
fn child_program() -> Option<PathBuf> {
    std::env::var_os("SIPP_CHILD_EXE")
        .map(PathBuf::from)
        .or_else(|| std::env::current_exe().ok())
}

/// How one child's life ended.
struct Outcome {
    became_healthy: bool,
    reason: String,
}

/// Starts one child, marks the target forwarded once it is healthy, and
/// returns when it exits (or could not start).
async fn run_child(
    state: &AppState,
    m: &ModelTarget,
    server: &ServerSection,
    program: &std::path::Path,
) -> Outcome {
    let failed = |reason: String| Outcome {
        became_healthy: false,
        reason,
    };
    let key = match random_key() {
        Ok(k) => k,
        Err(e) => return failed(format!("could not start: no random key ({e})")),
    };
    let config = match child_config(m, server) {
        Ok(c) => c,
        Err(e) => return failed(format!("could not start: {e}")),
    };
    let mut cmd = Command::new(program);
    cmd.args(["serve", "--supervised", "--config"])
        .arg(&config.path)
        .env("SIPP_API_KEY", &key)
        .env_remove("SIPP_MODEL")
        .env_remove("SIPP_HOST")
        .env_remove("SIPP_PORT")
        .env_remove("SIPP_CONFIG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return failed(format!("could not start: {e}")),
    };
    // Held until the child is done with: its end closes the child's stdin,
    // which the child takes as the order to exit.
    let _stdin = child.stdin.take();
    // The child's log lines go to this process's stderr, each marked with
    // the target it serves.
    if let Some(stderr) = child.stderr.take() {
        let tag = m.id.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                eprintln!("[child {tag}] {line}");
            }
        });
    }
    let addr = match listening_address(&mut child).await {
        Ok(a) => a,
        Err(e) => return failed(exit_reason(&mut child, e).await),
    };
    // Read by now: the child listens only after loading its config.
    drop(config);
    let link = ChildLink {
        base: format!("http://{addr}"),
        key: key.into(),
        client: reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .build()
            .unwrap_or_default(),
    };
    tracing::info!(model = %m.id, child = %link.base, "child process listening");
    let healthy = tokio::select! {
        h = child_health(&link, true) => h,
        status = child.wait() => return failed(describe_exit(status)),
    };
    if let Err(e) = healthy {
        return failed(exit_reason(&mut child, format!("failed to load: {e}")).await);
    }
    tracing::info!(model = %m.id, "child process healthy: forwarding");
    state.set_target(&m.id, TargetState::Forwarded(link.clone()));
    // Until it exits; a child whose engine stopped without exiting is ended.
    let reason = loop {
        tokio::select! {
            status = child.wait() => break describe_exit(status),
            () = tokio::time::sleep(HEALTH_INTERVAL) => {
                if let Err(e) = child_health(&link, false).await {
                    break exit_reason(&mut child, format!("became unhealthy: {e}")).await;
                }
            }
        }
    };
    Outcome {
        became_healthy: true,
        reason,
    }
}

/// Reads the child's `{"listening": ADDR}` line.
async fn listening_address(child: &mut Child) -> Result<String, String> {
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(LISTEN_TIMEOUT, lines.next_line())
        .await
        .map_err(|_| "did not say where it listens in time".to_string())?
        .map_err(|e| e.to_string())?
        .ok_or("exited before it listened")?;
    // Nothing else comes on stdout; keep the pipe drained anyway.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    #[derive(serde::Deserialize)]
    struct Listening {
        listening: String,
    }
    serde_json::from_str::<Listening>(&line)
        .map(|l| l.listening)
        .map_err(|_| format!("printed `{line}` instead of its address"))
}

/// The child's /health: `Ok` once it is 200. While it loads (or, when
/// `wait`, does not answer yet) it is asked again; a failed target (its
/// `{"status": "error", "message"}`) is the error. Without `wait`, one answer
/// decides and no answer is an error.
async fn child_health(link: &ChildLink, wait: bool) -> Result<(), String> {
    #[derive(serde::Deserialize)]
    struct HealthBody {
        status: String,
        #[serde(default)]
        message: String,
    }
    loop {
        match link
            .client
            .get(format!("{}/health", link.base))
            .timeout(Duration::from_secs(10))
            .send()
            .await
        {
            Ok(r) if r.status().is_success() => return Ok(()),
            Ok(r) => {
                let body = r.bytes().await.unwrap_or_default();
                if let Ok(h) = serde_json::from_slice::<HealthBody>(&body) {
                    if h.status == "error" {
                        return Err(h.message);
                    }
                }
            }
            Err(e) if !wait => return Err(format!("/health did not answer ({e})")),
            Err(_) => {}
        }
        if !wait {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Why a child that could not be used ended: it is killed if still running.
async fn exit_reason(child: &mut Child, why: String) -> String {
    let _ = child.start_kill();
    let status = child.wait().await;
    format!("{why} ({})", describe_exit(status))
}

fn describe_exit(status: std::io::Result<std::process::ExitStatus>) -> String {
    match status {
        Ok(s) => {
            #[cfg(unix)]
            {
                use std::os::unix::process::ExitStatusExt;
                if let Some(sig) = s.signal() {
                    let name = match sig {
                        6 => " (SIGABRT: ggml aborted, e.g. an RPC server dropped)",
                        9 => " (SIGKILL)",
                        _ => "",
                    };
                    return format!("was ended by signal {sig}{name}");
                }
            }
            match s.code() {
                Some(c) => format!("exited with code {c}"),
                None => "exited".into(),
            }
        }
        Err(e) => format!("could not be waited for: {e}"),
    }
}

/// `n` random bytes as hex.
fn random_hex(n: usize) -> Result<String, getrandom::Error> {
    let mut bytes = vec![0u8; n];
    getrandom::fill(&mut bytes)?;
    Ok(hex::encode(bytes))
}

/// A child's key: 32 random bytes.
fn random_key() -> Result<String, getrandom::Error> {
    Ok(format!("sk-child-{}", random_hex(32)?))
}

/// The child's config file, removed when dropped.
struct ChildConfig {
    path: PathBuf,
}

impl Drop for ChildConfig {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The child serves `m` alone (with its aliases), as its default, on a free loopback port; the
/// parent's traffic policy stays with the parent (the child's only key is the
/// parent's, passed in its environment).
fn child_config(m: &ModelTarget, server: &ServerSection) -> Result<ChildConfig, String> {
    let config = ServeConfig {
        server: ServerSection {
            host: "127.0.0.1".into(),
            port: 0,
            api_keys: Vec::new(),
            limits: Default::default(),
            ip: Default::default(),
            protect_health: false,
            public_metrics: false,
            cors_origins: Vec::new(),
            // The child keeps its one model loaded.
            models_max: None,
            idle_unload_secs: None,
            ..server.clone()
        },
        // The aliases too: forwarded bodies name the model as the client did.
        models: vec![ModelTarget {
            default: true,
            ..m.clone()
        }],
        child: true,
    };
    let text = toml::to_string(&config).map_err(|e| format!("cannot write its config: {e}"))?;
    let safe: String =
        m.id.chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
    let path = std::env::temp_dir().join(format!(
        "sipp-child-{}-{safe}-{}.toml",
        std::process::id(),
        random_hex(4).unwrap_or_default()
    ));
    std::fs::write(&path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(ChildConfig { path })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rpc_target() -> ModelTarget {
        let mut runtime = sipp::NativeRuntimeConfig::default();
        runtime.placement.rpc = vec!["127.0.0.1:50052".into()];
        runtime.context.n_parallel = 3;
        ModelTarget {
            id: "spread/one".into(),
            model: "default".into(),
            provider: None,
            default: false,
            aliases: vec!["big".into()],
            runtime,
            load: Default::default(),
        }
    }

    #[test]
    fn only_local_targets_on_rpc_servers_are_supervised() {
        let m = rpc_target();
        assert!(is_supervised(&m));
        let mut local = m.clone();
        local.runtime.placement.rpc.clear();
        assert!(!is_supervised(&local));
    }

    /// The child's config holds the target alone, as its default, on a free
    /// loopback port, without the parent's keys, limits or address lists; it
    /// reads back as the same target.
    #[test]
    fn the_child_config_is_the_target_alone_on_loopback() {
        let server = ServerSection {
            host: "0.0.0.0".into(),
            port: 8080,
            api_keys: vec!["sk-parent".to_string().into()],
            max_body_bytes: 1234,
            ..Default::default()
        };
        let m = rpc_target();
        let c = child_config(&m, &server).expect("written");
        let text = std::fs::read_to_string(&c.path).expect("readable");
        let back = ServeConfig::from_toml(&text).expect("parses");
        assert_eq!(back.server.host, "127.0.0.1");
        assert_eq!(back.server.port, 0);
        assert!(back.server.api_keys.is_empty(), "{text}");
        assert_eq!(back.server.max_body_bytes, 1234);
        assert_eq!(back.models.len(), 1);
        let t = &back.models[0];
        assert!(t.default);
        assert_eq!(t.aliases, m.aliases);
        assert_eq!(t.id, m.id);
        assert_eq!(t.runtime, m.runtime);
        back.validate().expect("valid");
        let path = c.path.clone();
        drop(c);
        assert!(!path.exists(), "removed with the child");
    }

    #[test]
    fn keys_differ_per_start() {
        let (a, b) = (random_key().expect("a"), random_key().expect("b"));
        assert_ne!(a, b);
        assert_eq!(a.len(), "sk-child-".len() + 64);
    }
}
