//! `sipp bench`: throughput and latency under concurrency.
//!
//! A workload is a list of scenarios run one after another on the same engine,
//! so their figures compare on the same machine state. Each scenario runs C
//! concurrent clients (async tasks on one thread, so the clients themselves
//! barely compete with llama.cpp for the cores), each sending R requests in
//! turn, and reports aggregate generated tokens per second, time to first token
//! and inter-token latency (p50/p99). Results print as a table and as one line
//! of JSON.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use serde::Serialize;
use sipp::config::SpeculativeMode;
use sipp::engine::{EmbedRequest, RequestEvent, SpeculativeRequest};
use sipp::sampling::{OutputConstraint, SamplingParams};
use sipp::{Engine, GenerateRequest};

use crate::common::{load_engine, CliError, ModelArgs};

mod grounded;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Workload {
    /// Distinct short prompts: single stream, C concurrent clients, and C in lockstep.
    Generate,
    /// A long shared system prompt (600+ tokens) and distinct short questions
    /// from C clients at once, with the prompt cache off and then on.
    SharedPrefix,
    /// C clients holding T-turn conversations (each turn resends the history),
    /// with the prompt cache off and then on; TTFT of turn 1 against later turns.
    MultiTurn,
    /// The same prompts unconstrained and under a JSON schema: decode speed of each.
    Constrained,
    /// The same chats unconstrained and as forced tool calls (the call's
    /// grammar and the function's schema): decode speed of each (local only).
    Tools,
    /// C x R embedding inputs one by one, then from C concurrent clients.
    Embed,
    /// Speculative decoding: the grounded tasks (rename a variable in a
    /// function, answer with quotes, summarize, extract JSON; see
    /// `bench/grounded.rs`) and the free-text `generate` prompts, single
    /// stream and C streams, with speculation off and with n-gram drafts
    /// (`--speculative-modes`), side by side.
    Grounded,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Measure an OpenAI-compatible server at this base URL (sipp serve,
    /// llama-server, ...) instead of an engine in this process.
    #[arg(long)]
    pub url: Option<String>,
    /// Model id to send to the server.
    #[arg(long = "server-model")]
    pub server_model: Option<String>,
    /// API key for the server.
    #[arg(long = "api-key", env = "SIPP_BENCH_API_KEY")]
    pub api_key: Option<String>,
    /// The workload.
    #[arg(long, value_enum, default_value = "generate")]
    pub workload: Workload,
    /// Concurrent clients.
    #[arg(long, short = 'C', default_value_t = 8)]
    pub clients: usize,
    /// Requests per client.
    #[arg(long, short = 'R', default_value_t = 2)]
    pub requests: usize,
    /// Tokens generated per request.
    #[arg(long = "max-tokens", short = 'n', default_value_t = 64)]
    pub max_tokens: u32,
    /// Turns per conversation (multi-turn).
    #[arg(long, default_value_t = 4)]
    pub turns: usize,
    /// Skip the cache-off baseline of the shared-prefix workload (to compare
    /// servers, each started fresh, on the cache-on scenario alone).
    #[arg(long = "no-baseline")]
    pub no_baseline: bool,
    /// Print only the JSON report.
    #[arg(long)]
    pub json: bool,
    /// Speculative modes the grounded workload compares, sent per request
    /// (`server` sends none: the server's own setting, e.g. llama-server's
    /// `--spec-type`).
    #[arg(
        long = "speculative-modes",
        value_delimiter = ',',
        default_value = "off,ngram"
    )]
    pub speculative_modes: Vec<String>,
}

/// One request as the bench sends it.
#[derive(Debug, Clone)]
pub struct BenchRequest {
    pub prompt: String,
    pub max_tokens: u32,
    /// Reuse KV across requests (false measures the cache-off baseline).
    pub cache_prompt: bool,
    /// Generate exactly max_tokens (end-of-generation banned).
    pub ignore_eos: bool,
    pub constraint: Option<OutputConstraint>,
    /// Speculative decoding asked for (`None`: the target's own setting).
    pub speculative: Option<SpeculativeMode>,
}

/// One request's timeline.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    pub ttft: Duration,
    /// Gaps between arrivals (a streamed chunk, or a delta of one or more
    /// tokens), and the tokens each brought.
    pub itls: Vec<Duration>,
    pub itl_tokens: Vec<usize>,
    pub tokens: usize,
    /// Tokens in the first arrival.
    pub first_tokens: usize,
    pub first_token_at: Option<Instant>,
    pub end_at: Option<Instant>,
    pub text: String,
    /// Tokens drafted and accepted by speculative decoding, when known.
    pub drafted: usize,
    pub accepted: usize,
}

impl Sample {
    /// Decode speed of this request after its first arrival, in tokens.
    fn decode_tokens_per_s(&self) -> f64 {
        let t: f64 = self.itls.iter().map(Duration::as_secs_f64).sum();
        let n = self.tokens.saturating_sub(self.first_tokens);
        if t > 0.0 {
            n as f64 / t
        } else {
            0.0
        }
    }

