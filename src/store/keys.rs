//! Key layout of the ledger's single sled tree.
//!
//! One tree with prefixed keyspaces, so that one scan reads one index and
//! one flush makes everything durable:
//!
//! | prefix | key | value |
//! |---|---|---|
//! | `t` | task id | `TaskRecord` JSON |
//! | `r` | creation millisecond of a UUIDv7 task id (its first 13 characters), 0, the bucket's first task id | where a record bucket is in the record file (see `record_file::Pointer`), or in ledgers of format 2 and before the bucket itself: ids and `TaskRecord` JSON of tasks finished when first applied (see [`record_in_bucket`]), LZ4-compressed when that is shorter (see [`seal_record_bucket`]); a task's own `t` key supersedes it |
//! | `e` | task id, 0, first seq (u64 BE) | JSON array of consecutive `StreamResponse`s (one object in ledgers from before 0.1) |
//! | `is` | owner, 0, state, order | empty: tasks by state; merged over every state, all tasks |
//! | `is` | owner, 0, state, order time | a bucket of tasks by terminal state: the ids of the tasks whose status in that state has that millisecond (see [`bucket_ids`]) |
//! | `ic` | owner, 0, context id, 0, order | empty: tasks by context |
//! | `n` | owner, 0, counter name | u64 BE count (`all`, `s{state}`) |
//! | `p` | task id, 0, config id | `TaskPushNotificationConfig` JSON |
//! | `pd` | task id, 0, config id | how far the config's notifications were handled (see `PushMark`) |
//! | `k` | owner, 0, idempotency key | `IdempotencyRecord` JSON |
//! | `a` | task id | empty: tasks an agent is working on (SUBMITTED, WORKING) |
//! | `w` | task id | empty: tasks waiting for input (INPUT_REQUIRED, AUTH_REQUIRED) |
//! | `g` | agent id | `AgentRecord` JSON: registered agents |
//! | `ch` | parent task id, 0, child task id | empty: the handoff graph |
//! | `x` | | the tasks and index keys the chunk being applied adds; empty between applications (see `applier`) |
//! | `f` | | the ledger's format (u32 BE); absent in ledgers written before it |
//! | `s` | | the length (u64 BE) the record file was synced to at the last checkpoint |
//!
//! A task Baton starts in a context of its own has no `ic` entry: its context
//! id is minted from its task id (see [`minted_context`]), so a query by
//! context finds that first task from the id itself.
//!
//! `order` is the status time inverted (u64::MAX - millis, big-endian) followed
//! by the task id, so a forward scan yields the newest status first.
//!
//! A task in a terminal state stays there, so its by-state entry is never
//! removed again: the applier keeps those entries in buckets, one sled key
//! per owner, state and millisecond, which sorts just before the single
//! entries of its millisecond. One bucket write per set's millisecond
//! costs sled far less than one new key per task (its inserts clone and
//! split leaves per key). Single terminal entries of older ledgers are
//! still read.

use chrono::{DateTime, Utc};
use std::borrow::Cow;

const SEP: u8 = 0;

fn join(parts: &[&[u8]]) -> Vec<u8> {
    let mut key = Vec::with_capacity(parts.iter().map(|p| p.len() + 1).sum());
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            key.push(SEP);
        }
        key.extend_from_slice(part);
    }
    key
}

/// `t` key of a task.
pub fn task(task_id: &str) -> Vec<u8> {
    join(&[b"t", task_id.as_bytes()])
}

/// Prefix of the record buckets that may hold task `task_id`: its
/// creation millisecond, as the first 48 bits of a UUIDv7 id carry it.
/// `None` for an id that is no hyphenated UUIDv7 (those keep `t` keys).
pub fn record_bucket_prefix(task_id: &str) -> Option<Vec<u8>> {
    let bytes = task_id.as_bytes();
    let hyphenated_v7 = bytes.len() == uuid::fmt::Hyphenated::LENGTH
        && uuid::Uuid::try_parse(task_id).is_ok_and(|uuid| uuid.get_version_num() == 7);
    if !hyphenated_v7 {
        return None;
    }
    let mut key = Vec::with_capacity(2 + RECORD_BUCKET_TIME_LEN + 1 + bytes.len());
    key.extend_from_slice(b"r");
    key.push(SEP);
    key.extend_from_slice(&bytes[..RECORD_BUCKET_TIME_LEN]);
    key.push(SEP);
    Some(key)
}

