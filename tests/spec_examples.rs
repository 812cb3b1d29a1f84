//! Round-trip tests over every JSON example of the A2A 1.0 specification, plus
//! unit tests for the ProtoJSON rules the examples do not exercise.
//!
//! The spec is read at test time from `../shared/a2a-spec/` (beside the
//! repository; CI has it): `specification.md` and every `topic-*.md`. Nothing
//! of it is copied into this repository.
//!
//! Each JSON example (a ```json block, the body of an ```http block, or one SSE
//! `data:` line) is classified (JSON-RPC request or response, REST body, SSE
//! event, bare object) by its method, its route or its keys, parsed into
//! Baton's type, serialized back, and compared with the original after
//! [`normalise`], which forgives only what ProtoJSON allows to differ.
//! Examples that are not A2A 1.0 wire objects are skipped by a named [`Skip`]
//! rule, never silently. Run with `-- --nocapture` to see the per-example table.

use baton::error::GatewayError;
use baton::jsonrpc::envelope::{decode_params, parse_request, success_body};
use baton::protocol::wire::{decode_base64, encode_base64, format_timestamp, parse_timestamp};
use baton::protocol::*;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

// ---------------------------------------------------------------------------
// Reading the spec
// ---------------------------------------------------------------------------

/// Where CI puts the spec, relative to the repository root.
fn spec_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/a2a-spec")
}

/// `specification.md` first, then the topic pages, with their text.
fn spec_files() -> Vec<(String, String)> {
    let dir = spec_dir();
    let main = dir.join("specification.md");
    assert!(
        main.is_file(),
        "the A2A spec is missing: expected {} (CI checks it out at ../shared/a2a-spec \
         beside the repository; this test reads it at run time)",
        main.display()
    );
    let mut topics: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .map(|entry| entry.expect("readable directory entry").path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("topic-") && n.ends_with(".md"))
        })
        .collect();
    topics.sort();
    std::iter::once(main)
        .chain(topics)
        .map(|path| {
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            (name, text)
        })
        .collect()
}

/// A fenced code block.
struct Block {
    /// 1-based line of the opening fence.
    line: usize,
    /// The info string, e.g. `json` or `http`.
    lang: String,
    /// The lines between the fences.
    lines: Vec<String>,
}

/// Every fenced block of a Markdown file (fences may be indented in lists).
fn fenced_blocks(text: &str) -> Vec<Block> {
    let mut blocks = Vec::new();
    let mut open: Option<Block> = None;
    for (index, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        match open.take() {
            None => {
                if let Some(info) = trimmed.strip_prefix("```") {
                    open = Some(Block {
                        line: index + 1,
                        lang: info.trim().to_ascii_lowercase(),
                        lines: Vec::new(),
                    });
                }
            }
            Some(mut block) => {
                if trimmed.starts_with("```") {
                    blocks.push(block);
                } else {
                    block.lines.push(line.to_string());
                    open = Some(block);
                }
            }
        }
    }
    blocks
}

/// An HTTP request line, for pairing a response with its request.
#[derive(Clone, Debug)]
struct Route {
    method: String,
    path: String,
}

/// Where an example appeared.
#[derive(Clone, Debug)]
enum Position {
    /// A ```json block.
    Bare,
    /// The body of an HTTP request.
    HttpRequest(Route),
    /// The body of an HTTP response, after the file's latest request.
    HttpResponse {
        status: u16,
        content_type: String,
        request: Option<Route>,
    },
    /// One SSE `data:` line, after the file's latest request (if any).
    Sse(Option<Route>),
}

/// One JSON example.
struct Example {
    /// `file:line`.
    origin: String,
    position: Position,
    text: String,
}

/// Every JSON example of one file: ```json blocks, HTTP bodies and SSE lines.
fn examples_of(file: &str, markdown: &str) -> Vec<Example> {
    let mut examples = Vec::new();
    let mut last_request: Option<Route> = None;
    for block in fenced_blocks(markdown) {
        let origin = |offset: usize| format!("{file}:{}", block.line + offset);
        match block.lang.as_str() {
            "json" => examples.push(Example {
                origin: origin(0),
                position: Position::Bare,
                text: block.lines.join("\n"),
            }),
            "http" => {
                let http = parse_http(&block.lines);
                let position = match http.start.split_whitespace().collect::<Vec<_>>()[..] {
                    [version, status, ..] if version.starts_with("HTTP/") => {
                        Position::HttpResponse {
                            status: status.parse().expect("numeric HTTP status"),
                            content_type: http.content_type.clone(),
                            request: last_request.clone(),
                        }
                    }
                    [method, path, ..] => {
                        let route = Route {
                            method: method.to_string(),
                            path: path.to_string(),
                        };
                        last_request = Some(route.clone());
                        Position::HttpRequest(route)
                    }
                    _ => panic!("{}: unreadable HTTP start line", origin(0)),
                };
                if http.content_type.starts_with("text/event-stream") {
                    let request = last_request.clone();
                    examples.extend(sse_lines(&block.lines).map(|(offset, data)| Example {
                        origin: origin(offset),
                        position: Position::Sse(request.clone()),
                        text: data,
                    }));
                } else if !http.body.trim().is_empty() {
                    examples.push(Example {
                        origin: origin(0),
                        position,
                        text: http.body,
                    });
                }
            }
            "text" => {
                let request = last_request.clone();
                examples.extend(sse_lines(&block.lines).map(|(offset, data)| Example {
                    origin: origin(offset),
                    position: Position::Sse(request.clone()),
                    text: data,
                }));
            }
            _ => {}
        }
    }
    examples
}

/// An HTTP message from an ```http block.
struct Http {
    start: String,
    content_type: String,
    body: String,
}

/// Splits an ```http block; the body starts after a blank line or at the first
/// line opening a JSON value (one topic page omits the blank line).
fn parse_http(lines: &[String]) -> Http {
    let mut iter = lines.iter().skip_while(|l| l.trim().is_empty());
    let start = iter
        .next()
        .map(|l| l.trim().to_string())
        .unwrap_or_default();
    let mut content_type = String::new();
    let mut body = Vec::new();
    let mut in_body = false;
    for line in iter {
        let trimmed = line.trim();
        if in_body {
            body.push(line.as_str());
        } else if trimmed.is_empty() {
            in_body = true;
        } else if trimmed.starts_with('{') || trimmed.starts_with('[') {
            in_body = true;
            body.push(line.as_str());
        } else if let Some((name, value)) = trimmed.split_once(':') {
            if name.eq_ignore_ascii_case("content-type") {
                content_type = value.trim().to_ascii_lowercase();
            }
        }
    }
    Http {
        start,
        content_type,
        body: body.join("\n"),
    }
}

