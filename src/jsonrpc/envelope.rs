//! Parsing the JSON-RPC request envelope, and writing reply envelopes, without
//! building a `serde_json::Value` tree of the whole request.

use crate::error::{FieldViolation, GatewayError};
use serde::de::{DeserializeOwned, IgnoredAny};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_path_to_error::Segment;
use std::borrow::Cow;

/// A parsed request: the id verbatim, the method, and the raw params.
#[derive(Debug)]
pub struct RpcRequest<'a> {
    /// The id as it appeared (string, number or null).
    pub id: &'a RawValue,
    /// The method name (borrowed unless written with escapes).
    pub method: Cow<'a, str>,
    /// The params object (`{}` when absent or null).
    pub params: &'a RawValue,
}

/// A failed parse, with the id to answer with when one was readable.
#[derive(Debug)]
pub struct EnvelopeError<'a> {
    /// The id to echo (`null` when unknown or invalid).
    pub id: Option<&'a RawValue>,
    /// What was wrong.
    pub error: GatewayError,
}

#[derive(Deserialize)]
struct Envelope<'a> {
    #[serde(borrow, default, deserialize_with = "present")]
    jsonrpc: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    id: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    method: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    params: Option<&'a RawValue>,
}

/// `Some` for any present member, `null` included (plain `Option` maps null to `None`).
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue>::deserialize(d).map(Some)
}

fn empty_params() -> &'static RawValue {
    serde_json::from_str::<&RawValue>("{}").expect("literal is valid JSON")
}

/// A JSON string's text: borrowed, unless escapes had to be decoded.
fn json_str(raw: &RawValue) -> Option<Cow<'_, str>> {
    match serde_json::from_str::<&str>(raw.get()) {
        Ok(text) => Some(Cow::Borrowed(text)),
        Err(_) => serde_json::from_str::<String>(raw.get())
            .ok()
            .map(Cow::Owned),
    }
}

/// Parses the envelope of one JSON-RPC request.
pub fn parse_request(body: &[u8]) -> Result<RpcRequest<'_>, EnvelopeError<'_>> {
    let fail = |id, error| Err(EnvelopeError { id, error });
    let first = body.iter().find(|b| !b.is_ascii_whitespace()).copied();
    // Only an object is a request: serde would also fill the envelope from
    // an array, by position.
    let parsed = match first {
        Some(b'{') => serde_json::from_slice::<Envelope>(body),
        _ => serde_json::from_slice::<IgnoredAny>(body).and_then(|_| {
            Err(serde::de::Error::custom(
                "the request must be a JSON object",
            ))
        }),
    };
    let envelope = match parsed {
        // Members the envelope skips are not checked for UTF-8 either.
        Ok(envelope) if body.is_ascii() || std::str::from_utf8(body).is_ok() => envelope,
        Ok(_) => {
            let why = "the request is not valid UTF-8".to_string();
            return fail(None, GatewayError::Parse(why));
        }
        Err(err) => {
            // Valid JSON of the wrong shape is an invalid request, not a parse
            // error. Skipping values does not check the UTF-8 of strings,
            // which JSON requires (RFC 8259 §8.1).
            let json = std::str::from_utf8(body).is_ok()
                && serde_json::from_slice::<IgnoredAny>(body).is_ok();
            let why = if !json {
                return fail(None, GatewayError::Parse(strip_position(&err.to_string())));
            } else if first == Some(b'[') {
                "batch requests are not supported".to_string()
            } else if first == Some(b'{') {
                // An object all the same: serde says what is wrong with it.
                strip_position(&err.to_string())
            } else {
                "the request must be a JSON object".to_string()
            };
            return fail(None, GatewayError::InvalidRequest(why));
        }
    };

    let id = match envelope.id {
        None => {
            return fail(None, GatewayError::InvalidRequest("id is required".into()));
        }
        Some(id) => match id.get().as_bytes().first() {
            Some(b'"' | b'-' | b'0'..=b'9' | b'n') => id,
            _ => {
                return fail(
                    None,
                    GatewayError::InvalidRequest("id must be a string, a number or null".into()),
                );
            }
        },
    };
    // Compared as written first; `"2\u002e0"` is "2.0" too.
    let version = envelope.jsonrpc;
    if version.map(RawValue::get) != Some("\"2.0\"")
        && version.and_then(json_str).as_deref() != Some("2.0")
    {
        return fail(
            Some(id),
            GatewayError::InvalidRequest("jsonrpc must be exactly \"2.0\"".into()),
        );
    }
    let method = match envelope.method.map(json_str) {
        Some(Some(method)) if !method.is_empty() => method,
        Some(_) => {
            return fail(
                Some(id),
                GatewayError::InvalidRequest("method must be a non-empty string".into()),
            );
        }
        None => {
            return fail(
                Some(id),
                GatewayError::InvalidRequest("method is required".into()),
            );
        }
    };
    let params = match envelope.params {
        None => empty_params(),
        Some(p) if p.get() == "null" => empty_params(),
        Some(p) if p.get().starts_with('{') => p,
        // A structured value, but A2A's params are objects.
        Some(p) if p.get().starts_with('[') => {
            return fail(
                Some(id),
                GatewayError::invalid_field("params", "must be an object"),
            );
        }
        // JSON-RPC 2.0 §4.2: params are structured, or the request is invalid.
        Some(_) => {
            let why = "params must be an object".to_string();
            return fail(Some(id), GatewayError::InvalidRequest(why));
        }
    };
    Ok(RpcRequest { id, method, params })
}

