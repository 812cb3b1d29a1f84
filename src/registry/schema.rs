//! Agent card validation against `schemas/agent-card.schema.json`.
//!
//! The schema is written from `a2a.proto` (A2A 1.0): fields marked
//! `(google.api.field_behavior) = REQUIRED` are required, required strings must
//! be non-empty and required repeated fields need at least one element
//! (spec §5.7). It is compiled once, with the `jsonschema` crate, into a
//! [`CardValidator`].
//!
//! Validation policy:
//! - Every failing field is reported, each as a JSON Pointer into the card as
//!   it was given (`/skills/0/tags`, `/name`; `""` for the card itself). A
//!   missing field is named by the pointer it would have.
//! - ProtoJSON parsers accept the proto (snake_case) field names and treat
//!   `null` as "not set". So that the schema need spell each field only once,
//!   the card is first normalised: message fields are renamed to camelCase and
//!   `null` fields dropped (a required field that is `null` is then reported
//!   missing). The walk follows the schema, so map keys (scheme names, scopes)
//!   and `google.protobuf.Struct` contents are never touched. Pointers in
//!   violations use the key the caller wrote.
//! - Unknown fields are allowed (spec §5.7: SHOULD ignore them), so v0.3
//!   leftovers like a top-level `url` or `preferredTransport` are ignored.
//! - A proto `oneof` (security scheme kind, OAuth flow) must have exactly one
//!   member set.
//! - `format: uri` is an annotation, not asserted: an interface URL may be a
//!   gRPC `host:port`, and the other URLs are descriptive; the outbound guard
//!   checks the URLs Baton actually calls.

use crate::error::FieldViolation;
use crate::protocol::AgentCard;
use crate::schema_support::{
    compile_embedded, describe_common, escape, oneof_members, serde_pointer,
};
use jsonschema::error::ValidationErrorKind;
use jsonschema::{ValidationError, Validator};
use serde_json::{Map, Value};
use std::sync::LazyLock;

/// The schema text, embedded so that validation needs no file at run time.
const SCHEMA: &str = include_str!("../../schemas/agent-card.schema.json");

/// The process-wide validator, compiled on first use.
static SHARED: LazyLock<CardValidator> = LazyLock::new(CardValidator::new);

/// A compiled agent card schema.
pub struct CardValidator {
    /// The schema document: the normaliser walks it, and `oneOf` errors look
    /// up their member names in it.
    schema: Value,
    validator: Validator,
}

impl std::fmt::Debug for CardValidator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CardValidator").finish_non_exhaustive()
    }
}

impl Default for CardValidator {
    fn default() -> Self {
        Self::new()
    }
}

impl CardValidator {
    /// Compiles the embedded schema.
    ///
    /// # Panics
    ///
    /// Only if the embedded schema is not a valid 2020-12 schema, which the
    /// unit tests rule out.
    pub fn new() -> Self {
        let (schema, validator) = compile_embedded(SCHEMA, "agent card");
        Self { schema, validator }
    }

