//! `baton keys add|list|revoke` and the argument handling of `baton agents`,
//! run as the built binary in a temporary directory.

use baton::auth::{AuthError, KeyStore};
use std::path::Path;
use std::process::{Command, Output};

/// Runs `baton ARGS` in `dir`, with none of the caller's `BATON_*` settings.
fn baton(dir: &Path, args: &[&str]) -> Output {
    baton_with_env(dir, args, &[])
}

/// Runs `baton ARGS` in `dir` with `env` as its only `BATON_*` settings.
fn baton_with_env(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_baton"));
    command.args(args).current_dir(dir);
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("BATON_") {
            command.env_remove(name);
        }
    }
    command.envs(env.iter().copied());
    command.output().expect("the baton binary runs")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// `baton keys add AGENCY ...`: the key printed, checked to succeed.
fn add_key(dir: &Path, agency: &str, extra: &[&str]) -> String {
    let output = baton(dir, &[&["keys", "add", agency], extra].concat());
    assert!(output.status.success(), "{}", stderr(&output));
    let key = stdout(&output).trim().to_string();
    assert!(key.starts_with("bk_"), "{key:?}");
    assert_eq!(
        stdout(&output).lines().count(),
        1,
        "the key alone on stdout"
    );
    key
}

fn principal(keys_file: &Path, key: &str) -> Result<String, AuthError> {
    KeyStore::load(Some(keys_file), None)
        .unwrap()
        .authenticate(Some(&format!("Bearer {key}")))
        .map(String::from)
}

#[test]
fn add_list_revoke() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("keys.json");
    let file_arg = file.to_str().unwrap();
    assert!(KeyStore::load(Some(&file), None).unwrap().is_open());

    let acme = add_key(dir.path(), "acme", &["--keys-file", file_arg]);
    let globex1 = add_key(dir.path(), "globex", &["--keys-file", file_arg]);
    let globex2 = add_key(dir.path(), "globex", &["--keys-file", file_arg]);
    assert_eq!(principal(&file, &acme).unwrap(), "acme");
    assert_eq!(principal(&file, &globex2).unwrap(), "globex");
    assert!(matches!(
        principal(&file, "bk_not-a-key"),
        Err(AuthError::Unauthenticated(_))
    ));
    let stored = std::fs::read_to_string(&file).unwrap();
    for key in [&acme, &globex1, &globex2] {
        assert!(!stored.contains(key.as_str()), "only hashes are stored");
    }

    let list = baton(dir.path(), &["keys", "list", "--keys-file", file_arg]);
    assert!(list.status.success(), "{}", stderr(&list));
    let table = stdout(&list);
    assert_eq!(table.lines().count(), 4, "{table}");
    assert!(
        table.contains("acme") && table.contains("globex"),
        "{table}"
    );
    for key in [&acme, &globex1, &globex2] {
        assert!(!table.contains(key.as_str()), "list never shows a key");
        assert!(table.contains(&key[..11]), "list shows the key id");
    }

    let json = baton(
        dir.path(),
        &["keys", "list", "--json", "--keys-file", file_arg],
    );
    let json: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(json["keys"].as_array().unwrap().len(), 3);

    // By key id: that key only.
    let acme_id = &acme[..11];
    let revoke = baton(
        dir.path(),
        &["keys", "revoke", acme_id, "--keys-file", file_arg],
    );
    assert!(revoke.status.success(), "{}", stderr(&revoke));
    assert!(stdout(&revoke).contains(acme_id));
    assert!(
        !stderr(&revoke).contains("no key is left"),
        "globex's keys are"
    );
    assert!(principal(&file, &acme).is_err());
    assert_eq!(principal(&file, &globex1).unwrap(), "globex");

    // By agency: all its keys; they are the last, so only when asked to
    // leave the file open.
    let refused = baton(
        dir.path(),
        &["keys", "revoke", "globex", "--keys-file", file_arg],
    );
    assert_eq!(refused.status.code(), Some(1));
    assert!(
        stderr(&refused).contains("--allow-open"),
        "{}",
        stderr(&refused)
    );
    assert_eq!(principal(&file, &globex1).unwrap(), "globex");
    let revoke = baton(
        dir.path(),
        &[
            "keys",
            "revoke",
            "globex",
            "--allow-open",
            "--keys-file",
            file_arg,
        ],
    );
    assert!(revoke.status.success(), "{}", stderr(&revoke));
    assert_eq!(stdout(&revoke).lines().count(), 2);
    assert!(KeyStore::load(Some(&file), None).unwrap().is_open());
    assert!(
        stderr(&revoke).contains("no key is left"),
        "{}",
        stderr(&revoke)
    );

    let again = baton(
        dir.path(),
        &["keys", "revoke", "globex", "--keys-file", file_arg],
    );
    assert_eq!(again.status.code(), Some(1));
    assert!(stderr(&again).contains("no key"), "{}", stderr(&again));

    let empty = baton(dir.path(), &["keys", "list", "--keys-file", file_arg]);
    assert!(empty.status.success());
    assert!(stdout(&empty).is_empty());
}

