//! sipp's CPU matrix kernels (`kernels/cpu_gemm.cpp`) on the real default
//! model (SmolLM2-135M: Q4_1 weights, Q8_0 tied embeddings).
//!
//! The kernels are checked against ggml's own arithmetic on random data by
//! the unit tests of `runtime::cpu_kernels`. Here: they serve the model's
//! products and attention, and a prompt decoded as one batch gives the same
//! logits, bit for bit, as the prompt decoded one token at a time (causal
//! attention makes both the same function of the same tokens), which is what
//! makes speculative verification give exactly the tokens of decoding alone.

mod common;

use sipp::runtime::llama::{load_model, LlamaRuntime};
use sipp::runtime::{cpu_kernels, Backend, BatchRow};
use sipp::NativeRuntimeConfig;

const PROMPT: &str = "The lighthouse keeper climbed the stairs every evening at dusk, \
    counting the steps aloud: one hundred and twelve of them, worn smooth by a \
    century of boots. At the top she lit the lamp and watched the ships.";

/// The logits of every position of `tokens`, decoded `chunk` rows at a time.
fn logits_of_every_position(rt: &mut LlamaRuntime, tokens: &[i32], chunk: usize) -> Vec<Vec<f32>> {
    rt.kv_clear();
    let rows: Vec<BatchRow> = tokens
        .iter()
        .enumerate()
        .map(|(i, &token)| BatchRow {
            token,
            pos: i as u32,
            seq: 0,
            output: true,
        })
        .collect();
    let mut logits = Vec::new();
    let mut at = 0;
    while at < rows.len() {
        let end = rows.len().min(at + chunk);
        rt.decode(&rows[at..end]).expect("decode");
        logits.extend((0..end - at).map(|i| rt.logits(i).to_vec()));
        at = end;
    }
    logits
}

#[test]
fn batched_products_through_the_kernel_match_one_row_products() {
    let mut cfg = NativeRuntimeConfig::default();
    cfg.context.n_ctx = 512;
    cfg.context.n_threads = 2;
    cfg.context.n_threads_batch = 2;
    let model = load_model(&common::default_model(), &cfg, 1, None).expect("load");
    let mut rt = LlamaRuntime::new(model, &cfg, 1).expect("context");
    // Active exactly where the build targets AVX-512 VNNI, or AVX2 and FMA
    // (unless switched off). Then past 64 tokens, where the attention kernel's threads split
    // the rows instead of the cells; ggml's own attention tiles from 64 rows
    // with other arithmetic, so without the kernels under 64.
    let expected = cpu_kernels::FOR_THIS_TARGET
        && std::env::var("SIPP_CPU_KERNELS").map_or(true, |v| v != "off");
    let prompt = if expected {
        format!("{PROMPT} {PROMPT} {PROMPT}")
    } else {
        PROMPT.to_string()
    };
    let tokens = rt.vocab().tokenize(&prompt, true, false).expect("tokenize");
    assert!(tokens.len() >= 32, "a prompt of {} tokens", tokens.len());
    assert_eq!(tokens.len() > 64, expected, "{} tokens", tokens.len());

    let attention_before = cpu_kernels::attention_ops();
    let before = cpu_kernels::products();
    let batched = logits_of_every_position(&mut rt, &tokens, tokens.len());
    let after_batch = cpu_kernels::products();
    let alone = logits_of_every_position(&mut rt, &tokens, 1);
    let after_alone = cpu_kernels::products();
    let attention_after = cpu_kernels::attention_ops();

    // The kernels serve every Q4_1 product (30 layers x 7 matrices) and the
    // Q8_0 output layer of each decode, one row or many.
    assert_eq!(cpu_kernels::active(), expected);
    let per_decode = if expected { 30 * 7 + 1 } else { 0 };
    assert_eq!(after_batch - before, per_decode, "products in the batch");
    assert_eq!(
        after_alone - after_batch,
        per_decode * tokens.len() as u64,
        "products one row at a time"
    );

    // The attention kernel served every layer of every decode.
    let decodes = 1 + tokens.len() as u64;
    let per_attention = if expected { 30 } else { 0 };
    assert_eq!(
        attention_after - attention_before,
        per_attention * decodes,
        "attention ops"
    );

    // A row's result does not depend on how many rows share the step, in
    // the kernels (any number of rows) as in ggml's own path (under 64): the
    // logits are equal, bit for bit.
    for (pos, (b, s)) in batched.iter().zip(&alone).enumerate() {
        assert!(
            b == s,
            "position {pos}: logits differ between one batch and one row at a time"
        );
    }
}
