//! `UpstreamClient`: A2A 1.0 JSON-RPC over HTTP to one agent endpoint.
//!
//! Every request carries `A2A-Version: 1.0` and `Content-Type:
//! application/json`, and the endpoint's tenant. Every connection passes the
//! outbound guard: IP-literal URLs are checked before sending, names are
//! checked after resolution. Answers are checked at two levels, so faults
//! stay distinct (see the module doc of [`crate::upstream`]): the JSON-RPC
//! envelope (version, id, exactly one of `result`/`error`), then the result
//! as the A2A object the method returns, with its required fields.

use super::sse::{SseDecoder, SseEvent};
use super::transport::{Call, Transport, failure, next_chunk, read_body};
use super::{UpstreamConfigError, UpstreamSettings};
use crate::agents::AgentError;
use crate::handoff::control::{Control, is_header_value};
use crate::netguard::OutboundPolicy;
use crate::protocol::{
    AgentCard, CancelTaskRequest, GetTaskRequest, Message, SendMessageRequest, SendMessageResponse,
    StreamResponse, SubscribeToTaskRequest, Task, TaskState, methods,
};
use hyper::StatusCode;
use hyper::body::Incoming;
use hyper::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::fmt::Display;
use std::sync::atomic::{AtomicU64, Ordering};

/// The header naming the A2A version of a request.
pub const VERSION_HEADER: &str = "A2A-Version";
/// [`VERSION_HEADER`] as a header name made at compile time.
pub const VERSION_HEADER_NAME: HeaderName = HeaderName::from_static("a2a-version");
const APPLICATION_JSON: &str = "application/json";
const EVENT_STREAM: &str = "text/event-stream";
/// Bytes first reserved for a call's body: a relayed short text message
/// with its handoff control takes ~400.
const REQUEST_BODY_CAPACITY: usize = 1024;
/// How much of a bad body an error message quotes.
const SNIPPET_CHARS: usize = 160;

/// A JSON-RPC request as sent upstream, borrowing its params (no `Value` tree).
#[derive(Serialize)]
struct Envelope<'a, P> {
    jsonrpc: &'static str,
    id: u64,
    method: &'a str,
    params: &'a P,
}

/// A JSON-RPC client for one A2A agent endpoint.
#[derive(Debug)]
pub struct UpstreamClient {
    http: Transport,
    policy: OutboundPolicy,
    url: reqwest::Url,
    /// Basic credentials the URL carried, if any.
    authorization: Option<HeaderValue>,
    tenant: String,
    settings: UpstreamSettings,
    next_id: AtomicU64,
}

impl UpstreamClient {
    /// A client for the endpoint `url`, putting `tenant` (may be empty) in
    /// every request, connecting only where `policy` allows.
    pub fn new(
        url: &str,
        tenant: impl Into<String>,
        policy: &OutboundPolicy,
        settings: UpstreamSettings,
    ) -> Result<Self, UpstreamConfigError> {
        let parsed = reqwest::Url::parse(url.trim())
            .map_err(|e| UpstreamConfigError::BadUrl(format!("{url:?} is not a URL: {e}")))?;
        if !matches!(parsed.scheme(), "http" | "https") || parsed.host().is_none() {
            return Err(UpstreamConfigError::BadUrl(format!(
                "{url:?} must be an absolute http or https URL"
            )));
        }
        // Credentials in the URL go in an Authorization header, as reqwest
        // sent them, and never into messages or logs.
        let authorization = basic_authorization(&parsed);
        let bare = crate::netguard::without_credentials(&parsed);
        let uri = bare
            .as_str()
            .parse()
            .map_err(|e| UpstreamConfigError::BadUrl(format!("{url:?} is not a URI: {e}")))?;
        Ok(Self {
            http: Transport::new(&uri, policy, settings.connect_timeout),
            policy: policy.clone(),
            url: bare,
            authorization,
            tenant: tenant.into(),
            settings,
            next_id: AtomicU64::new(1),
        })
    }

    /// A client for the card's [`AgentCard::calling_interface`] (its URL
    /// and tenant).
    pub fn for_card(
        card: &AgentCard,
        policy: &OutboundPolicy,
        settings: UpstreamSettings,
    ) -> Result<Self, UpstreamConfigError> {
        let interface = card
            .calling_interface()
            .ok_or_else(|| UpstreamConfigError::NoJsonRpcInterface(card.name.clone()))?;
        Self::new(&interface.url, interface.tenant.clone(), policy, settings)
    }

