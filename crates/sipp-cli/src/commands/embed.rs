//! `sipp embed`: one embedding per input, as JSON lines.

use std::io::Write;

use clap::{Args, ValueEnum};
use sipp::engine::EmbedRequest;
use sipp::runtime::Pooling;

use crate::common::{load_engine, CliError, ModelArgs};

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum PoolingArg {
    None,
    Mean,
    Cls,
    Last,
    Rank,
}

impl From<PoolingArg> for Pooling {
    fn from(p: PoolingArg) -> Self {
        match p {
            PoolingArg::None => Pooling::None,
            PoolingArg::Mean => Pooling::Mean,
            PoolingArg::Cls => Pooling::Cls,
            PoolingArg::Last => Pooling::Last,
            PoolingArg::Rank => Pooling::Rank,
        }
    }
}

#[derive(Args, Debug)]
pub struct EmbedArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Return raw vectors instead of L2-normalized ones.
    #[arg(long = "no-normalize")]
    pub no_normalize: bool,
    /// Pooling (default: the model's own, else mean).
    #[arg(long, value_enum)]
    pub pooling: Option<PoolingArg>,
    /// The inputs.
    #[arg(required = true)]
    pub texts: Vec<String>,
}

pub fn run(args: EmbedArgs) -> Result<(), CliError> {
    let mut cfg = args.model.runtime_config()?;
    cfg.context.embeddings = true;
    if let Some(p) = args.pooling {
        cfg.context.pooling = Some(p.into());
    }
    if args.model.parallel.is_none() {
        cfg.context.n_parallel = (args.texts.len() as u32).clamp(1, 16);
    }
    cfg.cache.idle_sequences = 0;
    let engine = load_engine(&args.model.model, cfg, true)?;
    // All inputs at once: they are batched together.
    let handles = args
        .texts
        .iter()
        .map(|t| {
            engine.embed(EmbedRequest {
                normalize: !args.no_normalize,
                ..EmbedRequest::new(t.as_str())
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut out = std::io::stdout().lock();
    for h in handles {
        let e = h.blocking_embedding()?;
        let line =
            serde_json::to_string(&e.values).map_err(|e| CliError::runtime(e.to_string()))?;
        let _ = writeln!(out, "{line}");
    }
    Ok(())
}
