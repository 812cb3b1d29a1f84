//! The `baton` binary: parse the command line, then serve, manage keys,
//! call a running Baton (its registry, a task's trace), or run the demo.

use baton::cli::{self, Cli, Command, EXIT_BAD_CONFIG};
use baton::config::Config;
use clap::Parser;
use std::process::ExitCode;

// glibc's malloc showed as the largest user-space cost under load (sled
// clones nodes on every write); mimalloc keeps per-thread heaps.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    disable_transparent_huge_pages();
    let cli = Cli::parse();
    // `serve` sizes its runtime from the configuration, so that is read first.
    let serving = match &cli.command {
        Command::Serve(args) => {
            let config = match Config::load(args, &baton::launch::builtin_agent_ids()) {
                Ok(config) => config,
                Err(err) => {
                    eprintln!("{err}");
                    return ExitCode::from(EXIT_BAD_CONFIG);
                }
            };
            if args.validate_config {
                println!("configuration is valid:\n{config:#?}");
                return ExitCode::SUCCESS;
            }
            Some(config)
        }
        _ => None,
    };
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    runtime.enable_all();
    if let Some(config) = &serving {
        runtime.worker_threads(config.workers);
    }
    let runtime = match runtime.build() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match serving {
        Some(config) => runtime.block_on(serve(config)),
        None => runtime.block_on(run(cli)),
    }
}

/// mimalloc asks for transparent huge pages on its arenas, and then each
/// touched 2 MiB counts whole in RSS: 43 of an idle Baton's 57 MB. A heap of
/// small, short-lived objects gains nothing from them. (This is what
/// mimalloc's own `MIMALLOC_ALLOW_THP=0` does, applied from the start.)
fn disable_transparent_huge_pages() {
    #[cfg(target_os = "linux")]
    if let Err(err) = rustix::thread::disable_transparent_huge_pages(true) {
        eprintln!("note: transparent huge pages stay enabled: {err}");
    }
}

async fn run(cli: Cli) -> ExitCode {
    match cli.command {
        Command::Keys(args) => cli::keys::run(args),
        Command::Agents(args) => cli::agents::run(args).await,
        Command::Trace(args) => cli::trace::run(args).await,
        Command::Demo => baton::demo::run().await,
        // Handled in `main`, which sizes the runtime from its configuration.
        Command::Serve(_) => unreachable!("serve runs from main"),
    }
}

async fn serve(config: Config) -> ExitCode {
    baton::telemetry::init(config.log_format);
    match baton::launch::serve(config).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!("{err:#}");
            eprintln!("baton: {err:#}");
            ExitCode::FAILURE
        }
    }
}
