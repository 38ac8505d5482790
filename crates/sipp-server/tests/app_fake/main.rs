//! The server in-process over engines on the fake backend: every route's
//! shapes, errors, streaming framing, loading and authentication, without a
//! model or a port. (`crates/sipp-cli/tests/serve_http.rs` covers what needs
//! the real model: real text, real JSON mode, the process and its signals.)

mod anthropic;
mod child;
mod dashboard;
mod errors;
mod harness;
mod lifecycle;
mod openai;
mod policy;
mod residency;
mod responses;
mod stream;