/// Text length of a UUIDv7's millisecond field (`xxxxxxxx-xxxx`).
const RECORD_BUCKET_TIME_LEN: usize = 13;

/// The record of `task_id` in a record bucket's value, if it holds it.
pub fn record_in_bucket<'a>(value: &'a [u8], task_id: &str) -> Option<&'a [u8]> {
    bucket_records(value)
        .find(|(id, _)| *id == task_id.as_bytes())
        .map(|(_, record)| record)
}

/// The ids and records of a record bucket's value (see
/// [`push_bucket_record`]), as far as it decodes.
pub fn bucket_records(value: &[u8]) -> impl Iterator<Item = (&[u8], &[u8])> {
    let mut rest = value;
    std::iter::from_fn(move || {
        let (id, after) = take_len_prefixed(rest, 2)?;
        let (record, after) = take_len_prefixed(after, 4)?;
        rest = after;
        Some((id, record))
    })
}

/// Appends one task to a record bucket's value: its id after a u16 BE
/// length, its record JSON after a u32 BE length.
pub fn push_bucket_record(value: &mut Vec<u8>, task_id: &str, record: &[u8]) {
    value.extend_from_slice(&(task_id.len() as u16).to_be_bytes());
    value.extend_from_slice(task_id.as_bytes());
    value.extend_from_slice(&(record.len() as u32).to_be_bytes());
    value.extend_from_slice(record);
}

/// First byte of a record bucket's value stored LZ4-compressed (see
/// [`seal_record_bucket`]). A plain value starts with the high byte of its
/// first id's length, 0 for every id a bucket takes (UUIDs).
const COMPRESSED_RECORD_BUCKET: u8 = 0xC1;

/// Bytes before a compressed record bucket's LZ4 block: the marker, the
/// plain length (u32 LE) and the plain bytes' CRC-32 (u32 LE).
const SEALED_HEADER: usize = 9;

/// Most bytes a compressed record bucket may claim to expand to: far above
/// what the applier puts in one, so only a corrupt value is refused.
const RECORD_BUCKET_PLAIN_MAX: usize = 1 << 20;

/// The value a record bucket is stored as: `plain` (built with
/// [`push_bucket_record`]) LZ4-compressed after a header (the marker, the
/// plain length and the plain bytes' CRC-32), or `plain` itself when that
/// is no shorter: about a third of the bytes to write, keep on disk and
/// hold in the page cache (records of one agent share field names and
/// ids). The checksum stands in for the one LZ4 blocks lack: a damaged
/// block may still decompress.
pub fn seal_record_bucket(plain: Vec<u8>) -> Vec<u8> {
    debug_assert_ne!(plain.first(), Some(&COMPRESSED_RECORD_BUCKET));
    let bound = lz4_flex::block::get_maximum_output_size(plain.len());
    let mut sealed = vec![0; SEALED_HEADER + bound];
    match lz4_flex::block::compress_into(&plain, &mut sealed[SEALED_HEADER..]) {
        // The header only once the block is known to pay for it.
        Ok(len) if SEALED_HEADER + len < plain.len() => {
            sealed[0] = COMPRESSED_RECORD_BUCKET;
            sealed[1..5].copy_from_slice(&(plain.len() as u32).to_le_bytes());
            sealed[5..9].copy_from_slice(&crc32fast::hash(&plain).to_le_bytes());
            sealed.truncate(SEALED_HEADER + len);
            sealed
        }
        _ => plain,
    }
}

