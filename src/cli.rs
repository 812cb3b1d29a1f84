//! The command line: `baton serve` and its flags.

use crate::config::ServeArgs;
use clap::{Parser, Subcommand};

/// Baton: an A2A 1.0 gateway with a durable task ledger.
#[derive(Debug, Parser)]
#[command(name = "baton", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the gateway.
    Serve(ServeArgs),
}
