//! The registry over real HTTP: registration inline and by URL, validation,
//! the outbound guard, publication with ETags, search, and routing A2A calls
//! to registered agents.

mod common;

use common::*;
use serde_json::{Value, json};

#[tokio::test]
async fn register_inline_publish_and_route_through_the_gateway() {
    let upstream = baton().start().await;
    let gateway = baton().start().await;
    let card = upstream.published_card("echo").await;

    let reply = gateway
        .registry("RegisterAgent", json!({"id": "far-echo", "card": card}))
        .await;
    let agent = &reply.result()["agent"];
    assert_eq!(agent["id"], "far-echo");
    assert_eq!(agent["owner"], "anonymous");
    assert_eq!(
        agent["card"]["supportedInterfaces"][0]["url"],
        upstream.url("/agents/echo/a2a")
    );
    let published = &agent["publishedCard"];
    assert_eq!(
        published["supportedInterfaces"][0]["url"],
        gateway.url("/agents/far-echo/a2a")
    );
    assert!(
        published["capabilities"]["extensions"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["uri"] == "urn:baton:handoff:v1")
    );
    assert_eq!(
        published["name"], card["name"],
        "the rest of the card is unchanged"
    );

    // The published card, its ETag and 304.
    let url = gateway.url("/agents/far-echo/.well-known/agent-card.json");
    let response = gateway.http.get(&url).send().await.unwrap();
    let etag = response.headers()["etag"].to_str().unwrap().to_string();
    assert_eq!(etag, agent["etag"].as_str().unwrap());
    assert_eq!(response.json::<Value>().await.unwrap(), *published);
    let cached = gateway
        .http
        .get(&url)
        .header("if-none-match", &etag)
        .send()
        .await
        .unwrap();
    assert_eq!(cached.status(), 304);

    // The gateway card lists the new agent's skills.
    let gateway_card: Value = gateway
        .http
        .get(gateway.url("/.well-known/agent-card.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        gateway_card["skills"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["id"] == "far-echo/echo")
    );

    // A2A through the gateway reaches the upstream agent.
    let reply = gateway
        .call_at(
            "/agents/far-echo/a2a",
            "SendMessage",
            json!({"message": user_message(&message_id("m"), "ping")}),
        )
        .await;
    let task = &reply.result()["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED");
    assert_eq!(task["artifacts"][0]["parts"][0]["text"], "ping");
    let by_tenant = gateway
        .call(
            "SendMessage",
            json!({"tenant": "far-echo", "message": user_message(&message_id("m"), "pong")}),
        )
        .await;
    assert_eq!(
        by_tenant.result()["task"]["artifacts"][0]["parts"][0]["text"],
        "pong"
    );

    // An update changes the card and its ETag.
    let mut changed = card.clone();
    changed["description"] = json!("a changed description");
    let updated = gateway
        .registry("UpdateAgent", json!({"id": "far-echo", "card": changed}))
        .await;
    let new_etag = updated.result()["agent"]["etag"]
        .as_str()
        .unwrap()
        .to_string();
    assert_ne!(new_etag, etag);
    let refreshed = gateway
        .http
        .get(&url)
        .header("if-none-match", &etag)
        .send()
        .await
        .unwrap();
    assert_eq!(refreshed.status(), 200);

    // An update without a card changes the limits and keeps the card.
    let limited = gateway
        .registry(
            "UpdateAgent",
            json!({"id": "far-echo", "taskTimeoutMs": 60000, "maxHops": 3}),
        )
        .await;
    let agent = &limited.result()["agent"];
    assert_eq!(agent["card"], updated.result()["agent"]["card"], "{agent}");
    assert_eq!(agent["etag"], new_etag.as_str());
    assert_eq!(
        (agent["taskTimeoutMs"].clone(), agent["maxHops"].clone()),
        (json!(60000), json!(3))
    );
    // Both a card and a card URL is still refused.
    let both = gateway
        .registry(
            "UpdateAgent",
            json!({"id": "far-echo", "card": changed, "cardUrl": "http://localhost:1"}),
        )
        .await;
    assert_eq!(both.code(), Some(-32602), "{}", both.body);

    // Deregistered agents are gone everywhere.
    let removed = gateway
        .registry("DeregisterAgent", json!({"id": "far-echo"}))
        .await;
    assert_eq!(removed.result(), &json!({}));
    assert_eq!(
        gateway
            .registry("GetAgent", json!({"id": "far-echo"}))
            .await
            .code(),
        Some(-32602)
    );
    let gone = gateway
        .call_at(
            "/agents/far-echo/a2a",
            "SendMessage",
            json!({"message": user_message("m", "x")}),
        )
        .await;
    assert_eq!(gone.status, 404);
    gateway.stop().await;
    upstream.stop().await;
}

#[tokio::test]
async fn register_by_url_fetches_the_card() {
    let upstream = baton().start().await;
    let gateway = baton().start().await;
    let card_url = upstream.url("/agents/scenario/.well-known/agent-card.json");
    let reply = gateway
        .registry("RegisterAgent", json!({"cardUrl": card_url}))
        .await;
    let agent = &reply.result()["agent"];
    assert_eq!(agent["id"], "scenario-2", "{agent}");
    assert_eq!(agent["cardUrl"], card_url.as_str());

    // A bare origin means the well-known card of the gateway itself.
    let reply = gateway
        .registry(
            "RegisterAgent",
            json!({"id": "upstream-gw", "cardUrl": upstream.base}),
        )
        .await;
    assert_eq!(reply.result()["agent"]["card"]["name"], "Baton");
    gateway.stop().await;
    upstream.stop().await;
}

#[tokio::test]
async fn invalid_cards_are_rejected_with_every_failing_field() {
    let gateway = baton().start().await;
    let card = json!({
        "name": "broken",
        "supportedInterfaces": [],
        "version": "1",
        "capabilities": {"streaming": "yes"},
        "defaultInputModes": ["text/plain"],
        "defaultOutputModes": ["text/plain"],
        "skills": [{"id": "s", "name": "S", "description": "d"}],
    });
    let reply = gateway
        .registry("RegisterAgent", json!({"id": "broken", "card": card}))
        .await;
    assert_eq!(reply.code(), Some(-32602));
    let data = &reply.body["error"]["data"][0];
    assert_eq!(data["@type"], "type.googleapis.com/google.rpc.BadRequest");
    let fields: Vec<&str> = data["fieldViolations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["field"].as_str().unwrap())
        .collect();
    for expected in [
        "/card/description",
        "/card/supportedInterfaces",
        "/card/capabilities/streaming",
        "/card/skills/0/tags",
    ] {
        assert!(
            fields.contains(&expected),
            "{expected} missing from {fields:?}"
        );
    }
    assert_eq!(
        gateway
            .registry("SearchAgents", json!({"query": "broken"}))
            .await
            .result()["agents"],
        json!([])
    );
    gateway.stop().await;
}

#[tokio::test]
async fn agents_are_called_and_checked_on_their_jsonrpc_interface_of_version_1() {
    let upstream = baton().start().await;
    let gateway = baton().start().await;
    let card = upstream.published_card("echo").await;
    let interface = card["supportedInterfaces"][0].clone();
    let with_interfaces = |interfaces: Value| {
        let mut card = card.clone();
        card["supportedInterfaces"] = interfaces;
        card
    };
    // Only A2A 0.3 over JSON-RPC: Baton could not speak to it.
    let old_only = with_interfaces(json!([
        {"url": upstream.url("/agents/echo/a2a"), "protocolBinding": "JSONRPC", "protocolVersion": "0.3"}
    ]));
    let reply = gateway
        .registry("RegisterAgent", json!({"id": "old-echo", "card": old_only}))
        .await;
    assert_eq!(reply.code(), Some(-32602), "{}", reply.body);
    assert!(reply.body.to_string().contains("/card/supportedInterfaces"));

    // Another binding and an older version come first; the 1.0 JSON-RPC
    // interface is the one called and checked.
    let listed_first = with_interfaces(json!([
        {"url": "grpc.example.com:443", "protocolBinding": "GRPC", "protocolVersion": "1.0"},
        {"url": upstream.url("/agents/nowhere/a2a"), "protocolBinding": "JSONRPC", "protocolVersion": "0.3"},
        interface,
    ]));
    let reply = gateway
        .registry(
            "RegisterAgent",
            json!({"id": "far-echo", "card": listed_first}),
        )
        .await;
    assert!(reply.code().is_none(), "{}", reply.body);
    let params = json!({"message": user_message(&message_id("m"), "hi")});
    let sent = gateway
        .call_at("/agents/far-echo/a2a", "SendMessage", params)
        .await;
    assert_eq!(
        sent.result()["task"]["status"]["state"],
        "TASK_STATE_COMPLETED",
        "{}",
        sent.body
    );
    tokio::time::timeout(WAIT, gateway.registry.check_health())
        .await
        .expect("health check in time");
    let got = gateway
        .registry("GetAgent", json!({"id": "far-echo"}))
        .await;
    assert_eq!(
        got.result()["agent"]["health"]["status"],
        "healthy",
        "{}",
        got.body
    );
    gateway.stop().await;
    upstream.stop().await;
}

#[tokio::test]
async fn card_urls_at_internal_addresses_are_refused_without_connecting() {
    let gateway = baton().without_loopback().start().await;
    for url in [
        "http://10.0.0.1/",
        "http://169.254.169.254/latest/meta-data",
        "http://127.0.0.1:1/",
    ] {
        let started = std::time::Instant::now();
        let reply = gateway
            .registry("RegisterAgent", json!({"cardUrl": url}))
            .await;
        assert_eq!(reply.code(), Some(-32602), "{url}");
        let violation = &reply.body["error"]["data"][0]["fieldViolations"][0];
        assert_eq!(violation["field"], "cardUrl");
        assert!(
            violation["description"]
                .as_str()
                .unwrap()
                .contains("refused"),
            "{violation}"
        );
        // 10.0.0.1 does not exist here: a connection attempt would hang until the timeout.
        assert!(
            started.elapsed() < std::time::Duration::from_millis(500),
            "{url} took {:?}",
            started.elapsed()
        );
    }
    gateway.stop().await;
}

#[tokio::test]
async fn search_filters_and_pages() {
    let upstream = baton().start().await;
    let gateway = baton().start().await;
    let echo = upstream.published_card("echo").await;
    let scenario = upstream.published_card("scenario").await;
    for i in 0..7 {
        let mut card = if i % 2 == 0 {
            echo.clone()
        } else {
            scenario.clone()
        };
        card["name"] = json!(format!("Agent {i}"));
        let reply = gateway
            .registry(
                "RegisterAgent",
                json!({"id": format!("agent-{i}"), "card": card}),
            )
            .await;
        reply.result();
    }
    let ids = |reply: &Reply| -> Vec<String> {
        reply.result()["agents"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["id"].as_str().unwrap().to_string())
            .collect()
    };
    // Built-ins (echo, scenario) plus 7 registered.
    let all = gateway.registry("SearchAgents", json!({})).await;
    assert_eq!(ids(&all).len(), 9);
    let by_skill = gateway
        .registry("SearchAgents", json!({"skill": "echo"}))
        .await;
    assert_eq!(
        ids(&by_skill),
        ["agent-0", "agent-2", "agent-4", "agent-6", "echo"]
    );
    let by_tag = gateway
        .registry("SearchAgents", json!({"tag": "conformance"}))
        .await;
    assert_eq!(ids(&by_tag), ["agent-1", "agent-3", "agent-5", "scenario"]);
    let by_text = gateway
        .registry("SearchAgents", json!({"query": "agent 3"}))
        .await;
    assert_eq!(ids(&by_text), ["agent-3"]);
    let by_input = gateway
        .registry("SearchAgents", json!({"inputMode": "image/png"}))
        .await;
    assert_eq!(
        ids(&by_input),
        ["agent-0", "agent-2", "agent-4", "agent-6", "echo"],
        "echo accepts */*"
    );
    let by_output = gateway
        .registry("SearchAgents", json!({"outputMode": "application/json"}))
        .await;
    assert_eq!(ids(&by_output).len(), 9);

    // Pages of 4 over the 9 agents, via JSON-RPC and via GET.
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let page = gateway
            .registry("SearchAgents", json!({"pageSize": 4, "pageToken": token}))
            .await;
        let page_ids = ids(&page);
        assert!(page_ids.len() <= 4);
        seen.extend(page_ids);
        token = page.result()["nextPageToken"].as_str().unwrap().to_string();
        if token.is_empty() {
            break;
        }
    }
    assert_eq!(seen, ids(&all));
    let listed: Value = gateway
        .http
        .get(gateway.url("/registry/agents?tag=conformance&pageSize=2"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(listed["agents"].as_array().unwrap().len(), 2);
    assert!(!listed["nextPageToken"].as_str().unwrap().is_empty());
    let by_q: Value = gateway
        .http
        .get(gateway.url("/registry/agents?q=agent%205"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(by_q["agents"][0]["id"], "agent-5");
    for query in ["pageSize=0", "pageSize=abc"] {
        let bad = gateway
            .http
            .get(gateway.url(&format!("/registry/agents?{query}")))
            .send()
            .await
            .unwrap();
        assert_eq!(bad.status(), 400, "{query}");
        let body: Value = bad.json().await.unwrap();
        assert_eq!(body["error"]["code"], -32602, "{query}: {body}");
    }
    gateway.stop().await;
    upstream.stop().await;
}

/// `GET /registry/agents` refuses a query past its bounds (256 bytes, 8
/// distinct words) with 400, naming its parameter `q`.
#[tokio::test]
async fn a_search_query_past_its_bounds_is_refused_naming_q() {
    let gateway = baton().start().await;
    let long = "echo+".repeat(60);
    for q in [long.as_str(), "a+b+c+d+e+f+g+h+i"] {
        let bad = gateway
            .http
            .get(gateway.url(&format!("/registry/agents?q={q}")))
            .send()
            .await
            .unwrap();
        assert_eq!(bad.status(), 400, "{q}");
        let body: Value = bad.json().await.unwrap();
        assert_eq!(body["error"]["code"], -32602, "{body}");
        let violation = &body["error"]["data"][0]["fieldViolations"][0];
        assert_eq!(violation["field"], "q", "{body}");
    }
    gateway.stop().await;
}

/// `GET /registry/agents` reads an empty parameter as an absent one, as
/// DESIGN.md writes its template (`?skill=&tag=&q=&pageSize=&pageToken=`).
#[tokio::test]
async fn empty_search_parameters_are_absent() {
    let gateway = baton().start().await;
    let list = |query: &'static str| {
        let gateway = &gateway;
        async move {
            let reply = gateway
                .http
                .get(gateway.url(&format!("/registry/agents?{query}")))
                .send()
                .await
                .unwrap();
            assert_eq!(reply.status(), 200, "{query}");
            let page: Value = reply.json().await.unwrap();
            let agents = page["agents"].as_array().unwrap().iter();
            let ids = agents.map(|agent| agent["id"].as_str().unwrap().to_string());
            ids.collect::<Vec<_>>()
        }
    };
    let all = list("").await;
    assert_eq!(all, ["echo", "scenario"]);
    let template = "skill=&tag=&q=&inputMode=&outputMode=&pageSize=&pageToken=";
    assert_eq!(list(template).await, all);
    assert_eq!(list("skill=echo&tag=&pageSize=").await, ["echo"]);
    gateway.stop().await;
}

/// `POST /registry/` is the registry too, as `/a2a/` is the A2A endpoint.
#[tokio::test]
async fn the_registry_answers_on_its_path_with_a_trailing_slash() {
    let gateway = baton().start().await;
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "GetAgent", "params": {"id": "echo"}});
    for path in ["/registry", "/registry/"] {
        let reply = gateway.post_json(path, &body).await;
        assert_eq!(reply.result()["agent"]["id"], "echo", "{path}");
    }
    gateway.stop().await;
}

/// An inline agent's health asks only that its server answer: an agent
/// under a sub-path of a server with no card at its origin is healthy, one
/// whose server fails (5xx) or does not listen is not.
#[tokio::test]
async fn an_inline_agents_health_needs_its_server_to_answer_not_a_card_at_its_origin() {
    use axum::http::StatusCode;
    let upstream = baton().start().await;
    let gateway = baton().start().await;
    let card = upstream.published_card("echo").await;
    let pointed_at = |url: String| {
        let mut card = card.clone();
        card["supportedInterfaces"][0]["url"] = json!(url);
        card
    };
    // Answers its agent's path only; its origin has no card (404).
    let sub_path = serve_on_loopback(axum::Router::new().route(
        "/team/echo/a2a",
        axum::routing::post(|| async { StatusCode::OK }),
    ))
    .await;
    let failing = serve_on_loopback(
        axum::Router::new().fallback(|| async { StatusCode::SERVICE_UNAVAILABLE }),
    )
    .await;
    let closed = {
        // Bound and let go: nothing listens there.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", listener.local_addr().unwrap())
    };
    for (id, base) in [
        ("sub-path", &sub_path),
        ("failing", &failing),
        ("closed", &closed),
    ] {
        let card = pointed_at(format!("{base}/team/echo/a2a"));
        let reply = gateway
            .registry("RegisterAgent", json!({"id": id, "card": card}))
            .await;
        assert!(reply.code().is_none(), "{}", reply.body);
    }
    tokio::time::timeout(WAIT, gateway.registry.check_health())
        .await
        .expect("health check in time");
    for (id, expected) in [
        ("sub-path", "healthy"),
        ("failing", "unhealthy"),
        ("closed", "unhealthy"),
    ] {
        let got = gateway.registry("GetAgent", json!({"id": id})).await;
        assert_eq!(
            got.result()["agent"]["health"]["status"],
            expected,
            "{id}: {}",
            got.body
        );
    }
    gateway.stop().await;
    upstream.stop().await;
}