/// Decodes params into a request type; on error, names every top-level
/// field that fails to decode, not only the first (at most sixteen, then
/// says that more fail).
pub fn decode_params<T: DeserializeOwned>(params: &RawValue) -> Result<T, GatewayError> {
    // Tracking the path allocates for every key; only an invalid request,
    // decoded again, needs it to name the failing fields.
    serde_json::from_str(params.get())
        .map_err(|_| GatewayError::invalid_fields(param_violations::<T>(params.get())))
}

/// Most fields one reply names.
const VIOLATIONS_MAX: usize = 16;

/// Largest params decoded again to name more than the first failing field:
/// each pass re-reads them whole, and a bad request must not cost many
/// times a good one.
const REDECODED_MAX_BYTES: usize = 64 * 1024;

/// The violations of params that do not decode into `T`. serde stops at the
/// first error, so each failing top-level member is taken out and the rest
/// decoded again. A required member taken out is then reported missing: it
/// is named already, so that ends the list.
fn param_violations<T: DeserializeOwned>(params: &str) -> Vec<FieldViolation> {
    let mut violations = Vec::new();
    let mut rest: Option<Vec<(String, Box<RawValue>)>> = None;
    let mut taken_out: Vec<String> = Vec::new();
    let mut text = Cow::Borrowed(params);
    loop {
        let mut deserializer = serde_json::Deserializer::from_str(&text);
        let Err(err) = serde_path_to_error::deserialize::<_, T>(&mut deserializer) else {
            break;
        };
        let description = plain_type_names(&strip_position(&err.inner().to_string()));
        let path = err.path().to_string();
        if path == "."
            && taken_out
                .iter()
                .any(|key| reports_missing(&description, key))
        {
            break;
        }
        if violations.len() == VIOLATIONS_MAX {
            let more = format!("more fields fail to decode; the first {VIOLATIONS_MAX} are named");
            violations.push(FieldViolation::new("params", more));
            break;
        }
        let field = if path == "." { "params".into() } else { path };
        violations.push(FieldViolation::new(field, description));
        let Some(Segment::Map { key }) = err.path().iter().next() else {
            break;
        };
        if params.len() > REDECODED_MAX_BYTES {
            break;
        }
        let members = match &mut rest {
            Some(members) => members,
            None => match serde_json::from_str::<Members>(params) {
                Ok(Members(members)) => rest.insert(members),
                Err(_) => break,
            },
        };
        let before = members.len();
        members.retain(|(name, _)| name != key);
        if members.len() == before {
            break;
        }
        taken_out.push(key.clone());
        text = Cow::Owned(object_text(members));
    }
    debug_assert!(!violations.is_empty(), "params that failed decode again");
    if violations.is_empty() {
        violations.push(FieldViolation::new("params", "invalid"));
    }
    violations
}

