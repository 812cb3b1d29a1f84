//! Agency API keys: the [`KeyStore`] that authenticates callers, and the
//! [`KeysFile`] that `baton keys add|list|revoke` manages.
//!
//! Keys come from two places. The keys file (JSON, default `./baton-keys.json`)
//! holds, for each key, its agency, a short public key id, the SHA-256 hash of
//! the key and its creation time: never the key itself. `BATON_API_KEYS`
//! (`agency=KEY,...`) adds keys for quick starts and tests; they are hashed in
//! memory at start-up and never written. With no key at all the store is
//! *open*: every call is allowed and belongs to the anonymous principal.
//!
//! A running server picks up keys that `baton keys` adds or revokes: at most
//! once a second the file's identity (modification time, length, inode) is
//! checked with one `stat`, and the file is re-read when it changed. A file
//! that cannot be read or parsed on reload keeps the last good keys and never
//! turns a closed store open. The file is always rewritten atomically (a
//! temporary file, then a rename) with mode 0600 on unix.
//!
//! Error policy: [`AuthError::Unauthenticated`] is the caller's fault (HTTP
//! 401); its message is safe to send back. The other variants are the
//! operator's (an unreadable file, a bad `BATON_API_KEYS` entry, an unknown key
//! id); they name the file, entry or agency, never a key.

use crate::config::Config;
use base64::Engine as _;
use chrono::{DateTime, SecondsFormat, SubsecRound as _, Utc};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use std::fmt;
use std::fs::{self, OpenOptions};
use std::io::{self, Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};
use subtle::ConstantTimeEq as _;

/// The principal of every call while no key is configured.
pub const ANONYMOUS: &str = "anonymous";

/// Where the keys file is kept unless configured otherwise.
pub const DEFAULT_KEYS_FILE: &str = "./baton-keys.json";

/// Every generated key starts with this, so that a leaked one is recognisable.
pub const KEY_PREFIX: &str = "bk_";

/// The `WWW-Authenticate` value to send with an HTTP 401.
pub const WWW_AUTHENTICATE: &str = "Bearer realm=\"baton\"";

/// Characters of a generated key, after the prefix, that make up its key id:
/// 48 of its 256 bits, enough to tell keys apart, far too few to guess the rest.
const KEY_ID_CHARS: usize = 8;

/// Random bytes in a generated key.
const KEY_BYTES: usize = 32;

/// How often, at most, the keys file is checked for changes.
const RELOAD_INTERVAL: Duration = Duration::from_secs(1);

/// The keys file format this code reads and writes.
const FILE_VERSION: u32 = 1;

/// Longest agency name.
const MAX_AGENCY_LEN: usize = 64;

/// Who made a call: an agency's name, or [`ANONYMOUS`] while no key exists.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Principal(String);

impl Principal {
    /// The principal of a named agency (or of a name read back from the ledger).
    pub fn new(name: impl Into<String>) -> Self {
        Self(name.into())
    }

    /// The one principal of every call while no key is configured.
    pub fn anonymous() -> Self {
        Self(ANONYMOUS.to_string())
    }

    /// Whether this is the anonymous principal.
    pub fn is_anonymous(&self) -> bool {
        self.0 == ANONYMOUS
    }

    /// The agency name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for Principal {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl From<Principal> for String {
    fn from(principal: Principal) -> Self {
        principal.0
    }
}

/// Why a key could not be used, loaded or managed.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// The call carries no valid key: answer HTTP 401 with this message.
    #[error("{0}")]
    Unauthenticated(String),
    /// The keys file cannot be read, parsed or written.
    #[error("keys file {}: {reason}", path.display())]
    KeysFile {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// `BATON_API_KEYS` has bad entries: every one is listed.
    #[error("BATON_API_KEYS: {}", .0.join("; "))]
    BadEnvKeys(Vec<String>),
    /// An agency name that keys cannot be issued to.
    #[error("{0}")]
    BadAgency(String),
    /// `revoke` matched neither a key id nor an agency.
    #[error("no key with id or agency {target:?} in {}", path.display())]
    NotFound {
        /// What was asked for.
        target: String,
        /// The keys file searched.
        path: PathBuf,
    },
    /// `revoke` would have removed the file's last key without `allow_open`.
    #[error(
        "revoking would leave no key in {}: a Baton using it would let every caller in, \
         unauthenticated; add another key first, or pass --allow-open",
        path.display()
    )]
    LastKey {
        /// The keys file.
        path: PathBuf,
    },
    /// The operating system's random source failed.
    #[error("cannot generate a key: {0}")]
    Random(String),
}

