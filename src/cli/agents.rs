//! `baton agents register|list|search|get|remove`: one registry call (or,
//! for list and search, one per page) to a running Baton; the result is
//! printed as pretty JSON, a failure goes to standard error with exit code 1.

use super::{AgentsArgs, AgentsCommand, RegisterArgs, SearchArgs};
use crate::registry_client::{ClientError, RegisterParams, RegistryClient, SearchParams};
use serde_json::Value;
use std::io::Read as _;
use std::path::Path;
use std::process::ExitCode;

/// Why a `baton agents` command failed.
#[derive(Debug, thiserror::Error)]
enum Failure {
    /// The card file could not be read or is not JSON.
    #[error("{0}")]
    Card(String),
    /// The call failed.
    #[error(transparent)]
    Client(#[from] ClientError),
}

/// Runs a `baton agents` command.
pub async fn run(args: AgentsArgs) -> ExitCode {
    match execute(args).await {
        Ok(result) => {
            println!(
                "{}",
                serde_json::to_string_pretty(&result).unwrap_or_default()
            );
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("{err}");
            if let Failure::Client(ClientError::Rpc {
                data: Some(data), ..
            }) = &err
            {
                eprintln!("{}", serde_json::to_string_pretty(data).unwrap_or_default());
            }
            ExitCode::FAILURE
        }
    }
}

async fn execute(args: AgentsArgs) -> Result<Value, Failure> {
    let client = RegistryClient::new(&args.url, args.key)?;
    let result = match args.command {
        AgentsCommand::Register(register) => client.register(&register_params(register)?).await,
        AgentsCommand::List => client.search_all(SearchParams::default()).await,
        AgentsCommand::Search(search) => client.search_all(search_params(search)).await,
        AgentsCommand::Get { id } => client.get(&id).await,
        AgentsCommand::Remove { id } => client.deregister(&id).await,
    };
    Ok(result?)
}

fn register_params(args: RegisterArgs) -> Result<RegisterParams, Failure> {
    Ok(RegisterParams {
        id: args.id,
        card: args.card.as_deref().map(read_card).transpose()?,
        card_url: args.card_url,
    })
}

fn search_params(args: SearchArgs) -> SearchParams {
    SearchParams {
        skill: args.skill,
        tag: args.tag,
        query: args.query,
        input_mode: args.input_mode,
        output_mode: args.output_mode,
        ..SearchParams::default()
    }
}

/// Reads an AgentCard from a file, or from standard input for `-`.
fn read_card(path: &Path) -> Result<Value, Failure> {
    let name = path.display();
    let text = if path == Path::new("-") {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .map_err(|e| Failure::Card(format!("cannot read the card from standard input: {e}")))?;
        text
    } else {
        std::fs::read_to_string(path)
            .map_err(|e| Failure::Card(format!("cannot read card {name}: {e}")))?
    };
    serde_json::from_str(&text).map_err(|e| Failure::Card(format!("card {name} is not JSON: {e}")))
}
