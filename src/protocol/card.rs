//! A2A 1.0 AgentCard and the objects it contains (`a2a.proto`), in exact ProtoJSON.

use super::wire::{Struct, is_false, nullable};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// `AgentCard`: what an agent is, what it can do and where to reach it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentCard {
    /// Human-readable name.
    #[serde(default, deserialize_with = "nullable")]
    pub name: String,
    /// What the agent does.
    #[serde(default, deserialize_with = "nullable")]
    pub description: String,
    /// Where to reach it, preferred first.
    #[serde(default, alias = "supported_interfaces", deserialize_with = "nullable")]
    pub supported_interfaces: Vec<AgentInterface>,
    /// Who runs it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<AgentProvider>,
    /// The agent's own version.
    #[serde(default, deserialize_with = "nullable")]
    pub version: String,
    /// Documentation link.
    #[serde(
        default,
        alias = "documentation_url",
        skip_serializing_if = "Option::is_none"
    )]
    pub documentation_url: Option<String>,
    /// Optional capabilities.
    #[serde(default, deserialize_with = "nullable")]
    pub capabilities: AgentCapabilities,
    /// Security schemes by name.
    #[serde(default, alias = "security_schemes", deserialize_with = "nullable")]
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub security_schemes: BTreeMap<String, SecurityScheme>,
    /// Which schemes a caller must satisfy.
    #[serde(
        default,
        alias = "security_requirements",
        deserialize_with = "nullable"
    )]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub security_requirements: Vec<SecurityRequirement>,
    /// Accepted input media types.
    #[serde(default, alias = "default_input_modes", deserialize_with = "nullable")]
    pub default_input_modes: Vec<String>,
    /// Produced output media types.
    #[serde(default, alias = "default_output_modes", deserialize_with = "nullable")]
    pub default_output_modes: Vec<String>,
    /// What the agent can do.
    #[serde(default, deserialize_with = "nullable")]
    pub skills: Vec<AgentSkill>,
    /// JWS signatures over the card.
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub signatures: Vec<AgentCardSignature>,
    /// Icon link.
    #[serde(default, alias = "icon_url", skip_serializing_if = "Option::is_none")]
    pub icon_url: Option<String>,
}

/// The protocol binding Baton speaks, to callers and to agents.
pub const JSONRPC_BINDING: &str = "JSONRPC";

impl AgentCard {
    /// The interface Baton calls the agent on: the first JSON-RPC one of
    /// protocol version 1 (Baton speaks A2A 1.0 to agents; spec §8.3.2:
    /// the first supported transport). A version left out counts as 1.
    /// A leading `v` ("v1", "V1.0") is read as written by hand, not as
    /// another version.
    pub fn jsonrpc_interface(&self) -> Option<&AgentInterface> {
        self.jsonrpc_interfaces().find(|interface| {
            let version = interface.protocol_version.trim();
            let is_1 = |number: &str| number == "1" || number.starts_with("1.");
            match version.strip_prefix(['v', 'V']) {
                Some(number) => is_1(number),
                None => version.is_empty() || is_1(version),
            }
        })
    }

    /// The interface Baton calls an agent it already routes to:
    /// [`Self::jsonrpc_interface`], else the first JSON-RPC one of any
    /// version. Registration requires the former; an agent stored before
    /// it did keeps its route rather than vanish at the next start.
    pub fn calling_interface(&self) -> Option<&AgentInterface> {
        self.jsonrpc_interface()
            .or_else(|| self.jsonrpc_interfaces().next())
    }

    fn jsonrpc_interfaces(&self) -> impl Iterator<Item = &AgentInterface> {
        self.supported_interfaces.iter().filter(|interface| {
            interface
                .protocol_binding
                .eq_ignore_ascii_case(JSONRPC_BINDING)
        })
    }
}

/// `AgentInterface`: one URL and the protocol binding spoken there.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentInterface {
    /// The endpoint.
    #[serde(default, deserialize_with = "nullable")]
    pub url: String,
    /// `JSONRPC`, `GRPC` or `HTTP+JSON`.
    #[serde(default, alias = "protocol_binding", deserialize_with = "nullable")]
    pub protocol_binding: String,
    /// Tenant to put in every request.
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "String::is_empty"
    )]
    pub tenant: String,
    /// Protocol version, e.g. `1.0`.
    #[serde(default, alias = "protocol_version", deserialize_with = "nullable")]
    pub protocol_version: String,
}