/// The `data:` lines of an SSE body, with their offset in the block.
fn sse_lines(lines: &[String]) -> impl Iterator<Item = (usize, String)> + '_ {
    lines.iter().enumerate().filter_map(|(i, line)| {
        line.trim()
            .strip_prefix("data:")
            .map(|data| (i + 1, data.trim().to_string()))
    })
}

// ---------------------------------------------------------------------------
// Skip rules and repairs
// ---------------------------------------------------------------------------

/// Why an example is not round-tripped. Every skip names one of these.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Skip {
    PlaceholderComment,
    MalformedJson,
    V03Kind,
    V03Role,
    V03CardField,
    ProblemJson,
    RestErrorStatus,
    JsonRpcError,
    JwsHeader,
    FormatIllustration,
}

impl Skip {
    fn name(self) -> &'static str {
        match self {
            Self::PlaceholderComment => "placeholder-comment",
            Self::MalformedJson => "malformed-json",
            Self::V03Kind => "v03-kind",
            Self::V03Role => "v03-role",
            Self::V03CardField => "v03-card-field",
            Self::ProblemJson => "problem-json",
            Self::RestErrorStatus => "rest-error-status",
            Self::JsonRpcError => "jsonrpc-error",
            Self::JwsHeader => "jws-header",
            Self::FormatIllustration => "format-illustration",
        }
    }

    fn why(self) -> &'static str {
        match self {
            Self::PlaceholderComment => {
                "a /* ... */ or // comment stands in for content: a shape sketch, not an object"
            }
            Self::MalformedJson => "not JSON even after the trailing-comma repair (spec typo)",
            Self::V03Kind => {
                "v0.3 `kind` discriminator; 1.0 has none (digest §3.1 'There is no kind field', §7.1)"
            }
            Self::V03Role => {
                "v0.3 lowercase role \"user\"; 1.0 says ROLE_USER (digest §7.1 names \
                 life-of-a-task.md); Baton still parses it leniently (checked)"
            }
            Self::V03CardField => {
                "AgentCard field removed in 1.0: top-level url / supportsExtendedAgentCard \
                 (digest §3.5 'Removed in 1.0', §5)"
            }
            Self::ProblemJson => {
                "RFC 9457 problem+json error; 1.0 REST errors are google.rpc.Status \
                 (digest §2.3 [spec-bug])"
            }
            Self::RestErrorStatus => {
                "google.rpc.Status REST error body: not an a2a.proto message, and Baton \
                 serves only the JSON-RPC binding"
            }
            Self::JsonRpcError => {
                "JSON-RPC error response: Baton writes these but never parses them; \
                 code, @type, reason, domain and details cross-checked against \
                 GatewayError::to_rpc_error"
            }
            Self::JwsHeader => "decoded JOSE protected header (RFC 7515), not an A2A object",
            Self::FormatIllustration => {
                "field-format illustration holding no A2A message (bag of timestamps); \
                 each value checked to parse and re-emit as a Baton timestamp"
            }
        }
    }
}

/// A repair applied before the round trip; the example still counts as round-tripped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Fix {
    /// A trailing comma before `}` or `]` (spec typo) was removed.
    TrailingComma,
    /// A `raw` value that is no base64 at all (e.g. `iVBORw0KGgo...`) is a
    /// placeholder; Baton is first checked to reject it, then it is replaced by
    /// the base64 of its own text.
    PlaceholderBase64,
}

/// The text with the contents of every JSON string blanked, so rules see syntax only.
fn syntax_only(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let (mut in_string, mut escaped) = (false, false);
    for c in text.chars() {
        if in_string {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
                out.push('"');
                continue;
            }
            out.push(' ');
        } else {
            in_string = c == '"';
            out.push(c);
        }
    }
    out
}

/// Removes commas that directly precede `}` or `]` outside strings.
fn strip_trailing_commas(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mask: Vec<char> = syntax_only(text).chars().collect();
    let mut out = String::with_capacity(text.len());
    for (i, &c) in chars.iter().enumerate() {
        if mask[i] == ',' {
            let next = mask[i + 1..].iter().find(|c| !c.is_whitespace());
            if matches!(next, Some('}' | ']')) {
                continue;
            }
        }
        out.push(c);
    }
    out
}

/// Fields holding a `google.protobuf.Struct`/`Value`: opaque JSON, never renamed,
/// normalised or inspected.
const OPAQUE: &[&str] = &["metadata", "params", "header", "data"];

