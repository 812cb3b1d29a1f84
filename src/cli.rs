//! The command line: `baton serve`, `baton keys` (the agency keys file),
//! `baton agents` (the registry of a running Baton) and `baton trace` (a
//! task's handoff tree on a running Baton).

pub mod agents;
pub mod keys;
pub mod trace;

use crate::config::ServeArgs;
use clap::{ArgGroup, Parser, Subcommand};
use std::path::PathBuf;

/// Exit code for a configuration that does not validate.
pub const EXIT_BAD_CONFIG: u8 = 2;

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
    Serve(Box<ServeArgs>),
    /// Manage agency API keys (only their hashes are stored).
    Keys(KeysArgs),
    /// Register, list, search, get and remove agents on a running Baton.
    Agents(AgentsArgs),
    /// Show the handoff tree below a task on a running Baton.
    Trace(TraceArgs),
    /// Show the point of Baton: three vendor agents, a transfer, one task, its trace.
    Demo,
}

/// `baton keys`: edits the keys file that a running Baton re-reads.
#[derive(Debug, clap::Args)]
pub struct KeysArgs {
    /// What to do with the keys.
    #[command(subcommand)]
    pub command: KeysCommand,
    /// Keys file (default: `keys-file` in the configuration file, else ./baton-keys.json).
    #[arg(long, env = "BATON_KEYS_FILE", global = true)]
    pub keys_file: Option<PathBuf>,
    /// Configuration file to take `keys-file` from (default ./baton.toml if present).
    #[arg(long, env = "BATON_CONFIG", global = true)]
    pub config: Option<PathBuf>,
}

/// `baton keys` subcommands.
#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Create a key for AGENCY and print it; it is shown this once.
    Add {
        /// The agency the key authenticates as.
        agency: String,
    },
    /// List the keys: agency, key id and creation time (never a key).
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Revoke one key by its id, or every key of an agency.
    Revoke {
        /// A key id (`bk_…`, from `baton keys list`) or an agency.
        #[arg(value_name = "KEY_ID_OR_AGENCY")]
        target: String,
        /// Revoke even the file's last key, which lets every caller of a
        /// Baton using the file in, unauthenticated.
        #[arg(long)]
        allow_open: bool,
    },
}

/// `baton agents`: calls `POST {url}/registry` on a running Baton.
#[derive(Debug, clap::Args)]
pub struct AgentsArgs {
    /// What to do.
    #[command(subcommand)]
    pub command: AgentsCommand,
    /// Base URL of the running Baton.
    #[arg(
        long,
        env = "BATON_URL",
        default_value = "http://localhost:8080",
        global = true
    )]
    pub url: String,
    /// Agency API key (prefer the environment: flags show in process lists).
    #[arg(long, env = "BATON_API_KEY", hide_env_values = true, global = true)]
    pub key: Option<String>,
}

/// `baton trace`: calls `GET {url}/tasks/{taskId}/trace` on a running Baton.
#[derive(Debug, clap::Args)]
pub struct TraceArgs {
    /// The gateway task id.
    pub task_id: String,
    /// Base URL of the running Baton.
    #[arg(long, env = "BATON_URL", default_value = "http://localhost:8080")]
    pub url: String,
    /// API key of the principal that owns the task (prefer the environment:
    /// flags show in process lists).
    #[arg(long, alias = "api-key", env = "BATON_API_KEY", hide_env_values = true)]
    pub key: Option<String>,
    /// Print the report as JSON instead of a tree.
    #[arg(long)]
    pub json: bool,
}

/// `baton agents` subcommands.
#[derive(Debug, Subcommand)]
pub enum AgentsCommand {
    /// Register an agent from its AgentCard (RegisterAgent).
    Register(RegisterArgs),
    /// List every registered agent (SearchAgents, all pages).
    List,
    /// Search agents by skill, tag or text (SearchAgents, all pages).
    Search(SearchArgs),
    /// Show one agent's record (GetAgent).
    Get {
        /// Agent id.
        id: String,
    },
    /// Deregister an agent (DeregisterAgent).
    Remove {
        /// Agent id.
        id: String,
    },
}

/// `baton agents register`.
#[derive(Debug, clap::Args)]
#[command(group(ArgGroup::new("source").required(true).args(["card", "card_url"])))]
pub struct RegisterArgs {
    /// AgentCard JSON file (`-` reads standard input).
    #[arg(long, value_name = "FILE")]
    pub card: Option<PathBuf>,
    /// URL Baton fetches the AgentCard from.
    #[arg(long, value_name = "URL")]
    pub card_url: Option<String>,
    /// Agent id (default: chosen by Baton from the card).
    #[arg(long)]
    pub id: Option<String>,
}

/// `baton agents search`.
#[derive(Debug, clap::Args)]
pub struct SearchArgs {
    /// Skill id.
    #[arg(long)]
    pub skill: Option<String>,
    /// Skill tag.
    #[arg(long)]
    pub tag: Option<String>,
    /// Free text.
    #[arg(long)]
    pub query: Option<String>,
    /// Accepted input media type.
    #[arg(long)]
    pub input_mode: Option<String>,
    /// Produced output media type.
    #[arg(long)]
    pub output_mode: Option<String>,
}