impl AuthError {
    fn file(path: &Path, reason: impl fmt::Display) -> Self {
        Self::KeysFile {
            path: path.to_path_buf(),
            reason: reason.to_string(),
        }
    }
}

/// SHA-256 of a key: the only form in which keys are kept.
pub fn hash_key(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// Compares two hashes in time that does not depend on where they differ.
fn hashes_equal(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.ct_eq(b).into()
}

fn to_hex(bytes: &[u8]) -> String {
    use fmt::Write as _;
    let mut text = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        let _ = write!(text, "{byte:02x}");
    }
    text
}

fn from_hex(text: &str) -> Option<[u8; 32]> {
    if text.len() != 64 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; 32];
    for (byte, pair) in out.iter_mut().zip(text.as_bytes().chunks(2)) {
        *byte = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(out)
}

/// A fresh key: 32 bytes from the operating system's CSPRNG, base64url, `bk_`.
pub fn generate_key() -> Result<String, AuthError> {
    let mut bytes = [0u8; KEY_BYTES];
    getrandom::fill(&mut bytes).map_err(|e| AuthError::Random(e.to_string()))?;
    Ok(format!(
        "{KEY_PREFIX}{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    ))
}

/// The public id of a generated key: its prefix and first few characters.
fn key_id_of(key: &str) -> String {
    key.chars().take(KEY_PREFIX.len() + KEY_ID_CHARS).collect()
}

/// Checks that `name` can own keys: 1–64 of `A-Z a-z 0-9 . _ -`, not starting
/// with `-` or the key prefix (so `revoke` can tell ids from agencies), and
/// not a name Baton uses itself.
pub fn validate_agency(name: &str) -> Result<(), AuthError> {
    let bad = |why: &str| Err(AuthError::BadAgency(format!("agency {name:?}: {why}")));
    if name.is_empty() || name.len() > MAX_AGENCY_LEN {
        return bad("must be 1 to 64 characters");
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
    {
        return bad("may hold only letters, digits, '.', '_' and '-'");
    }
    if name.starts_with('-') || name.starts_with(KEY_PREFIX) {
        return bad(&format!("may not start with '-' or {KEY_PREFIX:?}"));
    }
    if name == ANONYMOUS || name == crate::launch::LOCAL_OWNER {
        return bad("is reserved by Baton");
    }
    Ok(())
}

/// One key the store accepts.
#[derive(Clone, Debug)]
struct KeyEntry {
    principal: Principal,
    hash: [u8; 32],
}

/// Parses `agency=KEY,...`; every bad entry is reported, by position and
/// agency, never with its key. Blank entries (a trailing comma) are skipped.
fn parse_env_keys(text: &str) -> Result<Vec<KeyEntry>, Vec<String>> {
    let mut entries: Vec<KeyEntry> = Vec::new();
    let mut errors = Vec::new();
    for (index, raw) in text.split(',').enumerate() {
        let position = index + 1;
        let raw = raw.trim();
        if raw.is_empty() {
            continue;
        }
        let Some((agency, key)) = raw.split_once('=') else {
            errors.push(format!("entry {position}: expected AGENCY=KEY"));
            continue;
        };
        let (agency, key) = (agency.trim(), key.trim());
        if let Err(err) = validate_agency(agency) {
            errors.push(format!("entry {position}: {err}"));
            continue;
        }
        if key.is_empty() {
            errors.push(format!("entry {position} (agency {agency:?}): empty key"));
            continue;
        }
        let hash = hash_key(key);
        if let Some(other) = entries.iter().find(|e| hashes_equal(&e.hash, &hash)) {
            errors.push(format!(
                "entry {position} (agency {agency:?}): same key as agency {:?}",
                other.principal.as_str()
            ));
            continue;
        }
        entries.push(KeyEntry {
            principal: Principal::new(agency),
            hash,
        });
    }
    if errors.is_empty() {
        Ok(entries)
    } else {
        Err(errors)
    }
}

/// Checks a `BATON_API_KEYS` value; the messages are those `KeyStore::load`
/// would report, for configuration checks that list every problem at once.
pub fn check_env_keys(text: &str) -> Result<(), Vec<String>> {
    parse_env_keys(text).map(|_| ())
}

/// One key as listed in the keys file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StoredKey {
    /// The agency the key authenticates as.
    pub agency: String,
    /// Public prefix of the key, for listing and revoking.
    pub key_id: String,
    /// SHA-256 of the key, lowercase hex.
    pub sha256: String,
    /// When the key was created.
    pub created_at: DateTime<Utc>,
}

impl StoredKey {
    /// `created_at` as RFC 3339 UTC to the second.
    pub fn created_at_text(&self) -> String {
        self.created_at.to_rfc3339_opts(SecondsFormat::Secs, true)
    }
}

/// The keys file's document.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct KeysDoc {
    version: u32,
    keys: Vec<StoredKey>,
}

/// What identifies one version of the keys file without reading it. An atomic
/// rewrite always changes the inode, so a change is seen even when the
/// filesystem's clock is coarse.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileStamp {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
}