/// Visits every object of a wire payload, not descending into opaque fields.
fn visit_objects(value: &mut Value, f: &mut dyn FnMut(&mut Map<String, Value>)) {
    match value {
        Value::Object(map) => {
            f(map);
            for (key, child) in map.iter_mut() {
                if !OPAQUE.contains(&key.as_str()) {
                    visit_objects(child, f);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|item| visit_objects(item, f)),
        _ => {}
    }
}

/// Replaces `raw` values that are not base64 in any alphabet; true if any was.
fn patch_placeholder_base64(value: &mut Value) -> bool {
    let mut patched = false;
    visit_objects(value, &mut |map| {
        if let Some(Value::String(raw)) = map.get_mut("raw") {
            if decode_base64(raw).is_err() {
                *raw = encode_base64(raw.as_bytes());
                patched = true;
            }
        }
    });
    patched
}

/// v0.3 leftovers in a payload, by rule.
fn v03_leftover(payload: &Value) -> Option<Skip> {
    let mut found = None;
    let mut payload = payload.clone();
    visit_objects(&mut payload, &mut |map| {
        if map.contains_key("kind") {
            found = found.or(Some(Skip::V03Kind));
        }
        if matches!(
            map.get("role").and_then(Value::as_str),
            Some("user" | "agent")
        ) {
            found = found.or(Some(Skip::V03Role));
        }
    });
    found
}

/// AgentCard members that 1.0 removed (digest §3.5).
const REMOVED_CARD_FIELDS: &[&str] = &[
    "url",
    "protocolVersion",
    "preferredTransport",
    "additionalInterfaces",
    "supportsAuthenticatedExtendedCard",
    "supportsExtendedAgentCard",
];

// ---------------------------------------------------------------------------
// Classification
// ---------------------------------------------------------------------------

macro_rules! wire_types {
    ($($ty:ident),* $(,)?) => {
        /// The Baton types an example can be round-tripped through.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        enum Ty { $($ty),* }

        impl Ty {
            /// Parses `json` as this type the way the server parses params, and
            /// serializes it back.
            fn round_trip(self, json: &str) -> Result<Value, String> {
                match self {
                    $(Ty::$ty => round_trip_as::<$ty>(json),)*
                }
            }
        }
    };
}

wire_types!(
    SendMessageRequest,
    GetTaskRequest,
    ListTasksRequest,
    CancelTaskRequest,
    SubscribeToTaskRequest,
    TaskPushNotificationConfig,
    TaskPushNotificationConfigRef,
    ListTaskPushNotificationConfigsRequest,
    GetExtendedAgentCardRequest,
    SendMessageResponse,
    StreamResponse,
    Task,
    ListTasksResponse,
    ListTaskPushNotificationConfigsResponse,
    AgentCard,
    Message,
    Part,
    Artifact,
    AgentCardSignature,
    TaskStatus,
    TaskStatusUpdateEvent,
    TaskArtifactUpdateEvent,
);

/// Parses with the server's own params decoder (field paths in errors) and
/// serializes back.
fn round_trip_as<T: DeserializeOwned + Serialize>(json: &str) -> Result<Value, String> {
    let raw: Box<RawValue> = serde_json::from_str(json).map_err(|e| e.to_string())?;
    let parsed: T = decode_params(&raw).map_err(|e| e.to_string())?;
    serde_json::to_value(&parsed).map_err(|e| e.to_string())
}

/// The params type of a JSON-RPC method.
fn params_type(method: &str) -> Option<Ty> {
    Some(match method {
        methods::SEND_MESSAGE | methods::SEND_STREAMING_MESSAGE => Ty::SendMessageRequest,
        methods::GET_TASK => Ty::GetTaskRequest,
        methods::LIST_TASKS => Ty::ListTasksRequest,
        methods::CANCEL_TASK => Ty::CancelTaskRequest,
        methods::SUBSCRIBE_TO_TASK => Ty::SubscribeToTaskRequest,
        methods::CREATE_PUSH_CONFIG => Ty::TaskPushNotificationConfig,
        methods::GET_PUSH_CONFIG | methods::DELETE_PUSH_CONFIG => Ty::TaskPushNotificationConfigRef,
        methods::LIST_PUSH_CONFIGS => Ty::ListTaskPushNotificationConfigsRequest,
        methods::GET_EXTENDED_AGENT_CARD => Ty::GetExtendedAgentCardRequest,
        _ => return None,
    })
}

/// The result type of a JSON-RPC method (per event, for the streaming ones).
fn result_type(method: &str) -> Option<Ty> {
    Some(match method {
        methods::SEND_MESSAGE => Ty::SendMessageResponse,
        methods::SEND_STREAMING_MESSAGE | methods::SUBSCRIBE_TO_TASK => Ty::StreamResponse,
        methods::GET_TASK | methods::CANCEL_TASK => Ty::Task,
        methods::LIST_TASKS => Ty::ListTasksResponse,
        methods::CREATE_PUSH_CONFIG | methods::GET_PUSH_CONFIG => Ty::TaskPushNotificationConfig,
        methods::LIST_PUSH_CONFIGS => Ty::ListTaskPushNotificationConfigsResponse,
        methods::GET_EXTENDED_AGENT_CARD => Ty::AgentCard,
        _ => return None,
    })
}

/// The body types of an HTTP+JSON route: (request body, response body).
fn route_types(route: &Route) -> Option<(Option<Ty>, Ty)> {
    let path = route.path.split('?').next().unwrap_or_default();
    Some(match (route.method.as_str(), path) {
        ("POST", "/message:send") => (Some(Ty::SendMessageRequest), Ty::SendMessageResponse),
        ("POST", "/message:stream") => (Some(Ty::SendMessageRequest), Ty::StreamResponse),
        ("GET", "/tasks") => (None, Ty::ListTasksResponse),
        ("GET", p) if p.starts_with("/tasks/") && !p[7..].contains('/') => (None, Ty::Task),
        ("POST", p) if p.starts_with("/tasks/") && p.ends_with(":cancel") => {
            (Some(Ty::CancelTaskRequest), Ty::Task)
        }
        ("GET", "/extendedAgentCard" | "/.well-known/agent-card.json") => (None, Ty::AgentCard),
        // A push notification is one StreamResponse posted to the client's webhook (§4.3).
        ("POST", p) if p.contains("webhook") => (Some(Ty::StreamResponse), Ty::StreamResponse),
        _ => return None,
    })
}

/// The type of a bare object, by its keys.
fn shape_type(object: &Map<String, Value>) -> Option<Ty> {
    let has = |key: &str| object.contains_key(key);
    let only = |keys: &[&str]| object.keys().all(|k| keys.contains(&k.as_str()));
    const CARD: &[&str] = &[
        "name",
        "description",
        "supportedInterfaces",
        "provider",
        "version",
        "documentationUrl",
        "capabilities",
        "securitySchemes",
        "securityRequirements",
        "defaultInputModes",
        "defaultOutputModes",
        "skills",
        "signatures",
        "iconUrl",
    ];
    const PART: &[&str] = &[
        "text",
        "raw",
        "url",
        "data",
        "metadata",
        "filename",
        "mediaType",
    ];
    Some(if object.len() == 1 && (has("task") || has("message")) {
        Ty::SendMessageResponse
    } else if object.len() == 1 && (has("statusUpdate") || has("artifactUpdate")) {
        Ty::StreamResponse
    } else if has("tasks") {
        Ty::ListTasksResponse
    } else if has("configs") {
        Ty::ListTaskPushNotificationConfigsResponse
    } else if has("artifactId") {
        Ty::Artifact
    } else if has("protected") && has("signature") {
        Ty::AgentCardSignature
    } else if has("taskId") && has("artifact") {
        Ty::TaskArtifactUpdateEvent
    } else if has("taskId") && has("status") {
        Ty::TaskStatusUpdateEvent
    } else if has("id") && has("status") {
        Ty::Task
    } else if has("url") && (has("authentication") || has("token") || has("taskId")) {
        Ty::TaskPushNotificationConfig
    } else if has("messageId") || has("role") || has("parts") {
        Ty::Message
    } else if has("state") {
        Ty::TaskStatus
    } else if only(PART) && ["text", "raw", "url", "data"].iter().any(|k| has(k)) {
        Ty::Part
    } else if CARD.iter().any(|k| has(k)) || REMOVED_CARD_FIELDS.iter().any(|k| has(k)) {
        Ty::AgentCard
    } else {
        return None;
    })
}

// ---------------------------------------------------------------------------
// Normalisation
// ---------------------------------------------------------------------------

/// proto3 `optional` fields: set-to-default is not the same as absent, so these
/// keep their default values through normalisation (and must survive the trip).
const OPTIONAL_FIELDS: &[&str] = &[
    "historyLength",
    "pageSize",
    "includeArtifacts",
    "streaming",
    "pushNotifications",
    "extendedAgentCard",
    "documentationUrl",
    "iconUrl",
];

/// Timestamp fields (`google.protobuf.Timestamp`).
const TIMESTAMP_FIELDS: &[&str] = &["timestamp", "statusTimestampAfter"];

/// Normalises a wire payload (not a JSON-RPC envelope) so that two ProtoJSON
/// encodings of the same message compare equal. Opaque `Struct`/`Value` fields
/// ([`OPAQUE`]) are compared verbatim. The rules:
fn normalise(value: &Value) -> Value {
    match value {
        Value::Object(map) => {
            let mut out = Map::new();
            for (key, child) in map {
                // Rule 1: parsers accept the proto (snake_case) name; printers
                // write lowerCamelCase.
                let key = baton::protocol::wire::to_camel_case(key);
                let child = if OPAQUE.contains(&key.as_str()) {
                    child.clone()
                } else if TIMESTAMP_FIELDS.contains(&key.as_str()) && child.is_string() {
                    // Rule 2: any RFC 3339 offset and precision is valid input;
                    // compare as UTC at millisecond precision, as Baton prints.
                    let text = child.as_str().unwrap_or_default();
                    parse_timestamp(text)
                        .map(|ts| Value::String(format_timestamp(&ts)))
                        .unwrap_or_else(|_| child.clone())
                } else {
                    normalise(child)
                };
                // Rule 3: a non-`optional` field at its default ("", 0, false,
                // [], {}, null, enum zero) is the same as an absent one: printers
                // omit it, parsers read absence (and null) as the default.
                if is_default(&child) && !OPTIONAL_FIELDS.contains(&key.as_str()) {
                    continue;
                }
                out.insert(key, child);
            }
            Value::Object(out)
        }
        Value::Array(items) => Value::Array(items.iter().map(normalise).collect()),
        other => other.clone(),
    }
}

/// Whether a JSON value is a proto default.
fn is_default(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty() || s.ends_with("_UNSPECIFIED"),
        Value::Array(items) => items.is_empty(),
        Value::Object(map) => map.is_empty(),
    }
}

/// The first path where two values differ, for failure messages.
fn first_difference(a: &Value, b: &Value, path: &str) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            keys.into_iter().find_map(|k| match (x.get(k), y.get(k)) {
                (Some(p), Some(q)) => first_difference(p, q, &format!("{path}.{k}")),
                (p, q) => Some(format!("{path}.{k}: spec {p:?}, Baton {q:?}")),
            })
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (p, q))| first_difference(p, q, &format!("{path}[{i}]"))),
        _ if a == b => None,
        _ => Some(format!("{path}: spec {a}, Baton {b}")),
    }
}

