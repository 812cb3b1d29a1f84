//! The HTTP surface: the router and the front door that takes JSON-RPC
//! calls past it, the JSON-RPC endpoints, card publication, health, and
//! graceful shutdown.

pub mod connections;
mod write_stall;

use crate::auth::{KeyStore, Principal, WWW_AUTHENTICATE};
use crate::error::GatewayError;
use crate::gateway::{CallContext, Gateway};
use crate::jsonrpc::dispatch::{dispatch, error_reply, json_reply};
use crate::jsonrpc::parse_request;
use crate::protocol::{AgentCard, HANDOFF_EXTENSION, methods};
use crate::registry::service::{Registry, SearchParams};
use crate::upstream::client::VERSION_HEADER_NAME;
use axum::Router;
use axum::body::Body;
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use connections::ConnectionLimits;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;
use tracing::Instrument as _;

/// Request headers read on every call, as names made at compile time: a
/// name given as text is parsed again at every lookup. (`A2A-Version` is the
/// agent client's [`VERSION_HEADER_NAME`].)
const A2A_EXTENSIONS: HeaderName = HeaderName::from_static("a2a-extensions");
const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// HTTP-level settings.
#[derive(Clone, Debug)]
pub struct ServerSettings {
    /// Base URL written into published cards.
    pub public_url: String,
    /// Agent for `/a2a` calls without a `tenant`.
    pub default_agent: String,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// Bounds on inbound connections, and on the time a request takes to
    /// arrive.
    pub connections: ConnectionLimits,
}

/// Shared state of every handler.
#[derive(Clone)]
pub struct AppState {
    gateway: Arc<Gateway>,
    registry: Arc<Registry>,
    keys: KeyStore,
    settings: Arc<ServerSettings>,
    /// Connections closed unserved past their client's bound.
    refused_connections: Arc<AtomicU64>,
}

impl AppState {
    /// The state of a server for `gateway` and `registry`, authenticating
    /// callers with `keys`.
    pub fn new(
        gateway: Arc<Gateway>,
        registry: Arc<Registry>,
        keys: KeyStore,
        settings: ServerSettings,
    ) -> Self {
        Self {
            gateway,
            registry,
            keys,
            settings: Arc::new(settings),
            refused_connections: Arc::default(),
        }
    }

    /// The caller's principal, or the 401 reply.
    #[allow(clippy::result_large_err)]
    fn authenticate(&self, headers: &HeaderMap) -> Result<Principal, Response> {
        self.keys.authenticate_headers(headers).map_err(|err| {
            let error = GatewayError::Unauthenticated(err.to_string());
            let mut response = json_reply(
                StatusCode::UNAUTHORIZED,
                crate::jsonrpc::error_body(None, &error),
            );
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static(WWW_AUTHENTICATE),
            );
            response
        })
    }
}

/// The router, apart from any listener.
pub fn app(state: AppState) -> Router {
    Router::new()
        .route("/.well-known/agent-card.json", get(gateway_card))
        .route("/a2a", post(rpc_gateway))
        .route("/a2a/", post(rpc_gateway))
        .route("/agents/{id}/a2a", post(rpc_agent))
        .route("/agents/{id}/a2a/", post(rpc_agent))
        .route("/agents/{id}/.well-known/agent-card.json", get(agent_card))
        .route("/registry", post(registry_rpc))
        .route("/registry/", post(registry_rpc))
        .route("/registry/agents", get(registry_search))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/tasks/{id}/trace", get(task_trace))
        .fallback(not_found)
        .layer(tower_http::trace::TraceLayer::new_for_http())
        .with_state(state)
}

/// The router, with a short way in for JSON-RPC calls (`POST /a2a` and
/// `POST /agents/{id}/a2a`), the paths every relayed call takes. Such a
/// call goes straight to its handler, past the route lookup, the route's
/// per-request clone and boxed futures, the copy of the headers axum's
/// extractor makes, and the trace layer and its clock reads: together 4 %
/// of a relayed send's instructions (README). It gets a `request` span of
/// its own (target `baton::server`, around building the reply, not around
/// streaming it), without the layer's debug events. Every other request
/// goes through the router, as does an agent id that is percent-encoded.
#[derive(Clone)]
struct FrontDoor {
    router: Router,
    /// Shared: each connection holds a copy of the door.
    state: Arc<AppState>,
}