impl FileStamp {
    fn of(meta: &fs::Metadata) -> Self {
        #[cfg(unix)]
        let inode = std::os::unix::fs::MetadataExt::ino(meta);
        #[cfg(not(unix))]
        let inode = 0;
        Self {
            modified: meta.modified().ok(),
            len: meta.len(),
            inode,
        }
    }
}

/// What the last look at the keys file's path found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Seen {
    Absent,
    Present(FileStamp),
    /// `stat` itself failed.
    Unknown,
}

/// Reads and checks the keys file; `None` when it does not exist.
fn read_doc(path: &Path) -> Result<Option<(Vec<StoredKey>, FileStamp)>, AuthError> {
    let mut file = match fs::File::open(path) {
        Ok(file) => file,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(err) => return Err(AuthError::file(path, err)),
    };
    // The stamp of the handle read, not of the path: a rename in between
    // then shows up as a change at the next check.
    let stamp = FileStamp::of(&file.metadata().map_err(|e| AuthError::file(path, e))?);
    let mut text = String::new();
    file.read_to_string(&mut text)
        .map_err(|e| AuthError::file(path, e))?;
    let doc: KeysDoc = serde_json::from_str(&text).map_err(|e| AuthError::file(path, e))?;
    if doc.version != FILE_VERSION {
        return Err(AuthError::file(
            path,
            format!(
                "version {} is not supported (expected {FILE_VERSION})",
                doc.version
            ),
        ));
    }
    Ok(Some((doc.keys, stamp)))
}

/// The keys of a file's entries, checked.
fn entries_of(path: &Path, keys: &[StoredKey]) -> Result<Vec<KeyEntry>, AuthError> {
    keys.iter()
        .map(|stored| {
            validate_agency(&stored.agency).map_err(|e| AuthError::file(path, e))?;
            let hash = from_hex(&stored.sha256).ok_or_else(|| {
                AuthError::file(
                    path,
                    format!("key {:?}: sha256 is not 64 hex digits", stored.key_id),
                )
            })?;
            Ok(KeyEntry {
                principal: Principal::new(&stored.agency),
                hash,
            })
        })
        .collect()
}

fn read_entries(path: &Path) -> Result<Option<(Vec<KeyEntry>, FileStamp)>, AuthError> {
    match read_doc(path)? {
        Some((keys, stamp)) => Ok(Some((entries_of(path, &keys)?, stamp))),
        None => Ok(None),
    }
}

/// Replaces the file with `keys`: a temporary file in the same directory
/// (mode 0600 on unix), synced, then renamed over the old one.
fn write_doc(path: &Path, keys: Vec<StoredKey>) -> Result<(), AuthError> {
    let doc = KeysDoc {
        version: FILE_VERSION,
        keys,
    };
    let mut text = serde_json::to_string_pretty(&doc).map_err(|e| AuthError::file(path, e))?;
    text.push('\n');

    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| AuthError::file(path, "not a file name"))?;
    let temp = dir.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = write_new(&temp, text.as_bytes()).and_then(|()| fs::rename(&temp, path));
    if let Err(err) = result {
        let _ = fs::remove_file(&temp);
        return Err(AuthError::file(path, err));
    }
    #[cfg(unix)]
    if let Ok(dir) = fs::File::open(dir) {
        // Makes the rename itself durable; the file is already complete.
        let _ = dir.sync_all();
    }
    Ok(())
}

fn write_new(path: &Path, bytes: &[u8]) -> io::Result<()> {
    // A temp file left by a crashed writer with the same pid is stale.
    match fs::remove_file(path) {
        Err(err) if err.kind() != io::ErrorKind::NotFound => return Err(err),
        _ => {}
    }
    let mut options = OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options.open(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}

/// A key just created: shown once, then only its hash remains.
pub struct NewKey {
    /// The key, to hand to the agency.
    pub key: String,
    /// What the keys file now holds for it.
    pub stored: StoredKey,
}

impl fmt::Debug for NewKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NewKey")
            .field("key", &"<redacted>")
            .field("stored", &self.stored)
            .finish()
    }
}