/// Compares an original payload with Baton's output after [`normalise`].
fn compare(original: &Value, output: &Value) -> Result<(), String> {
    let (a, b) = (normalise(original), normalise(output));
    match first_difference(&a, &b, "$") {
        None => Ok(()),
        Some(diff) => Err(format!(
            "{diff}\n  spec (normalised):  {a}\n  Baton (normalised): {b}"
        )),
    }
}

// ---------------------------------------------------------------------------
// Running one example
// ---------------------------------------------------------------------------

/// What happened to one example.
enum Outcome {
    RoundTripped { class: String, fixes: Vec<Fix> },
    Skipped { rule: Skip, detail: String },
    Failed(String),
}

/// The JSON-RPC methods seen so far in a file, by request id, for typing responses.
type RpcMethods = HashMap<String, String>;

/// Skip rules, repairs, classification and the round trip of one example.
fn run_example(example: &Example, rpc_methods: &mut RpcMethods) -> Outcome {
    let skip = |rule, detail: &str| Outcome::Skipped {
        rule,
        detail: detail.to_string(),
    };
    let syntax = syntax_only(&example.text);
    if syntax.contains("/*") || syntax.contains("//") {
        return skip(Skip::PlaceholderComment, "");
    }
    let mut fixes = Vec::new();
    let mut text = example.text.clone();
    if serde_json::from_str::<Value>(&text).is_err() {
        let repaired = strip_trailing_commas(&text);
        if repaired != text {
            text = repaired;
            fixes.push(Fix::TrailingComma);
        }
    }
    let value: Value = match serde_json::from_str(&text) {
        Ok(value) => value,
        Err(err) => return skip(Skip::MalformedJson, &err.to_string()),
    };

    // Pair JSON-RPC responses with their request's method before any skip.
    let rpc_id = value.get("id").map(Value::to_string);
    let rpc_method = value
        .get("method")
        .and_then(Value::as_str)
        .map(str::to_string);
    if let (Some(id), Some(method), Some(_)) = (&rpc_id, &rpc_method, value.get("jsonrpc")) {
        rpc_methods.insert(id.clone(), method.clone());
    }

    // Error bodies first: they are not a2a.proto messages.
    if let Position::HttpResponse {
        status,
        content_type,
        ..
    } = &example.position
    {
        if content_type.contains("problem+json") {
            return skip(Skip::ProblemJson, &format!("HTTP {status}"));
        }
        if !(200..300).contains(status) {
            return skip(Skip::RestErrorStatus, &format!("HTTP {status}"));
        }
    }
    if value.get("jsonrpc").is_some() && value.get("error").is_some() {
        return match cross_check_rpc_error(&value["error"]) {
            Ok(()) => skip(Skip::JsonRpcError, "cross-checked"),
            Err(err) => Outcome::Failed(err),
        };
    }
    if value.get("alg").is_some() && value.get("kid").is_some() {
        return skip(Skip::JwsHeader, "");
    }
    if let Some(outcome) = format_illustration(&value) {
        return outcome;
    }

    // The payload, and the type to read it as.
    let envelope = value.get("jsonrpc").is_some();
    let payload_key = if !envelope {
        None
    } else if value.get("method").is_some() {
        Some("params")
    } else {
        Some("result")
    };
    let payload = match payload_key {
        Some(key) => value.get(key).cloned().unwrap_or(json!({})),
        None => value.clone(),
    };
    if let Some(rule) = v03_leftover(&payload) {
        if rule == Skip::V03Role {
            // Baton reads v0.3 role spellings leniently; check that much.
            if let Some(Err(err)) = classify(example, &value, &payload, rpc_methods)
                .map(|(ty, _)| ty.round_trip(&payload.to_string()))
            {
                return Outcome::Failed(format!("v0.3 role not parsed leniently: {err}"));
            }
        }
        return skip(rule, "");
    }
    let Some((ty, class)) = classify(example, &value, &payload, rpc_methods) else {
        return Outcome::Failed(format!("cannot classify: {value}"));
    };
    if ty == Ty::AgentCard {
        let removed: Vec<&str> = REMOVED_CARD_FIELDS
            .iter()
            .copied()
            .filter(|k| payload.get(*k).is_some())
            .collect();
        if !removed.is_empty() {
            return skip(Skip::V03CardField, &removed.join(", "));
        }
    }

    let mut payload = payload;
    let before_patch = payload.clone();
    if patch_placeholder_base64(&mut payload) {
        if ty.round_trip(&before_patch.to_string()).is_ok() {
            return Outcome::Failed("Baton accepted a raw value that is not base64".into());
        }
        fixes.push(Fix::PlaceholderBase64);
    }

    let result = if envelope {
        round_trip_envelope(&value, payload_key.unwrap_or_default(), &payload, ty)
    } else {
        ty.round_trip(&payload.to_string())
            .and_then(|output| compare(&payload, &output))
    };
    match result {
        Ok(()) => Outcome::RoundTripped { class, fixes },
        Err(err) => Outcome::Failed(format!("{class}: {err}")),
    }
}

