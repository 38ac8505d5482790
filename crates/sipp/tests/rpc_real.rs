//! One model over two llama.cpp RPC servers (`rpc-server` from the reference
//! build, on loopback): every layer is offloaded to the two remote devices,
//! the weights land in the servers' memory, and greedy output equals the
//! in-process CPU engine's under the near-tie rule.
//!
//! `SIPP_RPC_SERVER` names the `rpc-server` binary (`scripts/rpc-server.sh`
//! builds it; `scripts/test.sh` sets the variable).

mod common;

use common::engine_with;
use common::rpc::RpcServer;

/// Largest logit gap at which two batchings may pick different tokens.
const NEAR_TIE: f32 = 1.0;

#[test]
fn a_model_spread_over_two_rpc_servers_matches_the_local_engine() {
    let (a, b) = (RpcServer::start(), RpcServer::start());
    let before = (a.rss(), b.rss());
    let remote = engine_with(1, |c| {
        c.context.n_ctx = 2048;
        c.placement.rpc = vec![a.endpoint.clone(), b.endpoint.clone()];
    });
    // The weights went over the wire: each server holds a share of them (the
    // model file is 98 MB; llama.cpp splits layers by the devices' memory).
    let grown = (a.rss() - before.0, b.rss() - before.1);
    eprintln!(
        "rpc-server memory grew by {:.1} MiB and {:.1} MiB",
        grown.0 as f64 / 1048576.0,
        grown.1 as f64 / 1048576.0
    );
    assert!(
        grown.0 > 10 << 20 && grown.1 > 10 << 20,
        "both servers hold layers: grew by {grown:?} bytes"
    );
    let local = engine_with(1, |c| c.context.n_ctx = 2048);
    common::compare_greedy(&local, &remote, &common::PROMPTS[..8], 24, NEAR_TIE);
}
