//! Baton as a separate process: the `baton` binary beside this one, serving
//! on 127.0.0.1 over a ledger directory the benchmark owns, stopped by its
//! PID (SIGTERM, then SIGKILL) and never by name.

use crate::client::Connection;
use crate::procfs;
use anyhow::{Context as _, bail};
use std::io::{BufRead as _, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

/// Longest Baton may take to open its ledger and answer `/readyz`: a
/// million stored tasks take a while to open.
const START_LIMIT: Duration = Duration::from_secs(180);

/// Longest Baton may take to stop after SIGTERM before it is killed.
const STOP_LIMIT: Duration = Duration::from_secs(15);

/// The `baton` binary: `explicit` (`--baton`) when given, else the one
/// built into the same directory as this one, rebuilt first when this runs
/// under `cargo run` so it matches the source.
pub fn locate_baton(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(path) = explicit {
        // Made absolute here: Baton runs in the bench's own work directory,
        // where a relative path would name nothing.
        return std::fs::canonicalize(path)
            .with_context(|| format!("--baton {}: no such binary", path.display()));
    }
    let exe = std::env::current_exe().context("locating this executable")?;
    let dir = exe.parent().context("this executable has no directory")?;
    let baton = dir.join("baton");
    // `cargo run --bin baton-bench` builds only this binary; build its sibling too.
    if let Some(cargo) = std::env::var_os("CARGO") {
        let mut build = Command::new(cargo);
        build.args(["build", "--quiet", "--bin", "baton"]);
        if dir.file_name().is_some_and(|name| name == "release") {
            build.arg("--release");
        }
        eprintln!("building the baton binary: {build:?}");
        let status = build.status().context("running cargo build --bin baton")?;
        if !status.success() {
            bail!("cargo build --bin baton failed: {status}");
        }
    }
    if !baton.exists() {
        bail!(
            "{} not found: build it with `cargo build --release --bins`, or pass --baton PATH",
            baton.display()
        );
    }
    Ok(baton)
}

/// Reads a child's stdout on a thread (draining it to the end) and passes
/// on the address of every line `prefix` + address.
pub fn announced_addresses(
    stdout: ChildStdout,
    prefix: &'static str,
) -> std::sync::mpsc::Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(addr) = line.strip_prefix(prefix) {
                let _ = tx.send(addr.trim().to_string());
            }
        }
    });
    rx
}

