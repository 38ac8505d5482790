//! `sipp bench`: throughput and latency under concurrency.
//!
//! Each scenario runs C concurrent clients, each sending R requests one after
//! another, and reports aggregate generated tokens per second, time to first
//! token and inter-token latency (p50/p99). Scenarios are run one after another
//! in the same process so their figures compare on the same machine state.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use serde::Serialize;
use sipp::engine::RequestEvent;
use sipp::sampling::SamplingParams;
use sipp::{Engine, GenerateRequest};

use crate::common::{load_engine, CliError, ModelArgs};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Workload {
    /// Distinct short prompts; single stream, then C concurrent clients.
    Generate,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The workload.
    #[arg(long, value_enum, default_value = "generate")]
    pub workload: Workload,
    /// Concurrent clients.
    #[arg(long, short = 'C', default_value_t = 8)]
    pub clients: usize,
    /// Requests per client.
    #[arg(long, short = 'R', default_value_t = 2)]
    pub requests: usize,
    /// Tokens generated per request (end-of-generation is ignored).
    #[arg(long = "max-tokens", short = 'n', default_value_t = 64)]
    pub max_tokens: u32,
    /// Print only the JSON report.
    #[arg(long)]
    pub json: bool,
}

/// One request's timeline.
#[derive(Debug, Clone, Default)]
struct Sample {
    ttft: Duration,
    itls: Vec<Duration>,
    tokens: usize,
}

/// Figures of one scenario.
#[derive(Debug, Clone, Serialize)]
pub struct ScenarioReport {
    pub name: String,
    pub clients: usize,
    pub requests: usize,
    pub generated_tokens: usize,
    pub wall_s: f64,
    pub tokens_per_s: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub itl_p50_ms: f64,
    pub itl_p99_ms: f64,
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let idx = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
    v[idx.min(v.len() - 1)]
}

fn report(name: &str, clients: usize, samples: &[Sample], wall: Duration) -> ScenarioReport {
    let tokens: usize = samples.iter().map(|s| s.tokens).sum();
    let mut ttft: Vec<f64> = samples.iter().map(|s| s.ttft.as_secs_f64() * 1e3).collect();
    let mut itl: Vec<f64> = samples
        .iter()
        .flat_map(|s| s.itls.iter().map(|d| d.as_secs_f64() * 1e3))
        .collect();
    ScenarioReport {
        name: name.to_string(),
        clients,
        requests: samples.len(),
        generated_tokens: tokens,
        wall_s: wall.as_secs_f64(),
        tokens_per_s: tokens as f64 / wall.as_secs_f64().max(1e-9),
        ttft_p50_ms: percentile(&mut ttft, 50.0),
        ttft_p99_ms: percentile(&mut ttft, 99.0),
        itl_p50_ms: percentile(&mut itl, 50.0),
        itl_p99_ms: percentile(&mut itl, 99.0),
    }
}

/// Runs one request and records its timeline.
fn timed_request(engine: &Engine, req: GenerateRequest) -> Result<Sample, String> {
    let start = Instant::now();
    let mut handle = engine.generate(req).map_err(|e| e.to_string())?;
    let mut sample = Sample::default();
    let mut last: Option<Instant> = None;
    while let Some(ev) = handle.blocking_next_event() {
        match ev {
            RequestEvent::Delta(d) if !d.tokens.is_empty() => {
                let now = Instant::now();
                match last {
                    None => sample.ttft = now - start,
                    Some(prev) => sample.itls.push(now - prev),
                }
                last = Some(now);
                sample.tokens += d.tokens.len();
            }
            RequestEvent::Finished(_) => return Ok(sample),
            RequestEvent::Failed(e) => return Err(e.to_string()),
            _ => {}
        }
    }
    Err("the engine stopped".into())
}

