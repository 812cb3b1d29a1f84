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

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Keys(args) => cli::keys::run(args),
        Command::Agents(args) => cli::agents::run(args).await,
        Command::Trace(args) => cli::trace::run(args).await,
        Command::Demo => baton::demo::run().await,
        Command::Serve(args) => {
            let config = match Config::load(&args, &baton::launch::builtin_agent_ids()) {
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
    }
}