    /// The arrivals after the first, each with when it came (the first
    /// having come at `first`) and the tokens it brought.
    fn later_arrivals(&self, first: Instant) -> impl Iterator<Item = (Instant, usize)> + '_ {
        self.itls
            .iter()
            .zip(&self.itl_tokens)
            .scan(first, |t, (d, &n)| {
                *t += *d;
                Some((*t, n))
            })
    }

    /// A server's streamed chunks are counted one token each while they
    /// arrive; its usage says how many tokens there were: spread them.
    fn settle_tokens(&mut self, usage: usize) {
        let chunks: usize = self.first_tokens + self.itl_tokens.iter().sum::<usize>();
        if usage == 0 || chunks == 0 || usage == chunks {
            return;
        }
        let scale = usage as f64 / chunks as f64;
        self.itl_tokens
            .iter_mut()
            .for_each(|n| *n = ((*n as f64) * scale).round() as usize);
        self.first_tokens = usage - self.itl_tokens.iter().sum::<usize>().min(usage);
        self.tokens = usage;
    }
}

/// Where requests go.
#[derive(Clone)]
pub enum Target {
    /// An engine in this process.
    Local(Engine),
    /// An OpenAI-compatible server.
    Http(HttpTarget),
}

/// An OpenAI-compatible server (streamed /v1/completions, /v1/embeddings).
#[derive(Clone)]
pub struct HttpTarget {
    client: reqwest::Client,
    base: String,
    model: Option<String>,
    api_key: Option<String>,
}

impl HttpTarget {
    fn post(&self, path: &str, body: &serde_json::Value) -> reqwest::RequestBuilder {
        let mut r = self
            .client
            .post(format!("{}{path}", self.base.trim_end_matches('/')))
            .json(body);
        if let Some(k) = &self.api_key {
            r = r.bearer_auth(k);
        }
        r
    }

    async fn generate(&self, r: &BenchRequest) -> Result<Sample, String> {
        use futures::StreamExt;
        let mut body = serde_json::json!({
            "prompt": r.prompt,
            "max_tokens": r.max_tokens,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
            "cache_prompt": r.cache_prompt,
            "ignore_eos": r.ignore_eos,
        });
        if let Some(m) = &self.model {
            body["model"] = serde_json::json!(m);
        }
        if let Some(OutputConstraint::JsonSchema(s)) = &r.constraint {
            body["json_schema"] = s.clone();
        }
        if let Some(m) = r.speculative {
            body["speculative"] = serde_json::json!({"mode": m.as_str()});
        }
        let start = Instant::now();
        let resp = self
            .post("/v1/completions", &body)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if !resp.status().is_success() {
            let status = resp.status();
            return Err(format!(
                "{status}: {}",
                resp.text().await.unwrap_or_default()
            ));
        }
        let mut sample = Sample::default();
        let mut usage_tokens = None;
        let mut buf = String::new();
        let mut stream = resp.bytes_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| e.to_string())?;
            buf.push_str(&String::from_utf8_lossy(&chunk));
            while let Some(end) = buf.find("\n\n") {
                let event: String = buf.drain(..end + 2).collect();
                for line in event.lines() {
                    let Some(data) = line.strip_prefix("data: ") else {
                        continue;
                    };
                    if data.trim() == "[DONE]" {
                        continue;
                    }
                    let v: serde_json::Value =
                        serde_json::from_str(data).map_err(|e| format!("{e}: {data}"))?;
                    if let Some(e) = v.get("error") {
                        return Err(e.to_string());
                    }
                    if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                        usage_tokens = Some(n as usize);
                    }
                    // llama-server reports its drafts in `timings`.
                    if let Some(n) = v["timings"]["draft_n"].as_u64() {
                        sample.drafted = n as usize;
                        sample.accepted =
                            v["timings"]["draft_n_accepted"].as_u64().unwrap_or(0) as usize;
                    }
                    let text = v["choices"][0]["text"].as_str().unwrap_or_default();
                    if !text.is_empty() {
                        sample.text.push_str(text);
                        sample.record_tokens(start, 1);
                    }
                }
            }
        }
        if let Some(n) = usage_tokens {
            sample.settle_tokens(n);
        }
        sample.end_at = Some(Instant::now());
        Ok(sample)
    }

    async fn embed(&self, text: &str) -> Result<(), String> {
        let mut body = serde_json::json!({"input": text});
        if let Some(m) = &self.model {
            body["model"] = serde_json::json!(m);
        }
        let resp = self
            .post("/v1/embeddings", &body)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if resp.status().is_success() {
            Ok(())
        } else {
            Err(format!(
                "{}: {}",
                resp.status(),
                resp.text().await.unwrap_or_default()
            ))
        }
    }
}