/// The Baton type of a payload, and a label for the report.
fn classify(
    example: &Example,
    value: &Value,
    payload: &Value,
    rpc_methods: &RpcMethods,
) -> Option<(Ty, String)> {
    let by_shape = || payload.as_object().and_then(shape_type);
    if value.get("jsonrpc").is_some() {
        if let Some(method) = value.get("method").and_then(Value::as_str) {
            let ty = params_type(method)?;
            return Some((ty, format!("JSON-RPC {method} params: {ty:?}")));
        }
        let id = value.get("id").map(Value::to_string).unwrap_or_default();
        return match rpc_methods.get(&id) {
            Some(method) => {
                let ty = result_type(method)?;
                Some((ty, format!("JSON-RPC {method} result: {ty:?}")))
            }
            None => by_shape().map(|ty| (ty, format!("JSON-RPC result by shape: {ty:?}"))),
        };
    }
    match &example.position {
        Position::Bare => by_shape().map(|ty| (ty, format!("bare {ty:?}"))),
        Position::HttpRequest(route) => {
            let ty = route_types(route)
                .and_then(|(req, _)| req)
                .or_else(by_shape)?;
            Some((ty, format!("{} {} body: {ty:?}", route.method, route.path)))
        }
        Position::HttpResponse { request, .. } => {
            let ty = request
                .as_ref()
                .and_then(route_types)
                .map(|(_, resp)| resp)
                .or_else(by_shape)?;
            Some((ty, format!("HTTP response body: {ty:?}")))
        }
        // Every SSE event of A2A is one StreamResponse (§3.1.2, §11.7).
        Position::Sse(request) => {
            let after = request
                .as_ref()
                .map(|r| format!(" of {} {}", r.method, r.path))
                .unwrap_or_default();
            Some((
                Ty::StreamResponse,
                format!("SSE data{after}: StreamResponse"),
            ))
        }
    }
}

/// Round-trips a JSON-RPC request or success response through the server's
/// own envelope code (`parse_request` + `decode_params`, `success_body`).
fn round_trip_envelope(envelope: &Value, key: &str, payload: &Value, ty: Ty) -> Result<(), String> {
    let mut patched = envelope.clone();
    if envelope.get(key).is_some() {
        patched[key] = payload.clone();
    }
    let body = patched.to_string();
    let output: Value = if key == "params" {
        let request = parse_request(body.as_bytes()).map_err(|e| e.error.to_string())?;
        let params = ty.round_trip(request.params.get())?;
        let id: Value = serde_json::from_str(request.id.get()).map_err(|e| e.to_string())?;
        json!({"jsonrpc": "2.0", "id": id, "method": request.method, "params": params})
    } else {
        let result = ty.round_trip(&payload.to_string())?;
        let id: Box<RawValue> =
            serde_json::value::to_raw_value(&envelope["id"]).map_err(|e| e.to_string())?;
        let bytes = success_body(&id, &result).map_err(|e| e.to_string())?;
        serde_json::from_slice(&bytes).map_err(|e| e.to_string())?
    };
    for member in ["jsonrpc", "id", "method"] {
        if envelope.get(member) != output.get(member) {
            return Err(format!(
                "envelope member {member}: spec {:?}, Baton {:?}",
                envelope.get(member),
                output.get(member)
            ));
        }
    }
    // An absent `params` is the empty request (rule 3 of `normalise`).
    compare(payload, &output[key])
}

