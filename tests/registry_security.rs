//! Security of the registry and of A2A calls over real HTTP: agency API keys
//! (401 without a valid key, public cards declaring the bearer scheme),
//! ownership of agents and tasks between agencies, agent health, and the
//! `baton agents` command line against a keyed Baton.

mod common;

use baton::protocol::HANDOFF_EXTENSION;
use common::agents::GatedAgent;
use common::*;
use serde_json::{Value, json};
use std::io::Read as _;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The keys of the two agencies of these tests.
const KEYS: &str = "acme=KEY1,globex=KEY2";
/// acme's key.
const ACME: &str = "KEY1";
/// globex's key.
const GLOBEX: &str = "KEY2";

/// Posts a JSON-RPC call to `path` with the standard A2A headers and, when
/// given, `Authorization: <authorization>` verbatim.
async fn rpc_with(
    baton: &TestBaton,
    path: &str,
    authorization: Option<&str>,
    method: &str,
    params: Value,
) -> Reply {
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
    let mut headers = STANDARD_HEADERS.to_vec();
    if let Some(value) = authorization {
        headers.push(("authorization", value));
    }
    baton.post_raw(path, body.to_string(), &headers).await
}

/// A JSON-RPC call to `path` as the agency holding `key`.
async fn rpc_as(baton: &TestBaton, path: &str, key: &str, method: &str, params: Value) -> Reply {
    let authorization = format!("Bearer {key}");
    rpc_with(baton, path, Some(&authorization), method, params).await
}

/// A registry call as the agency holding `key`.
async fn registry_as(baton: &TestBaton, key: &str, method: &str, params: Value) -> Reply {
    rpc_as(baton, "/registry", key, method, params).await
}

