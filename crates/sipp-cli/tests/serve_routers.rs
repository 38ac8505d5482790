//! Two sipp replicas (1 thread each) behind the routers operators run:
//! sglang-router and vllm-router from PyPI, `cache_aware` against
//! `round_robin`, streaming and not, and a replica killed mid-run
//! (tests/routers.py drives the processes and checks the replicas' /metrics).

mod common;

use std::process::Command;

use common::{manifest_dir, ServerTurn};

#[test]
fn replicas_behind_sglang_and_vllm_routers_keep_prefixes_and_survive_a_kill() {
    // The replicas are this test's servers: no other test runs one meanwhile.
    let _turn = ServerTurn::take();
    let fetch = Command::new(env!("CARGO_BIN_EXE_sipp"))
        .args(["models", "fetch", "default"])
        .output()
        .expect("fetch");
    assert!(fetch.status.success());
    let bin = std::env::var("SIPP_ROUTERS_BIN")
        .expect("SIPP_ROUTERS_BIN names the venv with sglang-router and vllm-router (scripts/test.sh sets it)");
    let out = Command::new(format!("{bin}/python"))
        .arg(manifest_dir().join("tests").join("routers.py"))
        .args([env!("CARGO_BIN_EXE_sipp"), "default", &bin])
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    print!("{stdout}");
    assert!(
        out.status.success() && stdout.contains("routers: all checks passed"),
        "router checks failed:\nstdout: {stdout}\nstderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
