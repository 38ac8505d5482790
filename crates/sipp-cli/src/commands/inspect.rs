//! `sipp inspect`: what a GGUF model is.

use clap::Args;
use sipp::runtime::gguf::{check_gguf, MetaValue};

use crate::common::{load_engine, CliError};

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// A GGUF path or a known model name.
    pub model: String,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Print only the chat template.
    #[arg(long = "chat-template")]
    pub chat_template: bool,
}

pub fn run(args: InspectArgs) -> Result<(), CliError> {
    let path = sipp::models::resolve_or_fetch(&args.model)?;
    let header = check_gguf(&path).map_err(|e| CliError::usage(e.to_string()))?;
    if args.chat_template {
        let t = header
            .metadata
            .get("tokenizer.chat_template")
            .and_then(MetaValue::as_str)
            .ok_or_else(|| {
                CliError::usage("the model has no chat template (tokenizer.chat_template)")
            })?;
        print!("{t}");
        return Ok(());
    }
    // Loading gives llama.cpp's own view: parameter count, vocabulary, tokens.
    let mut cfg = sipp::NativeRuntimeConfig::default();
    cfg.context.n_ctx = 256;
    cfg.context.n_parallel = 1;
    cfg.cache.idle_sequences = 0;
    let engine = load_engine(path.to_str().unwrap_or_default(), cfg, true)?;
    let info = &engine.info().model;
    let vocab = engine.vocab();
    let special: Vec<serde_json::Value> = info
        .special_tokens(vocab.as_ref())
        .into_iter()
        .map(|(name, id, text)| serde_json::json!({"name": name, "id": id, "text": text}))
        .collect();
    let tokenizer_model = header
        .metadata
        .get("tokenizer.ggml.model")
        .and_then(MetaValue::as_str)
        .unwrap_or("unknown");
    let report = serde_json::json!({
        "path": path.display().to_string(),
        "architecture": info.architecture,
        "name": info.name,
        "parameters": info.n_params,
        "size_bytes": info.size_bytes,
        "file_size_bytes": header.file_size,
        "quantization": info.quantization,
        "context_length": info.n_ctx_train,
        "placement": info.placement,
        "embedding_length": info.n_embd,
        "layers": info.n_layer,
        "vocab_size": info.n_vocab,
        "tokenizer": tokenizer_model,
        "special_tokens": special,
        "add_bos": info.add_bos,
        "chat_template": info.chat_template.is_some(),
        "can_generate": info.has_decoder,
        "pooling": info.pooling.map(|p| p.as_str()),
        "gguf_version": header.version,
        "tensors": header.tensors.len(),
    });
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).unwrap_or_default()
        );
        return Ok(());
    }
    println!("path:             {}", path.display());
    println!("architecture:     {}", info.architecture);
    if let Some(n) = &info.name {
        println!("name:             {n}");
    }
    println!(
        "parameters:       {} ({:.1} M)",
        info.n_params,
        info.n_params as f64 / 1e6
    );
    println!("quantization:     {}", info.quantization);
    println!(
        "size:             {:.1} MiB",
        info.size_bytes as f64 / (1024.0 * 1024.0)
    );
    println!("context length:   {}", info.n_ctx_train);
    println!("embedding length: {}", info.n_embd);
    println!("layers:           {}", info.n_layer);
    println!("placement:        {}", info.placement.summary());
    println!("vocabulary:       {} ({tokenizer_model})", info.n_vocab);
    for (name, id, text) in info.special_tokens(vocab.as_ref()) {
        println!("{:<18}{id} {text:?}", format!("{name} token:"));
    }
    println!(
        "chat template:    {}",
        if info.chat_template.is_some() {
            "yes"
        } else {
            "no"
        }
    );
    println!(
        "can generate:     {}",
        if info.has_decoder {
            "yes"
        } else {
            "no (encoder only)"
        }
    );
    if let Some(p) = info.pooling {
        println!("pooling:          {}", p.as_str());
    }
    Ok(())
}
