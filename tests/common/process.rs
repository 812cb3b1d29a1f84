//! The `baton` binary as an operator runs it: `baton serve` child processes
//! on 127.0.0.1:0, found by the `baton listening on ADDR` line they print,
//! with their log lines kept for assertions, and bounded runs of one-shot
//! commands. Every wait is bounded and every process is killed on drop.
//!
//! Used as `#[path = "common/process.rs"] mod process;` by the tests that
//! run the binary (it depends on nothing else in `common`).
#![allow(dead_code)]

use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a process may take to start, answer, or exit.
pub const PROCESS_WAIT: Duration = Duration::from_secs(10);

/// How a `baton serve` process is started. The defaults: the `scenario`
/// agent serves `/a2a`, a 3 s shutdown grace, `RUST_LOG=warn`, and
/// `TCK_STREAMING_TIMEOUT=60` (the long-running scenario lasts 2 minutes).
pub struct ProcessBuilder {
    data: PathBuf,
    default_agent: String,
    shutdown_grace_secs: u64,
    env: BTreeMap<String, String>,
    args: Vec<OsString>,
    current_dir: Option<PathBuf>,
}

impl ProcessBuilder {
    /// Sets `--default-agent`.
    pub fn default_agent(mut self, id: &str) -> Self {
        self.default_agent = id.into();
        self
    }

    /// Sets `--shutdown-grace-secs`.
    pub fn shutdown_grace_secs(mut self, secs: u64) -> Self {
        self.shutdown_grace_secs = secs;
        self
    }

    /// Sets (or replaces) an environment variable of the process.
    pub fn env(mut self, name: &str, value: &str) -> Self {
        self.env.insert(name.into(), value.into());
        self
    }

    /// Adds command-line arguments after the defaults.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Runs the process in `dir` (where `./baton.toml`, `./agent-cards` and
    /// `./baton-keys.json` are looked up).
    pub fn current_dir(mut self, dir: &Path) -> Self {
        self.current_dir = Some(dir.to_path_buf());
        self
    }

    /// Starts the process and waits (bounded) for its listening line; panics
    /// with its log when it exits or stays silent instead.
    pub fn start(self) -> BatonProcess {
        let mut command = Command::new(env!("CARGO_BIN_EXE_baton"));
        command
            .args(["serve", "--listen", "127.0.0.1:0", "--default-agent"])
            .arg(&self.default_agent)
            .arg("--data")
            .arg(&self.data)
            .arg("--shutdown-grace-secs")
            .arg(self.shutdown_grace_secs.to_string())
            .args(&self.args)
            .envs(&self.env)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(dir) = &self.current_dir {
            command.current_dir(dir);
        }
        let mut child = command.spawn().expect("spawn baton");
        let logs = Arc::new(Mutex::new(String::new()));
        keep_lines(child.stderr.take().expect("stderr"), logs.clone());

        // The first stdout line names the address; the rest is drained.
        let (first_tx, first_rx) = mpsc::channel();
        let stdout = child.stdout.take().expect("stdout");
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let _ = first_tx.send(lines.next());
            for _ in lines {}
        });
        let mut process = BatonProcess {
            child,
            base: String::new(),
            http: reqwest::Client::builder()
                .timeout(PROCESS_WAIT)
                .build()
                .expect("HTTP client"),
            logs,
        };
        let line = match first_rx.recv_timeout(PROCESS_WAIT) {
            Ok(Some(Ok(line))) => line,
            other => {
                let status = process.stop_now();
                panic!(
                    "baton printed no listening line ({other:?}; {status:?}); its log:\n{}",
                    process.logs()
                );
            }
        };
        let Some(addr) = line.trim().strip_prefix("baton listening on ") else {
            process.stop_now();
            panic!("unexpected first line {line:?}");
        };
        process.base = format!("http://{addr}");
        process
    }
}

/// Appends each line read from `from` to `into`, echoing it to the test's
/// stderr (the test harness shows it when the test fails).
fn keep_lines(from: impl Read + Send + 'static, into: Arc<Mutex<String>>) {
    std::thread::spawn(move || {
        for line in BufReader::new(from).lines() {
            let Ok(line) = line else { break };
            eprintln!("{line}");
            let mut logs = into.lock().expect("log lock");
            logs.push_str(&line);
            logs.push('\n');
        }
    });
}

/// A `baton serve` child process.
pub struct BatonProcess {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// An HTTP client whose requests time out after [`PROCESS_WAIT`].
    pub http: reqwest::Client,
    logs: Arc<Mutex<String>>,
}

impl BatonProcess {
    /// A process over the ledger in `data`, with the defaults.
    pub fn builder(data: &Path) -> ProcessBuilder {
        ProcessBuilder {
            data: data.to_path_buf(),
            default_agent: "scenario".into(),
            shutdown_grace_secs: 3,
            env: [
                ("RUST_LOG".to_string(), "warn".to_string()),
                ("TCK_STREAMING_TIMEOUT".to_string(), "60".to_string()),
            ]
            .into(),
            args: Vec::new(),
            current_dir: None,
        }
    }

