//! Server configuration: one TOML file with a `[server]` table and one
//! `[[models]]` entry per served target. The `sipp serve` command applies its
//! flags and environment variables over this (flags, then environment, then
//! file, then these defaults).

use serde::{Deserialize, Serialize};
use sipp::NativeRuntimeConfig;

use crate::policy::{ApiKey, IpPolicy, LimitsSection};

/// The whole server configuration.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServeConfig {
    /// Listener, auth and limits.
    pub server: ServerSection,
    /// Served models. Empty means the default model.
    pub models: Vec<ModelTarget>,
    /// This process is a supervised child (`sipp serve --supervised`): it
    /// loads RPC-backed targets itself instead of supervising them.
    #[serde(skip)]
    pub child: bool,
}

/// Listener, auth and limits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerSection {
    /// Address to bind. Default 127.0.0.1.
    pub host: String,
    /// Port. Default 8080.
    pub port: u16,
    /// API keys; empty means no authentication. `SIPP_API_KEY` adds one.
    /// A plain string is a key with full access; a table
    /// `{ key, name, role = "admin" | "user", models = [...], limits = {...} }`
    /// limits it.
    pub api_keys: Vec<ApiKey>,
    /// Rate and in-flight limits per key and per client address.
    pub limits: LimitsSection,
    /// Client address allow / deny lists and trusted proxies.
    pub ip: IpPolicy,
    /// Whether /health needs a key too. Default false.
    pub protect_health: bool,
    /// Whether /metrics answers without a key, for scrapers that send none
    /// (Prometheus by default, the inference extension's endpoint picker).
    /// Address lists still apply. Default false.
    pub public_metrics: bool,
    /// Origins allowed by CORS; empty disables CORS. `"*"` allows any.
    pub cors_origins: Vec<String>,
    /// Largest request body in bytes (larger: 413). Default 8 MiB.
    pub max_body_bytes: usize,
    /// Seconds in-flight requests get to finish at shutdown before they are
    /// cancelled. Default 10.
    pub shutdown_grace_secs: u64,
    /// Responses kept in memory for `GET /v1/responses/{id}` and
    /// `previous_response_id`, oldest evicted first; 0 keeps none. Default 1000.
    pub responses_store: usize,
    /// The shape of `GET /get_load` when the request does not ask
    /// (`?format=`): `sglang` (a list per data-parallel rank, what
    /// sglang-router reads; the default) or `vllm` (`{"load": N}`, what
    /// vllm-router reads).
    pub load_format: LoadFormat,
    /// The most in-process local models resident at once; loading another
    /// unloads the least recently used first (after its in-flight requests
    /// finish). Default: no cap.
    pub models_max: Option<usize>,
    /// Unload an in-process local model unused for this many seconds (it is
    /// loaded again on its next request). Default: never.
    pub idle_unload_secs: Option<u64>,
    /// How long a request waits for its model to load (and for room to be
    /// made for it) before a 503. Default 300.
    pub load_wait_secs: u64,
    /// Where `POST /slots/{id}?action=save|restore` and
    /// `/v1/sessions/{key}?action=...` keep their files (llama-server's
    /// `--slot-save-path`). Unset (the default): saving and restoring answer
    /// 501.
    pub slot_save_path: Option<std::path::PathBuf>,
    /// Fetch http(s) image URLs of chat requests (`--fetch-image-urls`).
    /// Default false: only `data:` URLs are read, and an http(s) URL is a 400.
    pub fetch_image_urls: bool,
    /// Seconds one image fetch may take. Default 10.
    pub image_fetch_timeout_secs: u64,
    /// Bytes one fetched image may have. Default 20 MiB.
    pub image_fetch_max_bytes: usize,
}

/// When a model target is loaded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadWhen {
    /// When the server starts (the default).
    #[default]
    Startup,
    /// On its first request (or `POST /models/load`).
    OnDemand,
}

/// The two shapes routers read from `GET /get_load`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LoadFormat {
    /// `[{"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}]`.
    #[default]
    Sglang,
    /// `{"load": N}`.
    Vllm,
}

impl std::str::FromStr for LoadFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "sglang" => Ok(LoadFormat::Sglang),
            "vllm" => Ok(LoadFormat::Vllm),
            other => Err(format!(
                "`{other}` is not a load format: use sglang or vllm"
            )),
        }
    }
}