/// `AgentProvider`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentProvider {
    /// The provider's site.
    #[serde(default, deserialize_with = "nullable")]
    pub url: String,
    /// The provider's name.
    #[serde(default, deserialize_with = "nullable")]
    pub organization: String,
}

/// `AgentCapabilities`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentCapabilities {
    /// Supports SendStreamingMessage and SubscribeToTask.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub streaming: Option<bool>,
    /// Supports push notification configs.
    #[serde(
        default,
        alias = "push_notifications",
        skip_serializing_if = "Option::is_none"
    )]
    pub push_notifications: Option<bool>,
    /// Declared extensions.
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub extensions: Vec<AgentExtension>,
    /// Serves GetExtendedAgentCard.
    #[serde(
        default,
        alias = "extended_agent_card",
        skip_serializing_if = "Option::is_none"
    )]
    pub extended_agent_card: Option<bool>,
}

/// `AgentExtension`: an extension the agent supports.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentExtension {
    /// The extension's URI.
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "String::is_empty"
    )]
    pub uri: String,
    /// What it is for here.
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "String::is_empty"
    )]
    pub description: String,
    /// Clients must activate it.
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "is_false"
    )]
    pub required: bool,
    /// Extension parameters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub params: Option<Struct>,
}

/// `AgentSkill`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentSkill {
    /// Unique id within the agent.
    #[serde(default, deserialize_with = "nullable")]
    pub id: String,
    /// Human-readable name.
    #[serde(default, deserialize_with = "nullable")]
    pub name: String,
    /// What the skill does.
    #[serde(default, deserialize_with = "nullable")]
    pub description: String,
    /// Keywords.
    #[serde(default, deserialize_with = "nullable")]
    pub tags: Vec<String>,
    /// Example prompts.
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub examples: Vec<String>,
    /// Accepted input media types, overriding the card's.
    #[serde(default, alias = "input_modes", deserialize_with = "nullable")]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub input_modes: Vec<String>,
    /// Produced output media types, overriding the card's.
    #[serde(default, alias = "output_modes", deserialize_with = "nullable")]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub output_modes: Vec<String>,
    /// Security requirements for this skill.
    #[serde(
        default,
        alias = "security_requirements",
        deserialize_with = "nullable"
    )]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub security_requirements: Vec<SecurityRequirement>,
}

/// `AgentCardSignature`: a detached JWS over the card.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentCardSignature {
    /// Base64url protected header.
    #[serde(default, deserialize_with = "nullable")]
    pub protected: String,
    /// Base64url signature.
    #[serde(default, deserialize_with = "nullable")]
    pub signature: String,
    /// Unprotected header.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<Struct>,
}

/// `StringList`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StringList {
    /// The strings (scopes).
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub list: Vec<String>,
}

/// `SecurityRequirement`: scheme names to required scopes.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SecurityRequirement {
    /// Scheme name to scopes.
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub schemes: BTreeMap<String, StringList>,
}

/// `SecurityScheme`: one of the scheme kinds (a proto `oneof`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SecurityScheme {
    /// API key.
    #[serde(
        default,
        alias = "api_key_security_scheme",
        skip_serializing_if = "Option::is_none"
    )]
    pub api_key_security_scheme: Option<ApiKeySecurityScheme>,
    /// HTTP auth (bearer, basic).
    #[serde(
        default,
        alias = "http_auth_security_scheme",
        skip_serializing_if = "Option::is_none"
    )]
    pub http_auth_security_scheme: Option<HttpAuthSecurityScheme>,
    /// OAuth 2.
    #[serde(
        default,
        alias = "oauth2_security_scheme",
        skip_serializing_if = "Option::is_none"
    )]
    pub oauth2_security_scheme: Option<OAuth2SecurityScheme>,
    /// OpenID Connect.
    #[serde(default, alias = "open_id_connect_security_scheme")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub open_id_connect_security_scheme: Option<OpenIdConnectSecurityScheme>,
    /// Mutual TLS.
    #[serde(
        default,
        alias = "mtls_security_scheme",
        skip_serializing_if = "Option::is_none"
    )]
    pub mtls_security_scheme: Option<MutualTlsSecurityScheme>,
}

