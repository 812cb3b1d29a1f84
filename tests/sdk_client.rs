//! The official Python SDK client (`a2a-sdk` 1.3.0, strict parsing) drives a
//! running `baton serve` through card resolution, send, stream, get, list,
//! cancel, push configs and push delivery (tests/sdk/sdk_client_test.py).
//!
//! The SDK lives in a virtualenv at `target/sdk-venv`; `.ci/run` creates it,
//! and this test creates it on first use when it is missing.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const SDK_REQUIREMENT: &str = "a2a-sdk==1.3.0";

fn venv_python() -> PathBuf {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/sdk-venv");
    let python = venv.join("bin/python");
    let installed = python.exists()
        && Command::new(&python)
            .args(["-c", "import a2a.client"])
            .status()
            .is_ok_and(|s| s.success());
    if !installed {
        let created = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .expect("python3 is needed for the SDK client test");
        assert!(created.success(), "python3 -m venv failed");
        let pip = Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                SDK_REQUIREMENT,
            ])
            .status()
            .expect("run pip");
        assert!(pip.success(), "pip install {SDK_REQUIREMENT} failed");
    }
    python
}

#[test]
fn official_python_sdk_drives_baton() {
    let python = venv_python();
    let data = tempfile::tempdir().unwrap();
    let mut baton = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--allow-upstream",
            "127.0.0.1,::1",
        ])
        .arg("--data")
        .arg(data.path())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn baton");
    let mut line = String::new();
    BufReader::new(baton.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .trim_start_matches("baton listening on ")
        .to_string();
    let port = addr.rsplit(':').next().unwrap();

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/sdk_client_test.py");
    let output = Command::new(&python)
        .arg(&script)
        .arg(format!("http://localhost:{port}"))
        .arg("--push-delivery")
        .output()
        .expect("run the SDK client");
    let _ = baton.kill();
    let _ = baton.wait();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "SDK client failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("all 14 steps passed"), "{stdout}");
}