/// C clients, each sending its requests in turn.
fn run_clients(
    engine: &Engine,
    clients: usize,
    requests: usize,
    make: Arc<dyn Fn(usize, usize) -> GenerateRequest + Send + Sync>,
) -> Result<(Vec<Sample>, Duration), CliError> {
    let start = Instant::now();
    let threads: Vec<_> = (0..clients)
        .map(|c| {
            let engine = engine.clone();
            let make = make.clone();
            std::thread::spawn(move || -> Result<Vec<Sample>, String> {
                (0..requests)
                    .map(|r| timed_request(&engine, make(c, r)))
                    .collect()
            })
        })
        .collect();
    let mut samples = Vec::new();
    for t in threads {
        let r = t
            .join()
            .map_err(|_| CliError::runtime("a bench client panicked"))?;
        samples.extend(r.map_err(CliError::runtime)?);
    }
    Ok((samples, start.elapsed()))
}

const TOPICS: &[&str] = &[
    "a lighthouse keeper",
    "the history of bread",
    "a robot learning to paint",
    "volcanoes",
    "a city under the sea",
    "the first day of school",
    "a chess tournament",
    "migrating birds",
    "a haunted library",
    "the moon landing",
    "a mountain village",
    "an old clockmaker",
    "a desert caravan",
    "the invention of paper",
    "a jazz musician",
    "a winter festival",
];

fn generate_request(c: usize, r: usize, max_tokens: u32) -> GenerateRequest {
    let topic = TOPICS[(c * 7 + r) % TOPICS.len()];
    GenerateRequest {
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        sampling: Some(SamplingParams::greedy()),
        ..GenerateRequest::new(format!("Write a short story about {topic}."))
    }
}

fn print_table(reports: &[ScenarioReport]) {
    println!(
        "{:<28} {:>7} {:>8} {:>8} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "scenario",
        "clients",
        "requests",
        "tokens",
        "tok/s",
        "ttft p50",
        "ttft p99",
        "itl p50",
        "itl p99"
    );
    for r in reports {
        println!(
            "{:<28} {:>7} {:>8} {:>8} {:>10.1} {:>8.1}ms {:>8.1}ms {:>8.1}ms {:>8.1}ms",
            r.name,
            r.clients,
            r.requests,
            r.generated_tokens,
            r.tokens_per_s,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.itl_p50_ms,
            r.itl_p99_ms
        );
    }
}

pub fn run(args: BenchArgs) -> Result<(), CliError> {
    let mut cfg = args.model.runtime_config()?;
    if args.model.parallel.is_none() {
        cfg.context.n_parallel = cfg.context.n_parallel.max(args.clients as u32);
    }
    let engine = load_engine(&args.model.model, cfg, args.json)?;
    let max_tokens = args.max_tokens;
    let mut reports = Vec::new();
    let mut ratios = serde_json::Map::new();
    match args.workload {
        Workload::Generate => {
            let make: Arc<dyn Fn(usize, usize) -> GenerateRequest + Send + Sync> =
                Arc::new(move |c, r| generate_request(c, r, max_tokens));
            // Warm-up: first-touch costs (page faults, thread pools) stay out of the figures.
            run_clients(&engine, 1, 1, make.clone())?;
            let (s, w) = run_clients(&engine, 1, args.requests, make.clone())?;
            let single = report("single-stream", 1, &s, w);
            let (s, w) = run_clients(&engine, args.clients, args.requests, make)?;
            let conc = report(
                &format!("concurrent x{}", args.clients),
                args.clients,
                &s,
                w,
            );
            ratios.insert(
                "concurrent_over_single_tok_s".into(),
                serde_json::json!(conc.tokens_per_s / single.tokens_per_s.max(1e-9)),
            );
            reports.push(single);
            reports.push(conc);
        }
    }
    let json = serde_json::json!({
        "workload": format!("{:?}", args.workload).to_lowercase(),
        "model": engine.info().model.path,
        "threads": engine_threads(&args.model),
        "max_tokens": max_tokens,
        "scenarios": reports,
        "ratios": ratios,
    });
    if !args.json {
        print_table(&reports);
        for (k, v) in &ratios {
            println!("{k}: {:.3}", v.as_f64().unwrap_or(0.0));
        }
    }
    println!("{}", serde_json::to_string(&json).unwrap_or_default());
    Ok(())
}

fn engine_threads(m: &ModelArgs) -> u32 {
    m.threads.unwrap_or_else(sipp::config::available_threads)
}
