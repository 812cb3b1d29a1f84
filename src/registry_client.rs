//! A client for a running Baton's registry JSON-RPC (`POST {url}/registry`,
//! DESIGN §4), used by `baton agents`. Results are kept as JSON values: the
//! command line prints them as they come.
//!
//! Error policy: an HTTP 401 is [`ClientError::Unauthorized`]; a JSON-RPC error
//! (whatever the HTTP status) is [`ClientError::Rpc`] with its code, message
//! and data; anything else the server says is [`ClientError::Http`] or
//! [`ClientError::BadReply`]; not reaching it at all is
//! [`ClientError::Transport`].

use serde::Serialize;
use serde_json::{Value, json};
use std::time::Duration;

/// Registry JSON-RPC method names.
pub mod method {
    /// Registers an agent from a card or a card URL.
    pub const REGISTER_AGENT: &str = "RegisterAgent";
    /// Replaces an agent's card or settings.
    pub const UPDATE_AGENT: &str = "UpdateAgent";
    /// Removes an agent.
    pub const DEREGISTER_AGENT: &str = "DeregisterAgent";
    /// One agent's record.
    pub const GET_AGENT: &str = "GetAgent";
    /// A page of agents matching filters.
    pub const SEARCH_AGENTS: &str = "SearchAgents";
}

/// The path of the registry endpoint under Baton's base URL.
pub const REGISTRY_PATH: &str = "/registry";

/// How long one call may take.
const TIMEOUT: Duration = Duration::from_secs(30);

/// Most pages `search_all` follows before deciding the server is looping.
const MAX_PAGES: usize = 10_000;

/// Why a registry call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// HTTP 401: no key, or a key Baton does not accept.
    #[error("unauthorized: {0}")]
    Unauthorized(String),
    /// The server answered with a JSON-RPC error.
    #[error("error {code}: {message}")]
    Rpc {
        /// JSON-RPC error code.
        code: i64,
        /// Its message.
        message: String,
        /// Its data, if any.
        data: Option<Value>,
    },
    /// A non-JSON-RPC answer with an error status.
    #[error("HTTP {status}: {body}")]
    Http {
        /// The status code.
        status: u16,
        /// The start of the body.
        body: String,
    },
    /// The server could not be reached or stopped answering.
    #[error("cannot reach {url}: {source}")]
    Transport {
        /// The endpoint.
        url: String,
        /// The cause.
        source: reqwest::Error,
    },
    /// A 2xx answer that is not a JSON-RPC response.
    #[error("bad reply from Baton: {0}")]
    BadReply(String),
    /// The base URL is not an http(s) URL.
    #[error("bad Baton URL {0:?}: expected http://host:port")]
    BadUrl(String),
}

/// `RegisterAgent` parameters.
#[derive(Clone, Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RegisterParams {
    /// Agent id; Baton chooses one when absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The AgentCard, inline.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub card: Option<Value>,
    /// Where Baton fetches the AgentCard from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub card_url: Option<String>,
}

/// `SearchAgents` parameters; all filters optional.
#[derive(Clone, Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SearchParams {
    /// Skill id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skill: Option<String>,
    /// Skill tag.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// Free text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub query: Option<String>,
    /// Accepted input media type.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input_mode: Option<String>,
    /// Produced output media type.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_mode: Option<String>,
    /// Largest page.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub page_size: Option<u32>,
    /// Where the page starts (a previous `nextPageToken`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub page_token: Option<String>,
}

/// Calls one Baton's registry.
#[derive(Clone)]
pub struct RegistryClient {
    http: reqwest::Client,
    endpoint: reqwest::Url,
    key: Option<String>,
}