impl Target {
    async fn generate(&self, r: &BenchRequest) -> Result<Sample, String> {
        match self {
            Target::Http(h) => h.generate(r).await,
            Target::Local(engine) => {
                let req = GenerateRequest {
                    max_tokens: Some(r.max_tokens),
                    ignore_eos: r.ignore_eos,
                    cache_prompt: r.cache_prompt,
                    constraint: r.constraint.clone(),
                    sampling: Some(SamplingParams::greedy()),
                    speculative: r.speculative.map(|m| SpeculativeRequest {
                        mode: Some(m),
                        n_max: None,
                    }),
                    ..GenerateRequest::new(r.prompt.as_str())
                };
                let start = Instant::now();
                let mut handle = engine.generate(req).map_err(|e| e.to_string())?;
                let mut sample = Sample::default();
                while let Some(ev) = handle.next_event().await {
                    match ev {
                        RequestEvent::Delta(d) => {
                            sample.text.push_str(&d.text);
                            if !d.tokens.is_empty() {
                                sample.record_tokens(start, d.tokens.len());
                            }
                        }
                        RequestEvent::Finished(c) => {
                            sample.end_at = Some(Instant::now());
                            sample.drafted = c.stats.drafted_tokens;
                            sample.accepted = c.stats.accepted_tokens;
                            return Ok(sample);
                        }
                        RequestEvent::Failed(e) => return Err(e.to_string()),
                        _ => {}
                    }
                }
                Err("the engine stopped".into())
            }
        }
    }

    async fn embed(&self, text: &str) -> Result<(), String> {
        match self {
            Target::Http(h) => h.embed(text).await,
            Target::Local(engine) => {
                let h = engine
                    .embed(EmbedRequest::new(text))
                    .map_err(|e| e.to_string())?;
                h.embedding().await.map(|_| ()).map_err(|e| e.to_string())
            }
        }
    }
}

impl Sample {
    fn record_tokens(&mut self, start: Instant, n: usize) {
        let now = Instant::now();
        match self.first_token_at {
            None => {
                self.ttft = now - start;
                self.first_token_at = Some(now);
                self.first_tokens = n;
            }
            Some(_) => {
                let prev = self.end_at.unwrap_or(now);
                self.itls.push(now - prev);
                self.itl_tokens.push(n);
            }
        }
        // `end_at` doubles as "last token at" until the request finishes.
        self.end_at = Some(now);
        self.tokens += n;
    }
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
    /// Median per-request decode speed after the first token.
    pub request_decode_tokens_per_s: f64,
    /// Tokens produced while every request was decoding together (from the
    /// last first token to the last finish), per second: the figure comparable
    /// to llama-batched-bench's S_TG.
    pub lockstep_decode_tokens_per_s: f64,
    /// Tokens that arrived while every client was busy (from the last
    /// client's first token to the first client's last finish), per second:
    /// the aggregate speed at this concurrency, whatever pace each request
    /// keeps. With one request per client and requests that finish apart
    /// (speculative decoding runs some faster), the lockstep window above
    /// also holds the tail where fewer requests run; this one does not.
    pub busy_tokens_per_s: f64,
    /// Share of drafted tokens accepted, when the target reports drafts.
    pub draft_acceptance: Option<f64>,
}

/// [`ScenarioReport::busy_tokens_per_s`] of `samples`, which hold each
/// client's requests in turn (as [`run_clients`] returns them).
fn busy_tokens_per_s(clients: usize, samples: &[Sample]) -> f64 {
    let per = samples.len() / clients.max(1);
    if per == 0 || per * clients != samples.len() {
        return 0.0;
    }
    let mine = |c: usize| &samples[c * per..(c + 1) * per];
    let start = (0..clients).map(|c| mine(c)[0].first_token_at).max();
    let end = (0..clients).map(|c| mine(c)[per - 1].end_at).min();
    let (Some(Some(from)), Some(Some(to))) = (start, end) else {
        return 0.0;
    };
    if to <= from {
        return 0.0;
    }
    let within = |t: Instant| t > from && t <= to;
    let tokens: usize = samples
        .iter()
        .filter_map(|s| {
            let first = s.first_token_at?;
            let later: usize = s
                .later_arrivals(first)
                .filter(|&(t, _)| within(t))
                .map(|(_, n)| n)
                .sum();
            Some(later + if within(first) { s.first_tokens } else { 0 })
        })
        .sum();
    tokens as f64 / (to - from).as_secs_f64()
}

pub fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let idx = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
    v[idx.min(v.len() - 1)]
}

pub fn report(name: &str, clients: usize, samples: &[Sample], wall: Duration) -> ScenarioReport {
    let tokens: usize = samples.iter().map(|s| s.tokens).sum();
    let mut ttft: Vec<f64> = samples.iter().map(|s| s.ttft.as_secs_f64() * 1e3).collect();
    let mut itl: Vec<f64> = samples
        .iter()
        .flat_map(|s| s.itls.iter().map(|d| d.as_secs_f64() * 1e3))
        .collect();
    let mut decode: Vec<f64> = samples.iter().map(Sample::decode_tokens_per_s).collect();
    let last_first = samples.iter().filter_map(|s| s.first_token_at).max();
    let last_end = samples.iter().filter_map(|s| s.end_at).max();
    let lockstep = match (last_first, last_end) {
        (Some(f), Some(e)) if e > f => {
            let toks: usize = samples
                .iter()
                .map(|s| {
                    s.later_arrivals(s.first_token_at.unwrap_or(f))
                        .filter(|&(t, _)| t > f)
                        .map(|(_, n)| n)
                        .sum::<usize>()
                })
                .sum();
            toks as f64 / (e - f).as_secs_f64()
        }
        _ => 0.0,
    };
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
        request_decode_tokens_per_s: percentile(&mut decode, 50.0),
        lockstep_decode_tokens_per_s: lockstep,
        busy_tokens_per_s: busy_tokens_per_s(clients, samples),
        draft_acceptance: {
            let drafted: usize = samples.iter().map(|s| s.drafted).sum();
            let accepted: usize = samples.iter().map(|s| s.accepted).sum();
            (drafted > 0).then(|| accepted as f64 / drafted as f64)
        },
    }
}