impl Default for ServerSection {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8080,
            api_keys: Vec::new(),
            limits: LimitsSection::default(),
            ip: IpPolicy::default(),
            protect_health: false,
            public_metrics: false,
            cors_origins: Vec::new(),
            max_body_bytes: 8 * 1024 * 1024,
            shutdown_grace_secs: 10,
            responses_store: crate::routes::responses::DEFAULT_STORED_RESPONSES,
            load_format: LoadFormat::default(),
            models_max: None,
            idle_unload_secs: None,
            load_wait_secs: 300,
            slot_save_path: None,
            fetch_image_urls: false,
            image_fetch_timeout_secs: 10,
            image_fetch_max_bytes: 20 << 20,
        }
    }
}

/// A remote provider a target forwards to, with server-side credentials.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderTarget {
    /// "openai", "openai_compatible" or "anthropic".
    pub kind: String,
    /// Base URL (required for openai_compatible).
    #[serde(default)]
    pub base_url: Option<String>,
    /// The API key itself (prefer `api_key_env`).
    #[serde(default)]
    pub api_key: Option<String>,
    /// An environment variable holding the API key.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// The model name at the provider.
    pub model: String,
    /// Retries on connection failures, 429 and 503. Default 2.
    #[serde(default = "two")]
    pub max_retries: u32,
}

fn two() -> u32 {
    2
}

/// One served model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelTarget {
    /// The id requests name in `model`.
    pub id: String,
    /// A GGUF path or a known model name (`default`, `minilm`); empty for a
    /// provider target.
    #[serde(default)]
    pub model: String,
    /// Forward to a remote provider instead of running a local model.
    #[serde(default)]
    pub provider: Option<ProviderTarget>,
    /// Answers requests that name no model. Default: the first target.
    #[serde(default)]
    pub default: bool,
    /// Other ids that route here.
    #[serde(default)]
    pub aliases: Vec<String>,
    /// This target's runtime configuration.
    #[serde(default)]
    pub runtime: NativeRuntimeConfig,
    /// `startup` (the default) or `on_demand`: declared, but loaded only
    /// when a request (or `POST /models/load`) first needs it. Local
    /// in-process models only.
    #[serde(default)]
    pub load: LoadWhen,
}

impl ModelTarget {
    /// Whether this target runs in this process on a local engine (not a
    /// provider, not an RPC-backed target in a supervised child): the
    /// targets that can be loaded and unloaded while serving.
    pub fn is_in_process(&self) -> bool {
        self.provider.is_none() && self.runtime.placement.rpc.is_empty()
    }
}

impl ServeConfig {
    /// Parses a TOML document. A key's model that no target has is named
    /// with its line (the rest of [`Self::validate`] runs later, once flags
    /// are applied).
    pub fn from_toml(text: &str) -> Result<Self, String> {
        let c: Self = toml::from_str(text).map_err(|e| format!("invalid server config: {e}"))?;
        c.check_key_models(Some(text))?;
        Ok(c)
    }

    /// Every model a key lists is a target id or alias (with the line when
    /// the config came from `text`).
    fn check_key_models(&self, text: Option<&str>) -> Result<(), String> {
        let known = |name: &str| {
            self.models
                .iter()
                .any(|m| m.id == name || m.aliases.iter().any(|a| a == name))
        };
        for (i, k) in self.server.api_keys.iter().enumerate() {
            for m in k.models() {
                if !known(m.get_ref()) {
                    let at = text
                        .map(|t| {
                            format!(
                                "line {}: ",
                                crate::policy::config::line_of(t, m.span().start)
                            )
                        })
                        .unwrap_or_default();
                    return Err(format!(
                        "invalid server config: {at}`server.api_keys[{i}].models`: no model target has the id or alias `{}`",
                        m.get_ref()
                    ));
                }
            }
            if k.key().trim().is_empty() {
                return Err(format!(
                    "invalid server config: `server.api_keys[{i}].key` is empty"
                ));
            }
        }
        Ok(())
    }

