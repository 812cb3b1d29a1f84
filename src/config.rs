//! Configuration: command-line flags and `BATON_*` variables (through clap),
//! over an optional `baton.toml`, over defaults. Every bad setting is reported
//! at once.

use crate::server::connections::{
    ConnectionLimits, DEFAULT_MAX_CONNECTIONS, DEFAULT_READ_TIMEOUT, DEFAULT_WRITE_TIMEOUT,
};
use crate::tls::ClientTls;
use ipnet::IpNet;
use serde::Deserialize;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Settings as given on the command line or in the environment.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, env = "BATON_LISTEN")]
    pub listen: Option<String>,
    /// Directory of the sled ledger.
    #[arg(long, env = "BATON_DATA")]
    pub data: Option<PathBuf>,
    /// Base URL written into published cards (default http://localhost:{port}).
    #[arg(long, env = "BATON_PUBLIC_URL")]
    pub public_url: Option<String>,
    /// Agent that serves /a2a calls without a tenant.
    #[arg(long, env = "BATON_DEFAULT_AGENT")]
    pub default_agent: Option<String>,
    /// Internal networks Baton may connect to (CIDRs or IPs, comma-separated).
    #[arg(long, env = "BATON_ALLOW_UPSTREAM", value_delimiter = ',')]
    pub allow_upstream: Option<Vec<String>>,
    /// Internal networks push webhooks may reach, when fewer than agents and
    /// card fetches may (default: the allow-upstream list; '' for none).
    #[arg(long, env = "BATON_ALLOW_WEBHOOKS", value_delimiter = ',')]
    pub allow_webhooks: Option<Vec<String>>,
    /// PEM file of extra CA certificates to trust for https agents, cards
    /// and webhooks, besides the built-in web PKI roots.
    #[arg(long, env = "BATON_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// Configuration file (default ./baton.toml if present).
    #[arg(long, env = "BATON_CONFIG")]
    pub config: Option<PathBuf>,
    /// Largest request body in bytes.
    #[arg(long, env = "BATON_MAX_BODY_BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Seconds a request head may take to arrive, and then its body; an idle
    /// kept-alive connection closes after it too (default 30).
    #[arg(long, env = "BATON_READ_TIMEOUT_SECS")]
    pub read_timeout_secs: Option<u64>,
    /// Seconds one write of a response may wait for the client to read
    /// before the connection is closed (default 60).
    #[arg(long, env = "BATON_WRITE_TIMEOUT_SECS")]
    pub write_timeout_secs: Option<u64>,
    /// Most inbound connections open at once (default 10000, lowered to fit
    /// the open-file limit).
    #[arg(long, env = "BATON_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Most inbound connections open at once from one client address
    /// (default: no bound); past it new ones are closed at once.
    #[arg(long, env = "BATON_MAX_CONNECTIONS_PER_ADDRESS")]
    pub max_connections_per_address: Option<usize>,
    /// Log format: text or json.
    #[arg(long, env = "BATON_LOG_FORMAT")]
    pub log_format: Option<String>,
    /// Seconds a stop may take: connections drain, then queued push notifications.
    #[arg(long, env = "BATON_SHUTDOWN_GRACE_SECS")]
    pub shutdown_grace_secs: Option<u64>,
    /// Longest a blocking SendMessage waits, in seconds.
    #[arg(long, env = "BATON_TASK_TIMEOUT_SECS")]
    pub task_timeout_secs: Option<u64>,
    /// Largest hop count of a line of work (default 5).
    #[arg(long, env = "BATON_MAX_HOPS")]
    pub max_hops: Option<u32>,
    /// How long a handoff's target may take to acknowledge, in milliseconds (default 5000).
    #[arg(long, env = "BATON_ACK_TIMEOUT_MS")]
    pub ack_timeout_ms: Option<u64>,
    /// Most events one task may hold before its agent is stopped and the
    /// task fails with EVENT_LIMIT_EXCEEDED (default 10000).
    #[arg(long, env = "BATON_MAX_TASK_EVENTS")]
    pub max_task_events: Option<u64>,
    /// Longest a task's stored record may grow, in bytes, before its agent
    /// is stopped and the task fails with TASK_SIZE_EXCEEDED (default 64 MiB).
    #[arg(long, env = "BATON_MAX_TASK_BYTES")]
    pub max_task_bytes: Option<usize>,
    /// When a handoff's target never acknowledges, leave the task
    /// INPUT_REQUIRED (ESCALATED) instead of failing it.
    #[arg(long, env = "BATON_ESCALATE")]
    pub escalate: bool,
    /// Directory of AgentCards registered at start-up (default ./agent-cards).
    #[arg(long, env = "BATON_AGENT_CARDS")]
    pub agent_cards: Option<PathBuf>,
    /// Seconds between health checks of registered agents.
    #[arg(long, env = "BATON_HEALTH_INTERVAL_SECS")]
    pub health_interval_secs: Option<u64>,
    /// Turn push notifications off (push methods then answer -32003).
    #[arg(long, env = "BATON_DISABLE_PUSH")]
    pub disable_push: bool,
    /// Agency API keys file, managed with `baton keys` (default ./baton-keys.json).
    #[arg(long, env = "BATON_KEYS_FILE")]
    pub keys_file: Option<PathBuf>,
    /// Request-serving threads (default: one per core but one, at least
    /// one; the ledger's log flusher and applier run on threads of their own).
    #[arg(long, env = "BATON_WORKERS")]
    pub workers: Option<usize>,
    /// Extra agency keys, `agency=KEY,...`: hashed in memory, never written.
    #[arg(long, env = "BATON_API_KEYS", hide_env_values = true)]
    pub api_keys: Option<String>,
    /// Check the configuration, print it, and exit.
    #[arg(long)]
    pub validate_config: bool,
}

