//! The `baton` binary: parse the command line, load the configuration, run.

use baton::cli::{Cli, Command};
use baton::config::Config;
use clap::Parser;
use std::process::ExitCode;

/// Exit code for a configuration that does not validate.
const EXIT_BAD_CONFIG: u8 = 2;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
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