    /// Starts a process over the ledger in `data`, with the defaults.
    pub fn start(data: &Path) -> Self {
        Self::builder(data).start()
    }

    /// Full URL of a path.
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// The JSON-RPC reply of `method` posted to `path` (`/a2a`, `/registry`).
    pub async fn rpc(&self, path: &str, method: &str, params: Value) -> Value {
        self.rpc_keyed(None, path, method, params).await
    }

    /// As [`BatonProcess::rpc`], called with the API key `key`.
    pub async fn rpc_as(&self, key: &str, path: &str, method: &str, params: Value) -> Value {
        self.rpc_keyed(Some(key), path, method, params).await
    }

    async fn rpc_keyed(&self, key: Option<&str>, path: &str, method: &str, params: Value) -> Value {
        let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
        let mut request = self
            .http
            .post(self.url(path))
            .header("content-type", "application/json")
            .header("a2a-version", "1.0");
        if let Some(key) = key {
            request = request.header("authorization", format!("Bearer {key}"));
        }
        request
            .body(body.to_string())
            .send()
            .await
            .unwrap_or_else(|e| panic!("{method} at {path}: {e}"))
            .json()
            .await
            .unwrap_or_else(|e| panic!("{method} at {path}: no JSON reply: {e}"))
    }

    /// The result of `method` at `/a2a`; panics on an error reply.
    pub async fn call(&self, method: &str, params: Value) -> Value {
        let reply = self.rpc("/a2a", method, params).await;
        assert!(reply.get("error").is_none(), "{method} failed: {reply}");
        reply["result"].clone()
    }

    /// The result of a registry `method` at `/registry`; panics on an error reply.
    pub async fn registry(&self, method: &str, params: Value) -> Value {
        let reply = self.rpc("/registry", method, params).await;
        assert!(reply.get("error").is_none(), "{method} failed: {reply}");
        reply["result"].clone()
    }

    /// `GET path`: the status and the JSON body.
    pub async fn get_json(&self, path: &str) -> (reqwest::StatusCode, Value) {
        let response = self
            .http
            .get(self.url(path))
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"));
        let status = response.status();
        let body = response
            .json()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: no JSON body: {e}"));
        (status, body)
    }

    /// Everything the process logged (stderr) so far.
    pub fn logs(&self) -> String {
        self.logs.lock().expect("log lock").clone()
    }

    /// Waits (bounded) until the log holds `needle`, and returns the log.
    pub fn wait_for_log(&self, needle: &str, bound: Duration) -> String {
        let started = Instant::now();
        loop {
            let logs = self.logs();
            if logs.contains(needle) {
                return logs;
            }
            assert!(
                started.elapsed() < bound,
                "{needle:?} not logged within {bound:?}; the log:\n{logs}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends SIGTERM.
    pub fn terminate(&mut self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("send SIGTERM");
        assert!(status.success());
    }

    /// Kills the process with SIGKILL, as a crash or an OOM kill would, and
    /// waits for it.
    pub fn kill(&mut self) {
        self.stop_now();
    }

    /// Waits (at most `bound`) for the process to exit.
    pub fn wait_exit(&mut self, bound: Duration) -> ExitStatus {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(
                started.elapsed() < bound,
                "baton did not exit within {bound:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the process if it still runs, and reaps it.
    fn stop_now(&mut self) -> Option<ExitStatus> {
        let _ = self.child.kill();
        self.child.wait().ok()
    }
}

impl Drop for BatonProcess {
    fn drop(&mut self) {
        self.stop_now();
    }
}

/// What a one-shot command did.
#[derive(Debug)]
pub struct Finished {
    /// How it exited.
    pub status: ExitStatus,
    /// Its standard output.
    pub stdout: String,
    /// Its standard error.
    pub stderr: String,
}

/// Runs `baton ARGS` in `dir` to its end; kills it and panics after `bound`.
pub fn run_baton<I, S>(args: I, dir: &Path, bound: Duration) -> Finished
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let mut child = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(args)
        .current_dir(dir)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn baton");
    let read_all = |mut from: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = from.read_to_string(&mut text);
            text
        })
    };
    let stdout = read_all(Box::new(child.stdout.take().expect("stdout")));
    let stderr = read_all(Box::new(child.stderr.take().expect("stderr")));
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if started.elapsed() > bound {
            let _ = child.kill();
            let _ = child.wait();
            panic!("baton did not finish within {bound:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Finished {
        status,
        stdout: stdout.join().expect("stdout reader"),
        stderr: stderr.join().expect("stderr reader"),
    }
}