impl hyper::service::Service<Request<hyper::body::Incoming>> for FrontDoor {
    type Response = Response;
    type Error = std::convert::Infallible;
    type Future = futures::future::BoxFuture<'static, Result<Response, Self::Error>>;

    fn call(&self, request: Request<hyper::body::Incoming>) -> Self::Future {
        let request = request.map(Body::new);
        let endpoint = if request.method() == Method::POST {
            rpc_endpoint(request.uri().path())
        } else {
            None
        };
        let Some(endpoint) = endpoint else {
            // The router is always ready (axum 0.8), so it need not be asked.
            return Box::pin(tower_service::Service::call(
                &mut self.router.clone(),
                request,
            ));
        };
        let (parts, body) = request.into_parts();
        let span = tracing::debug_span!(
            "request",
            method = %parts.method,
            uri = %parts.uri,
            version = ?parts.version,
        );
        let state = self.state.clone();
        let query = parts.uri.query().map(str::to_string);
        let reply = async move {
            Ok(match endpoint {
                RpcEndpoint::Gateway => serve_rpc(&state, None, query, parts.headers, body).await,
                RpcEndpoint::Agent(id) => {
                    serve_agent_rpc(&state, id, query, parts.headers, body).await
                }
            })
        };
        Box::pin(reply.instrument(span))
    }
}

/// A JSON-RPC endpoint the front door serves itself.
#[derive(Debug, PartialEq)]
enum RpcEndpoint {
    /// `/a2a`: the gateway's.
    Gateway,
    /// `/agents/{id}/a2a`: one agent's, as published cards name it.
    Agent(String),
}

/// The JSON-RPC endpoint `path` names, with or without a trailing slash;
/// `None` for anything else, and for an agent id that is percent-encoded
/// (the router decodes it).
fn rpc_endpoint(path: &str) -> Option<RpcEndpoint> {
    let path = path.strip_suffix('/').unwrap_or(path);
    if path == "/a2a" {
        return Some(RpcEndpoint::Gateway);
    }
    let id = path.strip_prefix("/agents/")?.strip_suffix("/a2a")?;
    let plain = !id.is_empty() && !id.contains(['/', '%']);
    plain.then(|| RpcEndpoint::Agent(id.to_string()))
}

/// Serves `app`, behind its front door for JSON-RPC calls, on `listener`
/// within the state's connection limits, until `shutdown` resolves; then
/// drains open connections for at most `grace` (SSE streams end at once).
pub async fn run(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) {
    let gateway = state.gateway.clone();
    let stop = gateway.shutdown.clone();
    let limits = state.settings.connections;
    let refused = state.refused_connections.clone();
    let front = FrontDoor {
        router: app(state.clone()),
        state: Arc::new(state),
    };
    let server = connections::serve(listener, front, limits, refused, async move {
        shutdown.await;
        tracing::info!("shutting down: closing streams and draining connections");
        stop.cancel();
    });
    let drained = gateway.shutdown.clone();
    tokio::select! {
        () = server => {}
        _ = async move {
            drained.cancelled().await;
            tokio::time::sleep(grace).await;
        } => {
            tracing::warn!(?grace, "drain grace period over; closing remaining connections");
        }
    }
}

async fn gateway_card(State(state): State<AppState>, headers: HeaderMap) -> Response {
    state.gateway.directory().gateway_card().respond(&headers)
}

async fn agent_card(
    State(state): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    match state.gateway.agent(&id) {
        Some(agent) => agent.card.respond(&headers),
        None => (
            StatusCode::NOT_FOUND,
            axum::Json(serde_json::json!({"error": format!("no agent {id:?} is registered")})),
        )
            .into_response(),
    }
}

async fn registry_rpc(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let (principal, body) = match accept_rpc(&state, &headers, body).await {
        Ok(accepted) => accepted,
        Err(response) => return response,
    };
    let request = match parse_request(&body) {
        Ok(request) => request,
        Err(failure) => return error_reply(failure.id, &failure.error),
    };
    crate::registry::rpc::dispatch(&state.registry, principal.as_str(), request).await
}