    /// The endpoint.
    pub fn url(&self) -> &reqwest::Url {
        &self.url
    }

    /// The tenant sent in every request (empty for none).
    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    /// Timeouts, polling and limits.
    pub fn settings(&self) -> &UpstreamSettings {
        &self.settings
    }

    /// `SendMessage`: a task or a direct message.
    pub async fn send_message(
        &self,
        mut request: SendMessageRequest,
    ) -> Result<SendMessageResponse, AgentError> {
        request.tenant = self.tenant.clone();
        let control = control_headers(&request);
        self.call(methods::SEND_MESSAGE, &request, &control).await
    }

    /// `SendStreamingMessage`: the stream of the task's events, or a single
    /// message. An error before the stream starts is returned here.
    pub async fn send_streaming_message(
        &self,
        mut request: SendMessageRequest,
    ) -> Result<UpstreamStream, AgentError> {
        request.tenant = self.tenant.clone();
        let control = control_headers(&request);
        self.open_stream(methods::SEND_STREAMING_MESSAGE, &request, &control)
            .await
    }

    /// `GetTask`.
    pub async fn get_task(&self, mut request: GetTaskRequest) -> Result<Task, AgentError> {
        request.tenant = self.tenant.clone();
        self.call(methods::GET_TASK, &request, &[]).await
    }

    /// `CancelTask`: the task as the agent left it.
    pub async fn cancel_task(&self, mut request: CancelTaskRequest) -> Result<Task, AgentError> {
        request.tenant = self.tenant.clone();
        self.call(methods::CANCEL_TASK, &request, &[]).await
    }

    /// `SubscribeToTask`: the task, then its later events.
    pub async fn subscribe_to_task(
        &self,
        mut request: SubscribeToTaskRequest,
    ) -> Result<UpstreamStream, AgentError> {
        request.tenant = self.tenant.clone();
        self.open_stream(methods::SUBSCRIBE_TO_TASK, &request, &[])
            .await
    }

    fn label<'a>(&'a self, method: &'a str) -> CallLabel<'a> {
        CallLabel { method }
    }

    /// A failure to reach the agent as callers see it: the causes name the
    /// agent's host (the guard's reasons, a certificate's names), which a
    /// caller of another agency must not learn (see [`CallLabel`]). The log
    /// keeps them, at debug level.
    fn hide_address(&self, err: AgentError) -> AgentError {
        let hide = |detail: String| {
            tracing::debug!(upstream = %self.url, %detail, "the agent could not be reached");
            hidden_address(detail, self.url.host_str().unwrap_or_default())
        };
        match err {
            AgentError::Unreachable(detail) => AgentError::Unreachable(hide(detail)),
            AgentError::Timeout(detail) => AgentError::Timeout(hide(detail)),
            other => other,
        }
    }

