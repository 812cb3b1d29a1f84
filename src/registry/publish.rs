//! Publication of AgentCards: each agent's card rewritten to route through
//! Baton, and the gateway's own card, with the ETag and caching headers that
//! go with them.

use crate::protocol::{
    AgentCapabilities, AgentCard, AgentExtension, AgentInterface, AgentProvider, AgentSkill,
    HANDOFF_EXTENSION, HttpAuthSecurityScheme, JSONRPC_BINDING, PROTOCOL_VERSION,
    SecurityRequirement, SecurityScheme, StringList,
};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

/// `Cache-Control` of published cards.
const CARD_CACHE_CONTROL: &str = "public, max-age=300";

/// A card ready to serve: its JSON, its ETag and when it last changed.
#[derive(Clone, Debug)]
pub struct PublishedCard {
    /// The card.
    pub card: AgentCard,
    /// The serialized card.
    pub body: bytes::Bytes,
    /// Strong ETag over the body.
    pub etag: String,
    /// `Last-Modified` value.
    pub last_modified: String,
}

impl PublishedCard {
    /// Serializes `card` and computes its validators.
    pub fn new(card: AgentCard, modified: chrono::DateTime<chrono::Utc>) -> Self {
        let body = serde_json::to_vec(&card).expect("cards always serialize");
        let digest = Sha256::digest(&body);
        let etag = format!("\"{}\"", hex(&digest[..16]));
        Self {
            card,
            body: body.into(),
            etag,
            last_modified: modified.format("%a, %d %b %Y %H:%M:%S GMT").to_string(),
        }
    }

