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
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::time::Instant;
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
    let stop = shutdown_signal();
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("binding {}", config.listen))?;
    run(config, listener, stop).await
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
    run_over(config, ledger, listener, stop).await
}

/// Runs Baton as [`run`] does, over a `ledger` already open (tests reach
/// into it); closes the ledger at the end.
async fn run_over(
    config: Config,
    ledger: Arc<Ledger>,
    listener: tokio::net::TcpListener,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let bound = listener.local_addr()?;
    let public_url = config
        .public_url
        .clone()
        .unwrap_or_else(|| format!("http://localhost:{}", bound.port()));

    let policy = OutboundPolicy {
        allow: config.allow_upstream.clone(),
        tls: config.tls.clone(),
    };
    let webhook_policy = OutboundPolicy {
        allow: config.allow_webhooks.clone(),
        ..policy.clone()
    };
    let push_settings = PushSettings {
        enabled: config.push_enabled,
        ..PushSettings::default()
    };
    let push = PushDispatcher::start(&ledger, webhook_policy, push_settings);
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
    registry.reserve_ids(config.routing.tenant_labels().map(str::to_string));
    let stored = registry.load()?;
    let from_files = registry
        .register_card_files(&config.agent_cards_dir, LOCAL_OWNER)
        .await?;
    tracing::info!(stored, from_files, "agents registered");
    let gateway = Gateway::new(
        ledger.clone(),
        directory,
        push.clone(),
        GatewaySettings {
            task_timeout: config.task_timeout,
            push_enabled: config.push_enabled,
            routing: Arc::new(config.routing.clone()),
            max_hops: config.max_hops,
            ack_timeout: config.ack_timeout,
            escalate: config.escalate,
            max_task_events: config.max_task_events,
            max_task_bytes: config.max_task_bytes,
            ..GatewaySettings::default()
        },
        shutdown.clone(),
    );
    let owed = push.catch_up(&ledger)?;
    if owed > 0 {
        tracing::info!(
            tasks = owed,
            "sending push notifications owed since before the last stop"
        );
    }
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
        shutdown.clone(),
    ));
    let state = AppState::new(
        gateway,
        registry,
        keys,
        ServerSettings {
            public_url: public_url.clone(),
            default_agent: config.default_agent.clone(),
            max_body_bytes: config.max_body_bytes,
            connections: config.connections.fit_open_files(),
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
    // One grace bounds the whole stop, from its signal: the connections'
    // drain, then the ledger's sync and the push drain share what is left.
    let stop_began = Arc::new(OnceLock::new());
    let stop = {
        let stop_began = stop_began.clone();
        async move {
            stop.await;
            let _ = stop_began.set(Instant::now());
        }
    };
    let grace = config.shutdown_grace;
    // Returns only after the stop, which has cancelled `shutdown`: the
    // drivers, streams and health checks are stopping.
    server::run(listener, state, stop, grace).await;
    let deadline = *stop_began.get_or_init(Instant::now) + grace;
    // What was made durable is also told to its webhooks: the writes made so
    // far first (their events are queued as they become durable), then their
    // notifications.
    if tokio::time::timeout_at(deadline, ledger.sync())
        .await
        .is_err()
    {
        tracing::warn!(?grace, "writes still not durable at the stop");
    }
    push.drain(deadline.saturating_duration_since(Instant::now()))
        .await;
    ledger.close();
    tracing::info!("stopped");
    Ok(())
}

/// Resolves on Ctrl-C or SIGTERM. On unix the handlers are installed at the
/// call, not at the first poll: the server polls it only once its accept loop
/// runs, after it announced it listens, and a SIGTERM before that would
/// take the default action and kill the process unsynced.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let interrupt = signal(SignalKind::interrupt());
        let terminate = signal(SignalKind::terminate());
        async move {
            let (mut interrupt, mut terminate) = match (interrupt, terminate) {
                (Ok(interrupt), Ok(terminate)) => (interrupt, terminate),
                (Err(err), _) | (_, Err(err)) => {
                    tracing::error!(%err, "cannot listen for SIGINT and SIGTERM");
                    return std::future::pending().await;
                }
            };
            tokio::select! {
                _ = interrupt.recv() => {}
                _ = terminate.recv() => {}
            }
        }
    }
    #[cfg(not(unix))]
    async {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ServeArgs;
    use serde_json::{Value, json};
    use std::time::Duration;

    /// A Baton over `ledger` (opened in `dir`) on an ephemeral loopback
    /// port, with the built-in agents and `echo` as the default; returns
    /// its base URL and what stops it.
    async fn serve_over(
        dir: &std::path::Path,
        ledger: &Arc<Ledger>,
    ) -> (String, tokio_util::sync::CancellationToken) {
        let empty_config = dir.join("baton.toml");
        std::fs::write(&empty_config, "").unwrap();
        let cards = dir.join("agent-cards");
        std::fs::create_dir_all(&cards).unwrap();
        let args = ServeArgs {
            listen: Some("127.0.0.1:0".into()),
            data: Some(dir.join("data")),
            config: Some(empty_config),
            agent_cards: Some(cards),
            keys_file: Some(dir.join("baton-keys.json")),
            shutdown_grace_secs: Some(1),
            ..ServeArgs::default()
        };
        let config = Config::load(&args, &builtin_agent_ids()).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let stop = tokio_util::sync::CancellationToken::new();
        tokio::spawn(run_over(
            config,
            ledger.clone(),
            listener,
            stop.clone().cancelled_owned(),
        ));
        crate::demo::wait_ready(&base).await.unwrap();
        (base, stop)
    }

    /// `GET /readyz`: its status and body.
    async fn readyz(base: &str) -> (u16, Value) {
        let reply = reqwest::get(format!("{base}/readyz")).await.unwrap();
        (reply.status().as_u16(), reply.json().await.unwrap())
    }

    /// The value of an unlabelled counter in `GET /metrics`.
    async fn counter(base: &str, name: &str) -> u64 {
        let text = reqwest::get(format!("{base}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let line = text
            .lines()
            .find_map(|line| line.strip_prefix(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} in {text}"));
        line.parse().unwrap()
    }

    /// A JSON-RPC call to `/a2a`, answered within 5 s.
    async fn call(base: &str, method: &str, params: Value) -> Value {
        let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
        let reply = reqwest::Client::new()
            .post(format!("{base}/a2a"))
            .header("A2A-Version", "1.0")
            .timeout(Duration::from_secs(5))
            .json(&body)
            .send()
            .await
            .expect("answered within 5 s");
        reply.json().await.unwrap()
    }

    fn hello(message_id: &str) -> Value {
        json!({"message": {"messageId": message_id, "role": "ROLE_USER", "parts": [{"text": "hi"}]}})
    }

    /// `reply` is -32603 LEDGER_UNAVAILABLE.
    fn assert_unavailable(reply: &Value) {
        assert_eq!(reply["error"]["code"], -32603, "{reply}");
        assert_eq!(reply["error"]["data"][0]["reason"], "LEDGER_UNAVAILABLE");
    }

    /// Polls `GET /readyz` for at most 5 s until it answers `status`.
    async fn until_readyz(base: &str, status: u16) -> Value {
        for _ in 0..500 {
            let (now, body) = readyz(base).await;
            if now == status {
                return body;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("/readyz did not answer {status} within 5 s");
    }

    /// Over HTTP: while the log cannot append, `/readyz` is 503 naming the
    /// error, a send is refused at once with LEDGER_UNAVAILABLE, and the
    /// failed appends are counted; once it can, all is served again.
    #[tokio::test]
    async fn a_failing_log_is_unready_and_refuses_sends_over_http() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Arc::new(Ledger::open(&dir.path().join("data")).unwrap());
        let (base, stop) = serve_over(dir.path(), &ledger).await;
        assert_eq!(readyz(&base).await.0, 200);

        let fault = ledger.fail_log(std::io::ErrorKind::StorageFull);
        // The log meets its failure at its next append.
        let pending = tokio::spawn({
            let ledger = ledger.clone();
            async move { ledger.put_raw(b"probe".to_vec(), b"1".to_vec()).await }
        });
        ledger.until_log_fails().await;
        let (status, body) = readyz(&base).await;
        assert_eq!(status, 503);
        assert!(
            body["reason"]
                .as_str()
                .unwrap()
                .contains("cannot make writes durable"),
            "{body}"
        );
        assert_unavailable(&call(&base, "SendMessage", hello("refused-1")).await);
        assert!(counter(&base, "baton_ledger_log_failed_appends_total").await > 0);

        drop(fault);
        pending.await.unwrap().unwrap();
        until_readyz(&base, 200).await;
        let served = call(&base, "SendMessage", hello("served-1")).await;
        assert_eq!(
            served["result"]["task"]["status"]["state"], "TASK_STATE_COMPLETED",
            "{served}"
        );
        stop.cancel();
    }

    /// The task id of a `SendMessage` reply.
    fn task_id(reply: &Value) -> String {
        let id = reply["result"]["task"]["id"].as_str();
        id.unwrap_or_else(|| panic!("a task: {reply}")).to_string()
    }

    /// Over HTTP: while writes cannot be applied to sled, the log keeps
    /// them and GetTask finds them, but `/readyz` is 503 naming the
    /// failure, listings and new sends get LEDGER_UNAVAILABLE and the
    /// failed attempts are counted. Once sled works again Baton is ready and
    /// serves, and a reopened ledger holds every task.
    #[tokio::test]
    async fn failing_sled_is_unready_but_loses_nothing_over_http() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let ledger = Arc::new(Ledger::open(&data).unwrap());
        let (base, stop) = serve_over(dir.path(), &ledger).await;

        let first = task_id(&call(&base, "SendMessage", hello("kept-1")).await);
        let fault = ledger.fail_sled(std::io::ErrorKind::Other);
        // Durable in the log; the applier meets the failure as it applies it.
        ledger
            .put_raw(b"probe".to_vec(), b"1".to_vec())
            .await
            .unwrap();
        let body = until_readyz(&base, 503).await;
        let reason = body["reason"].as_str().unwrap();
        assert!(reason.contains("cannot apply writes to sled"), "{body}");
        assert!(counter(&base, "baton_ledger_sled_failed_attempts_total").await > 0);
        let read = call(&base, "GetTask", json!({"id": first})).await;
        assert_eq!(
            read["result"]["status"]["state"], "TASK_STATE_COMPLETED",
            "{read}"
        );
        // A listing applies what is pending first, and says why it cannot.
        for (method, params) in [
            ("ListTasks", json!({})),
            ("SendMessage", hello("refused-1")),
        ] {
            assert_unavailable(&call(&base, method, params).await);
        }

        drop(fault);
        until_readyz(&base, 200).await;
        let second = task_id(&call(&base, "SendMessage", hello("kept-2")).await);
        stop.cancel();
        // The server closes the ledger as it stops, and lets go of it.
        crate::store::until("the stopped server lets go of the ledger", || {
            (Arc::strong_count(&ledger) == 1).then_some(())
        })
        .await;
        drop(ledger);
        let reopened = Ledger::open(&data).unwrap();
        for id in [&first, &second] {
            assert!(reopened.get(id).unwrap().is_some(), "{id} was kept");
        }
        reopened.close();
    }
}