type MakeRequest = Arc<dyn Fn(usize, usize) -> BenchRequest + Send + Sync>;

/// C clients, each sending R requests in turn; returns samples in (client,
/// request) order and the wall time.
pub fn run_clients(
    rt: &tokio::runtime::Runtime,
    target: &Target,
    clients: usize,
    requests: usize,
    make: MakeRequest,
) -> Result<(Vec<Sample>, Duration), CliError> {
    rt.block_on(async {
        let start = Instant::now();
        let tasks: Vec<_> = (0..clients)
            .map(|c| {
                let target = target.clone();
                let make = make.clone();
                tokio::spawn(async move {
                    let mut out = Vec::with_capacity(requests);
                    for r in 0..requests {
                        out.push(target.generate(&make(c, r)).await?);
                    }
                    Ok::<_, String>(out)
                })
            })
            .collect();
        let mut samples = Vec::new();
        for t in tasks {
            let r = t
                .await
                .map_err(|_| CliError::runtime("a bench client panicked"))?;
            samples.extend(r.map_err(CliError::runtime)?);
        }
        Ok((samples, start.elapsed()))
    })
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

fn story_prompt(c: usize, r: usize) -> String {
    format!(
        "Write a short story about {}.",
        TOPICS[(c * 7 + r) % TOPICS.len()]
    )
}

fn print_table(reports: &[ScenarioReport]) {
    println!(
        "{:<26} {:>7} {:>8} {:>7} {:>9} {:>10} {:>10} {:>9} {:>9} {:>12} {:>9}",
        "scenario",
        "clients",
        "requests",
        "tokens",
        "tok/s",
        "ttft p50",
        "ttft p99",
        "itl p50",
        "itl p99",
        "decode tok/s",
        "accepted"
    );
    for r in reports {
        println!(
            "{:<26} {:>7} {:>8} {:>7} {:>9.1} {:>8.1}ms {:>8.1}ms {:>7.1}ms {:>7.1}ms {:>12.1} {:>9}",
            r.name,
            r.clients,
            r.requests,
            r.generated_tokens,
            r.tokens_per_s,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.itl_p50_ms,
            r.itl_p99_ms,
            if r.clients == 1 {
                r.request_decode_tokens_per_s
            } else if r.requests > r.clients {
                r.busy_tokens_per_s
            } else {
                r.lockstep_decode_tokens_per_s
            },
            r.draft_acceptance
                .map_or_else(|| "-".to_string(), |a| format!("{:.1}%", a * 100.0))
        );
    }
}

/// Everything a workload produces.
#[derive(Default)]
pub struct Outcome {
    pub reports: Vec<ScenarioReport>,
    pub ratios: serde_json::Map<String, serde_json::Value>,
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl Outcome {
    fn ratio(&mut self, name: &str, v: f64) {
        self.ratios.insert(name.into(), serde_json::json!(v));
    }
}

fn generate_workload(
    rt: &tokio::runtime::Runtime,
    target: &Target,
    args: &BenchArgs,
) -> Result<Outcome, CliError> {
    let max_tokens = args.max_tokens;
    let make: MakeRequest = Arc::new(move |c, r| BenchRequest {
        prompt: story_prompt(c, r),
        max_tokens,
        cache_prompt: true,
        ignore_eos: true,
        constraint: None,
        speculative: None,
    });
    let mut out = Outcome::default();
    // Warm-up: first-touch costs (page faults, thread start) stay out of the figures.
    run_clients(rt, target, 1, 1, make.clone())?;
    let (s, w) = run_clients(rt, target, 1, args.requests, make.clone())?;
    let single = report("single-stream", 1, &s, w);
    let (s, w) = run_clients(rt, target, args.clients, args.requests, make.clone())?;
    let conc = report(
        &format!("concurrent x{}", args.clients),
        args.clients,
        &s,
        w,
    );
    // One request per client, all at once: after the first tokens every
    // sequence decodes in the same batch, as in llama-batched-bench.
    let (s, w) = run_clients(rt, target, args.clients, 1, make)?;
    let lockstep = report(&format!("lockstep x{}", args.clients), args.clients, &s, w);
    out.ratio(
        "concurrent_over_single_tok_s",
        conc.tokens_per_s / single.tokens_per_s.max(1e-9),
    );
    out.ratio(
        "lockstep_decode_over_single_tok_s",
        lockstep.lockstep_decode_tokens_per_s / single.tokens_per_s.max(1e-9),
    );
    out.reports = vec![single, conc, lockstep];
    Ok(out)
}

/// A long instruction block (about 700 tokens on the default model).
pub fn long_system_prompt(owner: &str) -> String {
    let rules = [
        "Answer in at most two short sentences.",
        "Be polite, calm and precise.",
        "Never invent facts; say that you do not know instead.",
        "Prefer simple words over technical jargon.",
        "Use metric units and the 24-hour clock.",
        "Do not use lists, tables or headings.",
        "Refer visitors to the front desk for payments.",
        "Opening hours are nine to seventeen on weekdays.",
    ];
    let mut s = format!("{owner} You are the help desk assistant of the city library. ");
    for round in 0..9 {
        for (i, r) in rules.iter().enumerate() {
            s.push_str(&format!("Rule {}.{}: {r} ", round + 1, i + 1));
        }
    }
    s
}

const QUESTIONS: &[&str] = &[
    "When do you open?",
    "Can I renew a book online?",
    "Is there wifi?",
    "Where can I print?",
    "Do you have audio books?",
    "Can children get a card?",
    "How much is a late fee?",
    "Are pets allowed?",
    "Do you sell coffee?",
    "Is parking free?",
    "Can I reserve a room?",
    "Do you have French novels?",
    "Where are the toilets?",
    "Can I donate books?",
    "Is there a reading club?",
    "Who can I call?",
];

fn shared_prefix_workload(
    rt: &tokio::runtime::Runtime,
    target: &Target,
    args: &BenchArgs,
) -> Result<Outcome, CliError> {
    let sys = Arc::new(long_system_prompt("Library of Springfield."));
    let max_tokens = args.max_tokens;
    let make = |cache: bool| -> MakeRequest {
        let sys = sys.clone();
        Arc::new(move |c, _| BenchRequest {
            prompt: format!(
                "{sys}\nUser: {}\nAssistant:",
                QUESTIONS[c % QUESTIONS.len()]
            ),
            max_tokens,
            cache_prompt: cache,
            ignore_eos: true,
            constraint: None,
            speculative: None,
        })
    };
    let mut out = Outcome::default();
    let warm: MakeRequest = Arc::new(|_, _| BenchRequest {
        prompt: "Hello there.".into(),
        max_tokens: 4,
        cache_prompt: false,
        ignore_eos: true,
        constraint: None,
        speculative: None,
    });
    run_clients(rt, target, 1, 1, warm)?;
    let off = if args.no_baseline {
        None
    } else {
        let (s, w) = run_clients(rt, target, args.clients, 1, make(false))?;
        Some(report("shared-prefix cache off", args.clients, &s, w))
    };
    let (s, w) = run_clients(rt, target, args.clients, 1, make(true))?;
    let on = report("shared-prefix cache on", args.clients, &s, w);
    if let Some(off) = &off {
        out.ratio(
            "ttft_p50_on_over_off",
            on.ttft_p50_ms / off.ttft_p50_ms.max(1e-9),
        );
        out.ratio(
            "tok_s_on_over_off",
            on.tokens_per_s / off.tokens_per_s.max(1e-9),
        );
    }
    if let Target::Local(e) = target {
        let n = e
            .vocab()
            .tokenize(&sys, true, true)
            .map(|t| t.len())
            .unwrap_or(0);
        out.extra
            .insert("system_prompt_tokens".into(), serde_json::json!(n));
    }
    out.reports = off.into_iter().chain([on]).collect();
    Ok(out)
}

/// Runs C conversations of T turns; returns per-turn samples.
fn conversations(
    rt: &tokio::runtime::Runtime,
    target: &Target,
    clients: usize,
    turns: usize,
    max_tokens: u32,
    cache: bool,
    tag: &str,
) -> Result<(Vec<Vec<Sample>>, Duration), CliError> {
    let tag = tag.to_string();
    rt.block_on(async {
        let start = Instant::now();
        let tasks: Vec<_> = (0..clients)
            .map(|c| {
                let target = target.clone();
                let tag = tag.clone();
                tokio::spawn(async move {
                    // A distinct opening per conversation: no sharing across clients.
                    let mut history = long_system_prompt(&format!("Conversation {tag}-{c}."));
                    let mut samples = Vec::with_capacity(turns);
                    for t in 0..turns {
                        history.push_str(&format!(
                            "\nUser: {}\nAssistant:",
                            QUESTIONS[(c * 5 + t) % QUESTIONS.len()]
                        ));
                        let s = target
                            .generate(&BenchRequest {
                                prompt: history.clone(),
                                max_tokens,
                                cache_prompt: cache,
                                ignore_eos: true,
                                constraint: None,
                                speculative: None,
                            })
                            .await?;
                        history.push_str(&s.text);
                        samples.push(s);
                    }
                    Ok::<_, String>(samples)
                })
            })
            .collect();
        let mut per_turn: Vec<Vec<Sample>> = vec![Vec::new(); turns];
        for t in tasks {
            let r = t
                .await
                .map_err(|_| CliError::runtime("a bench client panicked"))?;
            for (i, s) in r.map_err(CliError::runtime)?.into_iter().enumerate() {
                per_turn[i].push(s);
            }
        }
        Ok((per_turn, start.elapsed()))
    })
}

fn multi_turn_workload(
    rt: &tokio::runtime::Runtime,
    target: &Target,
    args: &BenchArgs,
) -> Result<Outcome, CliError> {
    let mut out = Outcome::default();
    let turns = args.turns.max(2);
    for (cache, label) in [(false, "off"), (true, "on")] {
        let (per_turn, wall) = conversations(
            rt,
            target,
            args.clients,
            turns,
            args.max_tokens,
            cache,
            label,
        )?;
        let first = report(
            &format!("multi-turn {label} turn 1"),
            args.clients,
            &per_turn[0],
            wall,
        );
        let later: Vec<Sample> = per_turn[1..].iter().flatten().cloned().collect();
        let rest = report(
            &format!("multi-turn {label} turns 2-{turns}"),
            args.clients,
            &later,
            wall,
        );
        out.ratio(
            &format!("cache_{label}_ttft_p50_later_over_turn1"),
            rest.ttft_p50_ms / first.ttft_p50_ms.max(1e-9),
        );
        out.reports.push(first);
        out.reports.push(rest);
    }
    Ok(out)
}

/// The schema of the constrained workload: an object with free text fields, so
/// outputs are long enough to measure decoding.
pub fn bench_schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 60},
            "summary": {"type": "string", "maxLength": 240},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "rating": {"enum": ["low", "medium", "high"]}
        },
        "required": ["title", "summary", "tags", "year", "rating"],
        "additionalProperties": false
    })
}

