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
    pub fn jsonrpc_interface(&self) -> Option<&AgentInterface> {
        self.supported_interfaces.iter().find(|interface| {
            let version = interface.protocol_version.trim();
            interface
                .protocol_binding
                .eq_ignore_ascii_case(JSONRPC_BINDING)
                && (version.is_empty() || version == "1" || version.starts_with("1."))
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