/// `APIKeySecurityScheme`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ApiKeySecurityScheme {
    /// Description.
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "String::is_empty"
    )]
    pub description: String,
    /// `query`, `header` or `cookie`.
    #[serde(default, deserialize_with = "nullable")]
    pub location: String,
    /// The parameter name.
    #[serde(default, deserialize_with = "nullable")]
    pub name: String,
}

/// `HTTPAuthSecurityScheme`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpAuthSecurityScheme {
    /// Description.
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "String::is_empty"
    )]
    pub description: String,
    /// IANA scheme, e.g. `Bearer`.
    #[serde(default, deserialize_with = "nullable")]
    pub scheme: String,
    /// Bearer token format hint.
    #[serde(default, alias = "bearer_format", deserialize_with = "nullable")]
    #[serde(skip_serializing_if = "String::is_empty")]
    pub bearer_format: String,
}

/// `OAuth2SecurityScheme`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OAuth2SecurityScheme {
    /// Description.
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "String::is_empty"
    )]
    pub description: String,
    /// The flows (a proto `oneof`, kept as JSON).
    #[serde(default, deserialize_with = "nullable")]
    pub flows: Struct,
    /// RFC 8414 metadata URL.
    #[serde(default, alias = "oauth2_metadata_url", deserialize_with = "nullable")]
    #[serde(skip_serializing_if = "String::is_empty")]
    pub oauth2_metadata_url: String,
}

/// `OpenIdConnectSecurityScheme`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OpenIdConnectSecurityScheme {
    /// Description.
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "String::is_empty"
    )]
    pub description: String,
    /// Discovery URL.
    #[serde(default, alias = "open_id_connect_url", deserialize_with = "nullable")]
    pub open_id_connect_url: String,
}

/// `MutualTlsSecurityScheme`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MutualTlsSecurityScheme {
    /// Description.
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "String::is_empty"
    )]
    pub description: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn card_with(interfaces: &[(&str, &str, &str)]) -> AgentCard {
        AgentCard {
            supported_interfaces: interfaces
                .iter()
                .map(|(url, binding, version)| AgentInterface {
                    url: url.to_string(),
                    protocol_binding: binding.to_string(),
                    protocol_version: version.to_string(),
                    ..AgentInterface::default()
                })
                .collect(),
            ..AgentCard::default()
        }
    }

    #[test]
    fn the_jsonrpc_interface_is_the_first_of_version_1() {
        let url = |card: &AgentCard| card.jsonrpc_interface().map(|i| i.url.clone());
        let card = card_with(&[
            ("grpc", "GRPC", "1.0"),
            ("old", "JSONRPC", "0.3"),
            ("new", "jsonrpc", "1.0"),
        ]);
        assert_eq!(url(&card).as_deref(), Some("new"));
        for version in ["", "1", "1.0", "1.1", "v1", "V1.0", " v1.0 "] {
            let card = card_with(&[("it", "JSONRPC", version)]);
            assert_eq!(url(&card).as_deref(), Some("it"), "{version:?}");
        }
        for version in ["0.3", "2.0", "v0.3", "10", "vv1", "v", "V"] {
            let card = card_with(&[("it", "JSONRPC", version)]);
            assert_eq!(url(&card), None, "{version:?}");
        }
    }

    #[test]
    fn an_agent_already_routed_is_called_on_any_jsonrpc_interface() {
        let card = card_with(&[("grpc", "GRPC", "1.0"), ("old", "JSONRPC", "0.3")]);
        assert!(card.jsonrpc_interface().is_none());
        assert_eq!(
            card.calling_interface().map(|i| i.url.as_str()),
            Some("old")
        );
        let card = card_with(&[("old", "JSONRPC", "0.3"), ("new", "JSONRPC", "1.0")]);
        assert_eq!(
            card.calling_interface().map(|i| i.url.as_str()),
            Some("new")
        );
        assert!(
            card_with(&[("grpc", "GRPC", "1.0")])
                .calling_interface()
                .is_none()
        );
    }
}
