//! llama.cpp's RPC backend: ggml devices on other hosts (`rpc-server`), over TCP.
//!
//! llama-cpp-2 wraps none of it, so this file is a few small calls into ggml's C
//! API, the same ones llama.cpp's `--rpc` flag makes: find the "RPC" backend,
//! ask it for `ggml_backend_rpc_add_server`, and register the backend that call
//! returns, so its devices are there when a model loads (llama.cpp offloads to
//! every registered GPU-type device, RPC devices included).
//!
//! Registration is process-wide and ggml aborts the process when a server it
//! talks to is unreachable or drops. Each endpoint is first probed with a plain
//! TCP connect, so a server that is down at load time is an error, not an
//! abort; a server that drops later still aborts, which is why `sipp serve`
//! runs RPC-backed targets in a child process.

use std::collections::HashSet;
use std::ffi::{c_char, c_void, CString};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::Duration;

use llama_cpp_sys_2::{
    ggml_backend_reg_by_name, ggml_backend_reg_get_proc_address, ggml_backend_reg_t,
    ggml_backend_register,
};

use super::RuntimeError;

/// How long a server may take to accept the probe connection.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// `ggml_backend_reg_t ggml_backend_rpc_add_server(const char * endpoint)`.
type AddServerFn = unsafe extern "C" fn(*const c_char) -> ggml_backend_reg_t;

/// Endpoints registered in this process (registering one twice would list its
/// devices twice).
static REGISTERED: Mutex<Option<HashSet<String>>> = Mutex::new(None);

fn rpc_error(endpoint: &str, message: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Load {
        path: format!("rpc://{endpoint}"),
        message: message.to_string(),
    }
}

/// Makes the devices of every RPC server in `endpoints` available to models
/// loaded from now on. Each must accept a TCP connection first.
pub fn register_servers(endpoints: &[String]) -> Result<(), RuntimeError> {
    if endpoints.is_empty() {
        return Ok(());
    }
    let mut registered = REGISTERED
        .lock()
        .map_err(|_| rpc_error("?", "RPC registry poisoned"))?;
    let registered = registered.get_or_insert_with(HashSet::new);
    let add_server = add_server_fn()?;
    for endpoint in endpoints {
        if registered.contains(endpoint) {
            continue;
        }
        probe(endpoint)?;
        let c = CString::new(endpoint.as_str())
            .map_err(|_| rpc_error(endpoint, "endpoint contains a NUL byte"))?;
        // SAFETY: `c` is a valid C string for the call; the returned registry
        // entry is owned by ggml for the life of the process.
        let reg = unsafe { add_server(c.as_ptr()) };
        if reg.is_null() {
            return Err(rpc_error(endpoint, "ggml could not add the RPC server"));
        }
        // SAFETY: `reg` is a live registry entry returned by ggml just above.
        unsafe { ggml_backend_register(reg) };
        registered.insert(endpoint.clone());
        tracing::info!(%endpoint, "RPC server registered");
    }
    Ok(())
}

/// Whether this build of llama.cpp has the RPC backend (built with
/// `GGML_RPC=ON`, which `.cargo/config.toml` sets).
pub fn available() -> bool {
    add_server_fn().is_ok()
}

fn add_server_fn() -> Result<AddServerFn, RuntimeError> {
    let name = CString::new("RPC").expect("no NUL");
    // SAFETY: plain lookups in ggml's static backend registry with valid C
    // strings; a null result is handled.
    let reg = unsafe { ggml_backend_reg_by_name(name.as_ptr()) };
    if reg.is_null() {
        return Err(rpc_error(
            "?",
            "this build of llama.cpp has no RPC backend (build with GGML_RPC=ON)",
        ));
    }
    let sym = CString::new("ggml_backend_rpc_add_server").expect("no NUL");
    // SAFETY: as above; `reg` is non-null.
    let f: *mut c_void = unsafe { ggml_backend_reg_get_proc_address(reg, sym.as_ptr()) };
    if f.is_null() {
        return Err(rpc_error("?", "the RPC backend has no add_server entry"));
    }
    // SAFETY: ggml publishes this symbol with exactly the `AddServerFn`
    // signature (ggml-rpc.h).
    Ok(unsafe { std::mem::transmute::<*mut c_void, AddServerFn>(f) })
}

/// A TCP connect to the endpoint, closed at once (the RPC server serves the
/// next connection).
fn probe(endpoint: &str) -> Result<(), RuntimeError> {
    let addrs: Vec<_> = endpoint
        .to_socket_addrs()
        .map_err(|e| rpc_error(endpoint, format!("cannot resolve: {e}")))?
        .collect();
    let mut last = None;
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, PROBE_TIMEOUT) {
            Ok(_) => return Ok(()),
            Err(e) => last = Some(e),
        }
    }
    Err(rpc_error(
        endpoint,
        format!(
            "RPC server unreachable: {}",
            last.map_or_else(|| "no address".to_string(), |e| e.to_string())
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_build_has_the_rpc_backend() {
        assert!(available(), "llama.cpp was built without GGML_RPC=ON");
    }

    #[test]
    fn an_unreachable_server_is_an_error_not_an_abort() {
        // A port nothing listens on: bind one, learn it, close it.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("free port");
        let e = register_servers(&[format!("127.0.0.1:{port}")]).expect_err("nothing listens");
        assert!(e.to_string().contains("unreachable"), "{e}");
    }
}