impl std::fmt::Debug for RegistryClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryClient")
            .field("endpoint", &self.endpoint.as_str())
            .field("key", &self.key.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl RegistryClient {
    /// A client for the Baton at `base_url`, sending `key` as a bearer token.
    pub fn new(base_url: &str, key: Option<String>) -> Result<Self, ClientError> {
        let bad = || ClientError::BadUrl(base_url.to_string());
        let endpoint = reqwest::Url::parse(&format!(
            "{}{REGISTRY_PATH}",
            base_url.trim().trim_end_matches('/')
        ))
        .map_err(|_| bad())?;
        if !matches!(endpoint.scheme(), "http" | "https") || endpoint.host().is_none() {
            return Err(bad());
        }
        let http = reqwest::Client::builder()
            .timeout(TIMEOUT)
            .build()
            .map_err(|source| ClientError::Transport {
                url: endpoint.to_string(),
                source,
            })?;
        Ok(Self {
            http,
            endpoint,
            key: key.filter(|k| !k.trim().is_empty()),
        })
    }

    /// The registry endpoint called.
    pub fn endpoint(&self) -> &str {
        self.endpoint.as_str()
    }

    /// Calls `method` with `params`; the JSON-RPC `result`.
    pub async fn call(&self, method: &str, params: Value) -> Result<Value, ClientError> {
        let request = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
        let mut builder = self.http.post(self.endpoint.clone()).json(&request);
        if let Some(key) = &self.key {
            builder = builder.bearer_auth(key.trim());
        }
        let transport = |source| ClientError::Transport {
            url: self.endpoint.to_string(),
            source,
        };
        let response = builder.send().await.map_err(transport)?;
        let status = response.status();
        let body = response.bytes().await.map_err(transport)?;
        let reply: Option<Value> = serde_json::from_slice(&body).ok();
        let rpc_error = reply.as_ref().and_then(|r| r.get("error"));

        if status == reqwest::StatusCode::UNAUTHORIZED {
            let message = rpc_error
                .and_then(|e| e.get("message"))
                .and_then(Value::as_str)
                .map(str::to_string)
                .unwrap_or_else(|| snippet(&body, "HTTP 401"));
            let hint = if self.key.is_none() {
                " (no key given: pass --key or set BATON_API_KEY)"
            } else {
                ""
            };
            return Err(ClientError::Unauthorized(format!("{message}{hint}")));
        }
        if let Some(error) = rpc_error {
            return Err(ClientError::Rpc {
                code: error.get("code").and_then(Value::as_i64).unwrap_or(0),
                message: error
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string(),
                data: error.get("data").cloned(),
            });
        }
        if !status.is_success() {
            return Err(ClientError::Http {
                status: status.as_u16(),
                body: snippet(&body, ""),
            });
        }
        match reply {
            Some(Value::Object(mut reply)) if reply.contains_key("result") => {
                Ok(reply.remove("result").unwrap_or_default())
            }
            _ => Err(ClientError::BadReply(snippet(&body, "empty body"))),
        }
    }

    /// `RegisterAgent`: `{agent}`.
    pub async fn register(&self, params: &RegisterParams) -> Result<Value, ClientError> {
        self.call(method::REGISTER_AGENT, to_value(params)).await
    }

    /// `GetAgent`: `{agent}`.
    pub async fn get(&self, id: &str) -> Result<Value, ClientError> {
        self.call(method::GET_AGENT, json!({"id": id})).await
    }

    /// `DeregisterAgent`: `{}`.
    pub async fn deregister(&self, id: &str) -> Result<Value, ClientError> {
        self.call(method::DEREGISTER_AGENT, json!({"id": id})).await
    }

    /// One `SearchAgents` page: `{agents, nextPageToken}`.
    pub async fn search(&self, params: &SearchParams) -> Result<Value, ClientError> {
        self.call(method::SEARCH_AGENTS, to_value(params)).await
    }

    /// Every page of `SearchAgents`, following `nextPageToken`: `{agents}`.
    pub async fn search_all(&self, mut params: SearchParams) -> Result<Value, ClientError> {
        let mut agents = Vec::new();
        for _ in 0..MAX_PAGES {
            let page = self.search(&params).await?;
            match page.get("agents") {
                Some(Value::Array(found)) => agents.extend(found.iter().cloned()),
                None | Some(Value::Null) => {}
                Some(_) => return Err(ClientError::BadReply("`agents` is not a list".into())),
            }
            let next = page
                .get("nextPageToken")
                .and_then(Value::as_str)
                .filter(|token| !token.is_empty());
            match next {
                None => return Ok(json!({"agents": agents})),
                Some(token) if params.page_token.as_deref() == Some(token) => {
                    return Err(ClientError::BadReply(
                        "the same nextPageToken twice in a row".into(),
                    ));
                }
                Some(token) => params.page_token = Some(token.to_string()),
            }
        }
        Err(ClientError::BadReply(format!(
            "more than {MAX_PAGES} pages of agents"
        )))
    }
}

fn to_value(params: &impl Serialize) -> Value {
    // Plain structs of strings and numbers always serialize.
    serde_json::to_value(params).unwrap_or_default()
}

/// The start of a body, for messages.
fn snippet(body: &[u8], if_empty: &str) -> String {
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    if text.is_empty() {
        return if_empty.to_string();
    }
    text.chars().take(500).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::Json;
    use axum::http::{HeaderMap, StatusCode};
    use axum::response::{IntoResponse, Response};
    use axum::routing::post;

    /// A stand-in registry: three agents in pages of two, key `KEY1`.
    async fn fake_registry(headers: HeaderMap, Json(request): Json<Value>) -> Response {
        if headers.get("authorization").and_then(|v| v.to_str().ok()) != Some("Bearer KEY1") {
            let error = json!({"jsonrpc": "2.0", "id": null,
                "error": {"code": -32001, "message": "invalid API key"}});
            return (StatusCode::UNAUTHORIZED, Json(error)).into_response();
        }
        let id = request["id"].clone();
        let params = &request["params"];
        let result = match request["method"].as_str().unwrap_or_default() {
            method::SEARCH_AGENTS => match params["pageToken"].as_str() {
                None => json!({"agents": [{"id": "a"}, {"id": "b"}], "nextPageToken": "p2"}),
                Some("p2") => json!({"agents": [{"id": "c"}], "nextPageToken": ""}),
                Some(_) => json!({"agents": [], "nextPageToken": "loop"}),
            },
            method::GET_AGENT if params["id"] == "a" => json!({"agent": {"id": "a"}}),
            _ => {
                let error = json!({"jsonrpc": "2.0", "id": id,
                    "error": {"code": -32602, "message": "no such agent", "data": {"id": params["id"]}}});
                return (StatusCode::NOT_FOUND, Json(error)).into_response();
            }
        };
        Json(json!({"jsonrpc": "2.0", "id": id, "result": result})).into_response()
    }

    async fn serve() -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = axum::Router::new().route(REGISTRY_PATH, post(fake_registry));
        tokio::spawn(async move { axum::serve(listener, app).await });
        format!("http://{addr}/")
    }

    #[test]
    fn urls() {
        let client = RegistryClient::new("http://localhost:8080/", None).unwrap();
        assert_eq!(client.endpoint(), "http://localhost:8080/registry");
        for bad in ["localhost:8080", "ftp://x", "not a url", ""] {
            assert!(
                matches!(RegistryClient::new(bad, None), Err(ClientError::BadUrl(_))),
                "{bad:?}"
            );
        }
        let client = RegistryClient::new("http://h", Some("SECRET".into())).unwrap();
        assert!(!format!("{client:?}").contains("SECRET"));
    }

    #[tokio::test]
    async fn results_errors_and_pages() {
        let url = serve().await;
        let client = RegistryClient::new(&url, Some("KEY1".into())).unwrap();
        assert_eq!(
            client.get("a").await.unwrap(),
            json!({"agent": {"id": "a"}})
        );
        match client.get("zz").await {
            Err(ClientError::Rpc {
                code: -32602,
                message,
                data: Some(data),
            }) => {
                assert_eq!(message, "no such agent");
                assert_eq!(data, json!({"id": "zz"}));
            }
            other => panic!("{other:?}"),
        }
        let all = client.search_all(SearchParams::default()).await.unwrap();
        assert_eq!(
            all,
            json!({"agents": [{"id": "a"}, {"id": "b"}, {"id": "c"}]})
        );
        let looping = SearchParams {
            page_token: Some("x".into()),
            ..SearchParams::default()
        };
        assert!(matches!(
            client.search_all(looping).await,
            Err(ClientError::BadReply(_))
        ));
    }

    #[tokio::test]
    async fn unauthorized() {
        let url = serve().await;
        for (key, hint) in [(None, true), (Some("WRONG".to_string()), false)] {
            let err = RegistryClient::new(&url, key)
                .unwrap()
                .get("a")
                .await
                .unwrap_err();
            let text = err.to_string();
            assert!(matches!(err, ClientError::Unauthorized(_)), "{text}");
            assert!(text.starts_with("unauthorized: invalid API key"), "{text}");
            assert_eq!(text.contains("BATON_API_KEY"), hint, "{text}");
        }
    }
}
