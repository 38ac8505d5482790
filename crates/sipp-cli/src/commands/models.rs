//! `sipp models`: fetch named models into the cache, list them.

use clap::{Args, Subcommand};

use crate::common::CliError;

#[derive(Args, Debug)]
pub struct ModelsArgs {
    #[command(subcommand)]
    pub command: ModelsCmd,
}

#[derive(Subcommand, Debug)]
pub enum ModelsCmd {
    /// Download a named model (default: `default`) into the cache and verify it.
    Fetch {
        /// Model names.
        #[arg(default_value = "default")]
        names: Vec<String>,
    },
    /// List known models and whether they are cached.
    List,
    /// Print the cached path of a named model.
    Path {
        /// Model name.
        #[arg(default_value = "default")]
        name: String,
    },
}

fn spec(name: &str) -> Result<&'static sipp::models::ModelSpec, CliError> {
    sipp::models::spec_by_name(name).ok_or_else(|| {
        let known: Vec<&str> = sipp::models::KNOWN_MODELS.iter().map(|m| m.name).collect();
        CliError::usage(format!(
            "unknown model `{name}` (known: {})",
            known.join(", ")
        ))
    })
}

pub fn run(args: ModelsArgs) -> Result<(), CliError> {
    match args.command {
        ModelsCmd::Fetch { names } => {
            for name in names {
                let s = spec(&name)?;
                let path = sipp::models::fetch(s)?;
                println!("{name}: {}", path.display());
            }
        }
        ModelsCmd::List => {
            for s in sipp::models::KNOWN_MODELS {
                let path = sipp::models::cached_path(s);
                let state = if path.is_file() {
                    "cached"
                } else {
                    "not fetched"
                };
                println!(
                    "{}\t{}=={}\t{}\t{}",
                    s.name,
                    s.package,
                    s.version,
                    state,
                    path.display()
                );
            }
        }
        ModelsCmd::Path { name } => {
            println!("{}", sipp::models::resolve(&spec(&name)?.name)?.display());
        }
    }
    Ok(())
}