/// The keys file, as `baton keys` manages it. Each change reads the file,
/// edits it and rewrites it atomically; two `baton keys` commands run at the
/// same instant can lose one of the two changes, never corrupt the file.
#[derive(Clone, Debug)]
pub struct KeysFile {
    path: PathBuf,
}

impl KeysFile {
    /// The keys file at `path` (it need not exist yet).
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }

    /// Where the file is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every key in the file, oldest first; none when the file does not exist.
    pub fn list(&self) -> Result<Vec<StoredKey>, AuthError> {
        let keys = match read_doc(&self.path)? {
            Some((keys, _)) => keys,
            None => Vec::new(),
        };
        entries_of(&self.path, &keys)?;
        Ok(keys)
    }

    /// Creates a key for `agency`, stores its hash and returns the key.
    pub fn add(&self, agency: &str) -> Result<NewKey, AuthError> {
        validate_agency(agency)?;
        let mut keys = self.list()?;
        let key = loop {
            let key = generate_key()?;
            let id = key_id_of(&key);
            if !keys.iter().any(|k| k.key_id == id) {
                break key;
            }
        };
        let stored = StoredKey {
            agency: agency.to_string(),
            key_id: key_id_of(&key),
            sha256: to_hex(&hash_key(&key)),
            created_at: Utc::now().trunc_subsecs(0),
        };
        keys.push(stored.clone());
        write_doc(&self.path, keys)?;
        Ok(NewKey { key, stored })
    }

    /// Removes the key whose id is `target`, or else every key of the agency
    /// `target`; returns what was removed. Unless `allow_open`, a revoke
    /// that would leave the file without keys is refused: a Baton using it
    /// would then let every caller in (DESIGN.md §6).
    pub fn revoke(&self, target: &str, allow_open: bool) -> Result<Vec<StoredKey>, AuthError> {
        let keys = self.list()?;
        let by_id = keys.iter().any(|k| k.key_id == target);
        let (removed, kept): (Vec<_>, Vec<_>) = keys.into_iter().partition(|k| {
            if by_id {
                k.key_id == target
            } else {
                k.agency == target
            }
        });
        if removed.is_empty() {
            return Err(AuthError::NotFound {
                target: target.to_string(),
                path: self.path.clone(),
            });
        }
        if kept.is_empty() && !allow_open {
            return Err(AuthError::LastKey {
                path: self.path.clone(),
            });
        }
        write_doc(&self.path, kept)?;
        Ok(removed)
    }
}

/// What the store last read from the keys file.
struct FileState {
    keys: Arc<[KeyEntry]>,
    seen: Seen,
    /// Why the last reload failed; while set, the store is never open.
    error: Option<String>,
    checked_at: Instant,
}

struct Inner {
    file: Option<PathBuf>,
    env_keys: Vec<KeyEntry>,
    reload_interval: Duration,
    /// A std mutex: it is held for a clock read and, at most once per
    /// interval, one `stat` (and, when the file changed, the read of a small
    /// file); never across an `.await`.
    state: Mutex<FileState>,
}

/// The agency keys a running Baton accepts. Cheap to clone (one `Arc`),
/// `Send + Sync`: keep one in the server state and call
/// [`authenticate`](Self::authenticate) from each handler.
#[derive(Clone)]
pub struct KeyStore {
    inner: Arc<Inner>,
}

impl fmt::Debug for KeyStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.lock();
        f.debug_struct("KeyStore")
            .field("file", &self.inner.file)
            .field("file_keys", &state.keys.len())
            .field("env_keys", &self.inner.env_keys.len())
            .field("file_error", &state.error)
            .finish()
    }
}

impl KeyStore {
    /// Loads the keys `file` (a missing file holds no keys, and is picked up
    /// once created) and the `BATON_API_KEYS`-style `env_keys`.
    pub fn load(file: Option<&Path>, env_keys: Option<&str>) -> Result<Self, AuthError> {
        Self::load_with_interval(file, env_keys, RELOAD_INTERVAL)
    }

    /// [`load`](Self::load) with the configured `keys_file` and `api_keys`.
    pub fn from_config(config: &Config) -> Result<Self, AuthError> {
        Self::load(Some(&config.keys_file), config.api_keys.as_deref())
    }