/// Decodes a query string into `T` as axum's `Query` does (the same
/// deserializer), naming the parameter that fails by its path. A parameter
/// with an empty value (`?skill=&pageSize=`, as DESIGN.md spells the
/// search's template) is absent.
fn decode_query<T: serde::de::DeserializeOwned>(raw: Option<&str>) -> Result<T, GatewayError> {
    // A value decodes empty only if it is written empty.
    let given: Vec<&str> = raw
        .unwrap_or_default()
        .split('&')
        .filter(|pair| {
            pair.split_once('=')
                .is_some_and(|(_, value)| !value.is_empty())
        })
        .collect();
    let given = given.join("&");
    let parameters = form_urlencoded::parse(given.as_bytes());
    serde_path_to_error::deserialize(serde_urlencoded::Deserializer::new(parameters)).map_err(
        |err| {
            let path = err.path().to_string();
            let field = if path == "." {
                "query".to_string()
            } else {
                path
            };
            GatewayError::invalid_field(field, err.inner().to_string())
        },
    )
}

async fn registry_search(
    State(state): State<AppState>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Response {
    let principal = match state.authenticate(&headers) {
        Ok(principal) => principal,
        Err(response) => return response,
    };
    // Decoded after the key check: nobody without a key probes the parser.
    let page = decode_query::<SearchParams>(query.as_deref())
        .and_then(|params| state.registry.search_with(&params, "q", principal.as_str()))
        .and_then(crate::registry::rpc::shown);
    match page {
        Ok(page) => axum::Json(page).into_response(),
        Err(err) => (
            StatusCode::BAD_REQUEST,
            axum::Json(serde_json::json!({"error": err.to_rpc_error()})),
        )
            .into_response(),
    }
}

async fn healthz() -> Response {
    axum::Json(serde_json::json!({"status": "ok"})).into_response()
}

async fn readyz(State(state): State<AppState>) -> Response {
    match readiness(state.gateway.ledger()) {
        Ok(()) => axum::Json(serde_json::json!({"status": "ready"})).into_response(),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(serde_json::json!({"status": "unavailable", "reason": reason})),
        )
            .into_response(),
    }
}

/// Whether the ledger can take work: it reads, its log makes writes
/// durable, and its writes reach sled. Sends are refused meanwhile, so a
/// balancer should look elsewhere.
fn readiness(ledger: &crate::store::Ledger) -> Result<(), String> {
    if let Some(failure) = ledger.failure() {
        return Err(failure.to_string());
    }
    ledger
        .get("readyz-probe")
        .map(drop)
        .map_err(|err| err.to_string())
}

