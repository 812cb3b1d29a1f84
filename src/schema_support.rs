//! Shared support for Baton's embedded JSON Schemas (agent cards, handoff
//! payloads): compiling them once, and saying what an error means in plain
//! words with JSON Pointers.

use jsonschema::error::{TypeKind, ValidationErrorKind};
use jsonschema::{ValidationError, Validator};
use serde_json::Value;
use std::collections::{HashMap, HashSet};

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

/// Most schema nodes a result schema (a `returnSchema`, a skill's output
/// schema) may stand for with each `$ref` expanded where it is used: a
/// validation may visit each, every branch of an `anyOf` included, so a
/// schema of a few kilobytes whose references double at each level would
/// take hours to check one result. Real schemas stand for hundreds.
pub const MAX_SCHEMA_EXPANSION: u64 = 50_000;

/// Compiles a result schema (JSON Schema 2020-12), and refuses one whose
/// validation could cost more than [`MAX_SCHEMA_EXPANSION`] nodes; the
/// reason, worded to follow the field's name.
pub fn check_result_schema(schema: &Value) -> Result<(), String> {
    if let Err(err) = jsonschema::draft202012::options().build(schema) {
        return Err(format!("is not a valid JSON Schema 2020-12: {err}"));
    }
    within_expansion(schema)
}

/// Refuses a schema past [`MAX_SCHEMA_EXPANSION`]; the reason, worded to
/// follow the schema's name.
pub fn within_expansion(schema: &Value) -> Result<(), String> {
    if expansion(schema) > MAX_SCHEMA_EXPANSION {
        return Err(format!(
            "stands for more than {MAX_SCHEMA_EXPANSION} schema nodes with its $refs \
             expanded (or uses a $ref other than a JSON Pointer or anchor in the schema): \
             checking a result against it would cost too much"
        ));
    }
    Ok(())
}

/// How many schema nodes `schema` stands for with each `$ref` (and
/// `$dynamicRef`) expanded where it is used, saturating. A reference back
/// into one being expanded (recursion, which the instance's depth bounds)
/// counts one; one this cannot follow counts as too many.
fn expansion(schema: &Value) -> u64 {
    let mut anchors = HashMap::new();
    collect_anchors(schema, &mut anchors);
    let mut walk = Expansion {
        root: schema,
        anchors,
        memo: HashMap::new(),
        open: HashSet::new(),
    };
    walk.of(schema)
}

fn collect_anchors<'s>(node: &'s Value, anchors: &mut HashMap<&'s str, &'s Value>) {
    match node {
        Value::Object(map) => {
            for key in ["$anchor", "$dynamicAnchor"] {
                if let Some(Value::String(name)) = map.get(key) {
                    anchors.insert(name, node);
                }
            }
            map.values()
                .for_each(|value| collect_anchors(value, anchors));
        }
        Value::Array(items) => items.iter().for_each(|item| collect_anchors(item, anchors)),
        _ => {}
    }
}

/// The walk of [`expansion`].
struct Expansion<'s> {
    root: &'s Value,
    anchors: HashMap<&'s str, &'s Value>,
    memo: HashMap<&'s str, u64>,
    open: HashSet<&'s str>,
}

impl<'s> Expansion<'s> {
    fn of(&mut self, node: &'s Value) -> u64 {
        match node {
            Value::Object(map) => map.iter().fold(1, |total: u64, (key, value)| {
                let cost = match (key.as_str(), value) {
                    ("$ref" | "$dynamicRef", Value::String(reference)) => {
                        self.referenced(reference)
                    }
                    // Values, not schemas.
                    ("const" | "enum" | "default" | "examples", _) => 1,
                    _ => self.of(value),
                };
                total.saturating_add(cost)
            }),
            Value::Array(items) => items
                .iter()
                .fold(1, |total: u64, item| total.saturating_add(self.of(item))),
            _ => 1,
        }
    }

