//! Typed artifacts (DESIGN.md §3.4): when a handoff's target completes, the
//! data parts of its artifacts must satisfy the payload's `returnSchema`;
//! otherwise the task fails with `OUTPUT_SCHEMA_INVALID` and the violations.

use super::payload::Violation;
use crate::protocol::{Artifact, PartContent};
use serde_json::Value;

/// Checks every data part of `artifacts` against `schema` (JSON Schema
/// 2020-12). At least one data part must exist: a typed result was asked for.
pub fn check_artifacts(schema: &Value, artifacts: &[Artifact]) -> Result<(), Vec<Violation>> {
    let validator = match jsonschema::draft202012::options().build(schema) {
        Ok(validator) => validator,
        Err(err) => {
            return Err(vec![Violation {
                pointer: String::new(),
                message: format!("the returnSchema is not a valid JSON Schema: {err}"),
            }]);
        }
    };
    let mut violations = Vec::new();
    let mut checked = 0;
    for (i, artifact) in artifacts.iter().enumerate() {
        for (j, part) in artifact.parts.iter().enumerate() {
            if let PartContent::Data(data) = &part.content {
                checked += 1;
                violations.extend(validator.iter_errors(data).map(|error| Violation {
                    pointer: format!(
                        "/artifacts/{i}/parts/{j}/data{}",
                        error.instance_path().as_str()
                    ),
                    message: error.to_string(),
                }));
            }
        }
    }
    if checked == 0 {
        violations.push(Violation {
            pointer: "/artifacts".into(),
            message: "no data artifact to check against the returnSchema".into(),
        });
    }
    if violations.is_empty() {
        Ok(())
    } else {
        Err(violations)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Part;
    use serde_json::json;

    fn artifact(data: Value) -> Artifact {
        Artifact {
            artifact_id: "a".into(),
            parts: vec![Part::data(data)],
            ..Artifact::default()
        }
    }

    #[test]
    fn data_parts_are_checked_against_the_schema() {
        let schema = json!({"type": "object", "required": ["refundId"], "properties": {"amount": {"type": "number"}}});
        assert!(
            check_artifacts(
                &schema,
                &[artifact(json!({"refundId": "r1", "amount": 12.5}))]
            )
            .is_ok()
        );
        let violations =
            check_artifacts(&schema, &[artifact(json!({"amount": "lots"}))]).unwrap_err();
        let pointers: Vec<&str> = violations.iter().map(|v| v.pointer.as_str()).collect();
        assert!(
            pointers.contains(&"/artifacts/0/parts/0/data"),
            "{pointers:?}"
        );
        assert!(
            pointers.contains(&"/artifacts/0/parts/0/data/amount"),
            "{pointers:?}"
        );
        let text_only = Artifact {
            artifact_id: "t".into(),
            parts: vec![Part::text("done")],
            ..Artifact::default()
        };
        assert_eq!(
            check_artifacts(&schema, &[text_only]).unwrap_err()[0].pointer,
            "/artifacts"
        );
        assert!(check_artifacts(&json!({"type": 12}), &[]).is_err());
    }
}