/// A stored record bucket's value as [`push_bucket_record`] built it:
/// `Borrowed` when it is stored plain. `None` for a compressed value that
/// does not decompress to its length and checksum.
pub fn open_record_bucket(value: &[u8]) -> Option<Cow<'_, [u8]>> {
    let Some((&COMPRESSED_RECORD_BUCKET, sealed)) = value.split_first() else {
        return Some(Cow::Borrowed(value));
    };
    let (len, sealed) = sealed.split_first_chunk::<4>()?;
    let (crc, compressed) = sealed.split_first_chunk::<4>()?;
    let len = u32::from_le_bytes(*len) as usize;
    if len > RECORD_BUCKET_PLAIN_MAX {
        return None;
    }
    // A damaged block may decompress short of `len`, or to other bytes.
    let plain = lz4_flex::block::decompress(compressed, len).ok()?;
    let whole = plain.len() == len && crc32fast::hash(&plain) == u32::from_le_bytes(*crc);
    whole.then_some(Cow::Owned(plain))
}

/// Splits a `width`-byte big-endian length and that many bytes off `bytes`.
fn take_len_prefixed(bytes: &[u8], width: usize) -> Option<(&[u8], &[u8])> {
    let (len, rest) = bytes.split_at_checked(width)?;
    let len = len.iter().fold(0usize, |n, b| n << 8 | usize::from(*b));
    rest.split_at_checked(len)
}

/// A UUIDv7 task id created at millisecond `millis`, told apart by `n`.
#[cfg(test)]
pub fn uuid_v7_at(millis: u64, n: u16) -> String {
    format!(
        "{:08x}-{:04x}-7{n:03x}-8000-{n:012x}",
        millis >> 16,
        millis & 0xffff
    )
}

/// Prefix of a task's event log.
pub fn events_prefix(task_id: &str) -> Vec<u8> {
    let mut key = join(&[b"e", task_id.as_bytes()]);
    key.push(SEP);
    key
}

/// `e` key of one event.
pub fn event(task_id: &str, seq: u64) -> Vec<u8> {
    let mut key = events_prefix(task_id);
    key.extend_from_slice(&seq.to_be_bytes());
    key
}

/// The sort suffix of a task in every list index.
pub fn order(timestamp: Option<DateTime<Utc>>, task_id: &str) -> Vec<u8> {
    // Milliseconds: the precision timestamps are stored with, so a key
    // rebuilt from a stored record matches the key written from memory.
    let millis = timestamp.map_or(0, |t| t.timestamp_millis().max(0) as u64);
    let mut key = Vec::with_capacity(ORDER_TIME_LEN + task_id.len());
    key.extend_from_slice(&(u64::MAX - millis).to_be_bytes());
    key.extend_from_slice(task_id.as_bytes());
    key
}

/// Splits an order suffix into the status time (millis) and the task id.
pub fn parse_order(suffix: &[u8]) -> Option<(u64, &str)> {
    let (inverted, id) = suffix.split_at_checked(ORDER_TIME_LEN)?;
    let millis = u64::MAX - u64::from_be_bytes(inverted.try_into().ok()?);
    Some((millis, std::str::from_utf8(id).ok()?))
}

/// Bytes of the status time at the head of an order suffix.
pub const ORDER_TIME_LEN: usize = 8;

/// Whether a by-state key's order suffix is a bucket's: a time without an id.
pub fn is_bucket_suffix(suffix: &[u8]) -> bool {
    suffix.len() == ORDER_TIME_LEN
}

/// The order time of a task without a status time, which is never put in
/// a bucket: such tasks would all share one.
pub const NO_TIME: [u8; ORDER_TIME_LEN] = [0xff; ORDER_TIME_LEN];

/// The id at byte `at` of a bucket value, and where the next one starts:
/// each id is a u16 big-endian length and the id. `None` past the end, or
/// for a value that does not decode.
pub fn bucket_id_at(value: &[u8], at: usize) -> Option<(&[u8], usize)> {
    let (len, rest) = value.get(at..)?.split_first_chunk::<2>()?;
    let len = u16::from_be_bytes(*len) as usize;
    let id = rest.get(..len)?;
    Some((id, at + 2 + len))
}