fn constrained_workload(
    rt: &tokio::runtime::Runtime,
    target: &Target,
    args: &BenchArgs,
) -> Result<Outcome, CliError> {
    let max_tokens = args.max_tokens;
    let make = |constrained: bool| -> MakeRequest {
        Arc::new(move |c, r| BenchRequest {
            prompt: format!(
                "Describe a book about {} as a JSON object:",
                TOPICS[(c * 7 + r) % TOPICS.len()]
            ),
            // A schema ends the output itself (end-of-generation stays allowed);
            // the limit only guards against a runaway.
            max_tokens: if constrained {
                max_tokens.max(512)
            } else {
                max_tokens
            },
            cache_prompt: true,
            ignore_eos: !constrained,
            constraint: constrained.then(|| OutputConstraint::JsonSchema(bench_schema())),
            speculative: None,
        })
    };
    let mut out = Outcome::default();
    run_clients(rt, target, 1, 1, make(false))?;
    let (s, w) = run_clients(rt, target, args.clients, args.requests, make(false))?;
    let plain = report("unconstrained", args.clients, &s, w);
    let (s, w) = run_clients(rt, target, args.clients, args.requests, make(true))?;
    let valid = s
        .iter()
        .filter(|x| serde_json::from_str::<serde_json::Value>(x.text.trim()).is_ok())
        .count();
    let constrained = report("json schema", args.clients, &s, w);
    out.ratio(
        "constrained_over_unconstrained_decode_tok_s",
        constrained.request_decode_tokens_per_s / plain.request_decode_tokens_per_s.max(1e-9),
    );
    out.extra.insert(
        "constrained_outputs_parsing".into(),
        serde_json::json!(format!("{valid}/{}", s.len())),
    );
    out.extra.insert(
        "unconstrained_request_decode_tok_s".into(),
        serde_json::json!(plain.request_decode_tokens_per_s),
    );
    out.extra.insert(
        "constrained_request_decode_tok_s".into(),
        serde_json::json!(constrained.request_decode_tokens_per_s),
    );
    out.reports = vec![plain, constrained];
    Ok(out)
}