/// Prometheus text; unauthenticated, like the health probes.
async fn metrics(State(state): State<AppState>) -> Response {
    let gateway = &state.gateway;
    let push = &gateway.push().stats;
    let load =
        |counter: &std::sync::atomic::AtomicU64| counter.load(std::sync::atomic::Ordering::Relaxed);
    let log = gateway.ledger().log_figures();
    let figures = crate::metrics::GatewayFigures {
        registered_agents: gateway.directory().list().len() as u64,
        push_delivered: load(&push.delivered),
        push_failed: load(&push.failed),
        push_dropped: load(&push.dropped),
        ledger_durable_writes: log.durable_writes,
        ledger_log_syncs: log.syncs,
        ledger_log_failed_appends: log.failed_appends,
        ledger_sled_failed_attempts: gateway.ledger().sled_failed_attempts(),
        connections_refused: load(&state.refused_connections),
    };
    (
        [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        gateway.metrics.render(figures),
    )
        .into_response()
}

/// The handoff tree below a task (Baton's own path, not A2A), for the
/// caller that owns the task; keys are checked as on the A2A endpoints.
async fn task_trace(
    State(state): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let principal = match state.authenticate(&headers) {
        Ok(principal) => principal,
        Err(response) => return response,
    };
    let ctx = CallContext {
        principal: principal.into(),
        agent_id: state.settings.default_agent.clone(),
        idempotency_key: None,
        incoming: Default::default(),
        pinned: false,
        extensions: Vec::new(),
        tenant_label: None,
    };
    match state.gateway.trace(&ctx, &id) {
        Ok(report) => axum::Json(report).into_response(),
        Err(err) => {
            let status = match err {
                GatewayError::TaskNotFound(_) | GatewayError::PushConfigNotFound { .. } => {
                    StatusCode::NOT_FOUND
                }
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            };
            (
                status,
                axum::Json(serde_json::json!({"error": err.to_rpc_error()})),
            )
                .into_response()
        }
    }
}

async fn not_found() -> Response {
    (
        StatusCode::NOT_FOUND,
        axum::Json(serde_json::json!({"error": "not found"})),
    )
        .into_response()
}

async fn rpc_gateway(
    State(state): State<AppState>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: Body,
) -> Response {
    serve_rpc(&state, None, query, headers, body).await
}

async fn rpc_agent(
    State(state): State<AppState>,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: Body,
) -> Response {
    serve_agent_rpc(&state, id, query, headers, body).await
}

/// A JSON-RPC call on one agent's endpoint (`/agents/{id}/a2a`).
async fn serve_agent_rpc(
    state: &AppState,
    id: String,
    query: Option<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    if state.gateway.agent(&id).is_none() {
        // A call without a valid key is 401 whatever it names (DESIGN.md
        // §6), so that no one learns which agents exist without a key.
        if let Err(response) = state.authenticate(&headers) {
            return response;
        }
        // The answer names the request it answers, when its id can be read
        // (JSON-RPC 2.0 §5); the unknown agent is the error, whatever else.
        let body = read_body(state, body).await.unwrap_or_default();
        let request_id = match parse_request(&body) {
            Ok(request) => Some(request.id),
            Err(failure) => failure.id,
        };
        let error = GatewayError::invalid_field("agent", format!("no agent {id:?} is registered"));
        return json_reply(
            StatusCode::NOT_FOUND,
            crate::jsonrpc::error_body(request_id, &error),
        );
    }
    serve_rpc(state, Some(id), query, headers, body).await
}

/// `A2A-Version` from the header or the query; `None` when absent or empty.
fn requested_version<'a>(headers: &'a HeaderMap, query: Option<&'a str>) -> Option<&'a str> {
    let from_header = headers
        .get(VERSION_HEADER_NAME)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty());
    let from_query = || {
        query?
            .split('&')
            .filter_map(|pair| pair.split_once('='))
            .find(|(key, _)| key.eq_ignore_ascii_case("a2a-version"))
            .map(|(_, value)| value.trim())
            .filter(|v| !v.is_empty())
    };
    from_header.or_else(from_query)
}

/// Baton speaks 1.0. Versions match on Major.Minor and the patch number is
/// ignored (spec §3.6.2); a bare major `1` is read as 1.0, and no version
/// at all as 0.3.
fn check_version(requested: Option<&str>) -> Result<(), GatewayError> {
    let Some(version) = requested else {
        return Err(GatewayError::VersionNotSupported {
            version: "0.3".into(),
            stated: false,
        });
    };
    let mut parts = version.split('.');
    let major = parts.next().unwrap_or("");
    let minor = parts.next().unwrap_or("0");
    if major == "1" && minor == "0" {
        Ok(())
    } else {
        Err(GatewayError::VersionNotSupported {
            version: version.to_string(),
            stated: true,
        })
    }
}

fn is_json_content_type(headers: &HeaderMap) -> bool {
    match headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    {
        None => true, // lenient: a missing header is read as JSON
        Some(value) => {
            let essence = value
                .split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase();
            essence == "application/json" || essence.ends_with("+json")
        }
    }
}

/// Extensions the client asked for that the card declares.
fn activated_extensions(headers: &HeaderMap, card: &AgentCard) -> Vec<String> {
    requested_extensions(headers)
        .filter(|uri| card.capabilities.extensions.iter().any(|e| e.uri == *uri))
        .map(str::to_string)
        .collect()
}