    /// The request for one call: guard checked, envelope encoded, headers
    /// checked.
    fn request<'a, P: Serialize>(
        &'a self,
        method: &str,
        params: &P,
        accept: &'static str,
        extra: &'a [(HeaderName, String)],
    ) -> Result<(u64, Call<'a>), AgentError> {
        // Resolvers never see IP literals, so those are checked here.
        self.policy.check_url(&self.url).map_err(|reason| {
            self.hide_address(AgentError::Unreachable(format!(
                "{}: {reason}",
                self.label(method)
            )))
        })?;
        // Header values go on the wire as they are: none may break a line.
        if let Some((name, _)) = extra.iter().find(|(_, value)| !is_header_value(value)) {
            return Err(AgentError::Failed(format!(
                "{}: cannot build the {name} header: a control character in its value",
                self.label(method)
            )));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        // Sized for a typical call, which then never regrows (`to_vec`
        // starts at 128 bytes and doubles, copying at each step).
        let mut body = Vec::with_capacity(REQUEST_BODY_CAPACITY);
        let envelope = Envelope {
            jsonrpc: "2.0",
            id,
            method,
            params,
        };
        serde_json::to_writer(&mut body, &envelope)
            .map_err(|e| AgentError::Failed(format!("cannot encode {method} params: {e}")))?;
        let call = Call {
            body,
            accept,
            extra,
            authorization: self.authorization.as_ref(),
        };
        Ok((id, call))
    }

    /// One unary call, its result parsed as `T`.
    async fn call<T: A2aResult>(
        &self,
        method: &str,
        params: &impl Serialize,
        extra: &[(HeaderName, String)],
    ) -> Result<T, AgentError> {
        let label = self.label(method);
        let (id, request) = self.request(method, params, APPLICATION_JSON, extra)?;
        tracing::debug!(upstream = %self.url, method, id, "calling agent");
        // The timeout covers connecting, sending and reading the whole body.
        let exchange = self
            .http
            .call(request, &label, self.settings.max_body_bytes);
        let timeout = self.settings.request_timeout;
        let answer = tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| AgentError::Timeout(format!("{label}: no answer within {timeout:?}")))?
            .map_err(|err| self.hide_address(err))?;
        let content_type = answer.content_type.as_ref().and_then(|v| v.to_str().ok());
        decode_reply(
            &label,
            id,
            answer.status,
            content_type.unwrap_or(""),
            &answer.body,
        )
    }

    /// Opens a streaming call.
    async fn open_stream(
        &self,
        method: &str,
        params: &impl Serialize,
        extra: &[(HeaderName, String)],
    ) -> Result<UpstreamStream, AgentError> {
        let label = self.label(method);
        let (id, request) = self.request(method, params, EVENT_STREAM, extra)?;
        tracing::debug!(upstream = %self.url, method, id, "opening agent stream");
        let timeout = self.settings.request_timeout;
        let timed_out = || AgentError::Timeout(format!("{label}: no answer within {timeout:?}"));
        let response = tokio::time::timeout(timeout, self.http.stream(request))
            .await
            .map_err(|_| timed_out())?
            .map_err(|e| self.hide_address(failure(&label, &e)))?;
        let (parts, body) = response.into_parts();
        let (status, content_type) = (parts.status, content_type(&parts.headers));
        let mut stream = UpstreamStream {
            label: label.to_string(),
            id,
            body: None,
            decoder: SseDecoder::default(),
            ready: VecDeque::new(),
            idle_timeout: self.settings.stream_idle_timeout,
            max_bytes: self.settings.max_body_bytes,
            done: false,
        };
        if status.is_success() && content_type.to_ascii_lowercase().starts_with(EVENT_STREAM) {
            stream.body = Some(body);
            return Ok(stream);
        }
        // Errors before the stream come as one plain JSON-RPC response (and
        // an agent may answer a stream request with a single result).
        let body = tokio::time::timeout(
            timeout,
            read_body(&label, body, self.settings.max_body_bytes),
        )
        .await
        .map_err(|_| timed_out())??;
        let event: StreamResponse = decode_reply(&label, id, status, content_type, &body)?;
        stream.ready.push_back(Ok(event));
        Ok(stream)
    }
}

/// `detail` without `host` (a URL's host: a name, an IPv4 address or a
/// bracketed IPv6 one) and without the names a refused certificate holds.
fn hidden_address(mut detail: String, host: &str) -> String {
    // rustls says which names the certificate holds after what it expected.
    const PRESENTED: &str = "; certificate is only valid for";
    if let Some(at) = detail.find(PRESENTED) {
        detail.truncate(at);
    }
    detail = replace_whole(&detail, host, "the agent's host");
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if bare != host {
        detail = replace_whole(&detail, bare, "the agent's host");
    }
    detail
}

/// `text` with each `name` that stands whole (not inside a longer host
/// name or word: a host may be a single label such as `agent`) replaced.
fn replace_whole(text: &str, name: &str, with: &str) -> String {
    let in_name = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':');
    let mut replaced = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = (!name.is_empty()).then(|| rest.find(name)).flatten() {
        let (before, after) = (&rest[..at], &rest[at + name.len()..]);
        let whole = !before.ends_with(in_name) && !after.starts_with(in_name);
        replaced.push_str(before);
        replaced.push_str(if whole { with } else { name });
        rest = after;
    }
    replaced.push_str(rest);
    replaced
}

/// Names a call in error messages (`SendMessage to the agent`); written
/// only when an error needs it. Callers see these messages, and with API
/// keys a caller may be of another agency than the agent's: its address
/// would let the caller go around Baton, so errors name the call only (the
/// agent's id goes beside them, in the error's data or status detail).
#[derive(Clone, Copy)]
struct CallLabel<'a> {
    method: &'a str,
}

impl Display for CallLabel<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} to the agent", self.method)
    }
}

