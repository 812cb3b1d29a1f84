//! The registry's JSON-RPC methods at `POST /registry`, and the read-only
//! search at `GET /registry/agents`.

use super::service::{IdParams, RegisterParams, Registry, SearchParams};
use crate::error::GatewayError;
use crate::jsonrpc::RpcRequest;
use crate::jsonrpc::dispatch::{error_reply, json_reply};
use crate::jsonrpc::envelope::{decode_params, success_body};
use axum::http::StatusCode;
use axum::response::Response;
use serde::Serialize;
use serde_json::json;

/// Registry method names, verbatim from DESIGN.md §4.
pub mod methods {
    /// RegisterAgent.
    pub const REGISTER_AGENT: &str = "RegisterAgent";
    /// UpdateAgent.
    pub const UPDATE_AGENT: &str = "UpdateAgent";
    /// DeregisterAgent.
    pub const DEREGISTER_AGENT: &str = "DeregisterAgent";
    /// GetAgent.
    pub const GET_AGENT: &str = "GetAgent";
    /// SearchAgents.
    pub const SEARCH_AGENTS: &str = "SearchAgents";
}

/// A reply with credentials kept out of every URL in it (see
/// [`hide_credentials`]).
fn reply<T: Serialize>(request: &RpcRequest<'_>, result: Result<T, GatewayError>) -> Response {
    let shown = result
        .and_then(shown)
        .and_then(|value| success_body(request.id, &value));
    match shown {
        Ok(body) => json_reply(StatusCode::OK, body),
        Err(err) => error_reply(Some(request.id), &err),
    }
}

/// `value` as JSON with [`hide_credentials`] applied: what the registry
/// shows of it.
pub fn shown<T: Serialize>(value: T) -> Result<serde_json::Value, GatewayError> {
    let mut shown = serde_json::to_value(value)
        .map_err(|e| GatewayError::Internal(format!("cannot encode a registry reply: {e}")))?;
    hide_credentials(&mut shown);
    Ok(shown)
}

/// Removes the `user:password@` of every URL in `value`'s strings: a card
/// URL or an agent interface may carry credentials, which Baton sends to
/// the agent (as Basic auth) but shows no caller, its owner included. A
/// health error quoting such a URL is cleaned the same way. A `cardUrl` and
/// every `url` field (an interface's, a provider's) also lose their query
/// and fragment, where a signed URL or a function key keeps its secret.
pub fn hide_credentials(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::String(text) => {
            if let Some(clean) = without_credentials(text) {
                *text = clean;
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(hide_credentials),
        serde_json::Value::Object(object) => {
            // A query may hold a key (a signed URL's signature, a function
            // key): a card's and an interface's URLs lose theirs.
            for field in ["cardUrl", "url"] {
                if let Some(serde_json::Value::String(url)) = object.get_mut(field)
                    && let Some(end) = url.find(['?', '#'])
                {
                    url.truncate(end);
                }
            }
            object.values_mut().for_each(hide_credentials);
        }
        _ => {}
    }
}

/// `text` without the credentials of the URLs in it; `None` if it has none.
/// A string that is one URL loses them as the URL parser reads them (which
/// is what Baton sends): up to the last `@` before the host, spaces and
/// `@`s included, tabs and line breaks dropped. In other text, a URL's
/// credentials end at the first `@` or space, so prose is left as written.
fn without_credentials(text: &str) -> Option<String> {
    // Credentials end at an `@`: most strings need no parse at all.
    if !text.contains('@') {
        return None;
    }
    static URL_USERINFO: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(r"(?i)^([a-z][a-z0-9+.-]*://)[^/?#\\]*@").expect("a valid pattern")
    });
    static TEXT_USERINFO: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/?#@\s]*@").expect("a valid pattern")
    });
    match url::Url::parse(text) {
        Ok(url) if has_credentials(&url) => {
            let read: String = text
                .trim()
                .chars()
                .filter(|c| !matches!(c, '\t' | '\r' | '\n'))
                .collect();
            let cleaned = URL_USERINFO.replace(&read, "$1");
            // A spelling the pattern does not take (`http:user:pw@host`, a
            // leading control character) is shown as the parser reads it.
            let taken = matches!(cleaned, std::borrow::Cow::Owned(_))
                && url::Url::parse(&cleaned).is_ok_and(|url| !has_credentials(&url));
            if taken {
                Some(cleaned.into_owned())
            } else {
                Some(crate::netguard::without_credentials(&url).to_string())
            }
        }
        Ok(_) => None,
        Err(_) => match TEXT_USERINFO.replace_all(text, "$1") {
            std::borrow::Cow::Owned(clean) => Some(clean),
            std::borrow::Cow::Borrowed(_) => None,
        },
    }
}

