//! Assembly of a running Baton from a `Config`: the ledger, the agents, push
//! delivery, the listener, and the shutdown signals.

use crate::agents;
use crate::auth::KeyStore;
use crate::config::Config;
use crate::gateway::{Gateway, GatewaySettings};
use crate::netguard::OutboundPolicy;
use crate::protocol::AgentCard;
use crate::push::{PushDispatcher, PushSettings};
use crate::registry::fetch::CardFetcher;
use crate::registry::service::AgentFactory;
use crate::registry::{Directory, Registry};
use crate::server::{self, AppState, ServerSettings};
use crate::store::Ledger;
use crate::upstream::{RemoteAgent, UpstreamSettings};
use anyhow::Context as _;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The owner of the agents Baton itself provides.
pub const LOCAL_OWNER: &str = "local";

/// Ids of the built-in agents, for configuration checks.
pub fn builtin_agent_ids() -> Vec<&'static str> {
    vec!["echo", "scenario"]
}

/// Longest a card fetch may take.
const CARD_FETCH_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest card accepted.
const CARD_MAX_BYTES: usize = 1024 * 1024;

/// Registered cards are served by remote A2A agents, under `policy`.
pub fn remote_agents(policy: OutboundPolicy) -> AgentFactory {
    Arc::new(move |_id: &str, card: &AgentCard| {
        RemoteAgent::from_card(card.clone(), &policy, UpstreamSettings::default())
            .map(|agent| Arc::new(agent) as Arc<dyn agents::Agent>)
            .map_err(|e| e.to_string())
    })
}

/// Re-fetches every registered card each `interval` until shutdown. Cards
/// follow the keys: the first key added makes them declare the API-key
/// scheme (checked every second).
async fn health_checks(
    registry: Arc<Registry>,
    keys: KeyStore,
    interval: Duration,
    shutdown: CancellationToken,
) {
    // Apart: a health check waits on agents, and keys must not wait on it.
    let secured = async {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = shutdown.cancelled() => return,
            }
            registry.directory().set_secured(!keys.is_open());
        }
    };
    let checks = async {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = shutdown.cancelled() => return,
            }
            tokio::select! {
                () = registry.check_health() => {}
                _ = shutdown.cancelled() => return,
            }
        }
    };
    tokio::join!(secured, checks);
}

/// Runs Baton until SIGTERM or Ctrl-C, then drains and closes the ledger.
pub async fn serve(config: Config) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("binding {}", config.listen))?;
    run(config, listener, shutdown_signal()).await
}

/// Runs Baton on `listener` (`config.listen` is not used) until `stop`
/// resolves, then drains and closes the ledger. `baton demo` runs it in process.
pub async fn run(
    config: Config,
    listener: tokio::net::TcpListener,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let ledger = Arc::new(
        Ledger::open(&config.data_dir)
            .with_context(|| format!("opening the ledger in {}", config.data_dir.display()))?,
    );
    let bound = listener.local_addr()?;
    let public_url = config
        .public_url
        .clone()
        .unwrap_or_else(|| format!("http://localhost:{}", bound.port()));

    let policy = OutboundPolicy {
        allow: config.allow_upstream.clone(),
        tls: config.tls.clone(),
    };
    let push = PushDispatcher::start(&ledger, policy.clone(), PushSettings::default());
    let shutdown = CancellationToken::new();
    let keys = KeyStore::from_config(&config).context("loading API keys")?;
    let directory = Arc::new(Directory::new(&public_url, config.push_enabled));
    directory.set_secured(!keys.is_open());
    let registry = Arc::new(Registry::new(
        ledger.clone(),
        directory.clone(),
        CardFetcher::new(policy.clone(), CARD_FETCH_TIMEOUT, CARD_MAX_BYTES),
        remote_agents(policy),
    ));
    for handle in agents::builtin_agents() {
        registry.add_builtin(handle, LOCAL_OWNER);
    }
    let stored = registry.load()?;
    let from_files = registry
        .register_card_files(&config.agent_cards_dir, LOCAL_OWNER)
        .await?;
    tracing::info!(stored, from_files, "agents registered");
    let gateway = Gateway::new(
        ledger.clone(),
        directory,
        push,
        GatewaySettings {
            task_timeout: config.task_timeout,
            push_enabled: config.push_enabled,
            routing: Arc::new(config.routing.clone()),
            max_hops: config.max_hops,
            ack_timeout: config.ack_timeout,
            escalate: config.escalate,
            ..GatewaySettings::default()
        },
        shutdown.clone(),
    );
    let recovered = gateway.recover_in_flight().await?;
    if recovered > 0 {
        tracing::info!(
            recovered,
            "picked up tasks that were in flight at the last stop"
        );
    }
    tokio::spawn(health_checks(
        registry.clone(),
        keys.clone(),
        config.health_interval,
        shutdown,
    ));
    let state = AppState::new(
        gateway,
        registry,
        keys,
        ServerSettings {
            public_url: public_url.clone(),
            default_agent: config.default_agent.clone(),
            max_body_bytes: config.max_body_bytes,
        },
    );
    tracing::info!(
        listen = %bound,
        public_url = %public_url,
        data = %config.data_dir.display(),
        default_agent = %config.default_agent,
        "Baton listening"
    );
    // A line tests and scripts can wait for.
    println!("baton listening on {bound}");
    server::run(listener, state, stop, config.shutdown_grace).await?;
    ledger.close();
    tracing::info!("stopped");
    Ok(())
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(err) => {
                tracing::error!(%err, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = terminate => {}
    }
}