    /// Checks ids and runtime configs.
    pub fn validate(&self) -> Result<(), String> {
        let mut seen = std::collections::HashSet::new();
        for m in &self.models {
            if m.id.trim().is_empty() {
                return Err("a model target has an empty `id`".into());
            }
            match (&m.provider, m.model.trim().is_empty()) {
                (None, true) => {
                    return Err(format!(
                        "model `{}` needs `model` (a path or name) or a `provider`",
                        m.id
                    ))
                }
                (Some(_), false) => {
                    return Err(format!("model `{}` has both `model` and `provider`", m.id))
                }
                (Some(p), true)
                    if !["openai", "openai_compatible", "anthropic"].contains(&p.kind.as_str()) =>
                {
                    return Err(format!(
                        "model `{}`: provider kind must be openai, openai_compatible or anthropic",
                        m.id
                    ))
                }
                _ => {}
            }
            let adapter_aliases = m.runtime.lora.iter().flat_map(|l| &l.aliases);
            for id in std::iter::once(&m.id)
                .chain(&m.aliases)
                .chain(adapter_aliases)
            {
                if !seen.insert(id.clone()) {
                    return Err(format!("model id `{id}` is used twice"));
                }
            }
            m.runtime
                .validate()
                .map_err(|e| format!("model `{}`: {e}", m.id))?;
        }
        if self.models.iter().filter(|m| m.default).count() > 1 {
            return Err("more than one model target has `default = true`".into());
        }
        self.check_residency()?;
        self.check_key_models(None)
    }