/// Settings as written in `baton.toml` (kebab-case keys).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct FileConfig {
    listen: Option<String>,
    data: Option<PathBuf>,
    public_url: Option<String>,
    default_agent: Option<String>,
    allow_upstream: Option<Vec<String>>,
    allow_webhooks: Option<Vec<String>>,
    tls_ca: Option<PathBuf>,
    max_body_bytes: Option<usize>,
    read_timeout_secs: Option<u64>,
    write_timeout_secs: Option<u64>,
    max_connections: Option<usize>,
    max_connections_per_address: Option<usize>,
    log_format: Option<String>,
    shutdown_grace_secs: Option<u64>,
    task_timeout_secs: Option<u64>,
    max_hops: Option<u32>,
    ack_timeout_ms: Option<u64>,
    max_task_events: Option<u64>,
    max_task_bytes: Option<usize>,
    escalate: Option<bool>,
    disable_push: Option<bool>,
    /// `[[route]]` tables: the routing rules of `/a2a`.
    #[serde(default)]
    route: Vec<crate::handoff::routing::RouteRule>,
    agent_cards: Option<PathBuf>,
    health_interval_secs: Option<u64>,
    keys_file: Option<PathBuf>,
    workers: Option<usize>,
}

/// Log output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// The validated configuration.
#[derive(Clone, Debug)]
pub struct Config {
    /// Listen address.
    pub listen: SocketAddr,
    /// Ledger directory.
    pub data_dir: PathBuf,
    /// Public base URL, when set; else derived from the bound port.
    pub public_url: Option<String>,
    /// Default agent id.
    pub default_agent: String,
    /// Internal networks allowed for outbound connections.
    pub allow_upstream: Vec<IpNet>,
    /// Internal networks allowed for push webhooks.
    pub allow_webhooks: Vec<IpNet>,
    /// The roots outbound `https` connections are verified against.
    pub tls: ClientTls,
    /// Request body cap.
    pub max_body_bytes: usize,
    /// Bounds on inbound connections and on a request's arrival.
    pub connections: ConnectionLimits,
    /// Log format.
    pub log_format: LogFormat,
    /// Bound on a stop, from its signal.
    pub shutdown_grace: Duration,
    /// Blocking SendMessage bound, and the longest deadline of a task.
    pub task_timeout: Duration,
    /// Largest hop count of a line of work.
    pub max_hops: u32,
    /// How long a handoff's target may take to acknowledge.
    pub ack_timeout: Duration,
    /// Most events one task may hold.
    pub max_task_events: u64,
    /// Longest a task's stored record may grow, in bytes.
    pub max_task_bytes: usize,
    /// An unavailable target escalates to the caller instead of failing.
    pub escalate: bool,
    /// Push notifications are offered.
    pub push_enabled: bool,
    /// Cards registered at start-up.
    pub agent_cards_dir: PathBuf,
    /// Routing rules for `/a2a` calls without a tenant (`[[route]]`).
    pub routing: crate::handoff::routing::RoutingRules,
    /// Between health checks of registered agents.
    pub health_interval: Duration,
    /// The file the settings came from, if any.
    pub config_file: Option<PathBuf>,
    /// The agency API keys file (it need not exist: no file, no keys).
    pub keys_file: PathBuf,
    /// `BATON_API_KEYS`: keys given at start-up, kept out of `Debug` output.
    pub api_keys: Option<Secret>,
    /// Threads of the async runtime that serves requests.
    pub workers: usize,
}