/// The events of a streaming call, decoded and checked one by one.
#[derive(Debug)]
pub struct UpstreamStream {
    label: String,
    id: u64,
    body: Option<Incoming>,
    decoder: SseDecoder,
    ready: VecDeque<Result<StreamResponse, AgentError>>,
    idle_timeout: std::time::Duration,
    max_bytes: usize,
    done: bool,
}

impl UpstreamStream {
    /// The next event; `None` once the stream has ended. After an error the
    /// stream is over.
    pub async fn next(&mut self) -> Option<Result<StreamResponse, AgentError>> {
        loop {
            if self.done {
                return None;
            }
            if let Some(result) = self.ready.pop_front() {
                self.done = result.is_err();
                return Some(result);
            }
            let Some(body) = self.body.as_mut() else {
                self.done = true;
                return None;
            };
            let next = tokio::time::timeout(self.idle_timeout, next_chunk(&self.label, body));
            let chunk = match next.await {
                Ok(Some(Ok(chunk))) => chunk,
                Ok(Some(Err(err))) => {
                    self.done = true;
                    return Some(Err(err));
                }
                Ok(None) => {
                    self.done = true;
                    return None;
                }
                Err(_) => {
                    self.done = true;
                    return Some(Err(AgentError::Timeout(format!(
                        "{}: the stream was silent for {:?}",
                        self.label, self.idle_timeout
                    ))));
                }
            };
            let too_large = || {
                Err(AgentError::InvalidResponse(format!(
                    "{}: a stream event is larger than {} bytes",
                    self.label, self.max_bytes
                )))
            };
            for event in self.decoder.push(&chunk) {
                // An event that arrived whole is held to the limit too.
                let decoded = if event.data.len() > self.max_bytes {
                    too_large()
                } else {
                    decode_event(&self.label, self.id, &event)
                };
                self.ready.push_back(decoded);
            }
            if self.decoder.pending_bytes() > self.max_bytes {
                self.ready.push_back(too_large());
            }
        }
    }
}

/// An A2A object a method returns, with the checks serde cannot express
/// (required fields, which the lenient wire types default).
trait A2aResult: DeserializeOwned {
    /// The A2A type name, for messages.
    const NAME: &'static str;
    /// Why the object is not valid A2A, if it is not.
    fn check(&self) -> Result<(), String>;
}

impl A2aResult for Task {
    const NAME: &'static str = "Task";
    fn check(&self) -> Result<(), String> {
        check_task(self)
    }
}

impl A2aResult for SendMessageResponse {
    const NAME: &'static str = "SendMessageResponse";
    fn check(&self) -> Result<(), String> {
        match self {
            Self::Task(task) => check_task(task).map_err(|e| format!("task.{e}")),
            Self::Message(message) => check_message(message).map_err(|e| format!("message.{e}")),
        }
    }
}

impl A2aResult for StreamResponse {
    const NAME: &'static str = "StreamResponse";
    fn check(&self) -> Result<(), String> {
        match self {
            Self::Task(task) => check_task(task).map_err(|e| format!("task.{e}")),
            Self::Message(message) => check_message(message).map_err(|e| format!("message.{e}")),
            Self::StatusUpdate(update) => {
                if update.task_id.is_empty() {
                    Err("statusUpdate.taskId is missing".into())
                } else if update.status.state == TaskState::Unspecified {
                    Err("statusUpdate.status.state is missing".into())
                } else {
                    Ok(())
                }
            }
            Self::ArtifactUpdate(update) => {
                if update.task_id.is_empty() {
                    Err("artifactUpdate.taskId is missing".into())
                } else if update.artifact.artifact_id.is_empty() {
                    Err("artifactUpdate.artifact.artifactId is missing".into())
                } else {
                    Ok(())
                }
            }
        }
    }
}

fn check_task(task: &Task) -> Result<(), String> {
    if task.id.is_empty() {
        return Err("id is missing".into());
    }
    if task.status.state == TaskState::Unspecified {
        return Err("status.state is missing".into());
    }
    if let Some(i) = task.artifacts.iter().position(|a| a.artifact_id.is_empty()) {
        return Err(format!("artifacts[{i}].artifactId is missing"));
    }
    Ok(())
}

fn check_message(message: &Message) -> Result<(), String> {
    if message.message_id.is_empty() {
        return Err("messageId is missing".into());
    }
    if message.parts.is_empty() {
        return Err("parts is empty".into());
    }
    Ok(())
}