/// Forced tool calls against free text on the same chats: the call grammar's
/// cost per decoded token. The function takes the constrained workload's
/// schema, so calls are long enough to measure.
fn tools_workload(
    rt: &tokio::runtime::Runtime,
    target: &Target,
    args: &BenchArgs,
) -> Result<Outcome, CliError> {
    use sipp::chat::ChatMessage;
    use sipp::tools::turn::ChatTurn;
    use sipp::tools::{Tool, ToolChoice, ToolSpec};
    let Target::Local(engine) = target else {
        return Err(CliError::usage(
            "the tools workload runs on an engine in this process (leave out --url)",
        ));
    };
    let spec = ToolSpec {
        tools: vec![Tool::function(
            "save_book",
            "Saves a book's description",
            bench_schema(),
        )],
        choice: ToolChoice::Required,
        parallel: false,
    };
    // Every (client, request) pair's chat, rendered with the tools shown.
    let mut prompts = Vec::new();
    let mut constraint = None;
    for i in 0..TOPICS.len() {
        let messages = [ChatMessage::user(format!(
            "Save a description of a book about {}.",
            TOPICS[i]
        ))];
        let (text, turn) = engine
            .render_turn(&ChatTurn::new(&messages, &spec))
            .map_err(|e| CliError::runtime(e.to_string()))?;
        prompts.push(text);
        constraint = turn.constraint;
    }
    let prompts = Arc::new(prompts);
    let max_tokens = args.max_tokens;
    let prompt_of = {
        let prompts = prompts.clone();
        move |c: usize, r: usize| prompts[(c * 7 + r) % prompts.len()].clone()
    };
    // The calls first (their grammar ends them), then free text of exactly
    // the same lengths, so both runs have the same batch shapes (requests
    // ending and prefilling at the same points) and differ only by the grammar.
    let calls_req: MakeRequest = {
        let prompt_of = prompt_of.clone();
        Arc::new(move |c, r| BenchRequest {
            prompt: prompt_of(c, r),
            max_tokens: max_tokens.max(512),
            cache_prompt: true,
            ignore_eos: false,
            constraint: constraint.clone(),
            speculative: None,
        })
    };
    let mut out = Outcome::default();
    run_clients(rt, target, 1, 1, calls_req.clone())?;
    let (s, w) = run_clients(rt, target, args.clients, args.requests, calls_req)?;
    let lengths: Arc<Vec<u32>> = Arc::new(s.iter().map(|x| x.tokens.max(1) as u32).collect());
    let requests = args.requests;
    let free_req: MakeRequest = Arc::new(move |c, r| BenchRequest {
        prompt: prompt_of(c, r),
        max_tokens: lengths[c * requests + r],
        cache_prompt: true,
        ignore_eos: true,
        constraint: None,
        speculative: None,
    });
    let (fs, fw) = run_clients(rt, target, args.clients, args.requests, free_req)?;
    let plain = report("free text, same lengths", args.clients, &fs, fw);
    let format = engine
        .template_caps()
        .map_or(sipp::tools::ToolFormat::Generic, |c| c.format);
    let parser = sipp::tools::OutputParser::new(
        format,
        true,
        sipp::tools::turn::ReasoningFormat::None,
        false,
    );
    let calls = s
        .iter()
        .filter(|x| {
            let out = parser.clone().parse_all(&x.text);
            out.calls.len() == 1
                && serde_json::from_str::<serde_json::Value>(&out.calls[0].function.arguments)
                    .is_ok()
        })
        .count();
    let tools = report("forced tool call", args.clients, &s, w);
    out.ratio(
        "free_text_over_tool_call_decode_tok_s",
        plain.request_decode_tokens_per_s / tools.request_decode_tokens_per_s.max(1e-9),
    );
    out.extra.insert(
        "tool_call_outputs_parsing".into(),
        serde_json::json!(format!("{calls}/{}", s.len())),
    );
    out.reports = vec![plain, tools];
    Ok(out)
}

