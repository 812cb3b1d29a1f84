//! Log frames of a large record's writes that carry what the write added,
//! not the whole record.
//!
//! An agent streaming its answer in chunks makes one write per chunk, and
//! each write used to log the task's whole record: a 2 MB answer streamed in
//! 2 000 chunks put 4.3 GB on the disk and cost Baton 5–7 s of CPU.
//! When a record is large ([`APPEND_FROM`]) and a write left its history and
//! artifacts as they were but for messages, artifacts and parts added at
//! their ends, the frame holds the record's other fields (its head) and
//! those additions. Start-up rebuilds the record from the one before it
//! ([`apply`]), which the log or sled holds: a segment is deleted only once
//! sled holds every write in it, so the write before a logged one is
//! always in one of them. sled still stores whole records, which the
//! applier encodes once per application, however many writes it coalesced.

use super::TaskRecord;
use crate::protocol::{Artifact, Message, Part, Task};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

/// The length of a record's JSON from which its writes may log only what
/// they add: below it a whole record costs about what comparing it does.
pub const APPEND_FROM: usize = 16 * 1024;

/// The length of a record's JSON when it was last logged or read from
/// sled (0 for a record replayed from the log), and of its history and
/// artifacts once a write logged as what it added counted them. A hint for
/// the next write, not part of the record: records equal whatever their
/// hints.
#[derive(Clone, Copy, Debug, Default)]
pub struct LoggedLen {
    /// The whole record's JSON, as encoded or as stored.
    pub total: usize,
    /// The part of `total` that its history and artifacts take, as encoded
    /// now. Counted at the first write logged as what it added, then carried
    /// from write to write; not taken from a stored length, as an older
    /// build may have stored the record otherwise (such as timestamps to the
    /// nanosecond).
    pub body: Option<usize>,
}

impl PartialEq for LoggedLen {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// A change to one artifact, by its position in the task's artifacts.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ArtifactChange {
    /// The artifact's position.
    pub index: usize,
    /// Set when the artifact kept its other fields and `artifact.parts`
    /// were added after its first `parts_from` parts; else `artifact` is
    /// the artifact at `index`, replaced or added.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parts_from: Option<usize>,
    /// The artifact, or its added parts with its other fields.
    pub artifact: Artifact,
}

/// What a write added to a task's history and artifacts, when that is all
/// it changed of them.
#[derive(Debug)]
pub struct Additions {
    /// The length of the history before the write; the messages after it
    /// are the write's.
    pub history_from: usize,
    /// The artifacts the write changed or added.
    pub artifacts: Vec<ArtifactChange>,
}

/// What `after` added to `before`'s history and artifacts, or None if it
/// changed or removed anything there. Compared as values: a number turned
/// from 0.0 to -0.0 in place reads as unchanged, and start-up would
/// rebuild it as 0.0.
pub fn additions(before: &Task, after: &Task) -> Option<Additions> {
    let history_from = before.history.len();
    if after.history.get(..history_from)? != before.history.as_slice() {
        return None;
    }
    if after.artifacts.len() < before.artifacts.len() {
        return None;
    }
    let mut artifacts = Vec::new();
    for (index, now) in after.artifacts.iter().enumerate() {
        let Some(was) = before.artifacts.get(index) else {
            artifacts.push(ArtifactChange {
                index,
                parts_from: None,
                artifact: now.clone(),
            });
            continue;
        };
        if now == was {
            continue;
        }
        // Parts added to none make a field appear, which is counted whole.
        let parts_from = was.parts.len();
        let parts_added =
            parts_from > 0 && now.parts.get(..parts_from) == Some(was.parts.as_slice());
        artifacts.push(if parts_added && same_but_parts(now, was) {
            ArtifactChange {
                index,
                parts_from: Some(parts_from),
                artifact: with_parts(now, now.parts[parts_from..].to_vec()),
            }
        } else {
            ArtifactChange {
                index,
                parts_from: None,
                artifact: now.clone(),
            }
        });
    }
    Some(Additions {
        history_from,
        artifacts,
    })
}

/// Whether two artifacts are alike but for their parts.
fn same_but_parts(one: &Artifact, other: &Artifact) -> bool {
    // Taken apart whole, so a field added to artifacts must be added here.
    let Artifact {
        artifact_id,
        name,
        description,
        parts: _,
        metadata,
        extensions,
    } = one;
    *artifact_id == other.artifact_id
        && *name == other.name
        && *description == other.description
        && *metadata == other.metadata
        && *extensions == other.extensions
}

