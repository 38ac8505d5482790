//! `sipp chat`: an interactive terminal chat. History is kept across turns
//! (each turn resends it, so the KV cache makes later turns cheap); `/reset`,
//! `/stats`, `/exit`; Ctrl-C stops the current answer and returns to the prompt.

use std::io::{BufRead, Write};
use std::sync::{Arc, Mutex};

use clap::Args;
use sipp::chat::ChatMessage;
use sipp::engine::{Canceller, RequestEvent, RequestStats};
use sipp::sampling::SamplingParams;
use sipp::text::FinishReason;
use sipp::GenerateRequest;

use crate::common::{load_engine, CliError, ModelArgs};

#[derive(Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// A system message opening the conversation.
    #[arg(long)]
    pub system: Option<String>,
    /// Most tokens per answer.
    #[arg(long = "max-tokens", short = 'n', default_value_t = 512)]
    pub max_tokens: u32,
    /// Sampling temperature (0 is greedy).
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Random seed.
    #[arg(long)]
    pub seed: Option<u32>,
    /// Keep answering past end-of-generation tokens (until max tokens or Ctrl-C).
    #[arg(long = "ignore-eos")]
    pub ignore_eos: bool,
}

const HELP: &str = "commands: /reset clears the history, /stats shows the last answer's figures, /exit (or Ctrl-D) leaves; Ctrl-C stops an answer";

fn print_stats(s: &RequestStats) {
    println!(
        "prompt tokens: {} (cached {}), generated tokens: {}, ttft: {:.1} ms, decode: {:.1} tok/s",
        s.prompt_tokens,
        s.cached_tokens,
        s.generated_tokens,
        s.ttft_ms,
        s.decode_tokens_per_second()
    );
}

pub fn run(args: ChatArgs) -> Result<(), CliError> {
    let mut cfg = args.model.runtime_config()?;
    if args.model.parallel.is_none() {
        cfg.context.n_parallel = 1;
    }
    let mut sampling = cfg.sampling.clone();
    if let Some(t) = args.temperature {
        sampling.temperature = t;
    }
    if let Some(s) = args.seed {
        sampling.seed = Some(s);
    }
    sampling
        .validate()
        .map_err(|e| CliError::usage(e.to_string()))?;
    let engine = load_engine(&args.model.model, cfg, false)?;
    if engine.info().model.chat_template.is_none() {
        return Err(CliError::usage(
            sipp::chat::ChatError::NoTemplate.to_string(),
        ));
    }
    let current: Arc<Mutex<Option<Canceller>>> = Arc::new(Mutex::new(None));
    {
        let current = current.clone();
        ctrlc::set_handler(move || {
            if let Ok(c) = current.lock() {
                if let Some(c) = c.as_ref() {
                    c.cancel();
                }
            }
        })
        .map_err(|e| CliError::runtime(format!("cannot handle Ctrl-C: {e}")))?;
    }
    let opening: Vec<ChatMessage> = args
        .system
        .iter()
        .map(|s| ChatMessage::system(s.as_str()))
        .collect();
    let mut history = opening.clone();
    let mut last_stats: Option<RequestStats> = None;
    println!("{HELP}");
    let stdin = std::io::stdin();
    let mut line = String::new();
    loop {
        print!("> ");
        let _ = std::io::stdout().flush();
        line.clear();
        match stdin.lock().read_line(&mut line) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => {
                // An interrupted read (Ctrl-C at the prompt) just asks again.
                if e.kind() == std::io::ErrorKind::Interrupted {
                    println!();
                    continue;
                }
                return Err(CliError::runtime(e.to_string()));
            }
        }
        let text = line.trim_end_matches(['\n', '\r']);
        match text.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                history = opening.clone();
                println!("(history cleared)");
                continue;
            }
            "/stats" => {
                match &last_stats {
                    Some(s) => print_stats(s),
                    None => println!("(no answer yet)"),
                }
                continue;
            }
            "/help" => {
                println!("{HELP}");
                continue;
            }
            cmd if cmd.starts_with('/') => {
                println!("unknown command {cmd}; {HELP}");
                continue;
            }
            _ => {}
        }
        history.push(ChatMessage::user(text));
        let req = GenerateRequest {
            max_tokens: Some(args.max_tokens),
            sampling: Some(SamplingParams { ..sampling.clone() }),
            context_key: Some("sipp-chat".into()),
            ignore_eos: args.ignore_eos,
            ..GenerateRequest::new("")
        };
        let mut handle = match engine.chat(&history, req) {
            Ok(h) => h,
            Err(e) => {
                history.pop();
                println!("error: {e}");
                continue;
            }
        };
        if let Ok(mut c) = current.lock() {
            *c = Some(handle.canceller());
        }
        let mut out = std::io::stdout();
        let mut answer = String::new();
        while let Some(ev) = handle.blocking_next_event() {
            match ev {
                RequestEvent::Delta(d) => {
                    answer.push_str(&d.text);
                    let _ = out.write_all(d.text.as_bytes());
                    let _ = out.flush();
                }
                RequestEvent::Finished(c) => {
                    if c.finish_reason == FinishReason::Cancelled {
                        print!(" [cancelled]");
                    }
                    println!();
                    last_stats = Some(c.stats);
                }
                RequestEvent::Failed(e) => println!("\nerror: {e}"),
                _ => {}
            }
        }
        if let Ok(mut c) = current.lock() {
            *c = None;
        }
        // The (possibly partial) answer stays in the history, as shown.
        history.push(ChatMessage::assistant(answer));
    }
    println!();
    Ok(())
}