/// Whether serde's `description` reports the member written as `key`
/// missing, under its own name or as the alias `key` may be (`task_id`
/// for `taskId`).
fn reports_missing(description: &str, key: &str) -> bool {
    let folded = |name: &str| {
        name.chars()
            .filter(|c| *c != '_')
            .map(|c| c.to_ascii_lowercase())
            .collect::<String>()
    };
    description
        .strip_prefix("missing field `")
        .and_then(|rest| rest.strip_suffix('`'))
        .is_some_and(|field| folded(field) == folded(key))
}

/// A JSON object's members in the order written (serde_json's own map
/// sorts them, and faults are named in the order the client wrote them).
struct Members(Vec<(String, Box<RawValue>)>);

impl<'de> Deserialize<'de> for Members {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct InOrder;
        impl<'de> serde::de::Visitor<'de> for InOrder {
            type Value = Members;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Members, A::Error> {
                let mut members = Vec::new();
                while let Some(member) = map.next_entry()? {
                    members.push(member);
                }
                Ok(Members(members))
            }
        }
        deserializer.deserialize_map(InOrder)
    }
}

/// `members` as one JSON object.
fn object_text(members: &[(String, Box<RawValue>)]) -> String {
    let mut text = String::from("{");
    for (at, (name, value)) in members.iter().enumerate() {
        if at > 0 {
            text.push(',');
        }
        text.push_str(&serde_json::to_string(name).expect("a string encodes"));
        text.push(':');
        text.push_str(value.get());
    }
    text.push('}');
    text
}

/// serde names Rust's number types ("expected u64"); a client knows JSON's.
fn plain_type_names(message: &str) -> String {
    const NAMES: [(&str, &str); 8] = [
        ("expected u8", "expected an integer from 0 to 255"),
        ("expected u16", "expected an integer from 0 to 65535"),
        ("expected u32", "expected an integer from 0 to 4294967295"),
        ("expected u64", "expected a non-negative integer"),
        ("expected usize", "expected a non-negative integer"),
        (
            "expected i32",
            "expected an integer from -2147483648 to 2147483647",
        ),
        ("expected i64", "expected an integer"),
        ("expected f64", "expected a number"),
    ];
    let mut plain = message.to_string();
    for (rust, json) in NAMES {
        // Whole words only: "expected u32" must not match "expected u320".
        if let Some(at) = plain.find(rust)
            && !plain[at + rust.len()..].starts_with(|c: char| c.is_ascii_alphanumeric())
        {
            plain.replace_range(at..at + rust.len(), json);
        }
    }
    plain
}

/// serde_json appends " at line L column C"; field paths say more.
fn strip_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(at) => message[..at].to_string(),
        None => message.to_string(),
    }
}

/// The body of a success reply.
pub fn success_body<T: Serialize + ?Sized>(
    id: &RawValue,
    result: &T,
) -> Result<Vec<u8>, GatewayError> {
    #[derive(Serialize)]
    struct Success<'a, T: ?Sized> {
        jsonrpc: &'static str,
        id: &'a RawValue,
        result: &'a T,
    }
    serde_json::to_vec(&Success {
        jsonrpc: "2.0",
        id,
        result,
    })
    .map_err(|e| GatewayError::Internal(format!("cannot encode result: {e}")))
}

