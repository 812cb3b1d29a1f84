//! Shared support for Baton's embedded JSON Schemas (agent cards, handoff
//! payloads): compiling them once, and saying what an error means in plain
//! words with JSON Pointers.

use jsonschema::error::{TypeKind, ValidationErrorKind};
use jsonschema::{ValidationError, Validator};
use serde_json::Value;

/// Parses and compiles a schema shipped in the binary (JSON Schema 2020-12).
///
/// # Panics
///
/// Only if the embedded text is not a valid schema, which unit tests rule out.
pub fn compile_embedded(text: &str, name: &str) -> (Value, Validator) {
    let schema: Value =
        serde_json::from_str(text).unwrap_or_else(|e| panic!("{name} schema is not JSON: {e}"));
    // 2020-12 makes `format` an annotation anyway; say so here so that a
    // change of the crate's default cannot start rejecting input.
    let validator = jsonschema::draft202012::options()
        .should_validate_formats(false)
        .build(&schema)
        .unwrap_or_else(|e| panic!("{name} schema does not compile: {e}"));
    (schema, validator)
}

/// The message of the errors every Baton schema words the same way: a wrong
/// type, an empty string, a value outside an enum.
pub fn describe_common(error: &ValidationError<'_>) -> Option<String> {
    let instance: &Value = error.instance();
    Some(match error.kind() {
        ValidationErrorKind::Type { kind } => {
            let expected: Vec<&str> = match kind {
                TypeKind::Single(one) => vec![one.as_str()],
                TypeKind::Multiple(set) => set.iter().map(|t| t.as_str()).collect(),
            };
            format!(
                "must be {}, not {}",
                with_article(&expected.join(" or ")),
                with_article(json_type(instance))
            )
        }
        ValidationErrorKind::MinLength { limit: 1 } => "must not be empty".to_owned(),
        ValidationErrorKind::Enum { options } => {
            let options: Vec<String> = options
                .as_array()
                .into_iter()
                .flatten()
                .map(Value::to_string)
                .collect();
            format!("must be one of {}", options.join(", "))
        }
        _ => return None,
    })
}

/// The member names of a `oneOf` whose branches are each
/// `{"required": [member]}` (how Baton's schemas write a proto `oneof`).
pub fn oneof_members<'s>(schema: &'s Value, schema_path: &str) -> Vec<&'s str> {
    schema
        .pointer(schema_path)
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|branch| branch.pointer("/required/0")?.as_str())
        .collect()
}

/// The JSON Pointer of a serde path.
pub fn serde_pointer(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut out = String::new();
    for segment in path.iter() {
        match segment {
            Segment::Seq { index } => out.push_str(&format!("/{index}")),
            Segment::Map { key } => out.push_str(&format!("/{}", escape(key))),
            Segment::Enum { variant } => out.push_str(&format!("/{}", escape(variant))),
            Segment::Unknown => {}
        }
    }
    out
}

/// Escapes one JSON Pointer reference token (RFC 6901).
pub fn escape(token: &str) -> String {
    token.replace('~', "~0").replace('/', "~1")
}

/// The JSON Schema type name of `value`.
pub fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// `"an object"`, `"a string"`: reads better in a sentence.
pub fn with_article(noun: &str) -> String {
    let article = if noun.starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    };
    format!("{article} {noun}")
}