/// Embeddings per second for `inputs`, sent by `clients` concurrent clients.
fn embed_rate(
    rt: &tokio::runtime::Runtime,
    target: &Target,
    inputs: &[String],
    clients: usize,
) -> Result<f64, CliError> {
    rt.block_on(async {
        let start = Instant::now();
        let chunks: Vec<Vec<String>> = (0..clients)
            .map(|c| inputs.iter().skip(c).step_by(clients).cloned().collect())
            .collect();
        let tasks: Vec<_> = chunks
            .into_iter()
            .map(|chunk| {
                let target = target.clone();
                tokio::spawn(async move { embed_all(&target, &chunk).await })
            })
            .collect();
        for t in tasks {
            t.await
                .map_err(|_| CliError::runtime("a bench client panicked"))?
                .map_err(CliError::runtime)?;
        }
        Ok(inputs.len() as f64 / start.elapsed().as_secs_f64())
    })
}

fn embed_workload(
    rt: &tokio::runtime::Runtime,
    target: &Target,
    args: &BenchArgs,
) -> Result<Outcome, CliError> {
    let n = (args.clients * args.requests).max(1);
    let inputs: Vec<String> = (0..n)
        .map(|i| {
            format!(
                "{} Question {i}: {}",
                TOPICS[i % TOPICS.len()],
                QUESTIONS[i % QUESTIONS.len()]
            )
        })
        .collect();
    let mut out = Outcome::default();
    embed_rate(rt, target, &inputs[..1], 1)?;
    let alone = embed_rate(rt, target, &inputs, 1)?;
    let together = embed_rate(rt, target, &inputs, args.clients)?;
    out.extra.insert("inputs".into(), serde_json::json!(n));
    out.extra.insert(
        "one_by_one_embeddings_per_s".into(),
        serde_json::json!(alone),
    );
    out.extra.insert(
        "concurrent_embeddings_per_s".into(),
        serde_json::json!(together),
    );
    out.ratio("concurrent_over_one_by_one", together / alone.max(1e-9));
    Ok(out)
}

