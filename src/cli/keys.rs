//! `baton keys add|list|revoke`: edits the keys file. A new key goes to
//! standard output alone (so `KEY=$(baton keys add acme)` works); notes go
//! to standard error.

use super::{EXIT_BAD_CONFIG, KeysArgs, KeysCommand};
use crate::auth::{KeysFile, StoredKey};
use crate::config::{Config, ServeArgs};
use std::path::PathBuf;
use std::process::ExitCode;

/// Runs a `baton keys` command.
pub fn run(args: KeysArgs) -> ExitCode {
    let path = match keys_file_path(&args) {
        Ok(path) => path,
        Err(err) => {
            eprintln!("{err}");
            return ExitCode::from(EXIT_BAD_CONFIG);
        }
    };
    let file = KeysFile::new(path);
    let done = match args.command {
        KeysCommand::Add { agency } => file.add(&agency).map(|new| {
            println!("{}", new.key);
            eprintln!(
                "created key {} for agency {:?} in {}; keep the key now: it is not shown again",
                new.stored.key_id,
                new.stored.agency,
                file.path().display()
            );
        }),
        KeysCommand::List { json } => file.list().map(|keys| {
            if json {
                println!("{}", listing_json(&keys));
            } else if keys.is_empty() {
                eprintln!("no keys in {}", file.path().display());
            } else {
                print!("{}", table(&keys));
            }
        }),
        KeysCommand::Revoke { target, allow_open } => {
            file.revoke(&target, allow_open).map(|removed| {
                for key in removed {
                    println!("revoked {} (agency {})", key.key_id, key.agency);
                }
                if file.list().is_ok_and(|left| left.is_empty()) {
                    eprintln!(
                        "warning: no key is left in {}: a Baton using it lets every caller in, \
                     unauthenticated, unless BATON_API_KEYS sets keys",
                        file.path().display()
                    );
                }
            })
        }
    };
    match done {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("baton keys: {err}");
            ExitCode::FAILURE
        }
    }
}

/// The keys file the server would use: `--keys-file`/`BATON_KEYS_FILE`, else
/// `keys-file` in the configuration file, else the default.
fn keys_file_path(args: &KeysArgs) -> Result<PathBuf, crate::config::ConfigError> {
    let serve = ServeArgs {
        keys_file: args.keys_file.clone(),
        config: args.config.clone(),
        ..ServeArgs::default()
    };
    Ok(Config::load(&serve, &crate::launch::builtin_agent_ids())?.keys_file)
}

/// Agency, key id and creation time of each key, as JSON (never a hash).
fn listing_json(keys: &[StoredKey]) -> String {
    let keys: Vec<_> = keys
        .iter()
        .map(|k| {
            serde_json::json!({
                "agency": k.agency,
                "keyId": k.key_id,
                "createdAt": k.created_at_text(),
            })
        })
        .collect();
    serde_json::to_string_pretty(&serde_json::json!({ "keys": keys })).unwrap_or_default()
}

/// An aligned table with a header line.
fn table(keys: &[StoredKey]) -> String {
    let rows: Vec<[String; 3]> = keys
        .iter()
        .map(|k| [k.agency.clone(), k.key_id.clone(), k.created_at_text()])
        .collect();
    let header = ["AGENCY", "KEY ID", "CREATED"].map(String::from);
    let width = |column: usize| {
        std::iter::once(&header)
            .chain(&rows)
            .map(|row| row[column].len())
            .max()
            .unwrap_or(0)
    };
    let (agency, id) = (width(0), width(1));
    std::iter::once(&header)
        .chain(&rows)
        .map(|[a, i, c]| format!("{a:agency$}  {i:id$}  {c}\n"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_aligned_and_has_no_hash() {
        let key = |agency: &str, id: &str| StoredKey {
            agency: agency.into(),
            key_id: id.into(),
            sha256: "ab".repeat(32),
            created_at: "2026-05-01T10:00:00Z".parse().unwrap(),
        };
        let keys = [
            key("acme", "bk_12345678"),
            key("globex-corp", "bk_abcdefgh"),
        ];
        let text = table(&keys);
        assert_eq!(
            text,
            "AGENCY       KEY ID       CREATED\n\
             acme         bk_12345678  2026-05-01T10:00:00Z\n\
             globex-corp  bk_abcdefgh  2026-05-01T10:00:00Z\n"
        );
        let json = listing_json(&keys);
        assert!(!json.contains("abab") && json.contains("\"keyId\": \"bk_abcdefgh\""));
    }
}