#[test]
fn keys_file_location() {
    let dir = tempfile::tempdir().unwrap();

    // Default: ./baton-keys.json.
    let key = add_key(dir.path(), "acme", &[]);
    assert_eq!(
        principal(&dir.path().join("baton-keys.json"), &key).unwrap(),
        "acme"
    );

    // `keys-file` in baton.toml, as the server reads it.
    std::fs::write(
        dir.path().join("baton.toml"),
        "keys-file = \"from-toml.json\"\n",
    )
    .unwrap();
    let key = add_key(dir.path(), "acme", &[]);
    assert_eq!(
        principal(&dir.path().join("from-toml.json"), &key).unwrap(),
        "acme"
    );

    // BATON_KEYS_FILE over the file.
    let output = baton_with_env(
        dir.path(),
        &["keys", "add", "acme"],
        &[("BATON_KEYS_FILE", "from-env.json")],
    );
    assert!(output.status.success(), "{}", stderr(&output));
    let key = stdout(&output).trim().to_string();
    assert_eq!(
        principal(&dir.path().join("from-env.json"), &key).unwrap(),
        "acme"
    );

    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let meta = std::fs::metadata(dir.path().join("from-env.json")).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    }

    // A broken baton.toml is a configuration error.
    std::fs::write(dir.path().join("baton.toml"), "no-such-setting = 1\n").unwrap();
    let output = baton(dir.path(), &["keys", "list"]);
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
}

#[test]
fn bad_agency_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    for agency in ["has space", "anonymous", "bk_x"] {
        let output = baton(dir.path(), &["keys", "add", agency]);
        assert_eq!(output.status.code(), Some(1), "{agency:?}");
        assert!(stdout(&output).is_empty());
        assert!(stderr(&output).contains("agency"), "{}", stderr(&output));
    }
    assert!(!dir.path().join("baton-keys.json").exists());
}

#[test]
fn agents_help_and_argument_errors() {
    let dir = tempfile::tempdir().unwrap();
    let help = baton(dir.path(), &["agents", "--help"]);
    assert!(help.status.success());
    let help = stdout(&help);
    for word in [
        "register", "list", "search", "get", "remove", "--url", "--key",
    ] {
        assert!(help.contains(word), "{word} in {help}");
    }
    let register_help = stdout(&baton(dir.path(), &["agents", "register", "--help"]));
    assert!(register_help.contains("--card") && register_help.contains("--card-url"));

    let cases: &[&[&str]] = &[
        &["agents"],
        &["agents", "register"],
        &[
            "agents",
            "register",
            "--card",
            "c.json",
            "--card-url",
            "http://x/card",
        ],
        &["agents", "get"],
        &["agents", "remove"],
        &["agents", "search", "--color", "red"],
        &["keys", "revoke"],
    ];
    for args in cases {
        let output = baton(dir.path(), args);
        assert_eq!(output.status.code(), Some(2), "{args:?}: usage error");
        assert!(stdout(&output).is_empty(), "{args:?}");
    }
}

#[test]
fn agents_report_failures_without_a_server() {
    let dir = tempfile::tempdir().unwrap();

    let output = baton(dir.path(), &["agents", "list", "--url", "not a url"]);
    assert_eq!(output.status.code(), Some(1));
    assert!(
        stderr(&output).contains("bad Baton URL"),
        "{}",
        stderr(&output)
    );

    let output = baton(
        dir.path(),
        &["agents", "register", "--card", "missing.json"],
    );
    assert_eq!(output.status.code(), Some(1));
    assert!(
        stderr(&output).contains("cannot read card"),
        "{}",
        stderr(&output)
    );

    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let output = baton(dir.path(), &["agents", "get", "echo", "--url", &url]);
    assert_eq!(output.status.code(), Some(1));
    assert!(
        stderr(&output).contains("cannot reach"),
        "{}",
        stderr(&output)
    );
}