fn has_credentials(url: &url::Url) -> bool {
    !url.username().is_empty() || url.password().is_some()
}

/// Serves one registry request for `principal`.
pub async fn dispatch(registry: &Registry, principal: &str, request: RpcRequest<'_>) -> Response {
    let params = request.params;
    match &*request.method {
        methods::REGISTER_AGENT => {
            let result = match decode_params::<RegisterParams>(params) {
                Ok(p) => registry
                    .register(principal, p)
                    .await
                    .map(|agent| json!({ "agent": agent })),
                Err(err) => Err(err),
            };
            reply(&request, result)
        }
        methods::UPDATE_AGENT => {
            let result = match decode_params::<RegisterParams>(params) {
                Ok(p) => registry
                    .update(principal, p)
                    .await
                    .map(|agent| json!({ "agent": agent })),
                Err(err) => Err(err),
            };
            reply(&request, result)
        }
        methods::DEREGISTER_AGENT => {
            let result = match decode_params::<IdParams>(params) {
                Ok(p) => registry
                    .deregister(principal, &p.id)
                    .await
                    .map(|()| json!({})),
                Err(err) => Err(err),
            };
            reply(&request, result)
        }
        methods::GET_AGENT => reply(
            &request,
            decode_params::<IdParams>(params)
                .and_then(|p| registry.get(&p.id, principal))
                .map(|agent| json!({ "agent": agent })),
        ),
        methods::SEARCH_AGENTS => reply(
            &request,
            decode_params::<SearchParams>(params).and_then(|p| registry.search(&p, principal)),
        ),
        other => error_reply(
            Some(request.id),
            &GatewayError::MethodNotFound(format!("{other:?} is not a registry method")),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_hidden_as_the_url_parser_reads_them() {
        let cases = [
            (
                "http://svc:S3cret@agent.example/a2a",
                "http://agent.example/a2a",
            ),
            (
                "http://svc:S3cr@tPart@agent.example/a2a",
                "http://agent.example/a2a",
            ),
            ("https://svc:pa ss@agent.example", "https://agent.example"),
            (
                "http://svc:pw@agent.example\\a@b",
                "http://agent.example\\a@b",
            ),
            (
                "cannot reach http://u:p@a.example/x: refused",
                "cannot reach http://a.example/x: refused",
            ),
            (
                "http://agent.example/a?to=a@b",
                "http://agent.example/a?to=a@b",
            ),
            ("mail ops@example.com", "mail ops@example.com"),
            (
                "http://svc:pa\nss@agent.example/a2a",
                "http://agent.example/a2a",
            ),
            (
                "Docs at https://docs.example.com or mail help@example.com",
                "Docs at https://docs.example.com or mail help@example.com",
            ),
            // Spellings the parser takes for credentials, shown as it reads them.
            (
                "http:svc:S3cret@agent.example/a2a",
                "http://agent.example/a2a",
            ),
            (
                "http:/svc:S3cret@agent.example/a2a",
                "http://agent.example/a2a",
            ),
            (
                "http:\\\\svc:S3cret@agent.example/a2a",
                "http://agent.example/a2a",
            ),
            (
                "\u{1}http://svc:S3cret@agent.example/a2a",
                "http://agent.example/a2a",
            ),
        ];
        for (text, expected) in cases {
            let mut value = serde_json::json!({"lastError": text, "urls": [text]});
            hide_credentials(&mut value);
            assert_eq!(value["lastError"], expected, "{text}");
            assert_eq!(value["urls"][0], expected, "{text}");
            // What is shown is what the URL parser takes for the agent.
            if let Ok(parsed) = url::Url::parse(text) {
                assert!(
                    !expected.contains(parsed.password().unwrap_or("\0")),
                    "{text}"
                );
            }
        }
    }

    #[test]
    fn card_and_interface_urls_lose_their_query_and_fragment() {
        let mut record = serde_json::json!({
            "cardUrl": "https://agent.example/card.json?sig=S3cret#x",
            "card": {"supportedInterfaces": [
                {"url": "https://fn.example/api/a2a?code=K3y", "protocolBinding": "JSONRPC"},
            ]},
            "note": "https://docs.example/?q=kept",
        });
        hide_credentials(&mut record);
        assert_eq!(record["cardUrl"], "https://agent.example/card.json");
        let interface = &record["card"]["supportedInterfaces"][0];
        assert_eq!(interface["url"], "https://fn.example/api/a2a");
        assert_eq!(record["note"], "https://docs.example/?q=kept");
    }
}