/// A setting that must not appear in logs or `--validate-config` output;
/// `Option<Secret>::as_deref()` gives the text.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps `text`.
    pub fn new(text: impl Into<String>) -> Self {
        Self(text.into())
    }
}

impl std::ops::Deref for Secret {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// Every problem found in the settings.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration:\n  - {}", .0.join("\n  - "))]
pub struct ConfigError(pub Vec<String>);

fn parse_network(text: &str) -> Result<IpNet, String> {
    let text = text.trim();
    text.parse::<IpNet>()
        .or_else(|_| text.parse::<IpAddr>().map(IpNet::from))
        .map_err(|_| format!("{text:?} is not a CIDR or an IP address"))
}

impl Config {
    /// Merges flags/env over the file over defaults. The default agent must
    /// be one of `builtin_agents` or have its card in the agent-cards directory.
    pub fn load(args: &ServeArgs, builtin_agents: &[&str]) -> Result<Self, ConfigError> {
        let mut errors = Vec::new();
        let (file, config_file) = match read_file(args.config.as_deref()) {
            Ok(found) => found,
            Err(err) => {
                errors.push(err);
                (FileConfig::default(), args.config.clone())
            }
        };

        let listen_text = args
            .listen
            .clone()
            .or(file.listen)
            .unwrap_or_else(|| "127.0.0.1:8080".into());
        let listen = listen_text.parse().unwrap_or_else(|_| {
            errors.push(format!(
                "listen: {listen_text:?} is not an address like 127.0.0.1:8080"
            ));
            SocketAddr::from(([127, 0, 0, 1], 8080))
        });

        let public_url = args.public_url.clone().or(file.public_url).map(|url| {
            let trimmed = url.trim_end_matches('/').to_string();
            match reqwest::Url::parse(&trimmed) {
                Ok(parsed) if matches!(parsed.scheme(), "http" | "https") => {}
                _ => errors.push(format!("public-url: {url:?} is not an http(s) URL")),
            }
            trimmed
        });

        let agent_cards_dir = args
            .agent_cards
            .clone()
            .or(file.agent_cards.clone())
            .unwrap_or_else(|| PathBuf::from("./agent-cards"));
        let mut known_agents: Vec<String> = builtin_agents.iter().map(|s| s.to_string()).collect();
        known_agents.extend(card_file_ids(&agent_cards_dir));
        let default_agent = args
            .default_agent
            .clone()
            .or(file.default_agent)
            .unwrap_or_else(|| "echo".into());
        if !known_agents.contains(&default_agent) {
            errors.push(format!(
                "default-agent: {default_agent:?} is not an agent (known: {})",
                known_agents.join(", ")
            ));
        }

        let mut networks = |given: Option<Vec<String>>, setting: &str| -> Option<Vec<IpNet>> {
            let given = given?;
            let parsed = given
                .iter()
                .filter(|s| !s.trim().is_empty())
                .filter_map(|s| {
                    parse_network(s)
                        .map_err(|e| errors.push(format!("{setting}: {e}")))
                        .ok()
                })
                .collect();
            Some(parsed)
        };
        let allow_upstream: Vec<IpNet> = networks(
            args.allow_upstream.clone().or(file.allow_upstream),
            "allow-upstream",
        )
        .unwrap_or_default();
        let allow_webhooks = networks(
            args.allow_webhooks.clone().or(file.allow_webhooks),
            "allow-webhooks",
        )
        .unwrap_or_else(|| allow_upstream.clone());

        let tls = match args.tls_ca.clone().or(file.tls_ca) {
            Some(path) => ClientTls::with_ca_file(&path).unwrap_or_else(|err| {
                errors.push(format!("tls-ca: {err}"));
                ClientTls::default()
            }),
            None => ClientTls::default(),
        };

        let max_body_bytes = positive(
            args.max_body_bytes
                .or(file.max_body_bytes)
                .unwrap_or(4 * 1024 * 1024),
            "max-body-bytes",
            &mut errors,
        );

        let read_timeout_secs = positive(
            args.read_timeout_secs
                .or(file.read_timeout_secs)
                .unwrap_or(DEFAULT_READ_TIMEOUT.as_secs()),
            "read-timeout-secs",
            &mut errors,
        );
        let write_timeout_secs = positive(
            args.write_timeout_secs
                .or(file.write_timeout_secs)
                .unwrap_or(DEFAULT_WRITE_TIMEOUT.as_secs()),
            "write-timeout-secs",
            &mut errors,
        );
        let max_connections = positive(
            args.max_connections
                .or(file.max_connections)
                .unwrap_or(DEFAULT_MAX_CONNECTIONS),
            "max-connections",
            &mut errors,
        );
        let max_per_address = args
            .max_connections_per_address
            .or(file.max_connections_per_address)
            .map_or(usize::MAX, |max| {
                positive(max, "max-connections-per-address", &mut errors)
            });

        let log_format = match args
            .log_format
            .clone()
            .or(file.log_format)
            .unwrap_or_else(|| "text".into())
            .as_str()
        {
            "text" => LogFormat::Text,
            "json" => LogFormat::Json,
            other => {
                errors.push(format!("log-format: {other:?} is not text or json"));
                LogFormat::Text
            }
        };

        let task_timeout_secs = positive(
            args.task_timeout_secs
                .or(file.task_timeout_secs)
                .unwrap_or(300),
            "task-timeout-secs",
            &mut errors,
        );

        let max_hops = positive(
            args.max_hops.or(file.max_hops).unwrap_or(5),
            "max-hops",
            &mut errors,
        );
        let ack_timeout_ms = positive(
            args.ack_timeout_ms.or(file.ack_timeout_ms).unwrap_or(5000),
            "ack-timeout-ms",
            &mut errors,
        );

        let max_task_events = args
            .max_task_events
            .or(file.max_task_events)
            .unwrap_or(crate::gateway::DEFAULT_MAX_TASK_EVENTS);
        if max_task_events < MIN_TASK_EVENTS {
            errors.push(format!(
                "max-task-events: must be at least {MIN_TASK_EVENTS}"
            ));
        }
        let max_task_bytes = args
            .max_task_bytes
            .or(file.max_task_bytes)
            .unwrap_or(crate::gateway::DEFAULT_MAX_TASK_BYTES);
        if max_task_bytes < MIN_TASK_BYTES {
            errors.push(format!("max-task-bytes: must be at least {MIN_TASK_BYTES}"));
        } else if max_task_bytes < max_body_bytes {
            // Else a new task's first message alone could pass its limit.
            errors.push(format!(
                "max-task-bytes: must be at least max-body-bytes ({max_body_bytes}), so that a \
                 task holds any message Baton takes"
            ));
        }

        let workers = args
            .workers
            .or(file.workers)
            .unwrap_or_else(default_workers);
        if !(1..=MAX_WORKERS).contains(&workers) {
            errors.push(format!("workers: must be between 1 and {MAX_WORKERS}"));
        }

        let api_keys = args.api_keys.clone().map(Secret);
        if let Some(Err(bad)) = api_keys.as_deref().map(crate::auth::check_env_keys) {
            errors.extend(bad.into_iter().map(|e| format!("api-keys: {e}")));
        }

        let routing = crate::handoff::routing::RoutingRules::compile(&file.route).unwrap_or_else(
            |problems| {
                errors.extend(problems);
                Default::default()
            },
        );

        if !errors.is_empty() {
            return Err(ConfigError(errors));
        }
        Ok(Self {
            listen,
            data_dir: args
                .data
                .clone()
                .or(file.data)
                .unwrap_or_else(|| PathBuf::from("./baton-data")),
            public_url,
            default_agent,
            allow_upstream,
            allow_webhooks,
            tls,
            max_body_bytes,
            connections: ConnectionLimits {
                read_timeout: Duration::from_secs(read_timeout_secs),
                write_timeout: Duration::from_secs(write_timeout_secs),
                max_connections,
                max_per_address,
            },
            log_format,
            shutdown_grace: Duration::from_secs(
                args.shutdown_grace_secs
                    .or(file.shutdown_grace_secs)
                    .unwrap_or(10),
            ),
            task_timeout: Duration::from_secs(task_timeout_secs),
            max_hops,
            ack_timeout: Duration::from_millis(ack_timeout_ms),
            max_task_events,
            max_task_bytes,
            escalate: args.escalate || file.escalate.unwrap_or(false),
            push_enabled: !(args.disable_push || file.disable_push.unwrap_or(false)),
            agent_cards_dir,
            routing,
            health_interval: Duration::from_secs(
                args.health_interval_secs
                    .or(file.health_interval_secs)
                    .unwrap_or(30)
                    .max(1),
            ),
            config_file,
            keys_file: args
                .keys_file
                .clone()
                .or(file.keys_file)
                .unwrap_or_else(|| PathBuf::from(crate::auth::DEFAULT_KEYS_FILE)),
            api_keys,
            workers,
        })
    }
}

/// `value`, with an error naming `setting` on `errors` when it is zero.
fn positive<T: Default + PartialEq>(value: T, setting: &str, errors: &mut Vec<String>) -> T {
    if value == T::default() {
        errors.push(format!("{setting}: must be positive"));
    }
    value
}

/// The fewest events per task accepted: a task's first write alone may
/// hold 65 (the agent's queue of 64 and the task's snapshot), and a lower
/// limit would cut ordinary tasks at their creation.
const MIN_TASK_EVENTS: u64 = 100;

/// The shortest record limit accepted (1 MiB): below it, ordinary results
/// and long conversations would fail.
const MIN_TASK_BYTES: usize = 1024 * 1024;

/// The most request-serving threads accepted: far more than cores only adds
/// thread overhead, and a mistyped value must not start thousands.
const MAX_WORKERS: usize = 1024;

/// One request-serving thread per core but one, at least one and at most
/// `MAX_WORKERS` (1024): the spare core is left to the ledger's log flusher
/// (at a raised priority where allowed), applier and sled I/O threads, which
/// then preempt the workers less. On two cores one worker cost 55–61 µs of
/// CPU per request at concurrency 16 against 62–66 µs for two, and served
/// more at concurrency 16 and 1, in five of five alternated pairs (README history,
/// round 32). At concurrency 64, where round 28 had found two better, one
/// served 1–14 % less in four pairs and 17 % more in one.
pub fn default_workers() -> usize {
    workers_for(std::thread::available_parallelism().ok())
}

/// [`default_workers`] on a machine with `cores` (one when unknown); apart
/// so that tests can try core counts this machine does not have.
fn workers_for(cores: Option<std::num::NonZeroUsize>) -> usize {
    cores.map_or(1, |cores| (cores.get() - 1).clamp(1, MAX_WORKERS))
}

/// Ids of the cards in an agent-cards directory (file stems of `*.json`).
fn card_file_ids(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "json"))
        .filter_map(|path| path.file_stem()?.to_str().map(str::to_string))
        .collect()
}

