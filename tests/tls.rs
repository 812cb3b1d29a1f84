//! Agents and cards over `https`: a test CA signs a certificate for
//! `localhost`, a TLS front on loopback relays to a real upstream Baton,
//! and a gateway reaches it through rustls, trusting the CA only when told
//! (`--tls-ca`). Covers unary and streaming calls, a card fetched by URL,
//! and the refusals of a server whose certificate is not trusted.

mod common;

use baton::netguard::OutboundPolicy;
use baton::protocol::AgentCard;
use baton::tls::ClientTls;
use baton::upstream::RemoteAgent;
use common::agents::card;
use common::*;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use serde_json::json;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio_rustls::TlsAcceptor;

/// A test CA and the certificate it signed for `localhost` and 127.0.0.1.
struct TestPki {
    ca_pem: String,
    server_chain: Vec<CertificateDer<'static>>,
    server_key: PrivatePkcs8KeyDer<'static>,
}

impl TestPki {
    fn new() -> Self {
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "Baton test CA");
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
        let server_key = KeyPair::generate().unwrap();
        let server = CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()])
            .unwrap()
            .signed_by(&server_key, &ca)
            .unwrap();
        Self {
            ca_pem: ca.pem(),
            server_chain: vec![server.der().clone()],
            server_key: PrivatePkcs8KeyDer::from(server_key.serialize_der()),
        }
    }

    fn trusted(&self) -> ClientTls {
        ClientTls::with_ca_pem(self.ca_pem.as_bytes()).unwrap()
    }
}

/// A TLS front on loopback that relays each connection to `backend`.
struct TlsFront {
    port: u16,
    handshakes: Arc<AtomicUsize>,
}

impl TlsFront {
    async fn start(pki: &TestPki, backend: SocketAddr) -> Self {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                pki.server_chain.clone(),
                PrivateKeyDer::Pkcs8(pki.server_key.clone_key()),
            )
            .unwrap();
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let handshakes = Arc::new(AtomicUsize::new(0));
        let counted = handshakes.clone();
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                let counted = counted.clone();
                tokio::spawn(async move {
                    // A client that does not trust the certificate hangs up here.
                    let Ok(mut tls) = acceptor.accept(socket).await else {
                        return;
                    };
                    counted.fetch_add(1, Ordering::SeqCst);
                    let mut plain = tokio::net::TcpStream::connect(backend).await.unwrap();
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                });
            }
        });
        Self { port, handshakes }
    }

    fn url(&self, path: &str) -> String {
        format!("https://localhost:{}{path}", self.port)
    }

    fn handshakes(&self) -> usize {
        self.handshakes.load(Ordering::SeqCst)
    }
}

/// A test CA, an upstream Baton, and a TLS front for it signed by the CA.
async fn upstream_behind_tls() -> (TestPki, TestBaton, TlsFront) {
    let pki = TestPki::new();
    let upstream = baton().start().await;
    let front = TlsFront::start(&pki, backend_of(&upstream)).await;
    (pki, upstream, front)
}

fn backend_of(baton: &TestBaton) -> SocketAddr {
    baton
        .base
        .trim_start_matches("http://")
        .parse()
        .expect("the test Baton's address")
}

fn policy(tls: ClientTls) -> OutboundPolicy {
    OutboundPolicy {
        allow: vec!["127.0.0.0/8".parse().unwrap()],
        tls,
    }
}

fn https_card(url: String, streaming: bool) -> AgentCard {
    let mut card = card("remote");
    card.supported_interfaces[0].url = url;
    card.capabilities.streaming = Some(streaming);
    card
}

/// A gateway whose default agent is the upstream's `scenario` behind `front`.
async fn gateway_to(front: &TlsFront, tls: ClientTls, streaming: bool) -> TestBaton {
    let card = https_card(front.url("/agents/scenario/a2a"), streaming);
    let agent = RemoteAgent::from_card(card, &policy(tls.clone()), fast_upstream()).unwrap();
    baton()
        .tls(tls)
        .agent("remote", agent)
        .default_agent("remote")
        .start()
        .await
}