/// The body of an error reply.
pub fn error_body(id: Option<&RawValue>, error: &GatewayError) -> Vec<u8> {
    #[derive(Serialize)]
    struct Failure<'a> {
        jsonrpc: &'static str,
        id: Option<&'a RawValue>,
        error: serde_json::Value,
    }
    serde_json::to_vec(&Failure {
        jsonrpc: "2.0",
        id,
        error: error.to_rpc_error(),
    })
    .expect("error bodies always encode")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_number_is_described_in_json_terms() {
        #[derive(Debug, serde::Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Limits {
            #[allow(dead_code)]
            task_timeout_ms: u64,
        }
        let params = RawValue::from_string(r#"{"taskTimeoutMs":-5}"#.into()).unwrap();
        let message = decode_params::<Limits>(&params).unwrap_err().to_string();
        assert!(message.contains("taskTimeoutMs"), "{message}");
        assert!(
            message.contains("expected a non-negative integer"),
            "{message}"
        );
        assert!(!message.contains("u64"), "{message}");
        assert_eq!(
            plain_type_names("invalid type: string \"x\", expected i32"),
            "invalid type: string \"x\", expected an integer from -2147483648 to 2147483647"
        );
        // Only whole names.
        assert_eq!(plain_type_names("expected u320"), "expected u320");
    }

    fn violated_fields<T: DeserializeOwned + std::fmt::Debug>(params: &str) -> Vec<String> {
        let params = RawValue::from_string(params.into()).unwrap();
        match decode_params::<T>(&params).unwrap_err() {
            GatewayError::InvalidParams { violations, .. } => {
                violations.into_iter().map(|v| v.field).collect()
            }
            other => panic!("not -32602: {other:?}"),
        }
    }

    #[test]
    fn every_failing_top_level_field_is_named() {
        use crate::protocol::requests::{ListTasksRequest, SendMessageRequest};
        assert_eq!(
            violated_fields::<ListTasksRequest>(
                r#"{"pageSize":"ten","contextId":"c","status":"DONE","historyLength":true}"#
            ),
            ["pageSize", "status", "historyLength"]
        );
        // A nested fault is named by its path.
        assert_eq!(
            violated_fields::<SendMessageRequest>(
                r#"{"message":{"role":"ROLE_USER","parts":7},"configuration":{"historyLength":"x"}}"#
            ),
            ["message.parts", "configuration.historyLength"]
        );
    }

    #[test]
    fn a_required_member_taken_out_is_not_named_again_as_missing() {
        #[derive(Debug, Deserialize)]
        #[serde(rename_all = "camelCase")]
        #[allow(dead_code)]
        struct Required {
            #[serde(alias = "task_id")]
            task_id: String,
            inner: Option<Inner>,
            count: Option<u32>,
        }
        #[derive(Debug, Deserialize)]
        #[serde(rename_all = "camelCase")]
        #[allow(dead_code)]
        struct Inner {
            task_id: String,
        }
        // Under its alias too.
        assert_eq!(
            violated_fields::<Required>(r#"{"task_id":5,"count":"x"}"#),
            ["task_id", "count"]
        );
        // A nested member of the same name is missing in its own right.
        assert_eq!(
            violated_fields::<Required>(r#"{"taskId":5,"inner":{}}"#),
            ["taskId", "inner"]
        );
        // Missing without being taken out: named.
        assert_eq!(violated_fields::<Required>(r#"{"count":1}"#), ["params"]);
    }

    #[test]
    fn at_most_sixteen_fields_are_named_and_more_said_to_fail() {
        type Counts = std::collections::HashMap<String, u32>;
        let params = |count: usize| {
            let members: Vec<String> = (0..count).map(|n| format!(r#""f{n}":"x""#)).collect();
            format!("{{{}}}", members.join(","))
        };
        let named = violated_fields::<Counts>(&params(20));
        assert_eq!(named.len(), VIOLATIONS_MAX + 1);
        assert_eq!(named[0], "f0");
        assert_eq!(named[15], "f15");
        assert_eq!(named[16], "params");
        // Exactly sixteen: no more to tell.
        let named = violated_fields::<Counts>(&params(16));
        assert_eq!(named.len(), VIOLATIONS_MAX);
        assert_eq!(named[15], "f15");
        // Large params are not decoded again: only the first is named.
        let mut large = params(3);
        large.insert_str(
            1,
            &format!(r#""pad":"{}","#, "p".repeat(REDECODED_MAX_BYTES)),
        );
        assert_eq!(violated_fields::<Counts>(&large), ["pad"]);
    }

    fn code(body: &str) -> i64 {
        parse_request(body.as_bytes()).unwrap_err().error.code()
    }

    #[test]
    fn envelope_errors() {
        assert_eq!(code("{not json"), -32700);
        assert_eq!(code("[]"), -32600);
        assert_eq!(
            code("[{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"GetTask\"}]"),
            -32600
        );
        assert_eq!(code("42"), -32600);
        // Not read by position into the envelope.
        let positional = parse_request(br#"["2.0",8,"SendMessage",{}]"#).unwrap_err();
        assert_eq!(positional.error.code(), -32600);
        assert!(
            positional.error.to_string().contains("batch"),
            "{}",
            positional.error
        );
        assert!(positional.id.is_none());
        assert_eq!(code("[not json"), -32700);
        // Invalid UTF-8 in a string is no JSON, wherever it is.
        let mut latin1 = br#"{"jsonrpc":"2.0","id":1,"method":"GetTask","params":{"id":""#.to_vec();
        latin1.extend_from_slice(b"\xff\"}}");
        assert_eq!(parse_request(&latin1).unwrap_err().error.code(), -32700);
        // Also in a member the envelope does not read.
        let mut skipped = br#"{"jsonrpc":"2.0","id":1,"method":"GetTask","x":""#.to_vec();
        skipped.extend_from_slice(b"\xff\"}");
        assert_eq!(parse_request(&skipped).unwrap_err().error.code(), -32700);
        let accented =
            "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"GetTask\",\"x\":\"\u{e9}t\u{e9}\"}";
        assert!(parse_request(accented.as_bytes()).is_ok());
        // An object of the wrong shape says what is wrong, not that it is
        // no object.
        let repeated =
            parse_request(br#"{"jsonrpc":"2.0","id":1,"id":2,"method":"GetTask"}"#).unwrap_err();
        assert_eq!(repeated.error.code(), -32600);
        assert!(
            repeated.error.to_string().contains("duplicate field"),
            "{}",
            repeated.error
        );
        assert_eq!(
            code("{\"jsonrpc\":\"1.0\",\"id\":1,\"method\":\"GetTask\"}"),
            -32600
        );
        assert_eq!(code("{\"jsonrpc\":\"2.0\",\"id\":1}"), -32600);
        assert_eq!(
            code("{\"jsonrpc\":\"2.0\",\"id\":{},\"method\":\"GetTask\"}"),
            -32600
        );
        assert_eq!(
            code("{\"jsonrpc\":\"2.0\",\"id\":true,\"method\":\"GetTask\"}"),
            -32600
        );
        assert_eq!(code("{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":7}"), -32600);
        assert_eq!(
            code("{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"GetTask\",\"params\":[1]}"),
            -32602
        );
        // Params that are not structured make the request invalid.
        for params in ["5", "\"x\"", "true"] {
            let body =
                format!(r#"{{"jsonrpc":"2.0","id":1,"method":"GetTask","params":{params}}}"#);
            let refused = parse_request(body.as_bytes()).unwrap_err();
            assert_eq!(refused.error.code(), -32600, "{params}");
            assert!(refused.id.is_some(), "the id is echoed");
        }
    }

    #[test]
    fn a_method_and_version_written_with_escapes_are_read_as_meant() {
        let body = br#"{"jsonrpc":"2\u002e0","id":1,"method":"Send\u004dessage"}"#;
        let request = parse_request(body).unwrap();
        assert_eq!(request.method, "SendMessage");
        let plain = parse_request(br#"{"jsonrpc":"2.0","id":1,"method":"GetTask"}"#).unwrap();
        assert!(
            matches!(plain.method, Cow::Borrowed("GetTask")),
            "no copy without escapes"
        );
        assert_eq!(
            code(r#"{"jsonrpc":"2\u002e1","id":1,"method":"GetTask"}"#),
            -32600
        );
    }

    #[test]
    fn ids_keep_their_type() {
        let request = parse_request(br#"{"jsonrpc":"2.0","id":"a1","method":"GetTask"}"#).unwrap();
        assert_eq!(request.id.get(), "\"a1\"");
        let body = success_body(request.id, &serde_json::json!({})).unwrap();
        assert_eq!(body, br#"{"jsonrpc":"2.0","id":"a1","result":{}}"#);
        let request = parse_request(br#"{"jsonrpc":"2.0","id":7,"method":"GetTask"}"#).unwrap();
        assert_eq!(request.id.get(), "7");
        assert_eq!(request.params.get(), "{}");
    }
}
