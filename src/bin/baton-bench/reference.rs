//! The reference proxy: the minimal stateless axum + reqwest proxy that
//! issue 5 measures Baton against. It parses and re-serializes the JSON-RPC
//! body each way and keeps no state, so its CPU time per request and its
//! throughput show what this machine charges for a proxy hop at all; Baton's
//! figures are printed beside it. It runs as this binary in a separate
//! process (`--reference-proxy URL`), so /proc gives its CPU time alone.

use crate::baton_process::{announced_addresses, first_address};
use crate::procfs;
use anyhow::{Context as _, bail};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The proxy's runtime workers: tokio's default of one per core, as issue 5
/// ran it, so that its CPU per request calibrates the machine against the
/// issue's; Baton's own default leaves a core to its ledger.
pub fn workers() -> usize {
    procfs::cores()
}

/// What the proxy prints once bound.
const LISTENING: &str = "reference proxy listening on ";

/// Longest the proxy may take to bind.
const START_LIMIT: Duration = Duration::from_secs(20);

#[derive(Clone)]
struct Upstream {
    client: reqwest::Client,
    url: String,
}

/// Serves the proxy on a free loopback port, forwarding every POST `/a2a`
/// to `upstream_url`, until the process is killed.
pub async fn serve(upstream_url: String) -> anyhow::Result<()> {
    let upstream = Upstream {
        client: reqwest::Client::new(),
        url: upstream_url,
    };
    let app = axum::Router::new()
        .route("/a2a", axum::routing::post(forward))
        .with_state(upstream);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("{LISTENING}{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}

async fn forward(State(upstream): State<Upstream>, body: axum::body::Bytes) -> Response {
    let relay = async {
        let request: serde_json::Value = serde_json::from_slice(&body)?;
        let reply = upstream
            .client
            .post(&upstream.url)
            .header(header::CONTENT_TYPE, "application/json")
            .body(serde_json::to_vec(&request)?)
            .send()
            .await?
            .bytes()
            .await?;
        let reply: serde_json::Value = serde_json::from_slice(&reply)?;
        anyhow::Ok(serde_json::to_vec(&reply)?)
    };
    match relay.await {
        Ok(json) => ([(header::CONTENT_TYPE, "application/json")], json).into_response(),
        Err(err) => (StatusCode::BAD_GATEWAY, err.to_string()).into_response(),
    }
}

/// The proxy running as a child process; killed by its PID when dropped.
pub struct ReferenceProxy {
    child: Child,
    /// Its listen address.
    pub addr: SocketAddr,
}

impl ReferenceProxy {
    /// Starts this executable as the proxy in front of `upstream_url`.
    pub async fn start(upstream_url: &str) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("locating this executable")?;
        let mut child = Command::new(exe)
            .args(["--reference-proxy", upstream_url])
            // Explicit, so that an inherited TOKIO_WORKER_THREADS cannot change it.
            .env("TOKIO_WORKER_THREADS", workers().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting the reference proxy")?;
        let stdout = child.stdout.take().context("no stdout")?;
        let announced = announced_addresses(stdout, LISTENING);
        let mut proxy = Self {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        };
        let alive = || match proxy.child.try_wait()? {
            Some(status) => bail!("the reference proxy exited early ({status})"),
            None => Ok(()),
        };
        let Some(addr) = first_address(&announced, START_LIMIT, alive).await? else {
            bail!("the reference proxy did not bind within {START_LIMIT:?}");
        };
        proxy.addr = addr;
        Ok(proxy)
    }

    /// CPU time used so far, in clock ticks.
    pub fn cpu_ticks(&self) -> anyhow::Result<u64> {
        procfs::cpu_ticks(self.child.id())
    }
}

impl Drop for ReferenceProxy {
    fn drop(&mut self) {
        // Stateless: nothing to flush, so SIGKILL to its PID is a clean stop.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