    /// Checks `load`, `server.models_max`, `server.idle_unload_secs` and
    /// `server.load_wait_secs`.
    fn check_residency(&self) -> Result<(), String> {
        let s = &self.server;
        for m in &self.models {
            if m.load != LoadWhen::OnDemand {
                continue;
            }
            if m.provider.is_some() {
                return Err(format!(
                    "model `{}`: `load = \"on_demand\"` is for local models; a provider target has nothing to load",
                    m.id
                ));
            }
            if !m.is_in_process() {
                return Err(format!(
                    "model `{}`: `load = \"on_demand\"` is for local models; an RPC-backed target runs in a supervised child process that loads it at start",
                    m.id
                ));
            }
        }
        if s.models_max == Some(0) {
            return Err("`server.models_max` must be at least 1".into());
        }
        if let Some(max) = s.models_max {
            let at_startup: Vec<&str> = self
                .models
                .iter()
                .filter(|m| m.is_in_process() && m.load == LoadWhen::Startup)
                .map(|m| m.id.as_str())
                .collect();
            if at_startup.len() > max {
                return Err(format!(
                    "`server.models_max` is {max} but {} local models load at startup ({}); mark some `load = \"on_demand\"` or raise the cap",
                    at_startup.len(),
                    at_startup.join(", ")
                ));
            }
        }
        if s.idle_unload_secs == Some(0) {
            return Err("`server.idle_unload_secs` must be at least 1 (leave it out to never unload idle models)".into());
        }
        if s.load_wait_secs == 0 {
            return Err("`server.load_wait_secs` must be at least 1".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_targets_with_runtime_sections() {
        let c = ServeConfig::from_toml(
            r#"
[server]
port = 9000
api_keys = ["k1"]

[[models]]
id = "chat"
model = "default"
default = true
[models.runtime.context]
n_ctx = 2048

[[models]]
id = "embed"
model = "minilm"
[models.runtime.context]
embeddings = true
"#,
        )
        .expect("parses");
        assert_eq!(c.server.port, 9000);
        assert_eq!(c.server.host, "127.0.0.1");
        assert_eq!(c.models.len(), 2);
        assert_eq!(c.models[0].runtime.context.n_ctx, 2048);
        assert!(c.models[1].runtime.context.embeddings);
        c.validate().expect("valid");
    }

    #[test]
    fn duplicate_ids_and_unknown_keys_are_rejected() {
        let c = ServeConfig::from_toml(
            "[[models]]\nid='a'\nmodel='x'\n[[models]]\nid='a'\nmodel='y'\n",
        )
        .expect("parses");
        assert!(c.validate().unwrap_err().contains("twice"));
        assert!(ServeConfig::from_toml("[server]\nprot = 1\n")
            .unwrap_err()
            .contains("prot"));
    }

    /// Bad traffic policy fails at start, naming the line and the field.
    #[test]
    fn bad_policy_names_the_line_and_the_field() {
        let models = "\n[[models]]\nid = \"chat\"\nmodel = \"default\"\naliases = [\"smol\"]\n";
        let cases = [
            ("[server.ip]\nallow = [\"10.0.0.0/8\", \"10.1.0.0/16\"]\n", 2, "allow", "overlaps"),
            ("[server.ip]\ndeny = [\"10.0.0.300/8\"]\n", 2, "deny", "not a CIDR"),
            ("[server.ip]\n\ntrusted_proxies = [\"proxy\"]\n", 3, "trusted_proxies", "not a CIDR"),
            ("[server.limits.per_ip]\nrequests_per_minute = 0\n", 2, "requests_per_minute", "nonzero"),
            (
                "[server]\napi_keys = [\n  \"sk-a\",\n  { key = \"sk-b\", limits = { tokens_per_minute = 0 } },\n]\n",
                4,
                "tokens_per_minute",
                "nonzero",
            ),
            (
                "[server]\napi_keys = [\n  { key = \"sk-b\", models = [\"smol\", \"gpt\"] },\n]\n",
                3,
                "api_keys[0].models",
                "`gpt`",
            ),
            ("[server]\napi_keys = [{ key = \"sk-b\", role = \"root\" }]\n", 2, "role", "root"),
            ("[server]\napi_keys = [{ key = \"sk-b\", modles = [] }]\n", 2, "modles", "unknown field"),
        ];
        for (text, line, field, what) in cases {
            let e = ServeConfig::from_toml(&format!("{text}{models}")).expect_err(text);
            assert!(e.contains(&format!("line {line}")), "{text}: {e}");
            assert!(e.contains(field), "{text}: {e}");
            assert!(e.contains(what), "{text}: {e}");
        }
        // An alias names its target; a plain key and a table mix.
        let c = ServeConfig::from_toml(&format!(
            "[server]\napi_keys = [\"sk-a\", {{ key = \"sk-b\", role = \"user\", models = [\"smol\"] }}]\n{models}"
        ))
        .expect("valid");
        assert_eq!(c.server.api_keys[0].role(), crate::policy::Role::Admin);
        assert_eq!(c.server.api_keys[1].role(), crate::policy::Role::User);
        c.validate().expect("valid");
    }

    /// On-demand loading and the residency settings parse; bad values fail
    /// naming the field.
    #[test]
    fn residency_settings_parse_and_bad_ones_name_the_field() {
        let two = "[[models]]\nid = \"a\"\nmodel = \"x\"\n[[models]]\nid = \"b\"\nmodel = \"y\"\nload = \"on_demand\"\n";
        let c = ServeConfig::from_toml(&format!(
            "[server]\nmodels_max = 1\nidle_unload_secs = 60\nload_wait_secs = 30\n{two}"
        ))
        .expect("parses");
        assert_eq!(c.models[0].load, LoadWhen::Startup);
        assert_eq!(c.models[1].load, LoadWhen::OnDemand);
        assert_eq!(
            (
                c.server.models_max,
                c.server.idle_unload_secs,
                c.server.load_wait_secs
            ),
            (Some(1), Some(60), 30)
        );
        c.validate().expect("valid");
        assert_eq!(ServeConfig::default().server.load_wait_secs, 300);
        let cases = [
            ("[server]\nmodels_max = 0\n", "server.models_max"),
            (
                "[server]\nidle_unload_secs = 0\n",
                "server.idle_unload_secs",
            ),
            ("[server]\nload_wait_secs = 0\n", "server.load_wait_secs"),
        ];
        for (server, field) in cases {
            let e = ServeConfig::from_toml(&format!("{server}{two}"))
                .expect("parses")
                .validate()
                .expect_err(server);
            assert!(e.contains(field), "{server}: {e}");
        }
        // Two load at startup, one may be resident.
        let e = ServeConfig::from_toml(&format!(
            "[server]\nmodels_max = 1\n{}",
            two.replace("load = \"on_demand\"\n", "")
        ))
        .expect("parses")
        .validate()
        .expect_err("over the cap");
        assert!(e.contains("server.models_max") && e.contains("a, b"), "{e}");
        // Nothing to load for a provider or an RPC-backed target.
        let e = ServeConfig::from_toml(
            "[[models]]\nid = \"p\"\nload = \"on_demand\"\n[models.provider]\nkind = \"openai\"\nmodel = \"gpt\"\n",
        )
        .expect("parses")
        .validate()
        .expect_err("provider");
        assert!(e.contains("`p`") && e.contains("on_demand"), "{e}");
        let e = ServeConfig::from_toml(
            "[[models]]\nid = \"r\"\nmodel = \"x\"\nload = \"on_demand\"\n[models.runtime.placement]\nrpc = [\"127.0.0.1:50052\"]\n",
        )
        .expect("parses")
        .validate()
        .expect_err("rpc");
        assert!(e.contains("`r`") && e.contains("RPC"), "{e}");
        let e = ServeConfig::from_toml("[[models]]\nid = \"a\"\nmodel = \"x\"\nload = \"lazy\"\n")
            .expect_err("unknown variant");
        assert!(e.contains("lazy"), "{e}");
    }
}
