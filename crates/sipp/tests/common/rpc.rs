//! llama.cpp's `rpc-server` on loopback, for the RPC tests of this crate and
//! of the server (`crates/sipp-cli/tests/serve_rpc.rs` includes this file).
//! `SIPP_RPC_SERVER` names the binary (`scripts/rpc-server.sh` builds it;
//! `scripts/test.sh` sets the variable).
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// An `rpc-server` (one CPU thread) on a loopback port, killed on drop.
pub struct RpcServer {
    pub child: Child,
    pub port: u16,
    pub endpoint: String,
}

impl RpcServer {
    /// On a free port.
    pub fn start() -> RpcServer {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        Self::start_on(port)
    }

    /// On `port`, once it accepts connections.
    pub fn start_on(port: u16) -> RpcServer {
        let bin = std::env::var("SIPP_RPC_SERVER").expect(
            "SIPP_RPC_SERVER names llama.cpp's rpc-server (scripts/rpc-server.sh builds it; scripts/test.sh sets it)",
        );
        let mut child = Command::new(bin)
            .args(["-H", "127.0.0.1", "-p", &port.to_string(), "-t", "1"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("rpc-server starts");
        // Drain its log so it never blocks on a full pipe.
        let stderr = child.stderr.take().expect("stderr");
        std::thread::spawn(move || for _ in BufReader::new(stderr).lines() {});
        let endpoint = format!("127.0.0.1:{port}");
        let start = Instant::now();
        while std::net::TcpStream::connect(&endpoint).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "rpc-server never listened on {endpoint}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        RpcServer {
            child,
            port,
            endpoint,
        }
    }

    /// Resident memory of the server process, in bytes.
    pub fn rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|kb| kb.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    }
}

impl Drop for RpcServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
