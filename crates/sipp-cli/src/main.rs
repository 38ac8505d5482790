//! The `sipp` command.

mod commands;
mod common;

use clap::{Parser, Subcommand};
use std::io::Write;
use std::process::ExitCode;

use common::CliError;

#[derive(Parser)]
#[command(
    name = "sipp",
    version,
    about = "Local LLM inference on llama.cpp with continuous batching"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate a completion for a prompt, streamed to stdout.
    Run(commands::run::RunArgs),
    /// Chat interactively with a model (history kept across turns).
    Chat(commands::chat::ChatArgs),
    /// Embed texts: one JSON vector per line.
    Embed(commands::embed::EmbedArgs),
    /// Describe a GGUF model.
    Inspect(commands::inspect::InspectArgs),
    /// Fetch and list named models.
    Models(commands::models::ModelsArgs),
    /// Pull models from a Hugging Face-style hub into the local store.
    Pull(commands::store::PullArgs),
    /// List the models in the local store.
    List(commands::store::ListArgs),
    /// Remove models from the local store.
    Rm(commands::store::RmArgs),
    /// Serve models over HTTP (OpenAI API and sipp's own profile).
    Serve(commands::serve::ServeArgs),
    /// Measure throughput and latency under concurrency.
    Bench(commands::bench::BenchArgs),
}

/// `sipp --version`: the version, the llama.cpp backends built in, and the
/// devices ggml sees here.
fn print_version() {
    use sipp::runtime::placement::{compiled_backends, devices};
    let mut text = format!(
        "sipp {}\nbackends: {}\n",
        env!("CARGO_PKG_VERSION"),
        compiled_backends().join(", ")
    );
    for d in devices() {
        text += &format!(
            "device: {} [{}, {:?}] {} MiB\n",
            d.label(),
            d.backend,
            d.kind,
            d.memory_total >> 20
        );
    }
    // A reader that stops early (`| head`) is not an error.
    let _ = std::io::stdout().write_all(text.as_bytes());
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SIPP_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    if matches!(std::env::args().nth(1).as_deref(), Some("--version" | "-V")) {
        print_version();
        return ExitCode::SUCCESS;
    }
    let cli = Cli::parse();
    let result: Result<(), CliError> = match cli.command {
        Cmd::Run(a) => commands::run::run(a),
        Cmd::Chat(a) => commands::chat::run(a),
        Cmd::Embed(a) => commands::embed::run(a),
        Cmd::Inspect(a) => commands::inspect::run(a),
        Cmd::Models(a) => commands::models::run(a),
        Cmd::Pull(a) => commands::store::pull(a),
        Cmd::List(a) => commands::store::list(a),
        Cmd::Rm(a) => commands::store::rm(a),
        Cmd::Bench(a) => commands::bench::run(a),
        Cmd::Serve(a) => commands::serve::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One write: llama.cpp logs from a thread of its own, and a line
            // it writes at this moment (its fitting's verdict) must land
            // before or after this one, not inside it.
            let _ = std::io::stderr().write_all(format!("error: {}\n", e.message).as_bytes());
            ExitCode::from(e.code)
        }
    }
}