/// `artifact` with `parts` instead of its own.
fn with_parts(artifact: &Artifact, parts: Vec<Part>) -> Artifact {
    Artifact {
        artifact_id: artifact.artifact_id.clone(),
        name: artifact.name.clone(),
        description: artifact.description.clone(),
        parts,
        metadata: artifact.metadata.clone(),
        extensions: artifact.extensions.clone(),
    }
}

/// Makes `record` the record a logged addition made of it: `head` with
/// `record`'s history and artifacts and the additions, moved, not copied.
/// Err says why they do not fit `record`, which is then left as it was.
pub fn apply(
    record: &mut TaskRecord,
    mut head: TaskRecord,
    history_from: usize,
    history: Vec<Message>,
    artifacts: Vec<ArtifactChange>,
) -> Result<(), String> {
    if head.version != record.version + 1 {
        return Err(format!(
            "version {} follows version {}",
            head.version, record.version
        ));
    }
    if history_from != record.task.history.len() {
        return Err(format!(
            "it adds to a history of {history_from} messages, not {}",
            record.task.history.len()
        ));
    }
    // Every change checked before any is made; each index once, in order,
    // as the writer lists them.
    let mut count = record.task.artifacts.len();
    let mut after = None;
    for change in &artifacts {
        if after.is_some_and(|index| change.index <= index) {
            return Err(format!("artifact {} changed out of order", change.index));
        }
        after = Some(change.index);
        let fits = match (change.parts_from, record.task.artifacts.get(change.index)) {
            (Some(parts_from), Some(artifact)) => artifact.parts.len() == parts_from,
            (None, Some(_)) => true,
            (None, None) => change.index == count,
            (Some(_), None) => false,
        };
        if !fits {
            return Err(format!(
                "artifact {} does not take its change",
                change.index
            ));
        }
        count = count.max(change.index + 1);
    }
    head.task.history = std::mem::take(&mut record.task.history);
    head.task.history.extend(history);
    head.task.artifacts = std::mem::take(&mut record.task.artifacts);
    for change in artifacts {
        match change.parts_from {
            Some(_) => head.task.artifacts[change.index]
                .parts
                .extend(change.artifact.parts),
            None if change.index < head.task.artifacts.len() => {
                head.task.artifacts[change.index] = change.artifact;
            }
            None => head.task.artifacts.push(change.artifact),
        }
    }
    *record = head;
    Ok(())
}

/// How much longer `after`'s history and artifacts are in JSON than
/// `before`'s, given what it added: counted from the additions alone, so
/// a write costs what it adds, not what the record holds.
pub fn growth(before: &Task, after: &Task, additions: &Additions) -> serde_json::Result<i64> {
    let added_messages = &after.history[additions.history_from..];
    let mut growth = appended_growth(
        "history",
        before.history.len(),
        items_len(added_messages)?,
        added_messages.len(),
    );
    let mut new_artifacts = (0, 0);
    for change in &additions.artifacts {
        let now = &after.artifacts[change.index];
        match (change.parts_from, before.artifacts.get(change.index)) {
            // Within `"parts":[…]`, which had parts: each added one after a comma.
            (Some(parts_from), _) => {
                let added = &now.parts[parts_from..];
                growth += (items_len(added)? + added.len()) as i64;
            }
            (None, Some(was)) => {
                growth += encoded_len(now)? as i64 - encoded_len(was)? as i64;
            }
            (None, None) => {
                new_artifacts.0 += encoded_len(now)?;
                new_artifacts.1 += 1;
            }
        }
    }
    let (bytes, count) = new_artifacts;
    Ok(growth + appended_growth("artifacts", before.artifacts.len(), bytes, count))
}

/// How long `task`'s history and artifacts are in its JSON, counted.
pub fn body_len(task: &Task) -> serde_json::Result<usize> {
    let (history, artifacts) = (&task.history, &task.artifacts);
    let history = appended_growth("history", 0, items_len(history)?, history.len());
    let artifacts = appended_growth("artifacts", 0, items_len(artifacts)?, artifacts.len());
    Ok((history + artifacts) as usize)
}