/// The extension URIs listed in the request's `A2A-Extensions` headers.
fn requested_extensions(headers: &HeaderMap) -> impl Iterator<Item = &str> {
    headers
        .get_all(A2A_EXTENSIONS)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|uri| !uri.is_empty())
}

/// Reads `message.messageId` from the params without decoding the rest.
fn peek_message_id(params: &serde_json::value::RawValue) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Params {
        message: Option<MessageIdOnly>,
    }
    #[derive(serde::Deserialize)]
    struct MessageIdOnly {
        #[serde(rename = "messageId", alias = "message_id")]
        message_id: Option<String>,
    }
    serde_json::from_str::<Params>(params.get())
        .ok()?
        .message?
        .message_id
}

/// Reads `tenant` from the params without decoding the rest.
fn peek_tenant(params: &serde_json::value::RawValue) -> String {
    #[derive(serde::Deserialize)]
    struct TenantOnly {
        #[serde(default)]
        tenant: Option<String>,
    }
    // Most calls name no tenant: text with neither the key nor an escape
    // (which could spell the key another way) has none, unparsed.
    let text = params.get();
    if !text.contains("\"tenant\"") && !text.contains('\\') {
        return String::new();
    }
    serde_json::from_str::<TenantOnly>(text)
        .ok()
        .and_then(|t| t.tenant)
        .unwrap_or_default()
}