    fn load_with_interval(
        file: Option<&Path>,
        env_keys: Option<&str>,
        reload_interval: Duration,
    ) -> Result<Self, AuthError> {
        let env_keys = match env_keys {
            Some(text) => parse_env_keys(text).map_err(AuthError::BadEnvKeys)?,
            None => Vec::new(),
        };
        let (keys, seen) = match file.map(read_entries).transpose()?.flatten() {
            Some((keys, stamp)) => (keys, Seen::Present(stamp)),
            None => (Vec::new(), Seen::Absent),
        };
        Ok(Self {
            inner: Arc::new(Inner {
                file: file.map(Path::to_path_buf),
                env_keys,
                reload_interval,
                state: Mutex::new(FileState {
                    keys: keys.into(),
                    seen,
                    error: None,
                    checked_at: Instant::now(),
                }),
            }),
        })
    }

    /// True while no key exists at all: every call is then anonymous.
    pub fn is_open(&self) -> bool {
        let (file_keys, file_error) = self.current();
        self.inner.env_keys.is_empty() && file_keys.is_empty() && !file_error
    }

    /// The principal of a call with this `Authorization` header value: the
    /// key's agency, or the anonymous principal while the store is open.
    pub fn authenticate(&self, authorization: Option<&str>) -> Result<Principal, AuthError> {
        let (file_keys, file_error) = self.current();
        if self.inner.env_keys.is_empty() && file_keys.is_empty() && !file_error {
            return Ok(Principal::anonymous());
        }
        let header = authorization.ok_or_else(|| {
            AuthError::Unauthenticated(
                "missing API key: send an `Authorization: Bearer <key>` header".into(),
            )
        })?;
        let hash = hash_key(bearer_token(header)?);
        self.inner
            .env_keys
            .iter()
            .chain(file_keys.iter())
            .find(|entry| hashes_equal(&entry.hash, &hash))
            .map(|entry| entry.principal.clone())
            .ok_or_else(|| AuthError::Unauthenticated("invalid API key".into()))
    }

