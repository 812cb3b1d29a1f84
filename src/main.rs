//! The `baton` binary: parse the command line, then serve, manage keys,
//! call a running Baton (its registry, a task's trace), or run the demo.

use baton::cli::{self, Cli, Command, EXIT_BAD_CONFIG};
use baton::config::{Config, ServeArgs};
use clap::Parser;
use std::process::ExitCode;

// glibc's malloc showed as the largest user-space cost under load (sled
// clones nodes on every write); mimalloc keeps per-thread heaps.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    disable_transparent_huge_pages();
    match Cli::parse().command {
        Command::Serve(args) => serve(&args),
        Command::Keys(args) => cli::keys::run(args),
        Command::Agents(args) => block_on(None, cli::agents::run(args)),
        Command::Trace(args) => block_on(None, cli::trace::run(args)),
        Command::Demo => block_on(None, baton::demo::run()),
    }
}

/// `baton serve`: the configuration is read first, because it sizes the
/// runtime (`workers`).
fn serve(args: &ServeArgs) -> ExitCode {
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
    let workers = config.workers;
    block_on(Some(workers), async move {
        baton::telemetry::init(config.log_format);
        match baton::launch::serve(config).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                tracing::error!("{err:#}");
                eprintln!("baton: {err:#}");
                ExitCode::FAILURE
            }
        }
    })
}

/// Runs `command` on a multi-thread runtime of `workers` threads (tokio's
/// default, one per core, when `None`; `serve` passes its configured
/// `--workers`).
fn block_on(workers: Option<usize>, command: impl Future<Output = ExitCode>) -> ExitCode {
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    runtime.enable_all();
    if let Some(workers) = workers {
        runtime.worker_threads(workers);
    }
    match runtime.build() {
        Ok(runtime) => runtime.block_on(command),
        Err(err) => {
            eprintln!("cannot start the async runtime: {err}");
            ExitCode::FAILURE
        }
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
