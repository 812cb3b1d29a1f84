//! Typed artifacts (DESIGN.md §3.4): when a handoff's target completes, the
//! data parts of its artifacts must satisfy the payload's `returnSchema`;
//! otherwise the task fails with `OUTPUT_SCHEMA_INVALID` and the violations.
//!
//! A target's artifacts are those made after it took the task over, and
//! any made before that it wrote into since (the same artifact id, which
//! the ledger merges in place): [`made_since`] tells them by the digests
//! noted at the handoff ([`digests`]).

use super::payload::Violation;
use crate::protocol::{Artifact, PartContent};
use serde_json::Value;
use sha2::{Digest as _, Sha256};

/// Each artifact's digest, noted at a handoff to tell later which of the
/// artifacts then present its target changed. 64 bits of SHA-256: no
/// target finds another artifact of the same digest.
pub fn digests(artifacts: &[Artifact]) -> Vec<u64> {
    artifacts.iter().map(digest).collect()
}

fn digest(artifact: &Artifact) -> u64 {
    let encoded = serde_json::to_vec(artifact).unwrap_or_default();
    let hash = Sha256::digest(encoded);
    u64::from_be_bytes(hash[..8].try_into().expect("8 bytes"))
}

/// The artifacts a holder made since a handoff that left `from` artifacts
/// with `noted` digests: those from `from` on, and earlier ones whose
/// digest changed. With no digests noted (a record older than them) only
/// those from `from` on. Each with its index in `artifacts`.
pub fn made_since<'a>(
    artifacts: &'a [Artifact],
    from: usize,
    noted: &[u64],
) -> Vec<(usize, &'a Artifact)> {
    artifacts
        .iter()
        .enumerate()
        .filter(|(i, artifact)| *i >= from || noted.get(*i).is_some_and(|d| *d != digest(artifact)))
        .collect()
}

/// Checks every data part of `artifacts` (each with its index in the task)
/// against `schema` (JSON Schema 2020-12). At least one data part must
/// exist: a typed result was asked for.
pub fn check_artifacts(
    schema: &Value,
    artifacts: &[(usize, &Artifact)],
) -> Result<(), Vec<Violation>> {
    // One kept from before schemas were bounded is checked here too: the
    // check runs under the ledger's write lock.
    if let Err(reason) = crate::schema_support::within_expansion(schema) {
        return Err(vec![Violation {
            pointer: String::new(),
            message: format!("the returnSchema {reason}"),
        }]);
    }
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
    for &(i, artifact) in artifacts {
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
        let valid = artifact(json!({"refundId": "r1", "amount": 12.5}));
        assert!(check_artifacts(&schema, &[(0, &valid)]).is_ok());
        let invalid = artifact(json!({"amount": "lots"}));
        let violations = check_artifacts(&schema, &[(3, &invalid)]).unwrap_err();
        let pointers: Vec<&str> = violations.iter().map(|v| v.pointer.as_str()).collect();
        assert!(
            pointers.contains(&"/artifacts/3/parts/0/data"),
            "the artifact's index in the task: {pointers:?}"
        );
        assert!(
            pointers.contains(&"/artifacts/3/parts/0/data/amount"),
            "{pointers:?}"
        );
        let text_only = Artifact {
            artifact_id: "t".into(),
            parts: vec![Part::text("done")],
            ..Artifact::default()
        };
        assert_eq!(
            check_artifacts(&schema, &[(0, &text_only)]).unwrap_err()[0].pointer,
            "/artifacts"
        );
        assert!(check_artifacts(&json!({"type": 12}), &[]).is_err());
    }

    #[test]
    fn a_holders_artifacts_are_the_later_ones_and_earlier_ones_it_changed() {
        let mut artifacts = vec![artifact(json!({"n": 0})), artifact(json!({"n": 1}))];
        artifacts[1].artifact_id = "b".into();
        let noted = digests(&artifacts);
        artifacts.push(artifact(json!({"n": 2})));
        let indices = |artifacts: &[Artifact], noted: &[u64]| {
            made_since(artifacts, 2, noted)
                .into_iter()
                .map(|(i, _)| i)
                .collect::<Vec<_>>()
        };
        assert_eq!(indices(&artifacts, &noted), [2]);
        artifacts[0].parts = vec![Part::data(json!({"n": "rewritten"}))];
        assert_eq!(indices(&artifacts, &noted), [0, 2]);
        assert_eq!(indices(&artifacts, &[]), [2], "no digests noted");
    }

    #[test]
    fn a_digest_holds_across_the_ledgers_encoding() {
        // As an agent may send it: spacing, key order, floats, escapes.
        let sent = r#"{"artifactId": "a", "name": "r\u00e9sum\u00e9",
            "parts": [{"data": {"z": 1.0, "a": [1e3, -0.5, "\n"]}, "mediaType": "application/json"}],
            "metadata": {"b": {"y": 2,  "x": null}, "a": true}}"#;
        let artifact: Artifact = serde_json::from_str(sent).unwrap();
        let stored = serde_json::to_vec(&artifact).unwrap();
        let read_back: Artifact = serde_json::from_slice(&stored).unwrap();
        assert_eq!(digests(&[artifact]), digests(&[read_back]));
    }
}