#[tokio::test]
async fn an_https_agent_is_called_over_tls_verified_against_the_given_ca() {
    let (pki, upstream, front) = upstream_behind_tls().await;
    for streaming in [false, true] {
        let before = front.handshakes();
        let gateway = gateway_to(&front, pki.trusted(), streaming).await;
        let result = gateway
            .send_text(&message_id("tck-complete-task"), "hello", json!({}))
            .await;
        let task = &result["task"];
        assert_eq!(
            task["status"]["state"], "TASK_STATE_COMPLETED",
            "streaming {streaming}: {result}"
        );
        assert_eq!(
            task["status"]["message"]["parts"][0]["text"],
            "Hello from TCK"
        );
        assert!(
            front.handshakes() > before,
            "streaming {streaming}: the call went through the TLS front"
        );
        gateway.stop().await;
    }
    upstream.stop().await;
}

#[tokio::test]
async fn a_card_is_fetched_over_tls_by_url() {
    let (pki, upstream, front) = upstream_behind_tls().await;
    let gateway = baton().tls(pki.trusted()).start().await;
    let card_url = front.url("/agents/scenario/.well-known/agent-card.json");
    let reply = gateway
        .registry(
            "RegisterAgent",
            json!({"id": "tls-agent", "cardUrl": card_url}),
        )
        .await;
    let agent = &reply.result()["agent"];
    assert_eq!(agent["id"], "tls-agent", "{agent}");
    assert_eq!(agent["cardUrl"], card_url.as_str());
    assert_eq!(front.handshakes(), 1);
    gateway.stop().await;
    upstream.stop().await;
}

#[tokio::test]
async fn a_server_whose_certificate_is_not_trusted_is_refused() {
    let (_pki, upstream, front) = upstream_behind_tls().await;

    // The web PKI alone does not know the test CA.
    let gateway = gateway_to(&front, ClientTls::default(), false).await;
    let reply = gateway
        .call(
            "SendMessage",
            json!({"message": user_message(&message_id("tck-complete-task"), "hello")}),
        )
        .await;
    let error = &reply.body["error"];
    assert!(error.is_object(), "{}", reply.body);
    let message = error["message"].as_str().unwrap_or_default();
    assert!(message.contains("certificate"), "{message}");

    let card_url = front.url("/agents/scenario/.well-known/agent-card.json");
    let reply = gateway
        .registry("RegisterAgent", json!({"cardUrl": card_url}))
        .await;
    assert_eq!(reply.code(), Some(-32602), "{}", reply.body);
    let violation = &reply.body["error"]["data"][0]["fieldViolations"][0];
    assert_eq!(violation["field"], "cardUrl");
    let description = violation["description"].as_str().unwrap_or_default();
    assert!(description.contains("certificate"), "{violation}");

    assert_eq!(front.handshakes(), 0, "no TLS session was ever established");
    gateway.stop().await;
    upstream.stop().await;
}

#[tokio::test]
async fn push_notifications_reach_an_https_webhook() {
    let pki = TestPki::new();
    // A plain webhook behind the TLS front; each body goes into the channel.
    let (delivered, mut deliveries) = tokio::sync::mpsc::unbounded_channel::<serde_json::Value>();
    let hook = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |axum::Json(body): axum::Json<serde_json::Value>| {
            let delivered = delivered.clone();
            async move {
                let _ = delivered.send(body);
                axum::http::StatusCode::OK
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook_addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, hook).await });
    let front = TlsFront::start(&pki, hook_addr).await;

    let gateway = baton().tls(pki.trusted()).start().await;
    let reply = gateway
        .call_at(
            "/agents/scenario/a2a",
            "SendMessage",
            json!({
                "message": user_message(&message_id("tck-complete-task"), "hi"),
                "configuration": {"taskPushNotificationConfig": {"url": front.url("/hook")}},
            }),
        )
        .await;
    let task_id = reply.result()["task"]["id"].as_str().unwrap().to_string();
    let body = tokio::time::timeout(WAIT, deliveries.recv())
        .await
        .expect("a notification in time")
        .expect("the webhook is up");
    assert!(
        body.to_string().contains(&task_id),
        "the notification names the task: {body}"
    );
    assert!(front.handshakes() >= 1);
    gateway.stop().await;
}