/// The ids a bucket value holds, sorted (see [`bucket_id_at`]).
pub fn bucket_ids(value: &[u8]) -> Vec<&[u8]> {
    let mut ids = Vec::new();
    let mut at = 0;
    while let Some((id, next)) = bucket_id_at(value, at) {
        ids.push(id);
        at = next;
    }
    ids
}

/// A bucket value of `ids`, sorted and without repeats.
pub fn bucket_value<'a>(ids: impl IntoIterator<Item = &'a [u8]>) -> Vec<u8> {
    let mut ids: Vec<&[u8]> = ids.into_iter().collect();
    ids.sort_unstable();
    ids.dedup();
    let mut value = Vec::with_capacity(ids.iter().map(|id| id.len() + 2).sum());
    for id in ids {
        // The applier buckets only ids that fit (Baton's are UUIDs).
        let len = u16::try_from(id.len()).expect("a bucketed id fits a u16 length");
        value.extend_from_slice(&len.to_be_bytes());
        value.extend_from_slice(id);
    }
    value
}

/// Prefix of the all-tasks index that earlier ledgers kept (`it`); it is
/// removed when such a ledger is opened.
pub fn retired_by_time_prefix() -> &'static [u8] {
    b"it\0"
}

/// Prefix of the by-state index of an owner and state.
pub fn by_state_prefix(owner: &str, state: u8) -> Vec<u8> {
    let mut key = join(&[b"is", owner.as_bytes()]);
    key.push(SEP);
    key.push(state);
    key
}

/// Prefix of the by-state index of every owner.
pub fn by_state_all_prefix() -> &'static [u8] {
    b"is\0"
}

/// A by-state index key (or prefix) split: its owner, its state and where
/// its order suffix starts. An owner holding a 0 byte is not told apart
/// from its continuation; principals hold none.
pub fn by_state_parts(key: &[u8]) -> Option<(&str, u8, usize)> {
    let rest = key.strip_prefix(by_state_all_prefix())?;
    let end = rest.iter().position(|&b| b == SEP)?;
    let owner = std::str::from_utf8(&rest[..end]).ok()?;
    let state = *rest.get(end + 1)?;
    Some((owner, state, by_state_all_prefix().len() + end + 2))
}

/// The context id Baton mints for a new task `task_id` (a UUIDv7): the same
/// 128 bits marked version 8. None for a task id that is no UUIDv7.
pub fn minted_context(task_id: &str) -> Option<String> {
    with_uuid_version(task_id, 7, 8).map(|uuid| uuid.hyphenated().to_string())
}

/// The context of a new task that was sent without one: minted from its id
/// when that is a UUIDv7 (as Baton's task ids are), else a fresh UUIDv4.
pub fn new_context_id(task_id: &str) -> String {
    minted_context(task_id).unwrap_or_else(|| uuid::Uuid::new_v4().to_string())
}

/// The task a context id was minted for, when it is one (see
/// [`minted_context`]). The caller still checks that the task exists and
/// holds this context: anyone can send a UUIDv8 of their own.
pub fn minting_task(context_id: &str) -> Option<String> {
    with_uuid_version(context_id, 8, 7).map(|uuid| uuid.hyphenated().to_string())
}

/// Whether a task's context is the one minted for it, and so is not
/// indexed. Called for every applied task: it allocates nothing.
pub fn context_is_minted(task_id: &str, context_id: &str) -> bool {
    let mut text = uuid::Uuid::encode_buffer();
    with_uuid_version(task_id, 7, 8)
        .is_some_and(|minted| minted.hyphenated().encode_lower(&mut text) == context_id)
}

/// `id` as a UUID of version `from`, remarked as version `to`.
fn with_uuid_version(id: &str, from: usize, to: u8) -> Option<uuid::Uuid> {
    let uuid = uuid::Uuid::try_parse(id).ok()?;
    if uuid.get_version_num() != from {
        return None;
    }
    let mut bytes = *uuid.as_bytes();
    bytes[6] = (bytes[6] & 0x0f) | (to << 4);
    Some(uuid::Uuid::from_bytes(bytes))
}