/// Rebuilds a spec JSON-RPC error with `GatewayError` and compares what must match.
fn cross_check_rpc_error(error: &Value) -> Result<(), String> {
    let detail = &error["data"][0];
    let ours = match error["code"].as_i64() {
        Some(-32602) => {
            let violations = detail["fieldViolations"]
                .as_array()
                .ok_or("BadRequest without fieldViolations")?
                .iter()
                .map(|v| {
                    baton::error::FieldViolation::new(
                        v["field"].as_str().unwrap_or_default(),
                        v["description"].as_str().unwrap_or_default(),
                    )
                })
                .collect();
            GatewayError::invalid_fields(violations)
        }
        Some(-32001) => GatewayError::TaskNotFound(
            detail["metadata"]["taskId"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        ),
        other => return Err(format!("no cross-check for JSON-RPC error code {other:?}")),
    }
    .to_rpc_error();
    let mine = &ours["data"][0];
    let mut pairs = vec![
        ("code", &error["code"], &ours["code"]),
        ("@type", &detail["@type"], &mine["@type"]),
        ("reason", &detail["reason"], &mine["reason"]),
        ("domain", &detail["domain"], &mine["domain"]),
        (
            "fieldViolations",
            &detail["fieldViolations"],
            &mine["fieldViolations"],
        ),
    ];
    if let Some(metadata) = mine["metadata"].as_object() {
        for (key, value) in metadata {
            pairs.push(("metadata", &detail["metadata"][key], value));
        }
    }
    for (what, spec, baton) in pairs {
        if spec != baton {
            return Err(format!("JSON-RPC error {what}: spec {spec}, Baton {baton}"));
        }
    }
    Ok(())
}

/// A bag of timestamps illustrating the format: each must round-trip as a
/// Baton timestamp (they are already UTC milliseconds).
fn format_illustration(value: &Value) -> Option<Outcome> {
    let map = value.as_object()?;
    let all_timestamps = !map.is_empty()
        && map
            .values()
            .all(|v| v.as_str().is_some_and(|s| parse_timestamp(s).is_ok()));
    if !all_timestamps {
        return None;
    }
    for text in map.values().filter_map(Value::as_str) {
        let status = json!({"state": "TASK_STATE_WORKING", "timestamp": text});
        match Ty::TaskStatus.round_trip(&status.to_string()) {
            Ok(out) if out["timestamp"] == *text => {}
            other => return Some(Outcome::Failed(format!("timestamp {text}: {other:?}"))),
        }
    }
    Some(Outcome::Skipped {
        rule: Skip::FormatIllustration,
        detail: String::new(),
    })
}

// ---------------------------------------------------------------------------
// The round-trip test
// ---------------------------------------------------------------------------

/// Examples measured to round-trip at the time of writing; fewer means the
/// extraction or a rule broke.
const ROUND_TRIP_FLOOR: usize = 47;

#[test]
fn every_spec_example_round_trips() {
    let mut round_tripped = 0;
    let mut fixed: BTreeMap<Fix, usize> = BTreeMap::new();
    let mut skipped: BTreeMap<Skip, Vec<String>> = BTreeMap::new();
    let mut failures = Vec::new();
    let mut total = 0;

    for (file, markdown) in spec_files() {
        let mut rpc_methods = RpcMethods::new();
        for example in examples_of(&file, &markdown) {
            total += 1;
            match run_example(&example, &mut rpc_methods) {
                Outcome::RoundTripped { class, fixes } => {
                    round_tripped += 1;
                    for fix in &fixes {
                        *fixed.entry(*fix).or_default() += 1;
                    }
                    println!("ok    {:<34} {class} {fixes:?}", example.origin);
                }
                Outcome::Skipped { rule, detail } => {
                    println!("skip  {:<34} {} {detail}", example.origin, rule.name());
                    skipped
                        .entry(rule)
                        .or_default()
                        .push(example.origin.clone());
                }
                Outcome::Failed(err) => {
                    println!("FAIL  {:<34} {err}", example.origin);
                    failures.push(format!("{}: {err}", example.origin));
                }
            }
        }
    }

    let skipped_total: usize = skipped.values().map(Vec::len).sum();
    println!(
        "\n{total} JSON examples: {round_tripped} round-tripped, {skipped_total} skipped, {} failed",
        failures.len()
    );
    for (fix, count) in &fixed {
        println!("  repaired {count:>2} × {fix:?}");
    }
    for (rule, origins) in &skipped {
        println!(
            "  skipped {:>2} × {:<20} {}\n             at {}",
            origins.len(),
            rule.name(),
            rule.why(),
            origins.join(", ")
        );
    }
    assert!(
        failures.is_empty(),
        "{} spec examples do not round-trip:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert_eq!(total, round_tripped + skipped_total);
    assert!(
        round_tripped >= ROUND_TRIP_FLOOR,
        "only {round_tripped} examples round-tripped (floor {ROUND_TRIP_FLOOR})"
    );
}

// ---------------------------------------------------------------------------
// ProtoJSON specifics the examples do not cover
// ---------------------------------------------------------------------------

/// Parses like the server (from text).
fn parse<T: DeserializeOwned>(value: Value) -> Result<T, String> {
    serde_json::from_str(&value.to_string()).map_err(|e| e.to_string())
}

/// Parses and serializes back.
fn trip<T: DeserializeOwned + Serialize>(value: Value) -> Value {
    let parsed: T = parse(value.clone()).unwrap_or_else(|e| panic!("{value} rejected: {e}"));
    serde_json::to_value(&parsed).unwrap()
}

fn to_json<T: Serialize>(value: &T) -> Value {
    serde_json::to_value(value).unwrap()
}

#[test]
fn optional_fields_are_emitted_when_set_to_zero_or_false() {
    for (value, ty) in [
        (json!({"id": "t", "historyLength": 0}), Ty::GetTaskRequest),
        (
            json!({"pageSize": 0, "historyLength": 0, "includeArtifacts": false}),
            Ty::ListTasksRequest,
        ),
        (
            json!({"message": {"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "hi"}]},
                   "configuration": {"historyLength": 0}}),
            Ty::SendMessageRequest,
        ),
    ] {
        assert_eq!(ty.round_trip(&value.to_string()).unwrap(), value, "{ty:?}");
    }
    let capabilities =
        json!({"streaming": false, "pushNotifications": false, "extendedAgentCard": false});
    assert_eq!(
        trip::<AgentCapabilities>(capabilities.clone()),
        capabilities
    );
    let card = trip::<AgentCard>(
        json!({"documentationUrl": "", "iconUrl": "", "capabilities": capabilities}),
    );
    assert_eq!(card["documentationUrl"], "");
    assert_eq!(card["iconUrl"], "");
    assert_eq!(card["capabilities"], capabilities);

    // Unset stays absent.
    assert_eq!(to_json(&AgentCapabilities::default()), json!({}));
    assert_eq!(
        trip::<GetTaskRequest>(json!({"id": "t"})),
        json!({"id": "t"})
    );
    assert_eq!(trip::<ListTasksRequest>(json!({})), json!({}));
    let card = to_json(&AgentCard::default());
    for key in ["documentationUrl", "iconUrl", "provider", "signatures"] {
        assert!(card.get(key).is_none(), "{key} emitted unset: {card}");
    }
}

#[test]
fn defaults_are_omitted() {
    let event = TaskArtifactUpdateEvent {
        task_id: "t".into(),
        context_id: "c".into(),
        artifact: Artifact {
            artifact_id: "a".into(),
            parts: vec![Part::text("x")],
            ..Artifact::default()
        },
        append: false,
        last_chunk: false,
        metadata: None,
    };
    assert_eq!(
        to_json(&event),
        json!({"taskId": "t", "contextId": "c", "artifact": {"artifactId": "a", "parts": [{"text": "x"}]}})
    );
    let chunk = json!({"taskId": "t", "contextId": "c", "artifact": {"artifactId": "a"},
                       "append": true, "lastChunk": true});
    assert_eq!(trip::<TaskArtifactUpdateEvent>(chunk.clone()), chunk);

    assert_eq!(to_json(&Message::default()), json!({}));
    assert_eq!(to_json(&Part::text("x")), json!({"text": "x"}));
    assert_eq!(to_json(&SendMessageRequest::default()), json!({}));
    assert_eq!(to_json(&SendMessageConfiguration::default()), json!({}));
    assert_eq!(to_json(&ListTasksRequest::default()), json!({}));
    assert_eq!(to_json(&GetExtendedAgentCardRequest::default()), json!({}));
    assert_eq!(
        to_json(&ListTaskPushNotificationConfigsResponse::default()),
        json!({})
    );
    assert_eq!(
        to_json(&ListTaskPushNotificationConfigsRequest {
            task_id: "t".into(),
            ..Default::default()
        }),
        json!({"taskId": "t"})
    );
    assert_eq!(
        to_json(&TaskPushNotificationConfig {
            url: "https://h/w".into(),
            ..Default::default()
        }),
        json!({"url": "https://h/w"})
    );
    assert_eq!(
        to_json(&AgentExtension {
            uri: "urn:x".into(),
            ..Default::default()
        }),
        json!({"uri": "urn:x"})
    );
    let task = to_json(&Task {
        id: "t".into(),
        status: TaskStatus {
            state: TaskState::Working,
            ..TaskStatus::default()
        },
        ..Task::default()
    });
    assert_eq!(
        task,
        json!({"id": "t", "status": {"state": "TASK_STATE_WORKING"}})
    );
    // Empty strings and lists given on input are dropped on output.
    assert_eq!(
        trip::<Message>(
            json!({"messageId": "m", "contextId": "", "taskId": "", "role": "ROLE_USER",
                               "parts": [{"text": "hi", "filename": "", "mediaType": ""}],
                               "extensions": [], "referenceTaskIds": []})
        ),
        json!({"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "hi"}]})
    );
    // ListTasksResponse is the exception: every field is always present (§3.1.4).
    assert_eq!(
        to_json(&ListTasksResponse::<Task>::default()),
        json!({"tasks": [], "nextPageToken": "", "pageSize": 0, "totalSize": 0})
    );
}

#[test]
fn oneofs_with_two_members_are_rejected() {
    for part in [
        json!({"text": "a", "url": "https://h/x"}),
        json!({"raw": "aGk=", "data": {"k": 1}}),
        json!({"text": "a", "data": null, "raw": "aGk="}),
        json!({"filename": "a.txt"}),
    ] {
        let err = parse::<Part>(part.clone()).expect_err(&part.to_string());
        assert!(err.contains("exactly one"), "{part}: {err}");
    }
    let task = json!({"id": "t", "status": {"state": "TASK_STATE_WORKING"}});
    let message = json!({"messageId": "m", "role": "ROLE_AGENT", "parts": [{"text": "a"}]});
    assert!(parse::<SendMessageResponse>(json!({"task": task, "message": message})).is_err());
    assert!(parse::<StreamResponse>(json!({"task": task, "message": message})).is_err());
    assert!(parse::<StreamResponse>(json!({})).is_err());
    assert!(parse::<SendMessageResponse>(json!({})).is_err());
}

#[test]
fn integer_enums_are_accepted() {
    assert_eq!(
        trip::<TaskStatus>(json!({"state": 3})),
        json!({"state": "TASK_STATE_COMPLETED"})
    );
    assert_eq!(
        trip::<Message>(json!({"messageId": "m", "role": 2, "parts": [{"text": "a"}]}))["role"],
        "ROLE_AGENT"
    );
    assert_eq!(
        trip::<ListTasksRequest>(json!({"status": 6})),
        json!({"status": "TASK_STATE_INPUT_REQUIRED"})
    );
    assert_eq!(trip::<TaskStatus>(json!({"state": 0})), json!({}));
    assert!(parse::<TaskStatus>(json!({"state": 99})).is_err());
    assert!(parse::<TaskStatus>(json!({"state": "TASK_STATE_RUNNING"})).is_err());
}

#[test]
fn snake_case_names_are_accepted() {
    let request = json!({
        "tenant": "echo",
        "message": {"message_id": "m", "context_id": "c", "task_id": "t", "role": "ROLE_USER",
                    "reference_task_ids": ["t0"],
                    "parts": [{"raw": "aGk=", "media_type": "text/plain"}]},
        "configuration": {"accepted_output_modes": ["text/plain"], "history_length": 2,
                          "return_immediately": true,
                          "task_push_notification_config": {"url": "https://h/w", "task_id": ""}}
    });
    assert_eq!(
        trip::<SendMessageRequest>(request),
        json!({
            "tenant": "echo",
            "message": {"messageId": "m", "contextId": "c", "taskId": "t", "role": "ROLE_USER",
                        "referenceTaskIds": ["t0"],
                        "parts": [{"raw": "aGk=", "mediaType": "text/plain"}]},
            "configuration": {"acceptedOutputModes": ["text/plain"], "historyLength": 2,
                              "returnImmediately": true,
                              "taskPushNotificationConfig": {"url": "https://h/w"}}
        })
    );
    assert_eq!(
        trip::<ListTasksRequest>(json!({"context_id": "c", "page_size": 5, "page_token": "p",
                                        "history_length": 1, "include_artifacts": true,
                                        "status_timestamp_after": "2026-01-02T03:04:05Z"})),
        json!({"contextId": "c", "pageSize": 5, "pageToken": "p", "historyLength": 1,
               "includeArtifacts": true, "statusTimestampAfter": "2026-01-02T03:04:05.000Z"})
    );
    assert_eq!(
        trip::<StreamResponse>(
            json!({"artifact_update": {"task_id": "t", "context_id": "c",
            "artifact": {"artifact_id": "a", "parts": [{"text": "x"}]}, "last_chunk": true}})
        ),
        json!({"artifactUpdate": {"taskId": "t", "contextId": "c",
            "artifact": {"artifactId": "a", "parts": [{"text": "x"}]}, "lastChunk": true}})
    );
    assert_eq!(
        trip::<StreamResponse>(json!({"status_update": {"task_id": "t", "context_id": "c",
            "status": {"state": "TASK_STATE_WORKING"}}})),
        json!({"statusUpdate": {"taskId": "t", "contextId": "c",
            "status": {"state": "TASK_STATE_WORKING"}}})
    );
    assert_eq!(
        trip::<ListTasksResponse>(json!({"tasks": [], "next_page_token": "n", "page_size": 10,
                                         "total_size": 11})),
        json!({"tasks": [], "nextPageToken": "n", "pageSize": 10, "totalSize": 11})
    );
    assert_eq!(
        trip::<ListTaskPushNotificationConfigsResponse>(json!({"configs": [{"task_id": "t",
            "url": "https://h/w"}], "next_page_token": "n"})),
        json!({"configs": [{"taskId": "t", "url": "https://h/w"}], "nextPageToken": "n"})
    );
    let card = trip::<AgentCard>(json!({
        "name": "a", "description": "d", "version": "1",
        "supported_interfaces": [{"url": "https://h/a2a", "protocol_binding": "JSONRPC",
                                  "protocol_version": "1.0"}],
        "capabilities": {"push_notifications": true, "extended_agent_card": false},
        "default_input_modes": ["text/plain"], "default_output_modes": ["text/plain"],
        "documentation_url": "https://h/doc", "icon_url": "https://h/i.png",
        "security_schemes": {"k": {"api_key_security_scheme": {"location": "header", "name": "X"}}},
        "security_requirements": [{"schemes": {"k": {"list": []}}}],
        "skills": [{"id": "s", "name": "s", "description": "s", "tags": [],
                    "input_modes": ["text/plain"], "output_modes": ["text/plain"]}]
    }));
    assert_eq!(
        card["supportedInterfaces"],
        json!([{"url": "https://h/a2a", "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}])
    );
    assert_eq!(
        card["capabilities"],
        json!({"pushNotifications": true, "extendedAgentCard": false})
    );
    assert_eq!(card["defaultInputModes"], json!(["text/plain"]));
    assert_eq!(card["documentationUrl"], "https://h/doc");
    assert_eq!(card["iconUrl"], "https://h/i.png");
    assert_eq!(
        card["securitySchemes"],
        json!({"k": {"apiKeySecurityScheme": {"location": "header", "name": "X"}}})
    );
    assert_eq!(card["skills"][0]["inputModes"], json!(["text/plain"]));
    assert!(
        card.to_string().find('_').is_none(),
        "snake_case left in {card}"
    );
}

#[test]
fn unknown_fields_are_ignored() {
    let task = json!({"id": "t", "kind": "task", "status": {"state": "TASK_STATE_WORKING", "x": 1},
                      "artifacts": [{"artifactId": "a", "parts": [{"kind": "text", "text": "x"}],
                                     "future": true}],
                      "history": [{"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "q"}],
                                   "final": true}]});
    let clean = json!({"id": "t", "status": {"state": "TASK_STATE_WORKING"},
                       "artifacts": [{"artifactId": "a", "parts": [{"text": "x"}]}],
                       "history": [{"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "q"}]}]});
    assert_eq!(trip::<Task>(task.clone()), clean);
    assert_eq!(
        trip::<SendMessageResponse>(json!({"task": task, "futureField": 1})),
        json!({"task": clean})
    );
    assert_eq!(
        trip::<StreamResponse>(json!({"task": task, "kind": "task"})),
        json!({"task": clean})
    );
    // A hybrid card from an SDK that merges v0.3 fields into the 1.0 card.
    let card = trip::<AgentCard>(
        json!({"name": "a", "url": "https://h", "preferredTransport": "JSONRPC",
                                        "protocolVersion": "0.3", "additionalInterfaces": [],
                                        "supportsAuthenticatedExtendedCard": true}),
    );
    assert_eq!(card["name"], "a");
    for key in [
        "url",
        "preferredTransport",
        "protocolVersion",
        "additionalInterfaces",
    ] {
        assert!(card.get(key).is_none(), "{key} re-emitted");
    }
    assert_eq!(
        trip::<GetTaskRequest>(json!({"id": "t", "A2A-Version": "1.0", "extra": {"a": [1]}})),
        json!({"id": "t"})
    );
}

#[test]
fn null_reads_as_the_default() {
    assert_eq!(
        trip::<Task>(
            json!({"id": "t", "contextId": null, "status": null, "artifacts": null,
                            "history": null, "metadata": null})
        ),
        json!({"id": "t", "status": {}})
    );
    assert_eq!(
        trip::<TaskStatusUpdateEvent>(json!({"taskId": "t", "contextId": "c", "status": null})),
        json!({"taskId": "t", "contextId": "c", "status": {}})
    );
    assert_eq!(
        trip::<TaskArtifactUpdateEvent>(json!({"taskId": "t", "contextId": "c", "artifact": null,
                                               "append": null, "lastChunk": null})),
        json!({"taskId": "t", "contextId": "c", "artifact": {}})
    );
    assert_eq!(
        trip::<AgentCard>(json!({"name": "a", "capabilities": null}))["capabilities"],
        json!({})
    );
    assert_eq!(
        trip::<OAuth2SecurityScheme>(json!({"flows": null, "oauth2MetadataUrl": null})),
        json!({"flows": {}})
    );
    assert_eq!(
        trip::<ListTasksRequest>(json!({"pageSize": null, "historyLength": null,
                                        "includeArtifacts": null, "status": null})),
        json!({})
    );
    assert_eq!(
        trip::<ListTasksResponse>(
            json!({"tasks": null, "nextPageToken": null, "pageSize": null,
                                         "totalSize": null})
        ),
        json!({"tasks": [], "nextPageToken": "", "pageSize": 0, "totalSize": 0})
    );
}

#[test]
fn raw_bytes_accept_any_base64_and_emit_standard_padded() {
    for input in ["-_8", "-_8=", "+/8", "+/8="] {
        assert_eq!(
            trip::<Part>(json!({"raw": input})),
            json!({"raw": "+/8="}),
            "input {input}"
        );
    }
    assert_eq!(trip::<Part>(json!({"raw": "aGk"})), json!({"raw": "aGk="}));
    assert_eq!(trip::<Part>(json!({"raw": ""})), json!({"raw": ""}));
    assert!(parse::<Part>(json!({"raw": "not base64!"})).is_err());
}

#[test]
fn numbers_and_timestamps_are_read_leniently() {
    assert_eq!(
        trip::<GetTaskRequest>(json!({"id": "t", "historyLength": "5"})),
        json!({"id": "t", "historyLength": 5})
    );
    assert_eq!(
        trip::<ListTasksRequest>(json!({"pageSize": 10.0})),
        json!({"pageSize": 10})
    );
    assert!(parse::<ListTasksRequest>(json!({"pageSize": 1.5})).is_err());
    assert_eq!(
        trip::<TaskStatus>(json!({"state": 2, "timestamp": "2026-01-02T03:04:05.123456+02:00"})),
        json!({"state": "TASK_STATE_WORKING", "timestamp": "2026-01-02T01:04:05.123Z"})
    );
    assert!(parse::<TaskStatus>(json!({"timestamp": "yesterday"})).is_err());
}

/// The comparison itself: it forgives only what ProtoJSON allows.
#[test]
fn normalise_forgives_only_protojson_differences() {
    let same = |a: Value, b: Value| compare(&a, &b).is_ok();
    // Forgiven.
    assert!(same(json!({"context_id": "c"}), json!({"contextId": "c"})));
    assert!(same(
        json!({"status": {"timestamp": "2024-03-15T10:15:00.680794+00:00"}}),
        json!({"status": {"timestamp": "2024-03-15T10:15:00.680Z"}})
    ));
    assert!(same(
        json!({"append": false, "name": "", "parts": [], "metadata": null}),
        json!({})
    ));
    assert!(same(json!({}), json!({"description": "", "skills": []})));
    // Not forgiven: a dropped field, a wrong name, a dropped optional default,
    // a rewritten Struct.
    assert!(!same(
        json!({"name": "a", "iconUrl": "x"}),
        json!({"name": "a"})
    ));
    assert!(!same(json!({"mediaType": "a"}), json!({"mimeType": "a"})));
    assert!(!same(json!({"streaming": false}), json!({})));
    assert!(!same(json!({"historyLength": 0}), json!({})));
    assert!(!same(
        json!({"metadata": {"a_b": "", "t": "2024-03-15T10:15:00Z"}}),
        json!({"metadata": {"aB": "", "t": "2024-03-15T10:15:00.000Z"}})
    ));
}