/// The growth of the JSON of a task's array field `name` (`,"name":[…]`,
/// omitted while empty, always after the task's status) that had `had`
/// items, by `added` items `bytes` long in all.
fn appended_growth(name: &str, had: usize, bytes: usize, added: usize) -> i64 {
    let growth = match (had, added) {
        (_, 0) => 0,
        // `,"name":[` and `]` appear, with commas between the items.
        (0, _) => name.len() + 6 + bytes + added - 1,
        _ => bytes + added,
    };
    growth as i64
}

/// The JSON length of `items`, each counted alone.
fn items_len<T: Serialize>(items: &[T]) -> serde_json::Result<usize> {
    items.iter().map(encoded_len).sum()
}

/// The head of `record` as JSON: the record with no history or artifacts.
pub fn head_json(record: &mut TaskRecord) -> serde_json::Result<Box<RawValue>> {
    let history = std::mem::take(&mut record.task.history);
    let artifacts = std::mem::take(&mut record.task.artifacts);
    let head = serde_json::value::to_raw_value(&*record);
    record.task.history = history;
    record.task.artifacts = artifacts;
    head
}

/// The length of `value`'s JSON, counted without keeping it.
pub fn encoded_len<T: Serialize + ?Sized>(value: &T) -> serde_json::Result<usize> {
    let mut counter = ByteCount(0);
    serde_json::to_writer(&mut counter, value)?;
    Ok(counter.0)
}

/// A writer that keeps only how many bytes it was given.
struct ByteCount(usize);

impl std::io::Write for ByteCount {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn artifact(id: &str, name: &str, texts: &[&str]) -> Artifact {
        Artifact {
            artifact_id: id.into(),
            name: name.into(),
            parts: texts.iter().map(|text| Part::text(*text)).collect(),
            ..Artifact::default()
        }
    }

    fn message(id: &str) -> Message {
        Message {
            message_id: id.into(),
            parts: vec![Part::text(id)],
            ..Message::default()
        }
    }

    fn record(version: u64, history: &[&str], artifacts: Vec<Artifact>) -> TaskRecord {
        TaskRecord {
            task: Task {
                id: "t1".into(),
                history: history.iter().map(|id| message(id)).collect(),
                artifacts,
                ..Task::default()
            },
            version,
            ..TaskRecord::default()
        }
    }

    /// `after` rebuilt from `before` and what it added, through its JSON.
    fn rebuilt(before: &TaskRecord, after: &TaskRecord) -> Result<TaskRecord, String> {
        rebuilt_on(before, before, after)
    }

    /// What `after` added to `before`, through its JSON, applied to `base`.
    fn rebuilt_on(
        base: &TaskRecord,
        before: &TaskRecord,
        after: &TaskRecord,
    ) -> Result<TaskRecord, String> {
        let additions = additions(&before.task, &after.task).expect("additions");
        let head_len = |record: &TaskRecord| head_json(&mut record.clone()).unwrap().get().len();
        let body = |record| encoded_len(record).unwrap() - head_len(record);
        let growth = growth(&before.task, &after.task, &additions).unwrap();
        assert_eq!(
            body(before) as i64 + growth,
            body(after) as i64,
            "{after:?}"
        );
        let mut head = after.clone();
        let head = serde_json::from_str(head_json(&mut head).unwrap().get()).unwrap();
        let history = after.task.history[additions.history_from..].to_vec();
        let changes = serde_json::to_string(&additions.artifacts).unwrap();
        let changes = serde_json::from_str(&changes).unwrap();
        let mut rebuilt = base.clone();
        let applied = apply(&mut rebuilt, head, additions.history_from, history, changes);
        match applied {
            Ok(()) => Ok(rebuilt),
            Err(why) => {
                assert_eq!(&rebuilt, base, "left as it was");
                Err(why)
            }
        }
    }

    #[test]
    fn messages_artifacts_and_parts_added_at_the_end_are_additions() {
        let before = record(4, &["m1"], vec![artifact("a1", "out", &["p1"])]);
        let after = record(
            5,
            &["m1", "m2"],
            vec![
                artifact("a1", "out", &["p1", "p2", "p3"]),
                artifact("a2", "", &["q1"]),
            ],
        );
        let found = additions(&before.task, &after.task).unwrap();
        assert_eq!(found.history_from, 1);
        let shapes: Vec<_> = found
            .artifacts
            .iter()
            .map(|c| (c.index, c.parts_from, c.artifact.parts.len()))
            .collect();
        assert_eq!(shapes, [(0, Some(1), 2), (1, None, 1)]);
        assert_eq!(rebuilt(&before, &after).unwrap(), after);
        // Added to none: the arrays' fields appear.
        let empty = record(4, &[], Vec::new());
        assert_eq!(rebuilt(&empty, &after).unwrap(), after);
        // A write of the head alone adds nothing.
        let head_only = record(5, &["m1"], before.task.artifacts.clone());
        let found = additions(&before.task, &head_only.task).unwrap();
        assert!(found.artifacts.is_empty());
        assert_eq!(rebuilt(&before, &head_only).unwrap(), head_only);
    }