    /// The card, or 304 when the client's `If-None-Match` matches.
    pub fn respond(&self, request_headers: &HeaderMap) -> Response {
        let matches = request_headers
            .get_all(header::IF_NONE_MATCH)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(|tag| tag.trim().trim_start_matches("W/"))
            .any(|tag| tag == "*" || tag == self.etag);
        let mut response = if matches {
            StatusCode::NOT_MODIFIED.into_response()
        } else {
            let mut response = self.body.clone().into_response();
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            response
        };
        let headers = response.headers_mut();
        headers.insert(
            header::CACHE_CONTROL,
            HeaderValue::from_static(CARD_CACHE_CONTROL),
        );
        if let Ok(etag) = HeaderValue::from_str(&self.etag) {
            headers.insert(header::ETAG, etag);
        }
        if let Ok(modified) = HeaderValue::from_str(&self.last_modified) {
            headers.insert(header::LAST_MODIFIED, modified);
        }
        response
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The handoff extension as declared in every published card.
pub fn handoff_extension() -> AgentExtension {
    AgentExtension {
        uri: HANDOFF_EXTENSION.into(),
        description: "Baton handoffs: trace id, hop limit, deadline and typed handoff payloads \
                      (metadata key urn:baton:handoff:v1)."
            .into(),
        required: false,
        params: None,
    }
}

fn jsonrpc_interface(url: String) -> AgentInterface {
    AgentInterface {
        url,
        protocol_binding: JSONRPC_BINDING.into(),
        tenant: String::new(),
        protocol_version: PROTOCOL_VERSION.into(),
    }
}

/// An agent's card as Baton publishes it: interfaces point at Baton, the
/// handoff extension is declared, and streaming and push are what Baton
/// itself provides (it streams and notifies from its ledger). The agency's
/// signatures are dropped, as they sign the card Baton has just changed.
/// Callers authenticate to Baton, which sends the agent none of their
/// credentials: with API keys, Baton's key is the one scheme; without, the
/// card declares none (a client following the agency's would hand Baton the
/// agency's secrets, in a query string even). An extended card is offered
/// only with keys (the spec serves it to authenticated callers, §13.3) and
/// when Baton holds one (`has_extended`). Everything else is the agency's
/// card.
pub fn publish_agent_card(
    card: &AgentCard,
    agent_id: &str,
    public_url: &str,
    push_enabled: bool,
    secured: bool,
    has_extended: bool,
) -> AgentCard {
    let mut card = card.clone();
    card.signatures.clear();
    if secured {
        declare_api_key(&mut card);
    } else {
        card.security_schemes.clear();
        card.security_requirements.clear();
    }
    // They name the agency's schemes, which the card no longer declares.
    for skill in &mut card.skills {
        skill.security_requirements.clear();
    }
    if !(secured && has_extended) {
        card.capabilities.extended_agent_card = None;
    }
    card.supported_interfaces = vec![jsonrpc_interface(format!(
        "{public_url}/agents/{agent_id}/a2a"
    ))];
    if !card
        .capabilities
        .extensions
        .iter()
        .any(|e| e.uri == HANDOFF_EXTENSION)
    {
        card.capabilities.extensions.push(handoff_extension());
    }
    card.capabilities.streaming = Some(true);
    card.capabilities.push_notifications = Some(push_enabled);
    card
}

/// The gateway's own card: a virtual agent whose skills are every agent's
/// skills, named `{agentId}/{skillId}`.
pub fn gateway_card(
    agents: &[(&str, &AgentCard)],
    public_url: &str,
    push_enabled: bool,
    secured: bool,
) -> AgentCard {
    let skills = agents
        .iter()
        .flat_map(|(id, card)| {
            card.skills.iter().map(move |skill| {
                // A skill without modes of its own has its agent's defaults,
                // not the gateway card's.
                let modes = |own: &Vec<String>, default: &Vec<String>| {
                    if own.is_empty() { default } else { own }.clone()
                };
                AgentSkill {
                    id: format!("{id}/{}", skill.id),
                    input_modes: modes(&skill.input_modes, &card.default_input_modes),
                    output_modes: modes(&skill.output_modes, &card.default_output_modes),
                    // They name the agencies' schemes, which this card does
                    // not declare.
                    security_requirements: Vec::new(),
                    ..skill.clone()
                }
            })
        })
        .collect();
    let mut card = AgentCard {
        name: "Baton".into(),
        description: "A2A gateway: routes each call to a registered agent and keeps every task \
                      in a durable ledger. Address an agent with params.tenant = its id."
            .into(),
        supported_interfaces: vec![jsonrpc_interface(format!("{public_url}/a2a"))],
        provider: Some(AgentProvider {
            url: "https://github.com/baton-gateway/baton".into(),
            organization: "Baton".into(),
        }),
        version: env!("CARGO_PKG_VERSION").into(),
        capabilities: AgentCapabilities {
            streaming: Some(true),
            push_notifications: Some(push_enabled),
            extensions: vec![handoff_extension()],
            // Served to authenticated callers only (§13.3), so only with keys.
            extended_agent_card: secured.then_some(true),
        },
        default_input_modes: vec!["text/plain".into(), "application/json".into()],
        default_output_modes: vec!["text/plain".into(), "application/json".into()],
        skills,
        ..AgentCard::default()
    };
    if secured {
        declare_api_key(&mut card);
    }
    card
}

/// The security scheme name of Baton's API keys in published cards.
pub const API_KEY_SCHEME: &str = "batonApiKey";

/// Declares that calls need a Baton API key as a bearer token. Callers
/// authenticate to Baton, not to the agency, so this replaces the agency's
/// own requirements in what Baton publishes.
fn declare_api_key(card: &mut AgentCard) {
    let scheme = SecurityScheme {
        http_auth_security_scheme: Some(HttpAuthSecurityScheme {
            description: "A Baton API key (baton keys add AGENCY), sent as a bearer token.".into(),
            scheme: "Bearer".into(),
            bearer_format: String::new(),
        }),
        ..SecurityScheme::default()
    };
    card.security_schemes = [(API_KEY_SCHEME.to_string(), scheme)].into();
    card.security_requirements = vec![SecurityRequirement {
        schemes: [(API_KEY_SCHEME.to_string(), StringList::default())].into(),
    }];
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A card with a signature and a skill that requires the agency's own
    /// scheme.
    fn signed_card() -> AgentCard {
        serde_json::from_value(serde_json::json!({
            "name": "Billing",
            "description": "Refunds.",
            "supportedInterfaces": [{"url": "http://billing.internal/a2a",
                "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}],
            "version": "1.0.0",
            "capabilities": {},
            "defaultInputModes": ["text/plain"],
            "defaultOutputModes": ["text/plain"],
            "securitySchemes": {"oauth": {"oauth2SecurityScheme": {"flows": {}}}},
            "securityRequirements": [{"schemes": {"oauth": {"list": ["refunds"]}}}],
            "skills": [{"id": "refund", "name": "Refund", "description": "Refunds.",
                "tags": ["refunds"],
                "securityRequirements": [{"schemes": {"oauth": {"list": ["refunds"]}}}]}],
            "signatures": [{"protected": "eyJhbGciOiJFUzI1NiJ9", "signature": "c2lnbmVk"}],
        }))
        .unwrap()
    }

    #[test]
    fn published_cards_carry_no_signature_and_only_schemes_they_declare() {
        let card = signed_card();
        let url = "http://localhost:8080";
        let open = publish_agent_card(&card, "billing", url, true, false, false);
        assert!(
            open.signatures.is_empty(),
            "the signatures cover the agency's card"
        );
        assert!(
            open.security_schemes.is_empty() && open.security_requirements.is_empty(),
            "Baton asks for no credential, and passes none on"
        );
        assert!(open.skills[0].security_requirements.is_empty());

        let secured = publish_agent_card(&card, "billing", url, true, true, false);
        assert!(secured.signatures.is_empty());
        assert_eq!(
            secured.security_schemes.keys().collect::<Vec<_>>(),
            [API_KEY_SCHEME]
        );
        assert!(
            secured.skills[0].security_requirements.is_empty(),
            "no scheme it names is declared"
        );
    }

    #[test]
    fn an_extended_card_is_offered_only_with_keys_and_when_held() {
        let mut card = signed_card();
        card.capabilities.extended_agent_card = Some(true);
        for secured in [false, true] {
            let offered = secured.then_some(true);
            let url = "http://localhost:8080";
            let agent = publish_agent_card(&card, "billing", url, true, secured, true);
            assert_eq!(agent.capabilities.extended_agent_card, offered);
            // An agent whose extended card Baton does not hold (a remote
            // agent's) is not said to have one.
            let remote = publish_agent_card(&card, "billing", url, true, secured, false);
            assert_eq!(remote.capabilities.extended_agent_card, None);
            let gateway = gateway_card(&[("billing", &card)], url, true, secured);
            assert_eq!(gateway.capabilities.extended_agent_card, offered);
        }
    }

    #[test]
    fn the_gateway_card_names_no_agencys_scheme() {
        let card = signed_card();
        for secured in [false, true] {
            let gateway = gateway_card(
                &[("billing", &card)],
                "http://localhost:8080",
                true,
                secured,
            );
            assert_eq!(gateway.skills[0].id, "billing/refund");
            assert_eq!(
                gateway.skills[0].input_modes,
                ["text/plain"],
                "the agent's default modes, not the gateway card's"
            );
            assert!(
                gateway.skills[0].security_requirements.is_empty(),
                "the gateway card declares no agency's scheme"
            );
            assert!(!gateway.security_schemes.contains_key("oauth"));
        }
    }
}