    fn referenced(&mut self, reference: &'s str) -> u64 {
        if let Some(cost) = self.memo.get(reference) {
            return *cost;
        }
        if !self.open.insert(reference) {
            return 1;
        }
        let cost = match self.target(reference) {
            Some(target) => self.of(target),
            None => u64::MAX,
        };
        self.open.remove(reference);
        self.memo.insert(reference, cost);
        cost
    }

    /// What `reference` names in the schema: a JSON Pointer fragment
    /// (percent-decoded) or an anchor, after the root's own `$id` if given.
    fn target(&self, reference: &str) -> Option<&'s Value> {
        let root_id = self.root.get("$id").and_then(Value::as_str).unwrap_or("");
        let fragment = match reference.split_once('#') {
            Some(("", fragment)) => fragment,
            Some((base, fragment)) if !root_id.is_empty() && base == root_id => fragment,
            _ if !root_id.is_empty() && reference == root_id => "",
            _ => return None,
        };
        let fragment = percent_encoding::percent_decode_str(fragment)
            .decode_utf8()
            .ok()?;
        if fragment.is_empty() {
            Some(self.root)
        } else if fragment.starts_with('/') {
            self.root.pointer(&fragment)
        } else {
            self.anchors.get(fragment.as_ref()).copied()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `levels` definitions, each an `anyOf` of two references to the one
    /// before: a schema of a few kilobytes whose expansion doubles per level.
    fn doubling(levels: usize) -> Value {
        let mut defs = serde_json::Map::new();
        defs.insert("d0".into(), json!({"type": "integer"}));
        for level in 1..=levels {
            let before = format!("#/$defs/d{}", level - 1);
            defs.insert(
                format!("d{level}"),
                json!({"anyOf": [{"$ref": before}, {"$ref": before}]}),
            );
        }
        json!({"$defs": defs, "$ref": format!("#/$defs/d{levels}")})
    }

    #[test]
    fn a_schema_whose_references_double_at_each_level_is_refused() {
        assert!(check_result_schema(&doubling(8)).is_ok());
        let refused = check_result_schema(&doubling(40)).unwrap_err();
        assert!(refused.contains("schema nodes"), "{refused}");
        assert_eq!(expansion(&doubling(64)), u64::MAX, "saturates");
    }

    #[test]
    fn shared_definitions_recursion_anchors_and_escapes_are_followed() {
        let address = json!({"type": "object", "properties": {"street": {"type": "string"}}});
        let shared = json!({
            "$defs": {"address": address},
            "properties": {
                "billing": {"$ref": "#/$defs/address"},
                "shipping": {"$ref": "#/$defs/address"},
            },
        });
        let once = expansion(&json!({"$defs": {"address": address}}));
        assert!(expansion(&shared) > once, "each use expands");
        assert!(check_result_schema(&shared).is_ok());

        let tree = json!({
            "$defs": {"node": {"type": "object", "properties": {
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
            }}},
            "$ref": "#/$defs/node",
        });
        assert!(expansion(&tree) < 50, "recursion counts once");

        let anchored = json!({
            "$defs": {"a b": {"$anchor": "item", "type": "string"}},
            "properties": {"x": {"$ref": "#item"}, "y": {"$ref": "#/$defs/a%20b"}},
        });
        assert!(expansion(&anchored) < 50);
        assert!(check_result_schema(&anchored).is_ok());
    }

    #[test]
    fn a_reference_this_cannot_follow_counts_as_too_many() {
        let elsewhere = json!({"properties": {"x": {"$ref": "https://example.com/s.json"}}});
        assert_eq!(expansion(&elsewhere), u64::MAX);
        let own_id = json!({
            "$id": "https://example.com/s.json",
            "$defs": {"a": {"type": "string"}},
            "properties": {"x": {"$ref": "https://example.com/s.json#/$defs/a"}},
        });
        assert!(expansion(&own_id) < 50);
    }
}