    /// The shared instance: compiling takes a moment, so callers that need no
    /// instance of their own should use this one.
    pub fn shared() -> &'static Self {
        &SHARED
    }

    /// Validates `card` and, if it is valid, parses it.
    ///
    /// On failure, returns every violation, sorted by field, with `field` a
    /// JSON Pointer into `card`.
    pub fn validate(&self, card: &Value) -> Result<AgentCard, Vec<FieldViolation>> {
        let mut violations = Vec::new();
        let normalised = self.normalise(&self.schema, card, "", &mut violations);
        for error in self.validator.iter_errors(&normalised) {
            let mut pointer = error.instance_path().as_str().to_owned();
            let description = match error.kind() {
                ValidationErrorKind::Required { property } => {
                    pointer.push('/');
                    pointer.push_str(&escape(property.as_str().unwrap_or_default()));
                    "is required".to_owned()
                }
                _ => self.describe(&error),
            };
            violations.push(FieldViolation::new(
                original_pointer(card, &pointer),
                description,
            ));
        }
        if violations.is_empty() {
            // The schema is stricter than the serde types, so this only fails
            // if the two disagree; report it rather than panic.
            return serde_path_to_error::deserialize(&normalised).map_err(|err| {
                let pointer = serde_pointer(err.path());
                vec![FieldViolation::new(
                    original_pointer(card, &pointer),
                    err.inner().to_string(),
                )]
            });
        }
        violations.sort_by(|a, b| (&a.field, &a.description).cmp(&(&b.field, &b.description)));
        violations.dedup();
        Err(violations)
    }

    /// A readable description of one schema error.
    fn describe(&self, error: &ValidationError<'_>) -> String {
        if let Some(message) = describe_common(error) {
            return message;
        }
        match error.kind() {
            ValidationErrorKind::MinItems { limit: 1 } => {
                "must contain at least one element".to_owned()
            }
            ValidationErrorKind::OneOfMultipleValid { .. }
            | ValidationErrorKind::OneOfNotValid { .. } => {
                self.describe_oneof(error.instance(), error.schema_path().as_str())
            }
            // Not produced by this schema today; jsonschema's own wording.
            _ => error.to_string(),
        }
    }

    /// Describes a proto `oneof` with the wrong number of members set. Each
    /// `oneOf` branch of the schema is `{"required": [member]}`.
    fn describe_oneof(&self, instance: &Value, schema_path: &str) -> String {
        let members = oneof_members(&self.schema, schema_path);
        let set: Vec<&str> = members
            .iter()
            .copied()
            .filter(|member| instance.get(member).is_some())
            .collect();
        let all = members.join(", ");
        if set.len() > 1 {
            format!(
                "sets {}; exactly one of {all} may be set",
                set.join(" and ")
            )
        } else {
            format!("must set exactly one of {all}")
        }
    }

    /// Follows `$ref`s (all local, `#/$defs/...`) to the schema they name.
    fn resolve<'s>(&'s self, mut schema: &'s Value) -> &'s Value {
        while let Some(target) = schema.get("$ref").and_then(Value::as_str) {
            match target
                .strip_prefix('#')
                .and_then(|pointer| self.schema.pointer(pointer))
            {
                Some(next) => schema = next,
                None => break,
            }
        }
        schema
    }

    /// Copies `value` with the message fields that `schema` declares spelled
    /// in camelCase and `null` fields dropped, as a ProtoJSON parser reads
    /// them. A field given in both spellings is a violation at `pointer`.
    fn normalise(
        &self,
        schema: &Value,
        value: &Value,
        pointer: &str,
        violations: &mut Vec<FieldViolation>,
    ) -> Value {
        let schema = self.resolve(schema);
        match value {
            Value::Object(object) => {
                if let Some(fields) = schema.get("properties").and_then(Value::as_object) {
                    let mut out = Map::new();
                    for (key, field) in object {
                        if field.is_null() {
                            continue;
                        }
                        let name = if fields.contains_key(key) {
                            key.clone()
                        } else {
                            let camel = crate::protocol::wire::to_camel_case(key);
                            if fields.contains_key(&camel) {
                                camel
                            } else {
                                key.clone()
                            }
                        };
                        let here = format!("{pointer}/{}", escape(key));
                        if name != *key && object.get(&name).is_some_and(|v| !v.is_null()) {
                            violations.push(FieldViolation::new(
                                here,
                                format!("duplicates {name}; give the field once"),
                            ));
                            continue;
                        }
                        let normalised = match fields.get(&name) {
                            Some(field_schema) => {
                                self.normalise(field_schema, field, &here, violations)
                            }
                            None => field.clone(),
                        };
                        out.insert(name, normalised);
                    }
                    Value::Object(out)
                } else if let Some(values) = schema.get("additionalProperties") {
                    // A proto map: the keys are names chosen by the card's author.
                    let out = object
                        .iter()
                        .map(|(key, entry)| {
                            let here = format!("{pointer}/{}", escape(key));
                            (
                                key.clone(),
                                self.normalise(values, entry, &here, violations),
                            )
                        })
                        .collect();
                    Value::Object(out)
                } else {
                    value.clone()
                }
            }
            Value::Array(items) => match schema.get("items") {
                Some(item_schema) => Value::Array(
                    items
                        .iter()
                        .enumerate()
                        .map(|(i, item)| {
                            self.normalise(item_schema, item, &format!("{pointer}/{i}"), violations)
                        })
                        .collect(),
                ),
                None => value.clone(),
            },
            _ => value.clone(),
        }
    }
}