    #[test]
    fn an_artifact_changed_otherwise_is_logged_whole() {
        let before = record(1, &[], vec![artifact("a1", "out", &["p1"])]);
        for now in [
            artifact("a1", "renamed", &["p1", "p2"]),
            artifact("a1", "out", &["other"]),
            artifact("a1", "out", &[]),
        ] {
            let after = record(2, &[], vec![now]);
            let found = additions(&before.task, &after.task).unwrap();
            assert_eq!(found.artifacts[0].parts_from, None);
            assert_eq!(rebuilt(&before, &after).unwrap(), after);
        }
    }

    #[test]
    fn parts_added_to_an_artifact_without_any_change_it_whole() {
        let before = record(1, &["m1"], vec![artifact("", "", &[])]);
        let after = record(2, &["m1"], vec![artifact("", "", &["p1", "p2"])]);
        let found = additions(&before.task, &after.task).unwrap();
        assert_eq!(found.artifacts[0].parts_from, None);
        assert_eq!(rebuilt(&before, &after).unwrap(), after);
    }

    #[test]
    fn a_write_that_changed_or_removed_content_is_no_addition() {
        let before = record(1, &["m1", "m2"], vec![artifact("a1", "", &["p"])]);
        let changed = record(2, &["m1", "other"], before.task.artifacts.clone());
        assert!(additions(&before.task, &changed.task).is_none());
        let shorter = record(2, &["m1"], before.task.artifacts.clone());
        assert!(additions(&before.task, &shorter.task).is_none());
        let no_artifacts = record(2, &["m1", "m2"], Vec::new());
        assert!(additions(&before.task, &no_artifacts.task).is_none());
    }

    #[test]
    fn additions_fit_only_the_record_they_were_made_on() {
        let before = record(4, &["m1"], vec![artifact("a1", "", &["p1"])]);
        let after = record(5, &["m1", "m2"], vec![artifact("a1", "", &["p1", "p2"])]);
        let older = record(3, &["m1"], before.task.artifacts.clone());
        let refusal = |base| rebuilt_on(base, &before, &after).unwrap_err();
        assert!(refusal(&older).contains("version 5"), "{}", refusal(&older));
        let shorter = record(4, &[], before.task.artifacts.clone());
        assert!(
            refusal(&shorter).contains("history"),
            "{}",
            refusal(&shorter)
        );
        let fewer_parts = record(4, &["m1"], vec![artifact("a1", "", &[])]);
        let why = refusal(&fewer_parts);
        assert!(why.contains("artifact 0"), "{why}");
        assert_eq!(rebuilt_on(&before, &before, &after).unwrap(), after);
    }

    #[test]
    fn changes_to_one_artifact_twice_or_out_of_order_fit_nothing() {
        let before = record(
            4,
            &[],
            vec![artifact("a1", "", &["p1"]), artifact("a2", "", &["q1"])],
        );
        let change = |index: usize| ArtifactChange {
            index,
            parts_from: Some(1),
            artifact: artifact("", "", &["more"]),
        };
        for changes in [vec![change(0), change(0)], vec![change(1), change(0)]] {
            let mut rebuilt = before.clone();
            let why = apply(
                &mut rebuilt,
                record(5, &[], Vec::new()),
                0,
                Vec::new(),
                changes,
            );
            assert!(why.unwrap_err().contains("out of order"));
            assert_eq!(rebuilt, before, "left as it was");
        }
    }

    #[test]
    fn the_counted_length_is_the_encoded_one() {
        let after = record(5, &["m1", "m\"2"], vec![artifact("a1", "é", &["p1"])]);
        let encoded = serde_json::to_vec(&after).unwrap();
        assert_eq!(encoded_len(&after).unwrap(), encoded.len());
    }
}
