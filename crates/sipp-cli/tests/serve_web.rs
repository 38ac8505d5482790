//! The chat page and the operator dashboard in a real browser (Debian's
//! headless Chromium through selenium, tests/web_ui.py) against the real
//! `sipp serve` on the default model. Screenshots go to
//! `$SIPP_SCREENSHOTS` (default: `web-screenshots` under the temp folder).

mod common;

use common::{run_python_client, Server};

#[test]
fn the_chat_page_and_dashboard_work_in_a_browser() {
    let tmp = common::temp_dir("web");
    let dir = tmp.path().to_path_buf();
    let cfg = dir.join("sipp.toml");
    std::fs::write(
        &cfg,
        r#"
[server]
api_keys = [
  { key = "sk-web-admin", name = "ops", role = "admin" },
  { key = "sk-web-user", name = "app", role = "user", models = ["smol"] },
]

[[models]]
id = "smol"
model = "default"
[models.runtime.context]
n_ctx = 4096
n_parallel = 2
"#,
    )
    .expect("write config");
    let s = Server::start(&["--config", cfg.to_str().expect("utf8")]);
    let shots = std::env::var("SIPP_SCREENSHOTS").unwrap_or_else(|_| {
        std::env::temp_dir()
            .join("web-screenshots")
            .display()
            .to_string()
    });
    run_python_client(
        &s,
        "SIPP_PYTHON",
        "web_ui.py",
        &["sk-web-admin", "sk-web-user", "smol", &shots],
        "the browser test failed (scripts/test.sh installs chromium, chromium-driver and selenium)",
    );
}