    /// [`authenticate`](Self::authenticate) on a request's headers.
    pub fn authenticate_headers(
        &self,
        headers: &axum::http::HeaderMap,
    ) -> Result<Principal, AuthError> {
        match headers.get(axum::http::header::AUTHORIZATION) {
            None => self.authenticate(None),
            Some(value) => self.authenticate(Some(value.to_str().map_err(|_| {
                AuthError::Unauthenticated("the Authorization header is not ASCII".into())
            })?)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FileState> {
        // Every update of the state is a whole assignment: a panic elsewhere
        // cannot leave it half-written.
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The file's keys, re-read first if the file changed and the interval
    /// has passed, and whether the last reload failed.
    fn current(&self) -> (Arc<[KeyEntry]>, bool) {
        let mut state = self.lock();
        if let Some(path) = &self.inner.file {
            let now = Instant::now();
            if now.duration_since(state.checked_at) >= self.inner.reload_interval {
                state.checked_at = now;
                let had_keys = !state.keys.is_empty();
                refresh(path, &mut state);
                if had_keys && state.keys.is_empty() && self.inner.env_keys.is_empty() {
                    // As DESIGN.md §6 says: no key, no authentication.
                    tracing::warn!(path = %path.display(), "no API key is left: every call is now allowed, as the anonymous principal");
                }
            }
        }
        (state.keys.clone(), state.error.is_some())
    }
}

/// Re-reads the keys file if its path now shows another file or none.
fn refresh(path: &Path, state: &mut FileState) {
    let seen = match fs::metadata(path) {
        Ok(meta) => Seen::Present(FileStamp::of(&meta)),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Seen::Absent,
        Err(err) => {
            if state.seen != Seen::Unknown {
                tracing::warn!(path = %path.display(), %err, "cannot check the keys file; keeping the keys loaded");
            }
            state.seen = Seen::Unknown;
            state.error = Some(err.to_string());
            return;
        }
    };
    if seen == state.seen {
        return;
    }
    match read_entries(path) {
        Ok(Some((keys, stamp))) => {
            tracing::info!(path = %path.display(), keys = keys.len(), "keys file reloaded");
            state.keys = keys.into();
            state.seen = Seen::Present(stamp);
            state.error = None;
        }
        // A file that held keys and is gone (deleted, moved, a deploy that
        // replaces it, a lost mount) keeps its keys: only a file listing no
        // key opens a closed store, as `keys revoke --allow-open` writes.
        Ok(None) if !state.keys.is_empty() => {
            tracing::error!(path = %path.display(), "keys file removed; keeping the keys loaded (write one with no key to allow every call)");
            state.seen = Seen::Absent;
            state.error = Some("the keys file was removed".into());
        }
        Ok(None) => {
            tracing::info!(path = %path.display(), "keys file removed");
            state.keys = Arc::new([]);
            state.seen = Seen::Absent;
            state.error = None;
        }
        Err(err) => {
            tracing::warn!(%err, "cannot reload the keys file; keeping the keys loaded");
            state.seen = seen;
            state.error = Some(err.to_string());
        }
    }
}

/// The key in `Bearer <key>` (scheme case-insensitive).
fn bearer_token(header: &str) -> Result<&str, AuthError> {
    let malformed =
        || AuthError::Unauthenticated("the Authorization header must be `Bearer <key>`".into());
    let (scheme, key) = header
        .trim()
        .split_once(char::is_whitespace)
        .ok_or_else(malformed)?;
    let key = key.trim();
    if !scheme.eq_ignore_ascii_case("bearer") || key.is_empty() {
        return Err(malformed());
    }
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unauthenticated(result: Result<Principal, AuthError>) -> String {
        match result {
            Err(AuthError::Unauthenticated(message)) => message,
            other => panic!("expected Unauthenticated, got {other:?}"),
        }
    }

    #[test]
    fn hashes_are_sha256_hex() {
        // SHA-256("abc"), FIPS 180-2 appendix B.1.
        let expected = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert_eq!(to_hex(&hash_key("abc")), expected);
        assert_eq!(from_hex(expected), Some(hash_key("abc")));
        assert_eq!(
            from_hex(&expected.to_uppercase()),
            Some(hash_key("abc")),
            "hex digits of either case"
        );
        for bad in ["", "ab", &expected[1..], &format!("+{}", &expected[1..])] {
            assert_eq!(from_hex(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn constant_time_compare() {
        let a = hash_key("KEY1");
        let mut b = a;
        assert!(hashes_equal(&a, &b));
        for index in [0, 15, 31] {
            b = a;
            b[index] ^= 1;
            assert!(!hashes_equal(&a, &b), "differs at byte {index}");
        }
    }

    #[test]
    fn generated_keys_are_prefixed_base64url_of_32_bytes() {
        let key = generate_key().unwrap();
        let body = key.strip_prefix(KEY_PREFIX).unwrap();
        let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(body)
            .unwrap();
        assert_eq!(bytes.len(), KEY_BYTES);
        assert_ne!(key, generate_key().unwrap());
        assert_eq!(key_id_of(&key).len(), KEY_PREFIX.len() + KEY_ID_CHARS);
        assert!(key.starts_with(&key_id_of(&key)));
    }

    #[test]
    fn env_keys_parse() {
        let cases: &[(&str, &[&str])] = &[
            ("acme=KEY1,globex=KEY2", &["acme", "globex"]),
            (" acme = KEY1 , ", &["acme"]),
            ("", &[]),
            ("acme=a=b", &["acme"]),
        ];
        for (text, agencies) in cases {
            let entries = parse_env_keys(text).unwrap();
            let names: Vec<_> = entries.iter().map(|e| e.principal.as_str()).collect();
            assert_eq!(&names, agencies, "{text:?}");
        }
        let entries = parse_env_keys("acme=a=b").unwrap();
        assert!(hashes_equal(&entries[0].hash, &hash_key("a=b")));
    }

    #[test]
    fn bad_env_entries_are_all_reported_without_keys() {
        let errors =
            parse_env_keys("acme=SECRET1,nokey,=SECRET2,globex=,bad name=SECRET3,umbrella=SECRET1")
                .unwrap_err();
        assert_eq!(errors.len(), 5, "{errors:#?}");
        assert!(errors[0].starts_with("entry 2:"), "{errors:#?}");
        assert!(errors[2].contains("globex") && errors[2].contains("empty key"));
        assert!(errors[4].contains("same key as agency \"acme\""));
        assert!(errors.iter().all(|e| !e.contains("SECRET")), "{errors:#?}");

        let err = KeyStore::load(None, Some("anonymous=x,local=y")).unwrap_err();
        assert!(
            matches!(&err, AuthError::BadEnvKeys(list) if list.len() == 2),
            "{err}"
        );
        assert!(
            err.to_string().starts_with("BATON_API_KEYS: entry 1:"),
            "{err}"
        );
    }

    #[test]
    fn agency_names() {
        for good in ["acme", "Globex-2", "a.b_c"] {
            validate_agency(good).unwrap();
        }
        for bad in ["", "has space", "-x", "bk_acme", "anonymous", "local", "é"] {
            assert!(validate_agency(bad).is_err(), "{bad:?}");
        }
        assert!(validate_agency(&"a".repeat(65)).is_err());
    }

    #[test]
    fn open_mode_without_keys() {
        let dir = tempfile::tempdir().unwrap();
        let store = KeyStore::load(Some(&dir.path().join("absent.json")), None).unwrap();
        assert!(store.is_open());
        assert!(store.authenticate(None).unwrap().is_anonymous());
        assert_eq!(
            store.authenticate(Some("Bearer whatever")).unwrap(),
            Principal::anonymous()
        );
        assert!(KeyStore::load(None, Some(" , ")).unwrap().is_open());
    }

    #[test]
    fn bearer_keys_authenticate() {
        let store = KeyStore::load(None, Some("acme=KEY1,globex=KEY2")).unwrap();
        assert!(!store.is_open());
        for header in [
            "Bearer KEY1",
            "bearer KEY1",
            "BEARER   KEY1 ",
            " Bearer\tKEY1",
        ] {
            assert_eq!(store.authenticate(Some(header)).unwrap().as_str(), "acme");
        }
        assert_eq!(
            store.authenticate(Some("Bearer KEY2")).unwrap().as_str(),
            "globex"
        );
        assert!(unauthenticated(store.authenticate(None)).contains("missing API key"));
        assert_eq!(
            unauthenticated(store.authenticate(Some("Bearer KEY3"))),
            "invalid API key"
        );
        for malformed in ["KEY1", "Basic KEY1", "Bearer", "Bearer   ", "Bearerx KEY1"] {
            assert!(
                unauthenticated(store.authenticate(Some(malformed))).contains("Bearer <key>"),
                "{malformed:?}"
            );
        }
    }

    #[test]
    fn headers_authenticate() {
        let store = KeyStore::load(None, Some("acme=KEY1")).unwrap();
        let mut headers = axum::http::HeaderMap::new();
        unauthenticated(store.authenticate_headers(&headers));
        headers.insert("authorization", "Bearer KEY1".parse().unwrap());
        assert_eq!(
            store.authenticate_headers(&headers).unwrap().as_str(),
            "acme"
        );
    }

    #[test]
    fn store_is_shareable() {
        fn check<T: Clone + Send + Sync + 'static>() {}
        check::<KeyStore>();
        check::<Principal>();
    }

    #[test]
    fn file_keys_add_list_and_revoke_by_id_or_agency() {
        let dir = tempfile::tempdir().unwrap();
        let file = KeysFile::new(dir.path().join("keys.json"));
        assert!(file.list().unwrap().is_empty());
        let first = file.add("acme").unwrap();
        let second = file.add("acme").unwrap();
        let third = file.add("globex").unwrap();
        assert!(validate_agency("bad agency").is_err());
        assert!(matches!(
            file.add("bad agency"),
            Err(AuthError::BadAgency(_))
        ));

        let text = fs::read_to_string(file.path()).unwrap();
        for new in [&first, &second, &third] {
            assert!(!text.contains(&new.key), "the key itself is never written");
            assert!(text.contains(&new.stored.sha256));
        }
        assert_eq!(file.list().unwrap().len(), 3);

        let store = KeyStore::load(Some(file.path()), None).unwrap();
        let bearer = |key: &str| store.authenticate(Some(&format!("Bearer {key}")));
        assert_eq!(bearer(&first.key).unwrap().as_str(), "acme");
        assert_eq!(bearer(&third.key).unwrap().as_str(), "globex");

        let removed = file.revoke(&first.stored.key_id, false).unwrap();
        assert_eq!(removed, vec![first.stored.clone()]);
        let removed = file.revoke("globex", false).unwrap();
        assert_eq!(removed, vec![third.stored.clone()]);
        assert_eq!(file.list().unwrap(), vec![second.stored.clone()]);
        assert!(matches!(
            file.revoke("globex", false),
            Err(AuthError::NotFound { .. })
        ));

        let store = KeyStore::load(Some(file.path()), None).unwrap();
        let bearer = |key: &str| store.authenticate(Some(&format!("Bearer {key}")));
        unauthenticated(bearer(&first.key));
        unauthenticated(bearer(&third.key));
        assert_eq!(bearer(&second.key).unwrap().as_str(), "acme");

        // The last key goes only when asked to open the store.
        assert!(matches!(
            file.revoke("acme", false),
            Err(AuthError::LastKey { .. })
        ));
        assert_eq!(file.list().unwrap(), vec![second.stored.clone()]);
        file.revoke("acme", true).unwrap();
        assert!(KeyStore::load(Some(file.path()), None).unwrap().is_open());
    }

    #[cfg(unix)]
    #[test]
    fn keys_file_is_private() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let file = KeysFile::new(dir.path().join("keys.json"));
        file.add("acme").unwrap();
        let mode = fs::metadata(file.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let names: Vec<_> = fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1, "no temporary file is left behind");
    }

    #[test]
    fn store_follows_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.json");
        let file = KeysFile::new(&path);
        let store =
            KeyStore::load_with_interval(Some(&path), Some("env=ENVKEY"), Duration::ZERO).unwrap();
        let bearer = |key: &str| store.authenticate(Some(&format!("Bearer {key}")));

        let acme = file.add("acme").unwrap();
        assert_eq!(
            bearer(&acme.key).unwrap().as_str(),
            "acme",
            "added key seen"
        );
        file.revoke("acme", true).unwrap();
        unauthenticated(bearer(&acme.key));
        assert_eq!(bearer("ENVKEY").unwrap().as_str(), "env", "env keys stay");

        let globex = file.add("globex").unwrap();
        assert_eq!(bearer(&globex.key).unwrap().as_str(), "globex");
        fs::write(&path, "{ not json").unwrap();
        assert_eq!(
            bearer(&globex.key).unwrap().as_str(),
            "globex",
            "a broken file keeps the last good keys"
        );
        // Gone, it keeps the keys it held: it never opens the store.
        fs::remove_file(&path).unwrap();
        assert_eq!(bearer(&globex.key).unwrap().as_str(), "globex");
        unauthenticated(store.authenticate(None));
        assert!(!store.is_open());
        // A file listing no key does, as `keys revoke --allow-open` writes.
        KeysFile::new(&path).add("initech").unwrap();
        file.revoke("initech", true).unwrap();
        unauthenticated(bearer(&globex.key));
        assert_eq!(bearer("ENVKEY").unwrap().as_str(), "env");
    }

    #[test]
    fn a_keys_file_that_held_keys_and_is_removed_keeps_the_store_closed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.json");
        let store = KeyStore::load_with_interval(Some(&path), None, Duration::ZERO).unwrap();
        let file = KeysFile::new(&path);
        let acme = file.add("acme").unwrap();
        assert!(!store.is_open());
        fs::remove_file(&path).unwrap();
        assert!(!store.is_open(), "removed, the file opens nothing");
        unauthenticated(store.authenticate(None));
        let bearer = format!("Bearer {}", acme.key);
        assert_eq!(store.authenticate(Some(&bearer)).unwrap().as_str(), "acme");
        file.add("globex").unwrap();
        unauthenticated(store.authenticate(Some(&bearer)));
        file.revoke("globex", true).unwrap();
        assert!(store.is_open(), "a file with no key opens it");
    }

    #[test]
    fn a_broken_file_never_opens_the_store() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.json");
        let store = KeyStore::load_with_interval(Some(&path), None, Duration::ZERO).unwrap();
        assert!(store.is_open());
        fs::write(&path, "{ not json").unwrap();
        assert!(!store.is_open());
        unauthenticated(store.authenticate(None));

        fs::write(&path, "{ not json either").unwrap();
        let err = KeyStore::load(Some(&path), None).unwrap_err();
        assert!(matches!(err, AuthError::KeysFile { .. }), "{err}");
        fs::write(&path, r#"{"version": 2, "keys": []}"#).unwrap();
        let err = KeyStore::load(Some(&path), None).unwrap_err();
        assert!(err.to_string().contains("version 2"), "{err}");
    }

    #[test]
    fn reloads_wait_for_the_interval() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.json");
        let store =
            KeyStore::load_with_interval(Some(&path), None, Duration::from_secs(3600)).unwrap();
        KeysFile::new(&path).add("acme").unwrap();
        assert!(store.is_open(), "not looked at again within the interval");
        assert!(!KeyStore::load(Some(&path), None).unwrap().is_open());
    }
}