/// Prefix of the by-context index of an owner and context.
pub fn by_context_prefix(owner: &str, context_id: &str) -> Vec<u8> {
    let mut key = join(&[b"ic", owner.as_bytes(), context_id.as_bytes()]);
    key.push(SEP);
    key
}

/// A counter of an owner: `all` or `s{state}` (ledgers written before
/// 0.1 also hold unused `c{context}` counters).
pub fn counter(owner: &str, name: &str) -> Vec<u8> {
    join(&[b"n", owner.as_bytes(), name.as_bytes()])
}

/// The counter of an owner's tasks in one state (`s{state}`).
pub fn state_counter(owner: &str, state: u8) -> Vec<u8> {
    counter(owner, &format!("s{state}"))
}

/// The intent of the application in progress: the tasks and index keys
/// its current chunk adds.
pub fn applying() -> &'static [u8] {
    b"x"
}

/// The ledger's format.
pub fn format() -> &'static [u8] {
    b"f"
}

/// How far the record file was synced at the last checkpoint.
pub fn records_synced() -> &'static [u8] {
    b"s"
}

/// Prefix of every record bucket.
pub fn record_bucket_all_prefix() -> &'static [u8] {
    b"r\0"
}

/// Prefix of every counter.
pub fn counter_all_prefix() -> &'static [u8] {
    b"n\0"
}

/// Whether a counter key is a task count (`all` or `s{state}`), not one of
/// the unused `c{context}` counters of older ledgers.
pub fn is_task_counter(key: &[u8]) -> bool {
    let Some(rest) = key.strip_prefix(counter_all_prefix()) else {
        return false;
    };
    match rest.iter().rposition(|&b| b == SEP) {
        Some(end) => {
            let name = &rest[end + 1..];
            name == b"all" || (name.first() == Some(&b's') && name.len() > 1)
        }
        None => false,
    }
}

/// Prefix of a task's push configs.
pub fn push_prefix(task_id: &str) -> Vec<u8> {
    let mut key = join(&[b"p", task_id.as_bytes()]);
    key.push(SEP);
    key
}

/// Prefix of every push config.
pub fn push_all_prefix() -> Vec<u8> {
    join(&[b"p", b""])
}

/// `p` key of one push config.
pub fn push_config(task_id: &str, config_id: &str) -> Vec<u8> {
    let mut key = push_prefix(task_id);
    key.extend_from_slice(config_id.as_bytes());
    key
}

/// Prefix of every push config's delivery mark.
pub fn push_mark_all_prefix() -> Vec<u8> {
    join(&[b"pd", b""])
}

/// `pd` key of one push config's delivery mark.
pub fn push_mark(task_id: &str, config_id: &str) -> Vec<u8> {
    let mut key = join(&[b"pd", task_id.as_bytes()]);
    key.push(SEP);
    key.extend_from_slice(config_id.as_bytes());
    key
}

/// The task id and config id of a `p` or `pd` key under `prefix` (one of
/// [`push_all_prefix`] and [`push_mark_all_prefix`]). Task ids hold no 0
/// byte; a config id may, so it is all that follows the task id's.
pub fn split_push_key<'k>(key: &'k [u8], prefix: &[u8]) -> Option<(&'k str, &'k str)> {
    let rest = key.strip_prefix(prefix)?;
    let at = rest.iter().position(|&b| b == SEP)?;
    let task_id = std::str::from_utf8(&rest[..at]).ok()?;
    let config_id = std::str::from_utf8(&rest[at + 1..]).ok()?;
    Some((task_id, config_id))
}

/// `a` key of a task an agent is working on; `active("")` is the prefix.
pub fn active(task_id: &str) -> Vec<u8> {
    join(&[b"a", task_id.as_bytes()])
}

/// `w` key of a task waiting for input; `waiting("")` is the prefix.
pub fn waiting(task_id: &str) -> Vec<u8> {
    join(&[b"w", task_id.as_bytes()])
}