/// Admits a JSON-RPC call: the caller first (nobody without a key gets to
/// probe the parser), then the body.
async fn accept_rpc(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<(Principal, axum::body::Bytes), Response> {
    let principal = state.authenticate(headers)?;
    let body = read_rpc_body(state, headers, body).await?;
    Ok((principal, body))
}

/// Why a request body could not be read.
#[derive(Debug, thiserror::Error)]
enum BodyError {
    /// The read timeout (in seconds) passed first.
    #[error("request body did not arrive within {0} s")]
    TimedOut(u64),
    /// Longer than the body limit (in bytes).
    #[error("request body exceeds the limit of {0} bytes")]
    TooLarge(usize),
    /// A broken chunked encoding, or a connection lost mid-body.
    #[error("request body could not be read: {0}")]
    Unreadable(axum::BoxError),
}

impl BodyError {
    /// The HTTP status of the answer.
    fn status(&self) -> StatusCode {
        match self {
            Self::TimedOut(_) => StatusCode::REQUEST_TIMEOUT,
            Self::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Unreadable(_) => StatusCode::BAD_REQUEST,
        }
    }
}

/// Reads a request body whole, up to the body limit, within the read
/// timeout.
async fn read_body(state: &AppState, body: Body) -> Result<axum::body::Bytes, BodyError> {
    let settings = &state.settings;
    let whole = axum::body::to_bytes(body, settings.max_body_bytes);
    let read_timeout = settings.connections.read_timeout;
    match tokio::time::timeout(read_timeout, whole).await {
        Ok(Ok(body)) => Ok(body),
        Ok(Err(err)) => {
            let cause = err.into_inner();
            Err(if cause.is::<http_body_util::LengthLimitError>() {
                BodyError::TooLarge(settings.max_body_bytes)
            } else {
                BodyError::Unreadable(cause)
            })
        }
        Err(_) => Err(BodyError::TimedOut(read_timeout.as_secs())),
    }
}

/// Reads a JSON-RPC body: capped in size, and JSON by its Content-Type.
async fn read_rpc_body(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<axum::body::Bytes, Response> {
    let body = read_body(state, body).await.map_err(|err| {
        let error = GatewayError::InvalidRequest(err.to_string());
        json_reply(err.status(), crate::jsonrpc::error_body(None, &error))
    })?;
    if !is_json_content_type(headers) {
        let error = GatewayError::ContentTypeNotSupported(
            "JSON-RPC requests must be sent as Content-Type: application/json".into(),
        );
        // Echo the id when the body is JSON-RPC after all.
        let id = parse_request(&body).ok().map(|request| request.id);
        return Err(error_reply(id, &error));
    }
    Ok(body)
}

async fn serve_rpc(
    state: &AppState,
    path_agent: Option<String>,
    query: Option<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let (principal, body) = match accept_rpc(state, &headers, body).await {
        Ok(accepted) => accepted,
        Err(response) => return response,
    };
    let request = match parse_request(&body) {
        Ok(request) => request,
        Err(failure) => return error_reply(failure.id, &failure.error),
    };
    if let Err(error) = check_version(requested_version(&headers, query.as_deref())) {
        return error_reply(Some(request.id), &error);
    }
    // Before its params are looked at (their tenant, a send's extensions).
    if !methods::ALL.contains(&&*request.method) {
        let error = crate::jsonrpc::dispatch::unknown_method(&request.method);
        return error_reply(Some(request.id), &error);
    }

    // The card of the endpoint addressed: an agent's, or the gateway's own.
    let tenant = peek_tenant(request.params);
    let path_pinned = path_agent.is_some();
    let mut pinned = path_pinned || !tenant.is_empty();
    let mut tenant_label = None;
    let (agent_id, published) = match path_agent.or((!tenant.is_empty()).then_some(tenant)) {
        // A label the routing rules match: the call is the gateway's, as
        // one without a tenant. The label wins over an agent of that id (one
        // registered before a rule named it; none can be since).
        Some(id) if pinned && !path_pinned && state.gateway.routes_tenant(&id) => {
            pinned = false;
            tenant_label = Some(id);
            (state.settings.default_agent.clone(), None)
        }
        Some(id) => match state.gateway.agent(&id) {
            Some(published) => (id, Some(published)),
            None => {
                let error =
                    GatewayError::invalid_field("tenant", format!("no agent {id:?} is registered"));
                return error_reply(Some(request.id), &error);
            }
        },
        None => (state.settings.default_agent.clone(), None),
    };
    let gateway_card = state.gateway.directory().gateway_card();
    let card = published
        .as_ref()
        .map_or(&gateway_card.card, |p| &p.card.card);
    let extensions = activated_extensions(&headers, card);
    let is_send = matches!(
        &*request.method,
        methods::SEND_MESSAGE | methods::SEND_STREAMING_MESSAGE
    );
    if is_send
        && let Err(error) = crate::gateway::validate::check_required_extensions(card, &extensions)
    {
        return error_reply(Some(request.id), &error);
    }
    let extended_card = if card.capabilities.extended_agent_card != Some(true) {
        Err(GatewayError::UnsupportedOperation(
            "this agent declares no extended agent card".into(),
        ))
    } else {
        match &published {
            None => Ok(&gateway_card.card),
            Some(agent) => agent
                .extended
                .as_ref()
                .ok_or(GatewayError::ExtendedAgentCardNotConfigured),
        }
    };
    let idempotency_key = headers
        .get(IDEMPOTENCY_KEY)
        .and_then(|v| v.to_str().ok())
        // A blank value is no key a client chose: every such send would
        // share it.
        .filter(|key| !key.trim().is_empty())
        .map(str::to_string)
        .or_else(|| {
            // With the handoff extension active, the messageId is the key (DESIGN.md §2).
            if !extensions.iter().any(|e| e == HANDOFF_EXTENSION) {
                return None;
            }
            peek_message_id(request.params)
        });
    let ctx = CallContext {
        principal: principal.into(),
        agent_id: agent_id.clone(),
        idempotency_key,
        incoming: crate::handoff::control::Incoming::read(&headers, None),
        pinned,
        extensions: requested_extensions(&headers).map(str::to_string).collect(),
        tenant_label,
    };
    // dispatch boxes the method's future, sized for that method alone, and
    // answers the methods that need no waiting at once: both in the span.
    let span = tracing::debug_span!("rpc", agent = %agent_id);
    let answer = span.in_scope(|| dispatch(&state.gateway, &ctx, request, extended_card));
    let mut response = answer.instrument(span).await;
    if !extensions.is_empty()
        && let Ok(value) = HeaderValue::from_str(&extensions.join(","))
    {
        response.headers_mut().insert(A2A_EXTENSIONS, value);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_is_read_however_the_params_spell_it() {
        let tenant_of = |params: &str| {
            peek_tenant(&serde_json::value::RawValue::from_string(params.into()).unwrap())
        };
        assert_eq!(tenant_of(r#"{"message":{"parts":[{"text":"hi"}]}}"#), "");
        assert_eq!(tenant_of(r#"{"id":"t","tenant":"billing"}"#), "billing");
        // The key escaped, or "tenant" only inside a value.
        assert_eq!(tenant_of(r#"{"tena\u006et":"billing"}"#), "billing");
        assert_eq!(
            tenant_of(r#"{"message":{"parts":[{"text":"\"tenant\""}]}}"#),
            ""
        );
        assert_eq!(tenant_of(r#"{"tenant":null}"#), "");
        // Not an object: no tenant.
        assert_eq!(tenant_of("[1]"), "");
    }

    #[test]
    fn the_front_door_takes_only_json_rpc_endpoints() {
        assert_eq!(rpc_endpoint("/a2a"), Some(RpcEndpoint::Gateway));
        assert_eq!(rpc_endpoint("/a2a/"), Some(RpcEndpoint::Gateway));
        for path in ["/agents/billing/a2a", "/agents/billing/a2a/"] {
            assert_eq!(
                rpc_endpoint(path),
                Some(RpcEndpoint::Agent("billing".into())),
                "{path}"
            );
        }
        // As the router reads `/agents/{id}/a2a`.
        assert_eq!(
            rpc_endpoint("/agents/a2a/a2a"),
            Some(RpcEndpoint::Agent("a2a".into()))
        );
        for path in [
            "/",
            "/a2a//",
            "/a2a/more",
            "/registry",
            "/agents//a2a",
            "/agents/a/b/a2a",
            "/agents/b%69lling/a2a",
            "/agents/billing/.well-known/agent-card.json",
            "/agents/billing",
            "/agents/a2a",
            "//a2a",
            "/agents/billing/a2a//",
        ] {
            assert_eq!(rpc_endpoint(path), None, "{path}");
        }
    }

    #[test]
    fn a_bad_search_parameter_is_named() {
        let error = decode_query::<SearchParams>(Some("pageSize=abc"))
            .unwrap_err()
            .to_rpc_error();
        let violation = &error["data"][0]["fieldViolations"][0];
        assert_eq!(violation["field"], "pageSize", "{error}");
        let description = violation["description"].as_str().unwrap();
        assert!(
            !description.contains("Failed to deserialize"),
            "{description}"
        );
        assert!(decode_query::<SearchParams>(None).is_ok());
    }

    /// An empty value is no value, for every parameter of the search.
    #[test]
    fn empty_search_parameters_are_absent() {
        let empty = "skill=&tag=&q=&inputMode=&outputMode=&pageSize=&pageToken=&skill";
        let params = decode_query::<SearchParams>(Some(empty)).unwrap();
        let given = [
            params.skill,
            params.tag,
            params.query,
            params.input_mode,
            params.output_mode,
            params.page_token,
        ];
        assert_eq!(given, [None, None, None, None, None, None]);
        assert_eq!(params.page_size, None);
        let params = decode_query::<SearchParams>(Some("tag=&skill=echo&pageSize=2")).unwrap();
        assert_eq!(params.skill.as_deref(), Some("echo"));
        assert_eq!((params.tag, params.page_size), (None, Some(2)));
    }

    #[test]
    fn versions() {
        for supported in ["1.0", "1.0.1", "1"] {
            assert!(check_version(Some(supported)).is_ok(), "{supported}");
        }
        for unsupported in ["1.1", "0.3", "99.0"] {
            let error = check_version(Some(unsupported)).unwrap_err();
            assert_eq!(error.code(), -32009, "{unsupported}");
        }
        let unstated = check_version(None).unwrap_err();
        assert_eq!(unstated.code(), -32009);
        assert!(
            unstated.to_string().contains("names no A2A version"),
            "{unstated}"
        );
        let mut headers = HeaderMap::new();
        assert_eq!(requested_version(&headers, None), None);
        assert_eq!(
            requested_version(&headers, Some("A2A-Version=1.0")),
            Some("1.0")
        );
        headers.insert("a2a-version", HeaderValue::from_static(""));
        assert_eq!(requested_version(&headers, None), None);
    }
}
