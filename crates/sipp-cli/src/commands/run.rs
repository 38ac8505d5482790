//! `sipp run`: one completion, streamed to stdout.

use std::io::Write;

use clap::Args;
use sipp::engine::RequestEvent;
use sipp::sampling::SamplingParams;
use sipp::GenerateRequest;

use crate::common::{load_engine, CliError, ModelArgs};

#[derive(Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Most tokens to generate.
    #[arg(long = "max-tokens", short = 'n', default_value_t = 256)]
    pub max_tokens: u32,
    /// Sampling temperature (0 is greedy).
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Random seed.
    #[arg(long)]
    pub seed: Option<u32>,
    /// Top-k (0 disables).
    #[arg(long = "top-k")]
    pub top_k: Option<i32>,
    /// Top-p.
    #[arg(long = "top-p")]
    pub top_p: Option<f32>,
    /// Stop string (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Keep generating past end-of-generation tokens.
    #[arg(long = "ignore-eos")]
    pub ignore_eos: bool,
    /// Print prompt and decode speed and time to first token to stderr.
    #[arg(long)]
    pub stats: bool,
    /// An image (PNG, JPEG or WebP; repeatable) for a model with a projector
    /// (`--mmproj`): the prompt then becomes one user turn of the model's
    /// chat template, the images before the text (as llama-mtmd-cli does).
    #[arg(long = "image", value_name = "PATH")]
    pub images: Vec<std::path::PathBuf>,
    /// The prompt.
    pub prompt: String,
}

pub fn run(args: RunArgs) -> Result<(), CliError> {
    let mut cfg = args.model.runtime_config()?;
    if args.model.parallel.is_none() {
        // One request: one slot, no idle sequences to keep.
        cfg.context.n_parallel = 1;
        cfg.cache.idle_sequences = 0;
    }
    let mut sampling = cfg.sampling.clone();
    if let Some(t) = args.temperature {
        sampling.temperature = t;
    }
    if let Some(s) = args.seed {
        sampling.seed = Some(s);
    }
    if let Some(k) = args.top_k {
        sampling.top_k = k;
    }
    if let Some(p) = args.top_p {
        sampling.top_p = p;
    }
    sampling
        .validate()
        .map_err(|e| CliError::usage(e.to_string()))?;
    if args.prompt.is_empty() {
        return Err(CliError::usage("the prompt is empty"));
    }
    let engine = load_engine(&args.model.model, cfg, false)?;
    let prompt = if args.images.is_empty() {
        sipp::PromptInput::Text(args.prompt)
    } else {
        image_turn(&engine, &args.images, args.prompt)?
    };
    let req = GenerateRequest {
        max_tokens: Some(args.max_tokens),
        stop: args.stop,
        ignore_eos: args.ignore_eos,
        sampling: Some(SamplingParams { ..sampling }),
        ..GenerateRequest::new(prompt)
    };
    let mut handle = engine.generate(req)?;
    let mut out = std::io::stdout().lock();
    while let Some(ev) = handle.blocking_next_event() {
        match ev {
            RequestEvent::Delta(d) => {
                let _ = out.write_all(d.text.as_bytes());
                let _ = out.flush();
            }
            RequestEvent::Finished(c) => {
                let _ = writeln!(out);
                if args.stats {
                    let s = c.stats;
                    eprintln!("prompt tokens:    {}", s.prompt_tokens);
                    eprintln!("prompt tok/s:     {:.1}", s.prompt_tokens_per_second());
                    eprintln!("generated tokens: {}", s.generated_tokens);
                    eprintln!("decode tok/s:     {:.1}", s.decode_tokens_per_second());
                    eprintln!("ttft ms:          {:.1}", s.ttft_ms);
                    if let Some(a) = s.acceptance() {
                        eprintln!(
                            "draft acceptance: {:.1}% ({} of {} drafted tokens)",
                            a * 100.0,
                            s.accepted_tokens,
                            s.drafted_tokens
                        );
                    }
                    eprintln!("finish reason:    {}", c.finish_reason.as_str());
                }
                return Ok(());
            }
            RequestEvent::Failed(e) => return Err(e.into()),
            _ => {}
        }
    }
    Err(CliError::runtime(
        "the engine stopped before the request finished",
    ))
}

/// One user turn with the images (read from files) before the text.
fn image_turn(
    engine: &sipp::Engine,
    paths: &[std::path::PathBuf],
    text: String,
) -> Result<sipp::PromptInput, CliError> {
    use sipp::chat::{ChatMessage, ContentPart, MessageContent, Role};
    let mut parts = Vec::with_capacity(paths.len() + 1);
    for p in paths {
        let bytes = std::fs::read(p)
            .map_err(|e| CliError::usage(format!("cannot read image {}: {e}", p.display())))?;
        parts.push(ContentPart::image(sipp::media::data_url(&bytes)));
    }
    parts.push(ContentPart::Text { text });
    let messages = [ChatMessage::new(Role::User, MessageContent::Parts(parts))];
    Ok(engine.chat_prompt(&messages)?)
}
