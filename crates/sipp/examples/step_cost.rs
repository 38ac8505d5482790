//! What a decode step costs by its shape: S sequences of C cells of context
//! each, with R rows each (a sampled token and R - 1 drafted ones), as
//! speculative decoding verifies them. The model's own runtime, this
//! process, no scheduler: each step is one llama_decode, its new cells cut
//! off again before the next.
//!
//!     cargo run --release -p sipp-rs --example step_cost -- MODEL.gguf \
//!         [--cells 800] [--seqs 1,8] [--rows 1,2,4,8,16] [--reps 12] [--one-drafts]
//!
//! Prints the median and fastest step per shape, and what each row added
//! over the first shape of `--rows` (from 1: the cost of a drafted row). With
//! `--one-drafts` only the first sequence gets the extra rows (one slot's
//! long draft among slots decoding one token each).

use std::time::Instant;

use sipp::runtime::llama::{load_model, LlamaRuntime};
use sipp::runtime::{Backend, BatchRow};
use sipp::NativeRuntimeConfig;

fn list(v: &str) -> Vec<u32> {
    v.split(',')
        .map(|x| x.trim().parse().expect("a list of numbers"))
        .collect()
}

fn main() {
    let mut args = std::env::args().skip(1);
    let Some(model) = args.next() else {
        eprintln!("usage: step_cost MODEL.gguf [--cells N] [--seqs A,B] [--rows A,B] [--reps N] [--one-drafts]");
        std::process::exit(2);
    };
    let (mut cells, mut seqs, mut rows, mut reps, mut one) =
        (800u32, vec![1, 8], vec![1, 2, 4, 8, 16], 12usize, false);
    while let Some(flag) = args.next() {
        let mut value = || args.next().expect("a value after the flag");
        match flag.as_str() {
            "--cells" => cells = value().parse().expect("--cells N"),
            "--seqs" => seqs = list(&value()),
            "--rows" => rows = list(&value()),
            "--reps" => reps = value().parse().expect("--reps N"),
            "--one-drafts" => one = true,
            other => panic!("unknown flag {other}"),
        }
    }
    let max_seqs = seqs.iter().copied().max().unwrap_or(1);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
    let mut cfg = NativeRuntimeConfig::default();
    cfg.context.n_ctx = max_seqs * (cells + rows.iter().copied().max().unwrap_or(1)) + 256;
    cfg.context.n_threads = threads;
    cfg.context.n_threads_batch = threads;
    let model = load_model(std::path::Path::new(&model), &cfg, max_seqs, None).expect("load");
    let mut rt = LlamaRuntime::new(model, &cfg, max_seqs).expect("context");
    println!("seqs\trows/seq\trows\tmedian ms\tfastest ms\tms per row over the first shape");
    for &s in &seqs {
        rt.kv_clear();
        // every sequence's own context, in chunks of a prompt's size
        for q in 0..s {
            let mut at = 0;
            while at < cells {
                let end = (at + 256).min(cells);
                let batch: Vec<BatchRow> = (at..end)
                    .map(|p| BatchRow {
                        token: 100 + ((p * 7 + q) % 5000) as i32,
                        pos: p,
                        seq: q as i32,
                        output: p + 1 == cells,
                    })
                    .collect();
                rt.decode(&batch).expect("prefill");
                at = end;
            }
        }
        let mut base = None;
        for &r in &rows {
            let mut times = Vec::with_capacity(reps);
            let mut total = 0;
            for rep in 0..reps {
                let mut batch = Vec::new();
                for q in 0..s {
                    let n = if one && q > 0 { 1 } else { r };
                    batch.extend((0..n).map(|i| BatchRow {
                        token: 200 + (i + rep as u32) as i32,
                        pos: cells + i,
                        seq: q as i32,
                        output: true,
                    }));
                }
                total = batch.len();
                let started = Instant::now();
                rt.decode(&batch).expect("decode");
                times.push(started.elapsed().as_secs_f64() * 1e3);
                for q in 0..s {
                    rt.kv_truncate(q as i32, cells);
                }
            }
            times.sort_by(f64::total_cmp);
            let median = times[times.len() / 2];
            let (base_rows, base_ms) = *base.get_or_insert((total, median));
            let extra = if total > base_rows {
                format!("{:.3}", (median - base_ms) / (total - base_rows) as f64)
            } else {
                "-".into()
            };
            println!(
                "{s}\t{}\t{total}\t{median:.2}\t{:.2}\t{extra}",
                if one {
                    format!("{r} (one)")
                } else {
                    r.to_string()
                },
                times[0]
            );
        }
    }
}