/// A GET with an optional `Authorization` value: status, headers and the body
/// as JSON (`Null` when it is not JSON).
async fn get_with(
    baton: &TestBaton,
    path: &str,
    authorization: Option<&str>,
) -> (reqwest::StatusCode, reqwest::header::HeaderMap, Value) {
    let mut request = baton.http.get(baton.url(path));
    if let Some(value) = authorization {
        request = request.header("authorization", value);
    }
    let response = tokio::time::timeout(WAIT, request.send())
        .await
        .expect("reply in time")
        .expect("HTTP request");
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = tokio::time::timeout(WAIT, response.bytes())
        .await
        .expect("body in time")
        .expect("body");
    (
        status,
        headers,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// The card of an agent served by `upstream`, as the upstream publishes it.
async fn upstream_card(upstream: &TestBaton, agent: &str) -> Value {
    let path = format!("/agents/{agent}/.well-known/agent-card.json");
    let (status, _, card) = get_with(upstream, &path, None).await;
    assert_eq!(status, 200, "{card}");
    card
}

/// Asserts an HTTP 401 with a bearer `WWW-Authenticate` challenge.
fn assert_unauthorized(
    status: reqwest::StatusCode,
    headers: &reqwest::header::HeaderMap,
    what: &str,
) {
    assert_eq!(status, 401, "{what}");
    let challenge = headers
        .get("www-authenticate")
        .unwrap_or_else(|| panic!("{what}: 401 without WWW-Authenticate"))
        .to_str()
        .unwrap();
    assert!(
        challenge.to_ascii_lowercase().starts_with("bearer"),
        "{what}: {challenge}"
    );
}

/// The record ids of a `SearchAgents` result.
fn ids(result: &Value) -> Vec<String> {
    result["agents"]
        .as_array()
        .unwrap_or_else(|| panic!("no agents in {result}"))
        .iter()
        .map(|a| a["id"].as_str().unwrap().to_string())
        .collect()
}

/// The error message of a reply, with `id` replaced by `ID`, to compare the
/// answer about another agency's agent with the answer about no agent.
fn message_without(reply: &Reply, id: &str) -> String {
    reply.body["error"]["message"]
        .as_str()
        .unwrap_or_else(|| panic!("expected an error, got {}", reply.body))
        .replace(id, "ID")
}

#[tokio::test]
async fn an_agency_cannot_update_or_remove_another_agencys_agent() {
    let upstream = baton().start().await;
    let gateway = baton().api_keys(KEYS).start().await;
    let card = upstream_card(&upstream, "echo").await;

    let registered = registry_as(
        &gateway,
        ACME,
        "RegisterAgent",
        json!({"id": "acme-echo", "card": card}),
    )
    .await;
    let before = registered.result()["agent"].clone();
    assert_eq!(before["owner"], "acme");

    // What an agent that does not exist looks like.
    let mut hijacked = card.clone();
    hijacked["description"] = json!("hijacked by globex");
    let ghost_update = registry_as(
        &gateway,
        GLOBEX,
        "UpdateAgent",
        json!({"id": "ghost", "card": hijacked}),
    )
    .await;
    assert_eq!(ghost_update.code(), Some(-32602), "{}", ghost_update.body);
    let ghost_remove =
        registry_as(&gateway, GLOBEX, "DeregisterAgent", json!({"id": "ghost"})).await;
    assert_eq!(ghost_remove.code(), Some(-32602), "{}", ghost_remove.body);

    // globex cannot update acme's agent: reported exactly as if it did not exist.
    let update = registry_as(
        &gateway,
        GLOBEX,
        "UpdateAgent",
        json!({"id": "acme-echo", "card": hijacked}),
    )
    .await;
    assert_eq!(update.code(), Some(-32602), "{}", update.body);
    assert_eq!(
        message_without(&update, "acme-echo"),
        message_without(&ghost_update, "ghost")
    );
    assert!(
        update.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no agent"),
        "{}",
        update.body
    );
    assert!(
        !update.body.to_string().contains("acme\""),
        "the owner is not disclosed: {}",
        update.body
    );

    // ... nor remove it.
    let remove = registry_as(
        &gateway,
        GLOBEX,
        "DeregisterAgent",
        json!({"id": "acme-echo"}),
    )
    .await;
    assert_eq!(remove.code(), Some(-32602), "{}", remove.body);
    assert_eq!(
        message_without(&remove, "acme-echo"),
        message_without(&ghost_remove, "ghost")
    );

    // ... nor take its id over by registering again.
    let takeover = registry_as(
        &gateway,
        GLOBEX,
        "RegisterAgent",
        json!({"id": "acme-echo", "card": hijacked}),
    )
    .await;
    assert_eq!(takeover.code(), Some(-32602), "{}", takeover.body);

    // Neither agency may take, change or remove the built-in agents; the
    // answer says it is built in (GetAgent shows it), not that it is missing.
    for key in [ACME, GLOBEX] {
        let update = registry_as(
            &gateway,
            key,
            "UpdateAgent",
            json!({"id": "echo", "card": hijacked}),
        )
        .await;
        let remove = registry_as(&gateway, key, "DeregisterAgent", json!({"id": "echo"})).await;
        let take = registry_as(
            &gateway,
            key,
            "RegisterAgent",
            json!({"id": "echo", "card": hijacked}),
        )
        .await;
        for refused in [update, remove, take] {
            assert_eq!(refused.code(), Some(-32602), "{}", refused.body);
            let message = refused.body["error"]["message"].as_str().unwrap();
            assert!(message.contains("built-in agent"), "{message}");
        }
    }

    // Any valid key may read: globex sees acme's agent, unchanged, as Baton
    // serves it: the card as published, not the agent's own addresses.
    let got = registry_as(&gateway, GLOBEX, "GetAgent", json!({"id": "acme-echo"})).await;
    let mut served = before.clone();
    served["card"] = before["publishedCard"].clone();
    assert_eq!(got.result()["agent"], served);
    let own = registry_as(&gateway, ACME, "GetAgent", json!({"id": "acme-echo"})).await;
    assert_eq!(own.result()["agent"], before, "its owner sees all");
    let found = registry_as(
        &gateway,
        GLOBEX,
        "SearchAgents",
        json!({"query": "acme-echo"}),
    )
    .await;
    assert_eq!(ids(found.result()), ["acme-echo"]);
    let (status, headers, published) = get_with(
        &gateway,
        "/agents/acme-echo/.well-known/agent-card.json",
        None,
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(published, before["publishedCard"]);
    assert_eq!(headers["etag"].to_str().unwrap(), before["etag"]);
    assert!(gateway.registry.get("acme-echo", "acme").is_ok());

    // Still routable to the upstream agent.
    let reply = rpc_as(
        &gateway,
        "/agents/acme-echo/a2a",
        ACME,
        "SendMessage",
        json!({"message": user_message(&message_id("m"), "still mine")}),
    )
    .await;
    let task = &reply.result()["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    assert_eq!(task["artifacts"][0]["parts"][0]["text"], "still mine");

    // The owner can: control that the refusals above were about ownership.
    let mut own_card = card.clone();
    own_card["description"] = json!("updated by acme");
    let own_update = registry_as(
        &gateway,
        ACME,
        "UpdateAgent",
        json!({"id": "acme-echo", "card": own_card}),
    )
    .await;
    assert_eq!(
        own_update.result()["agent"]["card"]["description"],
        "updated by acme"
    );
    let own_remove = registry_as(
        &gateway,
        ACME,
        "DeregisterAgent",
        json!({"id": "acme-echo"}),
    )
    .await;
    assert_eq!(own_remove.result(), &json!({}));
    gateway.stop().await;
    upstream.stop().await;
}

#[tokio::test]
async fn of_simultaneous_registrations_of_one_id_exactly_one_is_taken() {
    let upstream = baton().start().await;
    let gateway = baton().api_keys(KEYS).start().await;
    let card = upstream_card(&upstream, "echo").await;
    let attempts = (0..8).map(|n| {
        let key = if n % 2 == 0 { ACME } else { GLOBEX };
        registry_as(
            &gateway,
            key,
            "RegisterAgent",
            json!({"id": "contested", "card": card}),
        )
    });
    let replies = futures::future::join_all(attempts).await;
    let taken: Vec<&Reply> = replies
        .iter()
        .filter(|r| r.body.get("result").is_some())
        .collect();
    let bodies: Vec<&Value> = replies.iter().map(|r| &r.body).collect();
    assert_eq!(taken.len(), 1, "{bodies:?}");
    // The one taken is the one kept.
    let owner = taken[0].result()["agent"]["owner"].clone();
    let got = registry_as(&gateway, ACME, "GetAgent", json!({"id": "contested"})).await;
    assert_eq!(got.result()["agent"]["owner"], owner);
}

#[tokio::test]
async fn an_agency_registers_at_most_its_share_of_agents() {
    use baton::registry::service::{MAX_AGENTS_PER_AGENCY, RegisterParams};
    let upstream = baton().start().await;
    let gateway = baton().api_keys(KEYS).start().await;
    let card = upstream_card(&upstream, "echo").await;
    let params = |id: String| -> RegisterParams {
        serde_json::from_value(json!({"id": id, "card": card})).unwrap()
    };
    for n in 0..MAX_AGENTS_PER_AGENCY {
        gateway
            .registry
            .register("acme", params(format!("a-{n}")))
            .await
            .unwrap();
    }
    let over = registry_as(
        &gateway,
        ACME,
        "RegisterAgent",
        json!({"id": "one-more", "card": card}),
    )
    .await;
    assert_eq!(over.code(), Some(-32602), "{}", over.body);
    assert!(over.body.to_string().contains("at most"), "{}", over.body);
    // Another agency's share is its own.
    let other = registry_as(
        &gateway,
        GLOBEX,
        "RegisterAgent",
        json!({"id": "globex-1", "card": card}),
    )
    .await;
    assert_eq!(other.result()["agent"]["owner"], "globex", "{}", other.body);
}

#[tokio::test]
async fn credentials_in_an_agent_url_reach_the_agent_and_no_caller() {
    let upstream = baton().start().await;
    let gateway = baton().api_keys(KEYS).start().await;
    let mut card = upstream_card(&upstream, "echo").await;
    let url = card["supportedInterfaces"][0]["url"]
        .as_str()
        .unwrap()
        .to_string();
    let with_credentials = url.replacen("http://", "http://svc:S3cret@", 1);
    card["supportedInterfaces"][0]["url"] = json!(with_credentials);

    let registered = registry_as(
        &gateway,
        ACME,
        "RegisterAgent",
        json!({"id": "keyed-echo", "card": card}),
    )
    .await;
    assert_eq!(registered.result()["agent"]["id"], "keyed-echo");
    let shown = registered.result()["agent"]["card"]["supportedInterfaces"][0]["url"].clone();
    assert_eq!(shown, json!(url), "the URL without its credentials");
    // Not to its owner, nor to another agency, by any way of reading.
    let replies = [
        registered.body,
        registry_as(&gateway, ACME, "GetAgent", json!({"id": "keyed-echo"}))
            .await
            .body,
        registry_as(&gateway, GLOBEX, "GetAgent", json!({"id": "keyed-echo"}))
            .await
            .body,
        registry_as(&gateway, GLOBEX, "SearchAgents", json!({}))
            .await
            .body,
        get_with(&gateway, "/registry/agents", Some("Bearer KEY2"))
            .await
            .2,
    ];
    for reply in &replies {
        assert!(reply.get("error").is_none(), "{reply}");
        assert!(!reply.to_string().contains("S3cret"), "{reply}");
    }
    assert!(
        replies[4]["agents"]
            .as_array()
            .is_some_and(|a| !a.is_empty())
    );

    // Baton still calls the agent with them.
    let sent = rpc_as(
        &gateway,
        "/agents/keyed-echo/a2a",
        ACME,
        "SendMessage",
        json!({"message": user_message(&message_id("keyed"), "hello")}),
    )
    .await;
    assert_eq!(
        sent.result()["task"]["status"]["state"],
        "TASK_STATE_COMPLETED",
        "{}",
        sent.body
    );
}

#[tokio::test]
async fn calls_without_a_valid_key_get_401_and_cards_stay_public() {
    let gateway = baton().api_keys(KEYS).start().await;
    let send = || json!({"message": user_message(&message_id("m"), "hi")});
    let endpoints = [
        ("/registry", "SearchAgents", json!({})),
        ("/a2a", "SendMessage", send()),
        ("/agents/echo/a2a", "SendMessage", send()),
        ("/a2a/", "GetTask", json!({"id": "whatever"})),
    ];
    let refused = [
        None,
        Some("Bearer WRONG"),
        Some("Bearer "),
        Some("KEY1"),
        Some("Basic S0VZMTo="),
        Some("Bearer KEY1x"),
    ];
    for (path, method, params) in &endpoints {
        for authorization in refused {
            let reply = rpc_with(&gateway, path, authorization, method, params.clone()).await;
            assert_unauthorized(
                reply.status,
                &reply.headers,
                &format!("{method} on {path} with {authorization:?}"),
            );
            assert!(
                reply.body["error"].is_object(),
                "{path}: a JSON-RPC error body: {}",
                reply.body
            );
            assert!(reply.body.get("result").is_none());
        }
    }
    // A malformed query is no way past the key check.
    for path in ["/registry/agents", "/registry/agents?pageSize=abc"] {
        for authorization in refused {
            let (status, headers, body) = get_with(&gateway, path, authorization).await;
            assert_unauthorized(
                status,
                &headers,
                &format!("GET {path} with {authorization:?}"),
            );
            assert!(body.get("agents").is_none(), "{body}");
        }
    }

    // With a key it works (the scheme name is case-insensitive).
    for authorization in ["Bearer KEY1", "bearer KEY2"] {
        let reply = rpc_with(
            &gateway,
            "/registry",
            Some(authorization),
            "SearchAgents",
            json!({}),
        )
        .await;
        assert_eq!(reply.status, 200);
        assert!(ids(reply.result()).contains(&"echo".to_string()));
        for path in ["/a2a", "/agents/echo/a2a"] {
            let reply = rpc_with(&gateway, path, Some(authorization), "SendMessage", send()).await;
            assert_eq!(reply.status, 200, "{path}");
            assert_eq!(
                reply.result()["task"]["status"]["state"],
                "TASK_STATE_COMPLETED",
                "{path}"
            );
        }
        let (status, _, body) = get_with(&gateway, "/registry/agents", Some(authorization)).await;
        assert_eq!(status, 200, "{body}");
        assert!(ids(&body).contains(&"scenario".to_string()));
    }

    // Cards stay public and declare the bearer scheme and a requirement for it.
    for path in [
        "/.well-known/agent-card.json",
        "/agents/echo/.well-known/agent-card.json",
    ] {
        let (status, _, card) = get_with(&gateway, path, None).await;
        assert_eq!(status, 200, "{path}");
        let scheme = &card["securitySchemes"]["batonApiKey"]["httpAuthSecurityScheme"];
        assert!(
            scheme["scheme"]
                .as_str()
                .is_some_and(|s| s.eq_ignore_ascii_case("bearer")),
            "{path}: {}",
            card["securitySchemes"]
        );
        let requirements = card["securityRequirements"].as_array().unwrap_or_else(|| {
            panic!("{path}: no securityRequirements in {card}");
        });
        assert!(
            requirements
                .iter()
                .any(|r| r["schemes"].get("batonApiKey").is_some()),
            "{path}: {requirements:?}"
        );
    }
    // A registered agent's published card too.
    let registered = registry_as(
        &gateway,
        ACME,
        "RegisterAgent",
        json!({"id": "published", "card": upstream_card(&gateway, "echo").await}),
    )
    .await;
    let published = &registered.result()["agent"]["publishedCard"];
    assert!(
        published["securitySchemes"]["batonApiKey"]["httpAuthSecurityScheme"].is_object(),
        "{published}"
    );

    // Without keys, nothing is declared and nothing is required.
    let open = baton().start().await;
    for path in [
        "/.well-known/agent-card.json",
        "/agents/echo/.well-known/agent-card.json",
    ] {
        let (status, _, card) = get_with(&open, path, None).await;
        assert_eq!(status, 200, "{path}");
        assert!(
            card.get("securitySchemes")
                .is_none_or(|s| s.as_object().is_some_and(|o| o.is_empty())),
            "{path}: {card}"
        );
        assert!(
            card.get("securityRequirements")
                .is_none_or(|r| r.as_array().is_some_and(|a| a.is_empty())),
            "{path}: {card}"
        );
    }
    let reply = rpc_with(&open, "/registry", None, "SearchAgents", json!({})).await;
    assert_eq!(reply.status, 200);
    reply.result();
    let reply = rpc_with(&open, "/a2a", None, "SendMessage", send()).await;
    assert_eq!(reply.status, 200);
    reply.result();
    let (status, _, _) = get_with(&open, "/registry/agents", None).await;
    assert_eq!(status, 200);
    open.stop().await;

    // A call without a key is refused before its body is looked at, on the
    // registry as on A2A endpoints (DESIGN §6: "a call without a valid key
    // gets HTTP 401").
    for path in ["/a2a", "/agents/echo/a2a", "/registry"] {
        let reply = gateway.post_raw(path, "{not json", &STANDARD_HEADERS).await;
        assert_unauthorized(
            reply.status,
            &reply.headers,
            &format!("unparseable body on {path} without a key: {}", reply.body),
        );
    }
    gateway.stop().await;
}

#[tokio::test]
async fn tasks_belong_to_the_principal_that_created_them() {
    let gated = GatedAgent::new();
    let gateway = baton()
        .api_keys(KEYS)
        .agent("gated", gated.clone())
        .start()
        .await;
    let created = rpc_as(
        &gateway,
        "/a2a",
        ACME,
        "SendMessage",
        json!({
            "tenant": "gated",
            "message": user_message(&message_id("m"), "acme's work"),
            "configuration": {"returnImmediately": true},
        }),
    )
    .await;
    let task = created.result()["task"].clone();
    let task_id = task["id"].as_str().unwrap().to_string();
    let context_id = task["contextId"].as_str().unwrap().to_string();

    // globex sees nothing of it.
    let not_found = |reply: &Reply, what: &str| {
        assert_eq!(reply.code(), Some(-32001), "{what}: {}", reply.body);
        assert!(reply.body.get("result").is_none(), "{what}");
    };
    for path in ["/a2a", "/agents/gated/a2a"] {
        let got = rpc_as(&gateway, path, GLOBEX, "GetTask", json!({"id": task_id})).await;
        not_found(&got, &format!("GetTask on {path}"));
        let listed = rpc_as(&gateway, path, GLOBEX, "ListTasks", json!({})).await;
        assert_eq!(listed.result()["totalSize"], 0, "{}", listed.body);
        assert_eq!(listed.result()["tasks"], json!([]));
        let by_context = rpc_as(
            &gateway,
            path,
            GLOBEX,
            "ListTasks",
            json!({"contextId": context_id}),
        )
        .await;
        assert_eq!(by_context.result()["totalSize"], 0, "{}", by_context.body);
        let canceled = rpc_as(&gateway, path, GLOBEX, "CancelTask", json!({"id": task_id})).await;
        not_found(&canceled, &format!("CancelTask on {path}"));
        let subscribed = rpc_as(
            &gateway,
            path,
            GLOBEX,
            "SubscribeToTask",
            json!({"id": task_id}),
        )
        .await;
        not_found(&subscribed, &format!("SubscribeToTask on {path}"));
        let configs = rpc_as(
            &gateway,
            path,
            GLOBEX,
            "ListTaskPushNotificationConfigs",
            json!({"taskId": task_id}),
        )
        .await;
        not_found(
            &configs,
            &format!("ListTaskPushNotificationConfigs on {path}"),
        );
        let follow_up = user_message_on(&task_id, &message_id("m"), "globex joins in");
        let continued = rpc_as(
            &gateway,
            path,
            GLOBEX,
            "SendMessage",
            json!({"tenant": "gated", "message": follow_up}),
        )
        .await;
        not_found(&continued, &format!("SendMessage to the task on {path}"));
    }

    // acme sees it, still running (globex's cancel did nothing).
    let got = rpc_as(&gateway, "/a2a", ACME, "GetTask", json!({"id": task_id})).await;
    let state = got.result()["status"]["state"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        state == "TASK_STATE_SUBMITTED" || state == "TASK_STATE_WORKING",
        "{state}"
    );
    let listed = rpc_as(&gateway, "/a2a", ACME, "ListTasks", json!({})).await;
    assert_eq!(listed.result()["totalSize"], 1, "{}", listed.body);
    assert_eq!(listed.result()["tasks"][0]["id"], json!(task_id));

    // acme may subscribe: the first event is the task.
    let body =
        json!({"jsonrpc": "2.0", "id": 7, "method": "SubscribeToTask", "params": {"id": task_id}});
    let mut request = gateway
        .http
        .post(gateway.url("/a2a"))
        .body(body.to_string())
        .header("accept", "text/event-stream")
        .bearer_auth(ACME);
    for (name, value) in STANDARD_HEADERS {
        request = request.header(name, value);
    }
    let response = tokio::time::timeout(WAIT, request.send())
        .await
        .expect("stream opens in time")
        .expect("HTTP request");
    assert_eq!(response.status(), 200);
    let stream = read_sse(response, 1).await;
    assert!(stream.content_type.starts_with("text/event-stream"));
    assert_eq!(
        stream.events[0]["result"]["task"]["id"],
        json!(task_id),
        "{:?}",
        stream.events
    );

    // ... and cancel.
    let canceled = rpc_as(&gateway, "/a2a", ACME, "CancelTask", json!({"id": task_id})).await;
    assert_eq!(
        canceled.result()["status"]["state"],
        "TASK_STATE_CANCELED",
        "{}",
        canceled.body
    );
    let listed = rpc_as(&gateway, "/a2a", GLOBEX, "ListTasks", json!({})).await;
    assert_eq!(listed.result()["totalSize"], 0);
    gateway.stop().await;
}

#[tokio::test]
async fn a_card_registered_by_url_keeps_being_followed_as_it_changes() {
    let upstream = baton().start().await;
    let gateway = baton().start().await;
    let served = std::sync::Arc::new(std::sync::Mutex::new(
        upstream_card(&upstream, "echo").await,
    ));
    let card_server = served.clone();
    let app = axum::Router::new().route(
        "/card.json",
        axum::routing::get(move || {
            let card = card_server.lock().unwrap().clone();
            // No card: the signature has expired.
            async move {
                use axum::response::IntoResponse as _;
                if card.is_null() {
                    return axum::http::StatusCode::FORBIDDEN.into_response();
                }
                axum::Json(card).into_response()
            }
        }),
    );
    // A signed URL: its query is followed, and shown to no caller.
    let shown_url = format!("{}/card.json", serve_on_loopback(app).await);
    let card_url = format!("{shown_url}?sig=S3cret#top");
    let registered = registry_as(
        &gateway,
        ACME,
        "RegisterAgent",
        json!({"id": "followed", "cardUrl": card_url}),
    )
    .await;
    assert_eq!(registered.result()["agent"]["cardUrl"], shown_url.as_str());
    let searched = registry_as(&gateway, GLOBEX, "SearchAgents", json!({})).await;
    assert!(
        !searched.body.to_string().contains("S3cret"),
        "{}",
        searched.body
    );

    for description in ["first change", "second change"] {
        served.lock().unwrap()["description"] = json!(description);
        tokio::time::timeout(WAIT, gateway.registry.check_health())
            .await
            .expect("health check in time");
        let got = registry_as(&gateway, ACME, "GetAgent", json!({"id": "followed"})).await;
        let agent = &got.result()["agent"];
        assert_eq!(agent["card"]["description"], description, "{agent}");
        assert_eq!(agent["cardUrl"], shown_url.as_str(), "{agent}");
        // The check that took the card is about the agent it updated.
        assert_eq!(agent["health"]["status"], "healthy", "{agent}");
    }

    // Nor does the error of a failed check show it.
    *served.lock().unwrap() = Value::Null;
    tokio::time::timeout(WAIT, gateway.registry.check_health())
        .await
        .expect("health check in time");
    let searched = registry_as(&gateway, GLOBEX, "SearchAgents", json!({})).await;
    let followed = searched.result()["agents"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["id"] == "followed")
        .cloned()
        .unwrap();
    let error = followed["health"]["error"].as_str().unwrap_or_default();
    assert!(error.contains("403"), "{followed}");
    assert!(
        !searched.body.to_string().contains("S3cret"),
        "{}",
        searched.body
    );
}

/// An owner's update made while a health check fetches the card URL is
/// kept: the check does not put the URL's card back over it.
#[tokio::test]
async fn an_update_made_during_a_health_check_is_not_undone_by_it() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    let upstream = baton().start().await;
    let gateway = baton().start().await;
    let served = Arc::new(Mutex::new(upstream_card(&upstream, "echo").await));
    let gated = Arc::new(AtomicBool::new(false));
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let fetches = Arc::new(AtomicUsize::new(0));
    let app = axum::Router::new().route(
        "/card.json",
        axum::routing::get({
            let (served, gated, gate, fetches) =
                (served.clone(), gated.clone(), gate.clone(), fetches.clone());
            move || {
                let (served, gated, gate, fetches) =
                    (served.clone(), gated.clone(), gate.clone(), fetches.clone());
                async move {
                    fetches.fetch_add(1, Ordering::SeqCst);
                    if gated.load(Ordering::SeqCst) {
                        gate.acquire().await.unwrap().forget();
                    }
                    let card = served.lock().unwrap().clone();
                    axum::Json(card)
                }
            }
        }),
    );
    let card_url = format!("{}/card.json", serve_on_loopback(app).await);
    let registered = registry_as(
        &gateway,
        ACME,
        "RegisterAgent",
        json!({"id": "followed", "cardUrl": card_url}),
    )
    .await;
    let mut inline = registered.result()["agent"]["card"].clone();

    served.lock().unwrap()["description"] = json!("changed at the URL");
    gated.store(true, Ordering::SeqCst);
    let fetched_before = fetches.load(Ordering::SeqCst);
    let check = tokio::time::timeout(WAIT, gateway.registry.check_health());
    let update = async {
        while fetches.load(Ordering::SeqCst) == fetched_before {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        inline["description"] = json!("the owner's own");
        let updated = registry_as(
            &gateway,
            ACME,
            "UpdateAgent",
            json!({"id": "followed", "card": inline}),
        )
        .await;
        assert!(updated.result()["agent"].is_object(), "{}", updated.body);
        gate.add_permits(1);
    };
    let (checked, ()) = tokio::join!(check, update);
    checked.expect("health check in time");

    let got = registry_as(&gateway, ACME, "GetAgent", json!({"id": "followed"})).await;
    let agent = &got.result()["agent"];
    assert_eq!(agent["card"]["description"], "the owner's own", "{agent}");
    assert!(agent.get("cardUrl").is_none(), "{agent}");
}

/// A card server for races: it serves its `card` at `/card.json` (403 while
/// the card is null), and once `held`, each answer waits for a `release`.
struct HeldCardServer {
    url: String,
    card: std::sync::Arc<std::sync::Mutex<Value>>,
    held: std::sync::Arc<std::sync::atomic::AtomicBool>,
    fetches: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    gate: std::sync::Arc<tokio::sync::Semaphore>,
}

impl HeldCardServer {
    async fn serve(card: Value) -> Self {
        use std::sync::Arc;
        use std::sync::atomic::Ordering;
        let server = Self {
            url: String::new(),
            card: Arc::new(std::sync::Mutex::new(card)),
            held: Arc::default(),
            fetches: Arc::default(),
            gate: Arc::new(tokio::sync::Semaphore::new(0)),
        };
        let (card, held, fetches, gate) = (
            server.card.clone(),
            server.held.clone(),
            server.fetches.clone(),
            server.gate.clone(),
        );
        let answer = move || {
            let (card, held, fetches, gate) =
                (card.clone(), held.clone(), fetches.clone(), gate.clone());
            async move {
                use axum::response::IntoResponse as _;
                fetches.fetch_add(1, Ordering::SeqCst);
                if held.load(Ordering::SeqCst) {
                    gate.acquire().await.unwrap().forget();
                }
                let card = card.lock().unwrap().clone();
                if card.is_null() {
                    return axum::http::StatusCode::FORBIDDEN.into_response();
                }
                axum::Json(card).into_response()
            }
        };
        let app = axum::Router::new().route("/card.json", axum::routing::get(answer));
        let url = format!("{}/card.json", serve_on_loopback(app).await);
        Self { url, ..server }
    }

    /// From now on, answers wait for a release.
    fn hold(&self) -> usize {
        self.held.store(true, std::sync::atomic::Ordering::SeqCst);
        self.fetches.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits until a fetch after `hold` (which returned `before`) arrived.
    async fn fetched_since(&self, before: usize) {
        let fetches = self.fetches.clone();
        wait_until("the card is fetched", move || {
            fetches.load(std::sync::atomic::Ordering::SeqCst) > before
        })
        .await;
    }

    /// Lets one held answer go.
    fn release(&self) {
        self.gate.add_permits(1);
    }
}

/// An UpdateAgent by cardUrl whose agent is deregistered and registered
/// again while the card is fetched is refused: the URL's card does not
/// replace the newer registration.
#[tokio::test]
async fn an_update_by_url_does_not_replace_a_registration_made_during_its_fetch() {
    let upstream = baton().start().await;
    let gateway = baton().api_keys(KEYS).start().await;
    let card = upstream_card(&upstream, "echo").await;
    let described = |description: &str| {
        let mut card = card.clone();
        card["description"] = json!(description);
        card
    };
    let register = |description: &str| {
        let params = json!({"id": "moving", "card": described(description)});
        registry_as(&gateway, ACME, "RegisterAgent", params)
    };
    assert!(register("first registration").await.result()["agent"].is_object());
    let server = HeldCardServer::serve(described("the URL's card")).await;

    let before = server.hold();
    let params = json!({"id": "moving", "cardUrl": server.url});
    let update = registry_as(&gateway, ACME, "UpdateAgent", params);
    let meanwhile = async {
        server.fetched_since(before).await;
        let removed = registry_as(&gateway, ACME, "DeregisterAgent", json!({"id": "moving"})).await;
        assert_eq!(removed.result(), &json!({}));
        let registered = register("second registration").await;
        assert!(
            registered.result()["agent"].is_object(),
            "{}",
            registered.body
        );
        server.release();
    };
    let (updated, ()) = tokio::join!(update, meanwhile);
    assert_eq!(updated.code(), Some(-32602), "{}", updated.body);
    let message = updated.body["error"].to_string();
    assert!(
        message.contains("changed while its card was fetched"),
        "{message}"
    );

    let got = registry_as(&gateway, ACME, "GetAgent", json!({"id": "moving"})).await;
    let agent = &got.result()["agent"];
    assert_eq!(
        agent["card"]["description"], "second registration",
        "{agent}"
    );
    assert!(agent.get("cardUrl").is_none(), "{agent}");
    gateway.stop().await;
    upstream.stop().await;
}

/// A health check's result about a registration replaced while the card
/// was fetched is dropped: the new one is not marked with the old URL's
/// error.
#[tokio::test]
async fn a_health_result_for_a_replaced_registration_is_dropped() {
    let upstream = baton().start().await;
    let gateway = baton().api_keys(KEYS).start().await;
    let card = upstream_card(&upstream, "echo").await;
    let server = HeldCardServer::serve(card.clone()).await;
    let params = json!({"id": "moving", "cardUrl": server.url});
    let registered = registry_as(&gateway, ACME, "RegisterAgent", params).await;
    assert!(
        registered.result()["agent"].is_object(),
        "{}",
        registered.body
    );

    // The old URL now fails, once the new registration is in.
    *server.card.lock().unwrap() = Value::Null;
    let before = server.hold();
    let check = tokio::time::timeout(WAIT, gateway.registry.check_health());
    let meanwhile = async {
        server.fetched_since(before).await;
        let removed = registry_as(&gateway, ACME, "DeregisterAgent", json!({"id": "moving"})).await;
        assert_eq!(removed.result(), &json!({}));
        let params = json!({"id": "moving", "card": card});
        let registered = registry_as(&gateway, ACME, "RegisterAgent", params).await;
        assert!(
            registered.result()["agent"].is_object(),
            "{}",
            registered.body
        );
        server.release();
    };
    let (checked, ()) = tokio::join!(check, meanwhile);
    checked.expect("health check in time");

    let got = registry_as(&gateway, ACME, "GetAgent", json!({"id": "moving"})).await;
    let health = &got.result()["agent"]["health"];
    assert_eq!(health["status"], "unknown", "not checked yet: {health}");
    let entry = gateway.registry.directory().get("moving").unwrap();
    assert!(entry.is_healthy(), "routed to as healthy");
    gateway.stop().await;
    upstream.stop().await;
}

#[tokio::test]
async fn agents_that_never_answer_do_not_hold_each_others_health_checks_up() {
    let upstream = baton().start().await;
    let gateway = baton().start().await;
    // Takes connections (the kernel's backlog) and never answers: each
    // check waits the whole fetch timeout, 2 s in tests.
    let hanging = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut card = upstream_card(&upstream, "echo").await;
    card["supportedInterfaces"][0]["url"] =
        json!(format!("http://{}/a2a", hanging.local_addr().unwrap()));
    for n in 0..6 {
        let id = format!("mute-{n}");
        let registered = registry_as(
            &gateway,
            ACME,
            "RegisterAgent",
            json!({"id": id, "card": card}),
        )
        .await;
        assert_eq!(registered.result()["agent"]["id"], id.as_str());
    }
    // One at a time, six would take 12 s.
    tokio::time::timeout(WAIT, gateway.registry.check_health())
        .await
        .expect("the checks run side by side");
    for n in 0..6 {
        let got = registry_as(
            &gateway,
            ACME,
            "GetAgent",
            json!({"id": format!("mute-{n}")}),
        )
        .await;
        assert_eq!(got.result()["agent"]["health"]["status"], "unhealthy");
    }
}

#[tokio::test]
async fn health_checks_mark_agents_healthy_then_unhealthy() {
    let upstream = baton().start().await;
    let gateway = baton().start().await;
    let card = upstream_card(&upstream, "echo").await;
    let registered = registry_as(
        &gateway,
        ACME,
        "RegisterAgent",
        json!({"id": "far-echo", "card": card}),
    )
    .await;
    assert_eq!(
        registered.result()["agent"]["health"]["status"],
        "unknown",
        "not checked yet"
    );
    let record_of = |result: &Value| -> Value {
        result["agents"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["id"] == "far-echo")
            .cloned()
            .unwrap_or_else(|| panic!("far-echo missing from {result}"))
    };

    tokio::time::timeout(WAIT, gateway.registry.check_health())
        .await
        .expect("health check in time");
    let got = registry_as(&gateway, ACME, "GetAgent", json!({"id": "far-echo"})).await;
    let health = got.result()["agent"]["health"].clone();
    assert_eq!(health["status"], "healthy", "{health}");
    let first_checked =
        chrono::DateTime::parse_from_rfc3339(health["lastChecked"].as_str().expect("lastChecked"))
            .expect("lastChecked is RFC 3339");
    assert!(health["latencyMs"].is_u64(), "{health}");
    assert!(health.get("error").is_none(), "{health}");
    let searched = registry_as(&gateway, ACME, "SearchAgents", json!({})).await;
    assert_eq!(record_of(searched.result())["health"], health);

    // The upstream goes away.
    upstream.stop().await;
    tokio::time::timeout(WAIT, gateway.registry.check_health())
        .await
        .expect("health check in time");
    let got = registry_as(&gateway, ACME, "GetAgent", json!({"id": "far-echo"})).await;
    let health = got.result()["agent"]["health"].clone();
    assert_eq!(health["status"], "unhealthy", "{health}");
    assert!(
        health["error"].as_str().is_some_and(|e| !e.is_empty()),
        "{health}"
    );
    let checked =
        chrono::DateTime::parse_from_rfc3339(health["lastChecked"].as_str().expect("lastChecked"))
            .expect("lastChecked is RFC 3339");
    assert!(checked >= first_checked);
    let searched = registry_as(&gateway, ACME, "SearchAgents", json!({})).await;
    assert_eq!(record_of(searched.result())["health"], health);
    let by_skill = registry_as(&gateway, ACME, "SearchAgents", json!({"skill": "echo"})).await;
    assert!(
        ids(by_skill.result()).contains(&"far-echo".to_string()),
        "an unhealthy agent is still listed"
    );
    let (status, _, listed) = get_with(&gateway, "/registry/agents?q=far-echo", None).await;
    assert_eq!(status, 200);
    assert_eq!(record_of(&listed)["health"]["status"], "unhealthy");

    // Built-in agents are not re-fetched and stay healthy.
    let echo = registry_as(&gateway, ACME, "GetAgent", json!({"id": "echo"})).await;
    assert_eq!(echo.result()["agent"]["health"]["status"], "healthy");
    gateway.stop().await;
}

/// What a `baton` run printed and how it ended.
struct CliRun {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl CliRun {
    /// Stdout as JSON; panics (showing stderr) when it is not.
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| {
            panic!(
                "stdout is not JSON ({e}): {:?}, stderr: {:?}",
                self.stdout, self.stderr
            )
        })
    }
}

/// Runs the built `baton ARGS` with none of the caller's `BATON_*` settings,
/// killing it after 30 s; off the async runtime so the in-process server
/// keeps serving.
async fn baton_cli(args: &[&str]) -> CliRun {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let run = tokio::task::spawn_blocking(move || {
        let mut command = Command::new(env!("CARGO_BIN_EXE_baton"));
        command
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("BATON_") {
                command.env_remove(name);
            }
        }
        let mut child = command.spawn().expect("the baton binary runs");
        let drain = |mut pipe: Box<dyn std::io::Read + Send>| {
            std::thread::spawn(move || {
                let mut text = String::new();
                let _ = pipe.read_to_string(&mut text);
                text
            })
        };
        let stdout = drain(Box::new(child.stdout.take().unwrap()));
        let stderr = drain(Box::new(child.stderr.take().unwrap()));
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(status) = child.try_wait().expect("wait for baton") {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("baton {args:?} did not finish within 30 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        CliRun {
            code: status.code(),
            stdout: stdout.join().unwrap(),
            stderr: stderr.join().unwrap(),
        }
    });
    tokio::time::timeout(Duration::from_secs(40), run)
        .await
        .expect("baton finishes in time")
        .expect("the CLI runner does not panic")
}

#[tokio::test]
async fn baton_agents_cli_end_to_end() {
    let upstream = baton().start().await;
    let gateway = baton().api_keys(KEYS).start().await;
    let mut card = upstream_card(&upstream, "echo").await;
    card["skills"][0]["tags"] = json!(["echo", "cli-remote"]);
    let dir = tempfile::tempdir().unwrap();
    let card_file = dir.path().join("card.json");
    std::fs::write(&card_file, card.to_string()).unwrap();
    let card_path = card_file.to_str().unwrap();
    let url = gateway.base.as_str();
    let with_key = |key: &'static str, args: &[&'static str]| -> Vec<String> {
        let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        all.extend(["--url".into(), url.to_string(), "--key".into(), key.into()]);
        all
    };
    async fn run(args: Vec<String>) -> CliRun {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        baton_cli(&refs).await
    }

    // register
    let mut register = with_key(ACME, &["agents", "register", "--id", "x"]);
    register.extend(["--card".into(), card_path.to_string()]);
    let out = run(register).await;
    assert_eq!(out.code, Some(0), "stderr: {}", out.stderr);
    let agent = &out.json()["agent"];
    assert_eq!(agent["id"], "x");
    assert_eq!(agent["owner"], "acme");
    assert_eq!(
        agent["publishedCard"]["supportedInterfaces"][0]["url"],
        gateway.url("/agents/x/a2a")
    );
    assert_eq!(gateway.registry.get("x", "acme").unwrap().owner, "acme");

    // get
    let out = run(with_key(GLOBEX, &["agents", "get", "x"])).await;
    assert_eq!(out.code, Some(0), "stderr: {}", out.stderr);
    assert_eq!(out.json()["agent"]["id"], "x");
    assert_eq!(out.json()["agent"]["owner"], "acme");

    // list
    let out = run(with_key(ACME, &["agents", "list"])).await;
    assert_eq!(out.code, Some(0), "stderr: {}", out.stderr);
    let listed = ids(&out.json());
    for id in ["echo", "scenario", "x"] {
        assert!(listed.contains(&id.to_string()), "{id} in {listed:?}");
    }

    // search
    let out = run(with_key(ACME, &["agents", "search", "--tag", "cli-remote"])).await;
    assert_eq!(out.code, Some(0), "stderr: {}", out.stderr);
    assert_eq!(ids(&out.json()), ["x"]);
    let out = run(with_key(
        ACME,
        &["agents", "search", "--tag", "no-such-tag"],
    ))
    .await;
    assert_eq!(out.code, Some(0), "stderr: {}", out.stderr);
    assert_eq!(out.json()["agents"], json!([]));

    // Another agency cannot remove it.
    let out = run(with_key(GLOBEX, &["agents", "remove", "x"])).await;
    assert_eq!(out.code, Some(1), "stdout: {}", out.stdout);
    assert!(out.stderr.contains("-32602"), "{}", out.stderr);
    assert!(out.stdout.is_empty(), "{}", out.stdout);
    assert!(gateway.registry.get("x", "acme").is_ok());

    // A wrong key, and no key.
    let out = run(with_key("WRONG", &["agents", "get", "x"])).await;
    assert_eq!(out.code, Some(1), "stdout: {}", out.stdout);
    assert!(out.stderr.contains("unauthorized"), "{}", out.stderr);
    assert!(out.stdout.is_empty(), "{}", out.stdout);
    let out = baton_cli(&["agents", "list", "--url", url]).await;
    assert_eq!(out.code, Some(1), "stdout: {}", out.stdout);
    assert!(out.stderr.contains("unauthorized"), "{}", out.stderr);
    assert!(out.stderr.contains("BATON_API_KEY"), "{}", out.stderr);

    // remove
    let out = run(with_key(ACME, &["agents", "remove", "x"])).await;
    assert_eq!(out.code, Some(0), "stderr: {}", out.stderr);
    assert_eq!(out.json(), json!({}));
    assert!(gateway.registry.get("x", "acme").is_err());
    let out = run(with_key(ACME, &["agents", "get", "x"])).await;
    assert_eq!(out.code, Some(1), "stdout: {}", out.stdout);
    assert!(out.stderr.contains("-32602"), "{}", out.stderr);
    gateway.stop().await;
    upstream.stop().await;
}

#[tokio::test]
async fn an_unknown_agent_path_is_401_without_a_key_and_404_with_one() {
    let gateway = baton().api_keys(KEYS).start().await;
    let acme = format!("Bearer {ACME}");
    let expected = [
        (None, 401),
        (Some("Bearer not-a-key"), 401),
        (Some(&*acme), 404),
    ];
    for (authorization, status) in expected {
        let params = json!({"id": "x"});
        let reply = rpc_with(
            &gateway,
            "/agents/nope/a2a",
            authorization,
            "GetTask",
            params,
        )
        .await;
        assert_eq!(reply.status, status, "{authorization:?}");
    }
    gateway.stop().await;
}

#[tokio::test]
async fn a_handoff_names_as_its_sender_only_an_agent_of_the_callers_agency() {
    let upstream = baton().start().await;
    let gateway = baton().api_keys(KEYS).start().await;
    let echo = upstream_card(&upstream, "echo").await;
    // acme's intake and retired-intake; globex's billing takes handoffs from
    // those, from peer-intake (which no agency registered here) and from the
    // built-in scenario agent; globex's open agent takes them from anyone.
    let allowed = ["intake", "retired-intake", "peer-intake", "scenario"];
    let agents = [
        (ACME, "intake", json!({})),
        (ACME, "retired-intake", json!({})),
        (GLOBEX, "billing", json!({"allowFrom": allowed})),
        (GLOBEX, "open", json!({})),
    ];
    for (key, id, extra) in agents {
        let mut params = json!({"id": id, "card": echo});
        merge(&mut params, extra);
        let reply = registry_as(&gateway, key, "RegisterAgent", params).await;
        assert!(reply.code().is_none(), "{}", reply.body);
    }
    let retired = json!({"id": "retired-intake"});
    let reply = registry_as(&gateway, ACME, "DeregisterAgent", retired).await;
    assert!(reply.code().is_none(), "{}", reply.body);

    // A message to `path` as the agency holding `key`, with `part` and the
    // handoff control `control`; the task it made.
    let send = |key: &'static str, path: &'static str, part: Value, control: Value| {
        let message = json!({
            "messageId": message_id("h"),
            "role": "ROLE_USER",
            "parts": [part],
            "metadata": {HANDOFF_EXTENSION: control},
        });
        let gateway = &gateway;
        async move {
            let params = json!({"message": message});
            let reply = rpc_as(gateway, path, key, "SendMessage", params).await;
            assert!(reply.code().is_none(), "{}", reply.body);
            reply.result()["task"].clone()
        }
    };
    let handoff =
        |from: &str, to: &str| handoff_part(handoff_payload(from, json!({"to": to}), json!({})));
    let state = |task: &Value| task["status"]["state"].as_str().unwrap_or("").to_string();

    // globex cannot pass for acme's intake, nor for the agent acme
    // deregistered; acme can pass for its own.
    for from in ["intake", "retired-intake"] {
        let task = send(GLOBEX, "/a2a", handoff(from, "billing"), json!({})).await;
        assert_eq!(state(&task), "TASK_STATE_REJECTED", "{task}");
        assert_eq!(reason(&task), "NOT_ALLOWED", "{task}");
    }
    let task = send(ACME, "/a2a", handoff("intake", "billing"), json!({})).await;
    assert_eq!(state(&task), "TASK_STATE_COMPLETED", "{task}");
    // A name no agency holds here is the caller's word: a peer gateway's
    // agent, and the operator's built-in scenario agent.
    for from in ["peer-intake", "scenario"] {
        let task = send(GLOBEX, "/a2a", handoff(from, "billing"), json!({})).await;
        assert_eq!(state(&task), "TASK_STATE_COMPLETED", "{from}: {task}");
    }
    let task = send(GLOBEX, "/a2a", handoff("stranger", "billing"), json!({})).await;
    assert_eq!(reason(&task), "NOT_ALLOWED", "not on the allow list");
    // Where no allow list decides, the claim is not checked.
    let task = send(GLOBEX, "/a2a", handoff("intake", "open"), json!({})).await;
    assert_eq!(state(&task), "TASK_STATE_COMPLETED", "{task}");
    // The end of a chain the caller sends is a claim too.
    let text = json!({"text": "forwarded"});
    let chain = json!({"chain": ["intake"]});
    let task = send(GLOBEX, "/agents/billing/a2a", text.clone(), chain).await;
    assert_eq!(reason(&task), "NOT_ALLOWED", "{task}");
    // Policy's own reasons come first: a cycle stays a cycle.
    let cycle = json!({"chain": ["billing"]});
    let task = send(GLOBEX, "/a2a", handoff("intake", "billing"), cycle).await;
    assert_eq!(reason(&task), "HANDOFF_CYCLE", "{task}");
    // The agent that held the parent task, by the ledger's record, is no
    // claim: globex's task at acme's intake may go on to billing.
    let parent = send(GLOBEX, "/agents/intake/a2a", text.clone(), json!({})).await;
    assert_eq!(state(&parent), "TASK_STATE_COMPLETED", "{parent}");
    let child = json!({"parentTaskId": parent["id"]});
    let task = send(GLOBEX, "/agents/billing/a2a", text.clone(), child).await;
    assert_eq!(state(&task), "TASK_STATE_COMPLETED", "{task}");
    // A parent refused before delivery vouches for no one: its chain ends
    // with acme's intake, which never held it.
    let chain = json!({"chain": ["intake", "x"]});
    let refused = send(GLOBEX, "/agents/intake/a2a", text, chain).await;
    assert_eq!(reason(&refused), "HANDOFF_CYCLE", "{refused}");
    let child = json!({"parentTaskId": refused["id"]});
    let task = send(GLOBEX, "/a2a", handoff("intake", "billing"), child).await;
    assert_eq!(reason(&task), "NOT_ALLOWED", "{task}");
    gateway.stop().await;
    upstream.stop().await;
}

/// An agent delegates under its agency's own key: a child naming as parent
/// the task that agency's agent holds for another principal is linked under
/// it, takes its lineage (hops), and is canceled with it (DESIGN.md §3.4).
#[tokio::test]
async fn an_agencys_child_of_a_task_its_agent_holds_is_linked_and_canceled_with_it() {
    use baton::demo::vendor::{Reply, VendorAgent};
    let gateway = baton().api_keys(KEYS).start().await;
    let worker = VendorAgent::start("worker", &["work"], |_| Reply::Working)
        .await
        .unwrap();
    let helper = VendorAgent::start("helper", &["help"], |_| Reply::Working)
        .await
        .unwrap();
    for (id, agent) in [("worker", &worker), ("helper", &helper)] {
        let params = json!({"id": id, "card": agent.card()});
        let reply = registry_as(&gateway, ACME, "RegisterAgent", params).await;
        assert!(reply.code().is_none(), "{}", reply.body);
    }
    let send = |key: &'static str, path: &'static str, control: Value| {
        let params = json!({
            "message": {
                "messageId": message_id("m"),
                "role": "ROLE_USER",
                "parts": [{"text": "work"}],
                "metadata": {HANDOFF_EXTENSION: control},
            },
            "configuration": {"returnImmediately": true},
        });
        let gateway = &gateway;
        async move {
            let reply = rpc_as(gateway, path, key, "SendMessage", params).await;
            assert!(reply.code().is_none(), "{}", reply.body);
            reply.result()["task"].clone()
        }
    };
    // globex's task, held by acme's worker; acme's worker delegates.
    let parent = send(GLOBEX, "/agents/worker/a2a", json!({})).await;
    let control = json!({"parentTaskId": parent["id"]});
    let child = send(ACME, "/agents/helper/a2a", control).await;
    let hops = &child["metadata"][HANDOFF_EXTENSION]["hops"];
    assert_eq!(hops, 2, "one hop past its parent's: {child}");

    // A direct handoff asking for the parent's whole conversation gets it
    // only for the parent's owner: acme's agent was sent what it was sent.
    let payload = handoff_payload(
        "worker",
        json!({"to": "helper"}),
        json!({"context": {"policy": "FULL"}}),
    );
    for (key, with_history) in [(ACME, false), (GLOBEX, true)] {
        let params = json!({
            "message": {
                "messageId": message_id("h"),
                "role": "ROLE_USER",
                "parts": [handoff_part(payload.clone())],
                "metadata": {HANDOFF_EXTENSION: {"parentTaskId": parent["id"]}},
            },
            "configuration": {"returnImmediately": true},
        });
        let reply = rpc_as(&gateway, "/a2a", key, "SendMessage", params).await;
        assert!(reply.code().is_none(), "{}", reply.body);
        let sent = helper.sends().last().unwrap().params["message"]["parts"].to_string();
        let history = baton::handoff::context::HISTORY_MEDIA_TYPE;
        assert_eq!(sent.contains(history), with_history, "{key}: {sent}");
    }

    let params = json!({"id": parent["id"]});
    let canceled = rpc_as(&gateway, "/a2a", GLOBEX, "CancelTask", params).await;
    assert_eq!(canceled.result()["status"]["state"], "TASK_STATE_CANCELED");
    let params = json!({"id": child["id"]});
    let read = rpc_as(&gateway, "/a2a", ACME, "GetTask", params).await;
    assert_eq!(
        read.result()["status"]["state"],
        "TASK_STATE_CANCELED",
        "{}",
        read.body
    );
    worker.stop().await;
    helper.stop().await;
    gateway.stop().await;
}