/// `g` key of a registered agent; `agent("")` is the prefix.
pub fn agent(agent_id: &str) -> Vec<u8> {
    join(&[b"g", agent_id.as_bytes()])
}

/// `gr` key of an agent id its agency deregistered, holding the agency;
/// `retired_agent("")` is the prefix.
pub fn retired_agent(agent_id: &str) -> Vec<u8> {
    join(&[b"gr", agent_id.as_bytes()])
}

/// `ch` key linking a child task to its parent; `child(parent, "")` is the
/// prefix of all the parent's children.
pub fn child(parent_task_id: &str, child_task_id: &str) -> Vec<u8> {
    join(&[b"ch", parent_task_id.as_bytes(), child_task_id.as_bytes()])
}

/// `k` key of an idempotency record.
pub fn idempotency(owner: &str, key: &str) -> Vec<u8> {
    join(&[b"k", owner.as_bytes(), key.as_bytes()])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newer_status_sorts_first() {
        let older = order(Some(DateTime::from_timestamp(1_000, 0).unwrap()), "a");
        let newer = order(Some(DateTime::from_timestamp(2_000, 0).unwrap()), "b");
        assert!(newer < older);
        let (millis, id) = parse_order(&newer).unwrap();
        assert_eq!((millis, id), (2_000_000, "b"));
        let precise = DateTime::from_timestamp(1_000, 123_456_000).unwrap();
        let stored = DateTime::from_timestamp(1_000, 123_000_000).unwrap();
        assert_eq!(order(Some(precise), "a"), order(Some(stored), "a"));
    }

    #[test]
    fn a_bucket_sorts_before_the_single_entries_of_its_millisecond() {
        let prefix = by_state_prefix("alice", 3);
        let time = Some(DateTime::from_timestamp(1_000, 5_000_000).unwrap());
        let single = [prefix.as_slice(), &order(time, "b")].concat();
        let bucket = &single[..single.len() - 1];
        let newer = [
            prefix.as_slice(),
            &order(time.map(|t| t + chrono::Duration::milliseconds(1)), "z"),
        ]
        .concat();
        let older = [
            prefix.as_slice(),
            &order(time.map(|t| t - chrono::Duration::milliseconds(1)), "a"),
        ]
        .concat();
        assert!(newer.as_slice() < bucket && bucket < single.as_slice() && single < older);
        let (owner, state, suffix_at) = by_state_parts(bucket).unwrap();
        assert_eq!(
            (owner, state, bucket.len() - suffix_at),
            ("alice", 3, ORDER_TIME_LEN)
        );
    }

    #[test]
    fn a_bucket_value_holds_its_ids_sorted_once() {
        let value = bucket_value([b"t2".as_slice(), b"t10", b"t2", b""]);
        assert_eq!(bucket_ids(&value), vec![b"".as_slice(), b"t10", b"t2"]);
        assert!(bucket_ids(&[]).is_empty());
        // Cut short: the whole ids before the cut are read.
        assert_eq!(
            bucket_ids(&value[..value.len() - 1]),
            vec![b"".as_slice(), b"t10"]
        );
    }

    #[test]
    fn a_minted_context_leads_back_to_its_task_only() {
        let task = uuid::Uuid::now_v7().to_string();
        let context = minted_context(&task).unwrap();
        assert_ne!(context, task);
        assert_eq!(
            uuid::Uuid::parse_str(&context).unwrap().get_version_num(),
            8
        );
        assert_eq!(minting_task(&context).as_deref(), Some(task.as_str()));
        assert!(context_is_minted(&task, &context));
        let other = uuid::Uuid::now_v7().to_string();
        assert!(!context_is_minted(&other, &context));
        assert_eq!(minted_context(&uuid::Uuid::new_v4().to_string()), None);
        assert_eq!(minting_task(&uuid::Uuid::new_v4().to_string()), None);
        assert_eq!(minting_task("ctx"), None);
    }

    #[test]
    fn a_record_bucket_is_sealed_compressed_when_that_is_shorter() {
        let record = br#"{"task":{"id":"01a2424e-d10e-778d-b1a2-7b874278f788","status":{"state":"TASK_STATE_COMPLETED"}},"owner":"alice"}"#;
        let mut plain = Vec::new();
        for n in 0..4 {
            let id = uuid_v7_at(1_767_000_000_000, n);
            push_bucket_record(&mut plain, &id, record);
        }
        let plain_len = plain.len();
        let sealed = seal_record_bucket(plain.clone());
        assert_eq!(sealed[0], COMPRESSED_RECORD_BUCKET);
        assert!(
            sealed.len() < plain.len() / 2,
            "{} of {}",
            sealed.len(),
            plain.len()
        );
        assert_eq!(
            open_record_bucket(&sealed).as_deref(),
            Some(plain.as_slice())
        );

        // Too short to gain: stored plain, and read without a copy.
        let mut tiny = Vec::new();
        push_bucket_record(&mut tiny, &uuid_v7_at(1_767_000_000_000, 9), b"{}");
        let sealed = seal_record_bucket(tiny.clone());
        assert_eq!(sealed, tiny);
        assert!(matches!(
            open_record_bucket(&sealed),
            Some(Cow::Borrowed(_))
        ));

        // Cut short, claiming another length, damaged, or claiming more
        // than any bucket holds: refused.
        let whole = seal_record_bucket(plain);
        assert_eq!(open_record_bucket(&whole[..whole.len() - 3]), None);
        for claimed in [plain_len - 1, plain_len + 100, u32::MAX as usize] {
            let mut misclaimed = whole.clone();
            misclaimed[1..5].copy_from_slice(&(claimed as u32).to_le_bytes());
            assert_eq!(open_record_bucket(&misclaimed), None, "{claimed}");
        }
        let damaged_anywhere = (SEALED_HEADER..whole.len()).all(|at| {
            let mut damaged = whole.clone();
            damaged[at] ^= 0x20;
            open_record_bucket(&damaged).is_none()
        });
        assert!(
            damaged_anywhere,
            "every damaged byte of the block is caught"
        );
        assert_eq!(open_record_bucket(&[COMPRESSED_RECORD_BUCKET, 1]), None);
    }

    #[test]
    fn record_buckets_are_found_from_uuidv7_ids_and_read_back_by_id() {
        let id = "019a2b3c-4d5e-7f01-8000-000000000001";
        let prefix = record_bucket_prefix(id).unwrap();
        assert_eq!(prefix, b"r\x00019a2b3c-4d5e\x00");
        let same_millis = "019a2b3c-4d5e-7aaa-9000-0000000000ff";
        assert_eq!(record_bucket_prefix(same_millis).unwrap(), prefix);
        for not_v7 in [
            "t1",
            "019a2b3c-4d5e-4f01-8000-000000000001",
            "019a2b3c-4d5e-7f01-8000-00000000000g",
            "019a2b3c4d5e7f0180000000000000000001",
        ] {
            assert_eq!(record_bucket_prefix(not_v7), None, "{not_v7}");
        }

        let mut value = Vec::new();
        push_bucket_record(&mut value, id, b"{\"a\":1}");
        push_bucket_record(&mut value, same_millis, b"{}");
        assert_eq!(record_in_bucket(&value, id), Some(&b"{\"a\":1}"[..]));
        assert_eq!(record_in_bucket(&value, same_millis), Some(&b"{}"[..]));
        assert_eq!(
            record_in_bucket(&value, "019a2b3c-4d5e-7f01-8000-000000000002"),
            None
        );
        let ids: Vec<&[u8]> = bucket_records(&value).map(|(id, _)| id).collect();
        assert_eq!(ids, [id.as_bytes(), same_millis.as_bytes()]);
        // A cut value reads as far as it is whole, and never panics.
        for cut in 0..value.len() {
            assert!(bucket_records(&value[..cut]).count() <= 1);
            assert_eq!(record_in_bucket(&value[..cut], same_millis), None);
        }
    }
}