/// Maps a pointer into the normalised card back onto the card as given:
/// where the caller wrote a snake_case key, the pointer names that key.
fn original_pointer(card: &Value, pointer: &str) -> String {
    let mut out = String::new();
    let mut current = Some(card);
    for segment in pointer.split('/').skip(1) {
        let segment = unescape(segment);
        let mut written = segment.clone();
        current = match current {
            Some(Value::Object(object)) => match object.get(&segment) {
                Some(next) => Some(next),
                None => object
                    .iter()
                    .find(|(key, _)| crate::protocol::wire::to_camel_case(key) == segment)
                    .map(|(key, next)| {
                        written = key.clone();
                        next
                    }),
            },
            Some(Value::Array(items)) => segment.parse::<usize>().ok().and_then(|i| items.get(i)),
            _ => None,
        };
        out.push('/');
        out.push_str(&escape(&written));
    }
    out
}

/// Undoes `escape`.
fn unescape(token: &str) -> String {
    token.replace("~1", "/").replace("~0", "~")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn valid_card() -> Value {
        json!({
            "name": "Test",
            "description": "A test agent.",
            "supportedInterfaces": [
                {"url": "https://agent.example.com/a2a", "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}
            ],
            "version": "1.0.0",
            "capabilities": {},
            "defaultInputModes": ["text/plain"],
            "defaultOutputModes": ["text/plain"],
            "skills": [
                {"id": "s", "name": "S", "description": "Does s.", "tags": ["t"]}
            ]
        })
    }

    /// `valid_card()` with `edit` applied.
    fn card_with(edit: impl FnOnce(&mut Value)) -> Value {
        let mut card = valid_card();
        edit(&mut card);
        card
    }

    fn remove(card: &mut Value, pointer: &str) {
        let (parent, key) = pointer.rsplit_once('/').unwrap();
        card.pointer_mut(parent)
            .unwrap()
            .as_object_mut()
            .unwrap()
            .remove(key)
            .unwrap();
    }

    fn set(card: &mut Value, pointer: &str, value: Value) {
        match card.pointer_mut(pointer) {
            Some(slot) => *slot = value,
            None => {
                let (parent, key) = pointer.rsplit_once('/').unwrap();
                card.pointer_mut(parent).unwrap()[key] = value;
            }
        }
    }

    fn pointers(card: &Value) -> Vec<String> {
        match CardValidator::shared().validate(card) {
            Ok(_) => Vec::new(),
            Err(violations) => violations.into_iter().map(|v| v.field).collect(),
        }
    }

    fn scheme(kinds: Value) -> impl FnOnce(&mut Value) {
        move |card| card["securitySchemes"] = json!({ "main": kinds })
    }

    #[test]
    fn the_embedded_schema_compiles() {
        let schema: Value = serde_json::from_str(SCHEMA).unwrap();
        jsonschema::meta::validate(&schema).unwrap();
        CardValidator::new();
    }

    #[test]
    fn built_in_cards_pass() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/agent-cards");
        let mut seen = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|ext| ext == "json") {
                let text = std::fs::read_to_string(&path).unwrap();
                let card: Value = serde_json::from_str(&text).unwrap();
                let parsed = CardValidator::shared()
                    .validate(&card)
                    .unwrap_or_else(|v| panic!("{}: {v:?}", path.display()));
                assert!(!parsed.name.is_empty());
                seen += 1;
            }
        }
        assert!(seen >= 2, "expected the built-in cards in {dir}");
    }

    #[test]
    fn a_full_card_passes_and_parses() {
        let card = card_with(|card| {
            card["provider"] = json!({"url": "https://example.com", "organization": "Example"});
            card["documentationUrl"] = json!("https://example.com/docs");
            card["iconUrl"] = json!("https://example.com/icon.png");
            card["capabilities"] = json!({
                "streaming": true, "pushNotifications": false, "extendedAgentCard": true,
                "extensions": [{"uri": "urn:x", "required": true, "params": {"any": null}}]
            });
            card["securitySchemes"] = json!({
                "key": {"apiKeySecurityScheme": {"location": "header", "name": "X-Key"}},
                "bearer": {"httpAuthSecurityScheme": {"scheme": "Bearer", "bearerFormat": "JWT"}},
                "oauth": {"oauth2SecurityScheme": {"flows": {"clientCredentials": {
                    "tokenUrl": "https://example.com/token", "scopes": {}
                }}}},
                "oidc": {"openIdConnectSecurityScheme": {
                    "openIdConnectUrl": "https://example.com/.well-known/openid-configuration"
                }},
                "mtls": {"mtlsSecurityScheme": {}}
            });
            card["securityRequirements"] = json!([{"schemes": {"oauth": {"list": ["read"]}}}]);
            card["signatures"] =
                json!([{"protected": "eyJ9", "signature": "c2ln", "header": {"kid": "1"}}]);
        });
        let parsed = CardValidator::shared().validate(&card).unwrap();
        assert_eq!(parsed.security_schemes.len(), 5);
        assert_eq!(parsed.signatures.len(), 1);
    }

    #[test]
    fn invalid_cards_report_exactly_the_failing_fields() {
        type Edit = Box<dyn FnOnce(&mut Value)>;
        let cases: Vec<(&str, Edit, Vec<&str>)> = vec![
            (
                "missing name",
                Box::new(|c| remove(c, "/name")),
                vec!["/name"],
            ),
            (
                "empty name",
                Box::new(|c| set(c, "/name", json!(""))),
                vec!["/name"],
            ),
            (
                "empty supportedInterfaces",
                Box::new(|c| set(c, "/supportedInterfaces", json!([]))),
                vec!["/supportedInterfaces"],
            ),
            (
                "interface without url, binding and version",
                Box::new(|c| set(c, "/supportedInterfaces/0", json!({"tenant": "t"}))),
                vec![
                    "/supportedInterfaces/0/protocolBinding",
                    "/supportedInterfaces/0/protocolVersion",
                    "/supportedInterfaces/0/url",
                ],
            ),
            (
                "empty protocolBinding",
                Box::new(|c| set(c, "/supportedInterfaces/0/protocolBinding", json!(""))),
                vec!["/supportedInterfaces/0/protocolBinding"],
            ),
            (
                "skill without tags",
                Box::new(|c| remove(c, "/skills/0/tags")),
                vec!["/skills/0/tags"],
            ),
            (
                "skill with empty tags",
                Box::new(|c| set(c, "/skills/0/tags", json!([]))),
                vec!["/skills/0/tags"],
            ),
            (
                "no skills",
                Box::new(|c| set(c, "/skills", json!([]))),
                vec!["/skills"],
            ),
            (
                "empty defaultOutputModes",
                Box::new(|c| set(c, "/defaultOutputModes", json!([]))),
                vec!["/defaultOutputModes"],
            ),
            (
                "version as number",
                Box::new(|c| set(c, "/version", json!(1))),
                vec!["/version"],
            ),
            (
                "input mode not a string",
                Box::new(|c| set(c, "/defaultInputModes", json!(["text/plain", 7]))),
                vec!["/defaultInputModes/1"],
            ),
            (
                "streaming as string",
                Box::new(|c| set(c, "/capabilities", json!({"streaming": "yes"}))),
                vec!["/capabilities/streaming"],
            ),
            (
                "capabilities null counts as missing",
                Box::new(|c| set(c, "/capabilities", Value::Null)),
                vec!["/capabilities"],
            ),
            (
                "provider without organization",
                Box::new(|c| c["provider"] = json!({"url": "https://example.com"})),
                vec!["/provider/organization"],
            ),
            (
                "scheme with two kinds",
                Box::new(scheme(json!({
                    "apiKeySecurityScheme": {"location": "header", "name": "X-Key"},
                    "mtlsSecurityScheme": {}
                }))),
                vec!["/securitySchemes/main"],
            ),
            (
                "scheme with no kind",
                Box::new(scheme(json!({"apiKey": {}}))),
                vec!["/securitySchemes/main"],
            ),
            (
                "api key in the wrong place",
                Box::new(scheme(
                    json!({"apiKeySecurityScheme": {"location": "body", "name": "k"}}),
                )),
                vec!["/securitySchemes/main/apiKeySecurityScheme/location"],
            ),
            (
                "oauth2 without flows",
                Box::new(scheme(
                    json!({"oauth2SecurityScheme": {"description": "d"}}),
                )),
                vec!["/securitySchemes/main/oauth2SecurityScheme/flows"],
            ),
            (
                "oauth2 with two flows, one incomplete",
                Box::new(scheme(json!({"oauth2SecurityScheme": {"flows": {
                    "clientCredentials": {"tokenUrl": "https://e.com/t", "scopes": {}},
                    "deviceCode": {"tokenUrl": "https://e.com/t", "scopes": {}}
                }}}))),
                vec![
                    "/securitySchemes/main/oauth2SecurityScheme/flows",
                    "/securitySchemes/main/oauth2SecurityScheme/flows/deviceCode/deviceAuthorizationUrl",
                ],
            ),
            (
                "scheme not an object",
                Box::new(scheme(json!("bearer"))),
                vec!["/securitySchemes/main"],
            ),
            (
                "signature without signature",
                Box::new(|c| c["signatures"] = json!([{"protected": "eyJ9"}])),
                vec!["/signatures/0/signature"],
            ),
            (
                "several errors at once",
                Box::new(|c| {
                    remove(c, "/name");
                    set(c, "/supportedInterfaces/0/url", json!(""));
                    set(c, "/skills/0/tags", json!("t"));
                    set(c, "/capabilities/pushNotifications", json!(1));
                    c["provider"] = json!({});
                }),
                vec![
                    "/capabilities/pushNotifications",
                    "/name",
                    "/provider/organization",
                    "/provider/url",
                    "/skills/0/tags",
                    "/supportedInterfaces/0/url",
                ],
            ),
            (
                "everything missing",
                Box::new(|c| *c = json!({})),
                vec![
                    "/capabilities",
                    "/defaultInputModes",
                    "/defaultOutputModes",
                    "/description",
                    "/name",
                    "/skills",
                    "/supportedInterfaces",
                    "/version",
                ],
            ),
            ("not an object", Box::new(|c| *c = json!([1, 2])), vec![""]),
            ("null", Box::new(|c| *c = Value::Null), vec![""]),
        ];
        assert!(cases.len() >= 15);
        for (name, edit, expected) in cases {
            let card = card_with(edit);
            assert_eq!(pointers(&card), expected, "{name}");
        }
    }

    #[test]
    fn descriptions_are_readable() {
        let card = card_with(|c| {
            remove(c, "/name");
            set(c, "/skills", json!([]));
            set(c, "/capabilities/streaming", json!("yes"));
            set(c, "/version", json!(""));
            c["securitySchemes"] = json!({
                "two": {"apiKeySecurityScheme": {"location": "header", "name": "k"},
                        "mtlsSecurityScheme": {}},
                "none": {},
                "where": {"apiKeySecurityScheme": {"location": "body", "name": "k"}}
            });
        });
        let violations = CardValidator::new().validate(&card).unwrap_err();
        let described: Vec<(&str, &str)> = violations
            .iter()
            .map(|v| (v.field.as_str(), v.description.as_str()))
            .collect();
        let kinds = "apiKeySecurityScheme, httpAuthSecurityScheme, oauth2SecurityScheme, \
                     openIdConnectSecurityScheme, mtlsSecurityScheme";
        let two = format!(
            "sets apiKeySecurityScheme and mtlsSecurityScheme; exactly one of {kinds} may be set"
        );
        let none = format!("must set exactly one of {kinds}");
        assert_eq!(
            described,
            vec![
                ("/capabilities/streaming", "must be a boolean, not a string"),
                ("/name", "is required"),
                ("/securitySchemes/none", none.as_str()),
                ("/securitySchemes/two", two.as_str()),
                (
                    "/securitySchemes/where/apiKeySecurityScheme/location",
                    "must be one of \"query\", \"header\", \"cookie\""
                ),
                ("/skills", "must contain at least one element"),
                ("/version", "must not be empty"),
            ]
        );
        let root = CardValidator::new().validate(&json!("card")).unwrap_err();
        assert_eq!(
            root,
            vec![FieldViolation::new("", "must be an object, not a string")]
        );
    }

    #[test]
    fn snake_case_input_is_accepted() {
        let card = json!({
            "name": "Snake",
            "description": "Written with proto field names.",
            "supported_interfaces": [
                {"url": "grpc.example.com:443", "protocol_binding": "GRPC", "protocol_version": "1.0"}
            ],
            "version": "1",
            "documentation_url": "https://example.com/docs",
            "capabilities": {"push_notifications": true, "extended_agent_card": false},
            "security_schemes": {
                "my_key": {"api_key_security_scheme": {"location": "query", "name": "api_key"}},
                "oauth": {"oauth2_security_scheme": {"flows": {"authorization_code": {
                    "authorization_url": "https://e.com/a", "token_url": "https://e.com/t",
                    "scopes": {"read_all": "Read everything"}, "pkce_required": true
                }}}}
            },
            "security_requirements": [{"schemes": {"my_key": {"list": []}}}],
            "default_input_modes": ["text/plain"],
            "default_output_modes": ["text/plain"],
            "skills": [{
                "id": "s", "name": "S", "description": "d", "tags": ["t"],
                "input_modes": ["application/json"]
            }],
            "icon_url": null
        });
        let parsed = CardValidator::shared().validate(&card).unwrap();
        assert_eq!(parsed.supported_interfaces[0].protocol_binding, "GRPC");
        assert_eq!(parsed.capabilities.push_notifications, Some(true));
        assert_eq!(parsed.skills[0].input_modes, ["application/json"]);
        assert!(parsed.security_schemes.contains_key("my_key"));
        assert_eq!(parsed.icon_url, None);
        // Map keys are the author's names, not fields: left as written.
        let oauth = &parsed.security_schemes["oauth"].oauth2_security_scheme;
        let flows = &oauth.as_ref().unwrap().flows;
        assert!(
            flows["authorizationCode"]["scopes"]
                .get("read_all")
                .is_some()
        );
    }

    #[test]
    fn snake_case_violations_point_at_the_key_as_written() {
        let card = card_with(|c| {
            let interfaces = c["supportedInterfaces"].take();
            remove(c, "/supportedInterfaces");
            c["supported_interfaces"] = interfaces;
            set(c, "/supported_interfaces/0/protocolBinding", Value::Null);
            c["supported_interfaces"][0]["protocol_version"] = json!(1);
            remove(c, "/supported_interfaces/0/protocolVersion");
            c["default_input_modes"] = json!(["text/plain"]);
        });
        assert_eq!(
            pointers(&card),
            [
                "/default_input_modes",
                "/supported_interfaces/0/protocolBinding",
                "/supported_interfaces/0/protocol_version",
            ]
        );
    }

    #[test]
    fn unknown_and_v03_fields_are_ignored() {
        let card = card_with(|c| {
            c["url"] = json!("https://old.example.com");
            c["preferredTransport"] = json!("JSONRPC");
            c["protocolVersion"] = json!("0.3.0");
            c["additionalInterfaces"] = json!([]);
            c["skills"][0]["futureField"] = json!({"x": 1});
        });
        assert_eq!(pointers(&card), Vec::<String>::new());
    }
}