/// `Basic` credentials for a URL's user and password, percent-decoded.
fn basic_authorization(url: &reqwest::Url) -> Option<HeaderValue> {
    if url.username().is_empty() && url.password().is_none() {
        return None;
    }
    let decode = |text: &str| {
        percent_encoding::percent_decode_str(text)
            .decode_utf8_lossy()
            .into_owned()
    };
    let credentials = format!(
        "{}:{}",
        decode(url.username()),
        decode(url.password().unwrap_or_default())
    );
    let encoded = crate::protocol::wire::encode_base64(credentials.as_bytes());
    let mut value = HeaderValue::from_str(&format!("Basic {encoded}")).ok()?;
    value.set_sensitive(true);
    Some(value)
}

fn content_type(headers: &HeaderMap) -> &str {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

fn snippet(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes)
        .chars()
        .take(SNIPPET_CHARS)
        .collect()
}

/// A unary answer: JSON, then a JSON-RPC response to request `id`, then `T`.
fn decode_reply<T: A2aResult>(
    label: &dyn Display,
    id: u64,
    status: StatusCode,
    content_type: &str,
    body: &[u8],
) -> Result<T, AgentError> {
    if let Some(result) = well_formed_result(id, body) {
        return Ok(result);
    }
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        AgentError::NotJson(format!(
            "{label}: HTTP {status} ({content_type:?}) is not JSON ({e}); it begins {:?}",
            snippet(body)
        ))
    })?;
    let result = rpc_result(label, id, value)?;
    parse_result(label, result)
}

/// One SSE event: a JSON-RPC response (or, as `event: error`, an error).
fn decode_event(
    label: &dyn Display,
    id: u64,
    event: &SseEvent,
) -> Result<StreamResponse, AgentError> {
    if event.event != "error"
        && let Some(result) = well_formed_result(id, event.data.as_bytes())
    {
        return Ok(result);
    }
    let value: Value = serde_json::from_str(&event.data).map_err(|e| {
        AgentError::NotJson(format!(
            "{label}: a stream event is not JSON ({e}); it begins {:?}",
            snippet(event.data.as_bytes())
        ))
    })?;
    if event.event == "error" {
        // Servers send either a whole JSON-RPC error response or the bare
        // error object here.
        if value.get("error").is_some() {
            rpc_result(label, id, value)?;
            return Err(AgentError::InvalidResponse(format!(
                "{label}: an error event carries no error"
            )));
        }
        return Err(refused(label, value));
    }
    let result = rpc_result(label, id, value)?;
    parse_result(label, result)
}

/// A JSON-RPC response as it arrives, its result decoded as `T` in the
/// same pass: only what the fast path looks at.
#[derive(serde::Deserialize)]
struct ReplyFields<'a, T> {
    #[serde(borrow)]
    jsonrpc: Option<&'a str>,
    id: Option<u64>,
    result: Option<T>,
    #[serde(borrow)]
    error: Option<&'a serde_json::value::RawValue>,
}

/// The result of a well-formed, valid answer to request `id`, decoded
/// straight from the bytes in one pass. Anything else is `None`, and the
/// caller's slow path (through `Value`) says exactly what is wrong.
fn well_formed_result<T: A2aResult>(id: u64, body: &[u8]) -> Option<T> {
    let fields: ReplyFields<'_, T> = serde_json::from_slice(body).ok()?;
    if fields.jsonrpc != Some("2.0") || fields.id != Some(id) || fields.error.is_some() {
        return None;
    }
    let parsed = fields.result?;
    parsed.check().is_ok().then_some(parsed)
}

/// The `result` of a JSON-RPC 2.0 response to request `id`; its `error` as
/// `Refused`; anything else is not a valid response.
fn rpc_result(label: &dyn Display, id: u64, value: Value) -> Result<Value, AgentError> {
    let invalid = |why: String| {
        AgentError::InvalidResponse(format!("{label}: not a JSON-RPC response: {why}"))
    };
    let Value::Object(mut object) = value else {
        return Err(invalid("the answer is not an object".into()));
    };
    if object.get("jsonrpc") != Some(&json!("2.0")) {
        return Err(invalid(format!(
            "jsonrpc is {}, not \"2.0\"",
            object.get("jsonrpc").unwrap_or(&Value::Null)
        )));
    }
    let answer_id = object.remove("id").unwrap_or(Value::Null);
    match (object.remove("result"), object.remove("error")) {
        (Some(_), Some(_)) => Err(invalid("both result and error are set".into())),
        (None, None) => Err(invalid("neither result nor error is set".into())),
        (None, Some(error)) => {
            // A server that could not read the request id answers with null.
            if answer_id != json!(id) && !answer_id.is_null() {
                return Err(invalid(format!("it answers request {answer_id}, not {id}")));
            }
            Err(refused(label, error))
        }
        (Some(result), None) => {
            if answer_id != json!(id) {
                return Err(invalid(format!("it answers request {answer_id}, not {id}")));
            }
            Ok(result)
        }
    }
}

