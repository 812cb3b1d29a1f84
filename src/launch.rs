//! Assembly of a running Baton from a `Config`: the ledger, the agents, push
//! delivery, the listener, and the shutdown signals.

use crate::agents;
use crate::config::Config;
use crate::gateway::{Gateway, GatewaySettings};
use crate::netguard::OutboundPolicy;
use crate::push::{PushDispatcher, PushSettings};
use crate::registry::Directory;
use crate::server::{self, AppState, ServerSettings};
use crate::store::Ledger;
use anyhow::Context as _;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// The owner of the agents Baton itself provides.
pub const LOCAL_OWNER: &str = "local";

/// Ids of the built-in agents, for configuration checks.
pub fn builtin_agent_ids() -> Vec<&'static str> {
    vec!["echo", "scenario"]
}

/// Runs Baton until SIGTERM or Ctrl-C, then drains and closes the ledger.
pub async fn serve(config: Config) -> anyhow::Result<()> {
    let ledger = Arc::new(
        Ledger::open(&config.data_dir)
            .with_context(|| format!("opening the ledger in {}", config.data_dir.display()))?,
    );
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("binding {}", config.listen))?;
    let bound = listener.local_addr()?;
    let public_url = config
        .public_url
        .clone()
        .unwrap_or_else(|| format!("http://localhost:{}", bound.port()));

    let policy = OutboundPolicy {
        allow: config.allow_upstream.clone(),
    };
    let push = PushDispatcher::start(&ledger, policy, PushSettings::default());
    let shutdown = CancellationToken::new();
    let gateway = Gateway::new(
        ledger.clone(),
        Arc::new(Directory::with_agents(
            &public_url,
            config.push_enabled,
            LOCAL_OWNER,
            agents::builtin_agents(),
        )),
        push,
        GatewaySettings {
            task_timeout: config.task_timeout,
            push_enabled: config.push_enabled,
        },
        shutdown,
    );
    let recovered = gateway.recover_in_flight().await?;
    if recovered > 0 {
        tracing::info!(
            recovered,
            "picked up tasks that were in flight at the last stop"
        );
    }
    let state = AppState::new(
        gateway,
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
    server::run(listener, state, shutdown_signal(), config.shutdown_grace).await?;
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