/// Reads the named file, or `./baton.toml` when it exists.
fn read_file(path: Option<&Path>) -> Result<(FileConfig, Option<PathBuf>), String> {
    let path = match path {
        Some(path) => path.to_path_buf(),
        None => {
            let default = PathBuf::from("baton.toml");
            if !default.exists() {
                return Ok((FileConfig::default(), None));
            }
            default
        }
    };
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("config: cannot read {}: {e}", path.display()))?;
    let file = toml::from_str(&text).map_err(|e| format!("config: {}: {e}", path.display()))?;
    Ok((file, Some(path)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_apply() {
        let config = Config::load(&ServeArgs::default(), &["echo"]).unwrap();
        assert_eq!(config.listen, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(config.default_agent, "echo");
        assert_eq!(config.max_body_bytes, 4 * 1024 * 1024);
    }

    #[test]
    fn workers_default_to_the_cores_but_one_and_are_bounded() {
        let config = Config::load(&ServeArgs::default(), &["echo"]).unwrap();
        // Wiring only: what the default is comes from the table below.
        assert_eq!(config.workers, default_workers());
        assert_eq!(workers_for(None), 1, "cores unknown");
        for (cores, workers) in [
            (1, 1),
            (2, 1),
            (3, 2),
            (1024, 1023),
            (1025, 1024),
            (1026, 1024),
            (5000, 1024),
        ] {
            let given = std::num::NonZeroUsize::new(cores);
            assert_eq!(workers_for(given), workers, "{cores} cores");
        }

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("baton.toml");
        std::fs::write(&path, "workers = 3\n").unwrap();
        let from_file = ServeArgs {
            config: Some(path),
            ..ServeArgs::default()
        };
        assert_eq!(Config::load(&from_file, &["echo"]).unwrap().workers, 3);
        let flag_over_file = ServeArgs {
            workers: Some(2),
            ..from_file
        };
        assert_eq!(Config::load(&flag_over_file, &["echo"]).unwrap().workers, 2);

        let none = ServeArgs {
            workers: Some(0),
            ..ServeArgs::default()
        };
        let err = Config::load(&none, &["echo"]).unwrap_err();
        assert!(
            err.to_string().contains("workers: must be between 1 and"),
            "{err}"
        );
        let too_many = ServeArgs {
            workers: Some(MAX_WORKERS + 1),
            ..ServeArgs::default()
        };
        assert!(Config::load(&too_many, &["echo"]).is_err());
    }

    #[test]
    fn connection_and_task_limits_default_and_must_be_positive() {
        let config = Config::load(&ServeArgs::default(), &["echo"]).unwrap();
        assert_eq!(config.connections, ConnectionLimits::default());
        let args = ServeArgs {
            read_timeout_secs: Some(5),
            write_timeout_secs: Some(7),
            max_connections: Some(64),
            max_connections_per_address: Some(8),
            ..ServeArgs::default()
        };
        let config = Config::load(&args, &["echo"]).unwrap();
        assert_eq!(config.connections.read_timeout, Duration::from_secs(5));
        assert_eq!(config.connections.write_timeout, Duration::from_secs(7));
        assert_eq!(config.connections.max_connections, 64);
        assert_eq!(config.connections.max_per_address, 8);
        assert_eq!(
            config.max_task_events,
            crate::gateway::DEFAULT_MAX_TASK_EVENTS
        );
        assert_eq!(
            config.max_task_bytes,
            crate::gateway::DEFAULT_MAX_TASK_BYTES
        );
        let zero = ServeArgs {
            read_timeout_secs: Some(0),
            write_timeout_secs: Some(0),
            max_connections: Some(0),
            max_connections_per_address: Some(0),
            max_task_events: Some(0),
            max_task_bytes: Some(1024 * 1024 - 1),
            ..ServeArgs::default()
        };
        let err = Config::load(&zero, &["echo"]).unwrap_err();
        assert_eq!(
            err.0,
            [
                "read-timeout-secs: must be positive",
                "write-timeout-secs: must be positive",
                "max-connections: must be positive",
                "max-connections-per-address: must be positive",
                "max-task-events: must be at least 100",
                "max-task-bytes: must be at least 1048576",
            ],
        );
        let smaller_than_a_body = ServeArgs {
            max_task_bytes: Some(2 * 1024 * 1024),
            ..ServeArgs::default()
        };
        let err = Config::load(&smaller_than_a_body, &["echo"]).unwrap_err();
        assert_eq!(
            err.0,
            [
                "max-task-bytes: must be at least max-body-bytes (4194304), so that a task \
              holds any message Baton takes"
            ],
        );
        let with_a_smaller_body = ServeArgs {
            max_body_bytes: Some(2 * 1024 * 1024),
            ..smaller_than_a_body
        };
        let config = Config::load(&with_a_smaller_body, &["echo"]).unwrap();
        assert_eq!(config.max_task_bytes, 2 * 1024 * 1024);
    }

    #[test]
    fn webhooks_reach_the_upstream_networks_unless_given_their_own() {
        let args = ServeArgs {
            allow_upstream: Some(vec!["10.0.0.0/8".into(), "127.0.0.1".into()]),
            ..ServeArgs::default()
        };
        let config = Config::load(&args, &["echo"]).unwrap();
        let upstream: Vec<IpNet> = vec![
            "10.0.0.0/8".parse().unwrap(),
            "127.0.0.1/32".parse().unwrap(),
        ];
        assert_eq!(config.allow_upstream, upstream);
        assert_eq!(config.allow_webhooks, upstream);
        let none = ServeArgs {
            allow_webhooks: Some(vec![String::new()]),
            ..args.clone()
        };
        let config = Config::load(&none, &["echo"]).unwrap();
        assert_eq!(config.allow_upstream, upstream);
        assert!(config.allow_webhooks.is_empty());
        let own = ServeArgs {
            allow_webhooks: Some(vec!["192.168.1.0/24".into()]),
            ..args.clone()
        };
        let config = Config::load(&own, &["echo"]).unwrap();
        assert_eq!(
            config.allow_webhooks,
            ["192.168.1.0/24".parse::<IpNet>().unwrap()]
        );
        let bad = ServeArgs {
            allow_webhooks: Some(vec!["nowhere".into()]),
            ..args
        };
        let err = Config::load(&bad, &["echo"]).unwrap_err();
        assert_eq!(
            err.0,
            [r#"allow-webhooks: "nowhere" is not a CIDR or an IP address"#]
        );
    }

    #[test]
    fn every_error_is_reported() {
        let args = ServeArgs {
            listen: Some("nowhere".into()),
            default_agent: Some("ghost".into()),
            allow_upstream: Some(vec!["not-a-net".into()]),
            log_format: Some("xml".into()),
            tls_ca: Some("no-such-ca.pem".into()),
            ..ServeArgs::default()
        };
        let err = Config::load(&args, &["echo"]).unwrap_err();
        assert_eq!(err.0.len(), 5, "{err}");
        assert!(
            err.0
                .iter()
                .any(|e| e.starts_with("tls-ca: cannot read the TLS CA file no-such-ca.pem")),
            "{err}"
        );
    }

    #[test]
    fn the_default_agent_may_be_a_card_in_the_agent_cards_directory() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("billing.json"), "{}").unwrap();
        let args = ServeArgs {
            agent_cards: Some(dir.path().to_path_buf()),
            default_agent: Some("billing".into()),
            ..ServeArgs::default()
        };
        assert!(Config::load(&args, &["echo"]).is_ok());
        let args = ServeArgs {
            default_agent: Some("payroll".into()),
            ..args
        };
        assert!(Config::load(&args, &["echo"]).is_err());
    }

    #[test]
    fn file_settings_sit_under_flags() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("baton.toml");
        std::fs::write(
            &path,
            "listen = \"127.0.0.1:9000\"\ndefault-agent = \"scenario\"\n",
        )
        .unwrap();
        let args = ServeArgs {
            config: Some(path),
            default_agent: Some("echo".into()),
            ..ServeArgs::default()
        };
        let config = Config::load(&args, &["echo", "scenario"]).unwrap();
        assert_eq!(config.listen.port(), 9000);
        assert_eq!(config.default_agent, "echo");
    }

    #[test]
    fn keys_settings() {
        let config = Config::load(&ServeArgs::default(), &["echo"]).unwrap();
        assert_eq!(config.keys_file, PathBuf::from("./baton-keys.json"));
        assert!(config.api_keys.is_none());

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("baton.toml");
        std::fs::write(&path, "keys-file = \"/etc/baton/keys.json\"\n").unwrap();
        let args = ServeArgs {
            config: Some(path.clone()),
            api_keys: Some("acme=SECRET1".into()),
            ..ServeArgs::default()
        };
        let config = Config::load(&args, &["echo"]).unwrap();
        assert_eq!(config.keys_file, PathBuf::from("/etc/baton/keys.json"));
        assert_eq!(config.api_keys.as_deref(), Some("acme=SECRET1"));
        assert!(
            !format!("{config:?}").contains("SECRET1"),
            "keys stay out of Debug"
        );

        let args = ServeArgs {
            config: Some(path),
            keys_file: Some("flag.json".into()),
            api_keys: Some("acme=SECRET1,nokey,=SECRET2".into()),
            ..ServeArgs::default()
        };
        let err = Config::load(&args, &["echo"]).unwrap_err();
        assert_eq!(err.0.len(), 2, "{err}");
        assert!(err.0[0].starts_with("api-keys: entry 2"), "{err}");
        assert!(!err.to_string().contains("SECRET"), "{err}");
    }
}