/// A JSON-RPC error object, passed on as it is.
fn refused(label: &dyn Display, error: Value) -> AgentError {
    match error.get("code").and_then(Value::as_i64) {
        Some(code) => AgentError::Refused {
            code,
            message: error
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
            data: error.get("data").cloned(),
        },
        None => AgentError::InvalidResponse(format!(
            "{label}: the error object has no integer code: {}",
            snippet(error.to_string().as_bytes())
        )),
    }
}

fn parse_result<T: A2aResult>(label: &dyn Display, result: Value) -> Result<T, AgentError> {
    let invalid = |why: String| {
        AgentError::InvalidResponse(format!(
            "{label}: the result is not a valid {}: {why}",
            T::NAME
        ))
    };
    let parsed: T = serde_path_to_error::deserialize(result).map_err(|e| invalid(e.to_string()))?;
    parsed.check().map_err(invalid)?;
    Ok(parsed)
}

/// The handoff control of a forwarded message as HTTP headers (trace
/// context with a new span, `Baton-Hops`, `Baton-Chain`, `Baton-Deadline`),
/// for agents that read headers only.
fn control_headers(request: &SendMessageRequest) -> Vec<(HeaderName, String)> {
    request
        .message
        .as_ref()
        .and_then(|message| Control::read_from(message.metadata.as_ref()))
        .map(|control| control.headers())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_static_version_header_name_is_the_version_header() {
        assert!(VERSION_HEADER.eq_ignore_ascii_case(VERSION_HEADER_NAME.as_str()));
        assert_eq!(VERSION_HEADER_NAME, VERSION_HEADER);
    }

    #[tokio::test]
    async fn an_error_names_the_call_and_not_the_agents_address() {
        // Bound and let go: nothing listens there.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let policy = OutboundPolicy {
            allow: vec!["127.0.0.0/8".parse().unwrap()],
            ..OutboundPolicy::default()
        };
        let url = format!("http://127.0.0.1:{port}/secret-path/a2a");
        let client = UpstreamClient::new(&url, "", &policy, UpstreamSettings::default()).unwrap();
        assert_eq!(
            client.label("SendMessage").to_string(),
            "SendMessage to the agent"
        );
        let err = client
            .send_message(SendMessageRequest::default())
            .await
            .unwrap_err();
        assert!(matches!(err, AgentError::Unreachable(_)), "{err:?}");
        let text = err.to_string();
        assert!(!text.contains(&port.to_string()), "{text}");
        assert!(!text.contains("secret-path"), "{text}");
        assert!(text.contains("SendMessage to the agent: "), "{text}");
    }

    #[test]
    fn replies_are_classified() {
        let ok_task = br#"{"jsonrpc":"2.0","id":7,"result":{"id":"t","status":{"state":"TASK_STATE_WORKING"}}}"#;
        let status = StatusCode::OK;
        let task: Task = decode_reply(&"x", 7, status, "", ok_task).unwrap();
        assert_eq!(task.id, "t");

        let cases: &[(&[u8], &str)] = &[
            (b"<html>oops</html>", "NotJson"),
            (br#"{"jsonrpc":"2.0","id":7,"result":{"bogus":true}}"#, "InvalidResponse"),
            (br#"{"id":7,"result":{"id":"t"}}"#, "InvalidResponse"),
            (br#"{"jsonrpc":"2.0","id":8,"result":{"id":"t","status":{"state":"TASK_STATE_WORKING"}}}"#, "InvalidResponse"),
            (br#"{"jsonrpc":"2.0","id":7}"#, "InvalidResponse"),
            (br#"[1,2]"#, "InvalidResponse"),
            (br#"{"jsonrpc":"2.0","id":7,"error":{"message":"no code"}}"#, "InvalidResponse"),
            (br#"{"jsonrpc":"2.0","id":null,"error":{"code":-32001,"message":"gone","data":[1]}}"#, "Refused"),
        ];
        for (body, kind) in cases {
            let err = decode_reply::<Task>(&"x", 7, status, "", body).unwrap_err();
            let got = format!("{err:?}");
            assert!(
                got.starts_with(kind),
                "{}: {got}",
                String::from_utf8_lossy(body)
            );
        }
        let err = decode_reply::<Task>(
            &"x",
            7,
            status,
            "",
            br#"{"jsonrpc":"2.0","id":7,"error":{"code":-32001,"message":"gone","data":[1]}}"#,
        )
        .unwrap_err();
        assert_eq!(
            err,
            AgentError::Refused {
                code: -32001,
                message: "gone".into(),
                data: Some(json!([1])),
            }
        );
        // A direct reply must have an id and content.
        let err = decode_reply::<SendMessageResponse>(
            &"x",
            7,
            status,
            "",
            br#"{"jsonrpc":"2.0","id":7,"result":{"message":{"role":"ROLE_AGENT"}}}"#,
        )
        .unwrap_err();
        assert!(matches!(err, AgentError::InvalidResponse(_)), "{err:?}");
    }

    #[test]
    fn the_direct_decode_agrees_with_the_checked_one() {
        let body = br#"{"jsonrpc":"2.0","id":3,"result":{"task":{"id":"t","contextId":"c",
            "status":{"state":"TASK_STATE_COMPLETED","timestamp":"2026-01-02T03:04:05.678Z"},
            "artifacts":[{"artifactId":"a","parts":[{"text":"hi"},{"data":{"n":1.5,"k":[true,null]}}]}],
            "metadata":{"x":{"y":"z"}}},"extra":1}}"#;
        let direct: SendMessageResponse = well_formed_result(3, body).expect("well formed");
        let value = serde_json::from_slice(body).unwrap();
        let checked: SendMessageResponse =
            parse_result(&"x", rpc_result(&"x", 3, value).unwrap()).unwrap();
        assert_eq!(direct, checked);
        // Another request's answer, or an invalid result, takes the checked path.
        assert!(well_formed_result::<SendMessageResponse>(4, body).is_none());
        let empty = br#"{"jsonrpc":"2.0","id":3,"result":{"message":{"role":"ROLE_AGENT"}}}"#;
        assert!(well_formed_result::<SendMessageResponse>(3, empty).is_none());
    }

    #[test]
    fn error_events_are_refusals() {
        let event = |event: &str, data: &str| SseEvent {
            event: event.into(),
            data: data.into(),
        };
        let bare = decode_event(
            &"x",
            1,
            &event("error", r#"{"code":-32603,"message":"boom"}"#),
        );
        assert!(matches!(
            bare,
            Err(AgentError::Refused { code: -32603, .. })
        ));
        let wrapped = decode_event(
            &"x",
            1,
            &event(
                "error",
                r#"{"jsonrpc":"2.0","id":1,"error":{"code":-32004,"message":"no"}}"#,
            ),
        );
        assert!(matches!(
            wrapped,
            Err(AgentError::Refused { code: -32004, .. })
        ));
        let update = decode_event(
            &"x",
            1,
            &event(
                "",
                r#"{"jsonrpc":"2.0","id":1,"result":{"statusUpdate":{"taskId":"t","status":{"state":"TASK_STATE_COMPLETED"}}}}"#,
            ),
        );
        assert!(matches!(update, Ok(StreamResponse::StatusUpdate(_))));
        let garbage = decode_event(&"x", 1, &event("", "not json"));
        assert!(matches!(garbage, Err(AgentError::NotJson(_))));
    }

    /// A client for `url` with the default (no internal addresses) policy.
    fn guarded_client(url: &str) -> UpstreamClient {
        let policy = OutboundPolicy::default();
        UpstreamClient::new(url, "", &policy, UpstreamSettings::default()).unwrap()
    }

    #[tokio::test]
    async fn the_guard_refuses_before_connecting() {
        let client = guarded_client("http://127.0.0.1:9/a2a");
        let err = client
            .get_task(GetTaskRequest::default())
            .await
            .unwrap_err();
        assert!(
            matches!(&err, AgentError::Unreachable(why) if why.contains("--allow-upstream")),
            "{err:?}"
        );
        let named = guarded_client("http://localhost:9/a2a");
        let err = named.get_task(GetTaskRequest::default()).await.unwrap_err();
        assert!(
            matches!(&err, AgentError::Unreachable(why) if why.contains("--allow-upstream")),
            "{err:?}"
        );
        // The reasons do not name the agent's host to the caller.
        for (url, host) in [
            ("http://127.0.0.1:9/a2a", "127.0.0.1"),
            ("http://localhost:9/a2a", "localhost"),
            ("http://[::1]:9/a2a", "::1"),
        ] {
            let client = guarded_client(url);
            let err = client.cancel_task(CancelTaskRequest::default()).await;
            let text = err.unwrap_err().to_string();
            assert!(!text.contains(host), "{text}");
            assert!(text.contains("the agent's host"), "{text}");
        }
    }

    #[test]
    fn a_host_is_hidden_only_where_it_stands_whole() {
        let detail = "GetTask to the agent: agent resolves only to internal addresses";
        assert_eq!(
            hidden_address(detail.to_string(), "agent"),
            "GetTask to the agent: the agent's host resolves only to internal addresses"
        );
        let detail = "outbound connection to ::1 refused; 10.0.0.1 is not 10.0.0.10";
        assert_eq!(
            hidden_address(detail.to_string(), "[::1]"),
            "outbound connection to the agent's host refused; 10.0.0.1 is not 10.0.0.10"
        );
        assert_eq!(
            hidden_address(detail.to_string(), "10.0.0.1"),
            "outbound connection to ::1 refused; the agent's host is not 10.0.0.10"
        );
    }

    #[test]
    fn a_refused_certificates_names_are_hidden() {
        let detail = "SendMessage to the agent: client error (Connect): invalid peer certificate: \
            certificate not valid for name \"agent.acme.corp\"; certificate is only valid for \
            DnsName(\"*.acme.internal\")";
        let hidden = hidden_address(detail.to_string(), "agent.acme.corp");
        assert_eq!(
            hidden,
            "SendMessage to the agent: client error (Connect): invalid peer certificate: \
            certificate not valid for name \"the agent's host\""
        );
    }

    #[test]
    fn a_header_value_that_would_break_its_line_is_refused() {
        let policy = OutboundPolicy {
            allow: vec!["127.0.0.0/8".parse().unwrap()],
            ..OutboundPolicy::default()
        };
        let client = UpstreamClient::new(
            "http://127.0.0.1:9/a2a",
            "",
            &policy,
            UpstreamSettings::default(),
        )
        .unwrap();
        let chain = HeaderName::from_static("x-chain");
        let call = |value: &str| {
            let extra = [(chain.clone(), value.to_string())];
            client
                .request("SendMessage", &json!({}), APPLICATION_JSON, &extra)
                .map(|(_, call)| call.body.len())
        };
        assert!(call("a,b\tc é").is_ok());
        for bad in ["a\r\nx-evil: 1", "a\nb", "a\u{0}b", "a\u{7f}"] {
            assert!(
                matches!(call(bad), Err(AgentError::Failed(why)) if why.contains("x-chain header")),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn credentials_in_the_url_become_a_basic_header_and_leave_the_url() {
        let client = guarded_client("http://agent:p%40ss@127.0.0.1:9/a2a");
        let header = client.authorization.as_ref().unwrap();
        // base64 of "agent:p@ss"
        assert_eq!(header.to_str().unwrap(), "Basic YWdlbnQ6cEBzcw==");
        assert!(header.is_sensitive());
        assert_eq!(client.url().as_str(), "http://127.0.0.1:9/a2a");
        assert_eq!(client.http.uri().to_string(), "http://127.0.0.1:9/a2a");
    }

    #[test]
    fn cards_without_jsonrpc_are_refused() {
        let card = AgentCard {
            name: "grpc-only".into(),
            supported_interfaces: vec![crate::protocol::AgentInterface {
                url: "http://agent.example/grpc".into(),
                protocol_binding: "GRPC".into(),
                ..Default::default()
            }],
            ..AgentCard::default()
        };
        let err = UpstreamClient::for_card(&card, &OutboundPolicy::default(), Default::default())
            .unwrap_err();
        assert!(matches!(err, UpstreamConfigError::NoJsonRpcInterface(_)));
        assert!(matches!(
            UpstreamClient::new(
                "ftp://x/",
                "",
                &OutboundPolicy::default(),
                Default::default()
            ),
            Err(UpstreamConfigError::BadUrl(_))
        ));
    }
}