/// The first address `announced` passes on within `limit`, calling `alive`
/// (an error when the child exited) between polls; `None` on time-out.
pub async fn first_address(
    announced: &std::sync::mpsc::Receiver<String>,
    limit: Duration,
    mut alive: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<Option<SocketAddr>> {
    let started = Instant::now();
    while started.elapsed() <= limit {
        if let Ok(addr) = announced.try_recv() {
            let addr = addr
                .parse()
                .with_context(|| format!("bad listen address {addr}"))?;
            return Ok(Some(addr));
        }
        alive()?;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(None)
}

/// What a Baton process is started with.
pub struct BatonOptions<'a> {
    /// The binary.
    pub binary: &'a Path,
    /// Its working directory (no `baton.toml` or keys file there).
    pub work_dir: &'a Path,
    /// The sled ledger directory.
    pub data_dir: &'a Path,
    /// The `--agent-cards` directory.
    pub cards_dir: &'a Path,
    /// The `--default-agent`.
    pub default_agent: &'a str,
}

/// A running Baton.
pub struct BatonProcess {
    child: Option<Child>,
    /// Its listen address.
    pub addr: SocketAddr,
    /// Its process id.
    pub pid: u32,
    log: PathBuf,
}

impl BatonProcess {
    /// Starts Baton on a free loopback port and waits for `/readyz`.
    pub async fn start(options: &BatonOptions<'_>) -> anyhow::Result<Self> {
        let log = options.work_dir.join("baton.log");
        let log_file = std::fs::File::create(&log)?;
        let mut command = Command::new(options.binary);
        command
            .arg("serve")
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--data")
            .arg(options.data_dir)
            .arg("--agent-cards")
            .arg(options.cards_dir)
            .arg("--keys-file")
            .arg(options.work_dir.join("baton-keys.json"))
            .arg("--allow-upstream")
            .arg("127.0.0.0/8,::1")
            .arg("--default-agent")
            .arg(options.default_agent)
            .current_dir(options.work_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log_file);
        // Only the flags above configure it; said aloud, so that nobody
        // compares runs that differ only in a variable Baton never saw.
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("BATON_") {
                eprintln!(
                    "baton-bench: {} is not passed to Baton (only the bench's own flags configure it)",
                    name.to_string_lossy()
                );
                command.env_remove(name);
            }
        }
        let mut child = command
            .spawn()
            .with_context(|| format!("starting {}", options.binary.display()))?;
        let pid = child.id();
        let stdout = child.stdout.take().context("no stdout")?;
        let announced = announced_addresses(stdout, "baton listening on ");
        let mut process = Self {
            child: Some(child),
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            pid,
            log,
        };
        let started = Instant::now();
        let Some(addr) = first_address(&announced, START_LIMIT, || process.check_alive()).await?
        else {
            bail!(
                "Baton did not bind within {START_LIMIT:?}{}",
                process.log_tail()
            );
        };
        process.addr = addr;
        while !process.ready().await {
            process.check_alive()?;
            if started.elapsed() > START_LIMIT {
                bail!(
                    "Baton was not ready within {START_LIMIT:?}{}",
                    process.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(process)
    }

    async fn ready(&self) -> bool {
        let probe = async {
            let mut connection = Connection::open(self.addr).await?;
            let (status, _) = connection.get("/readyz").await?;
            anyhow::Ok(status.is_success())
        };
        matches!(
            tokio::time::timeout(Duration::from_secs(2), probe).await,
            Ok(Ok(true))
        )
    }

    fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Some(child) = self.child.as_mut() {
            if let Some(status) = child.try_wait()? {
                self.child = None;
                bail!("Baton exited early ({status}){}", self.log_tail());
            }
        }
        Ok(())
    }

    /// The last lines of Baton's log, to explain a failure.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines[lines.len().saturating_sub(15)..].join("\n");
        if tail.is_empty() {
            String::new()
        } else {
            format!("\n--- baton log (last lines) ---\n{tail}")
        }
    }

    /// CPU time used so far, in clock ticks.
    pub fn cpu_ticks(&self) -> anyhow::Result<u64> {
        procfs::cpu_ticks(self.pid)
    }

    /// Resident memory now and at peak.
    pub fn memory(&self) -> anyhow::Result<procfs::Memory> {
        procfs::memory(self.pid)
    }

    /// The ledger's log counters from `GET /metrics`, read with the bench's
    /// own client. Called where the /proc readings are, at a window's edge,
    /// outside async code; a busy Baton may take milliseconds to answer, so
    /// the load's other tasks move off this thread meanwhile.
    pub fn log_counters(&self) -> anyhow::Result<LogCounters> {
        let runtime = tokio::runtime::Handle::current();
        tokio::task::block_in_place(|| runtime.block_on(self.read_log_counters()))
    }

    async fn read_log_counters(&self) -> anyhow::Result<LogCounters> {
        let read = async {
            let mut connection = Connection::open(self.addr).await?;
            let (_, body) = connection.get("/metrics").await?;
            anyhow::Ok(body)
        };
        let body = tokio::time::timeout(METRICS_LIMIT, read)
            .await
            .context("GET /metrics took too long")??;
        LogCounters::parse(std::str::from_utf8(&body)?)
            .context("no ledger log counters in GET /metrics")
    }

    /// Stops Baton: SIGTERM to its PID, then SIGKILL after [`STOP_LIMIT`].
    pub fn stop(mut self) {
        self.stop_child();
    }

    fn stop_child(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if matches!(child.try_wait(), Ok(Some(_))) {
            return;
        }
        // std offers only SIGKILL; a graceful stop lets sled flush and close.
        let _ = Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .status();
        let deadline = Instant::now() + STOP_LIMIT;
        while Instant::now() < deadline {
            if matches!(child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Longest the bench waits on `GET /metrics`.
const METRICS_LIMIT: Duration = Duration::from_secs(2);

/// The ledger's group-commit counters, as Baton's `GET /metrics` gives them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogCounters {
    /// Writes made durable.
    pub durable_writes: u64,
    /// Synchronous log appends that made them so.
    pub syncs: u64,
}

impl LogCounters {
    /// Both counters' samples from a Prometheus text.
    fn parse(text: &str) -> Option<Self> {
        let sample = |name: &str| baton::metrics::sample_value(text, name)?.parse().ok();
        Some(Self {
            durable_writes: sample("baton_ledger_durable_writes_total")?,
            syncs: sample("baton_ledger_log_syncs_total")?,
        })
    }
}

impl Drop for BatonProcess {
    fn drop(&mut self) {
        self.stop_child();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_counters_are_read_from_their_samples() {
        let text = "HTTP/1.1 200 OK\r\n\r\n\
            # HELP baton_ledger_durable_writes_total Ledger writes.\n\
            # TYPE baton_ledger_durable_writes_total counter\n\
            baton_ledger_durable_writes_total 120\n\
            baton_ledger_log_syncs_total 41\n";
        assert_eq!(
            LogCounters::parse(text),
            Some(LogCounters {
                durable_writes: 120,
                syncs: 41
            })
        );
        assert_eq!(
            LogCounters::parse("baton_ledger_durable_writes_total 1\n"),
            None
        );
    }
}