pub fn run(args: BenchArgs) -> Result<(), CliError> {
    let (target, model) = match &args.url {
        Some(url) => (
            Target::Http(HttpTarget {
                // A fresh connection per request: some servers (llama-server)
                // close idle keep-alive connections, which a pool would reuse.
                client: reqwest::Client::builder()
                    .pool_max_idle_per_host(0)
                    .build()
                    .map_err(|e| CliError::runtime(e.to_string()))?,
                base: url.clone(),
                model: args.server_model.clone(),
                api_key: args.api_key.clone(),
            }),
            url.clone(),
        ),
        None => {
            let mut cfg = args.model.runtime_config()?;
            if args.workload == Workload::Embed {
                cfg.context.embeddings = true;
                cfg.cache.idle_sequences = 0;
            }
            if args.model.parallel.is_none() {
                cfg.context.n_parallel = cfg.context.n_parallel.max(args.clients as u32);
            }
            let engine = load_engine(&args.model.model, cfg, args.json)?;
            let model = engine.info().model.path.clone();
            (Target::Local(engine), model)
        }
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| CliError::runtime(e.to_string()))?;
    let mut out = match args.workload {
        Workload::Generate => generate_workload(&rt, &target, &args)?,
        Workload::SharedPrefix => shared_prefix_workload(&rt, &target, &args)?,
        Workload::MultiTurn => multi_turn_workload(&rt, &target, &args)?,
        Workload::Constrained => constrained_workload(&rt, &target, &args)?,
        Workload::Tools => tools_workload(&rt, &target, &args)?,
        Workload::Embed => embed_workload(&rt, &target, &args)?,
        Workload::Grounded => grounded::workload(&rt, &target, &args)?,
    };
    if let Target::Local(engine) = &target {
        let m = engine.metrics();
        out.extra.insert(
            "engine_batch_share".into(),
            serde_json::json!(m.batch_ns as f64 / m.step_ns.max(1) as f64),
        );
    }
    let json = serde_json::json!({
        "workload": format!("{:?}", args.workload).to_lowercase(),
        "model": model,
        "threads": args.model.threads.unwrap_or_else(sipp::config::available_threads),
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "scenarios": out.reports,
        "ratios": out.ratios,
        "extra": out.extra,
    });
    if !args.json {
        print_table(&out.reports);
        for (k, v) in &out.ratios {
            println!("{k}: {:.3}", v.as_f64().unwrap_or(0.0));
        }
    }
    println!("{}", serde_json::to_string(&json).unwrap_or_default());
    Ok(())
}

async fn embed_all(target: &Target, inputs: &[String]) -> Result<(), String> {
    for i in inputs {
        target.embed(i).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request whose first token arrives `first` ms after `t0`, then
    /// one token every `gap` ms until it has `tokens`.
    fn sample(t0: Instant, first: u64, gap: u64, tokens: usize) -> Sample {
        let itls = vec![Duration::from_millis(gap); tokens - 1];
        Sample {
            first_token_at: Some(t0 + Duration::from_millis(first)),
            end_at: Some(t0 + Duration::from_millis(first + gap * (tokens as u64 - 1))),
            itl_tokens: vec![1; tokens - 1],
            itls,
            tokens,
            first_tokens: 1,
            ..Sample::default()
        }
    }

    #[test]
    fn busy_speed_counts_only_while_every_client_works() {
        let t0 = Instant::now();
        // Client 0: two requests of 10 tokens, 10 ms apart, from 0 ms
        // (tokens at 0..90, then 100..190). Client 1: one request of 10
        // tokens at 20 ms apart from 50 ms (tokens at 50..230), then one
        // of 5 tokens from 300 ms.
        let samples = vec![
            sample(t0, 0, 10, 10),
            sample(t0, 100, 10, 10),
            sample(t0, 50, 20, 10),
            sample(t0, 300, 10, 5),
        ];
        // Busy from 50 ms (client 1's first token) to 190 ms (client 0's
        // end): client 0's tokens at 60..90 and 100..190 (4 + 10), client
        // 1's at 70..190 (7; the one at 50 opens the window).
        let v = busy_tokens_per_s(2, &samples);
        assert!((v - 21.0 / 0.140).abs() < 1e-6, "{v}");
        // The lockstep window runs from the last first token (300 ms) to
        // the last end (340 ms): client 1's 4 tokens after its first.
        let r = report("x", 2, &samples, Duration::from_millis(340));
        assert_eq!(r.busy_tokens_per_s, v);
        let l = r.lockstep_decode_tokens_per_s;
        assert!((l - 4.0 / 0.040).abs() < 1e-6, "{l}");
    }

    #[test]
    fn busy_speed_needs_every_client_busy_at_once() {
        let t0 = Instant::now();
        // One client ends before the other starts: never both busy.
        let samples = vec![sample(t0, 0, 10, 5), sample(t0, 100, 10, 5)];
        assert_eq!(busy_tokens_per_s(2, &samples), 0.0);
        // Samples that are not whole clients' requests.
        assert_eq!(busy_tokens_per_s(2, &samples[..1]), 0.0);
        // One client alone: its own decode, after its first token.
        let v = busy_tokens_per_s(1, &samples[..1]);
        assert!((v - 4.0 / 0.040).abs() < 1e-6, "{v}");
    }
}
