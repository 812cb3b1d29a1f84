//! Control metadata (DESIGN.md §3.1): the trace id, hop count, chain and
//! deadline every call through Baton carries, in message metadata under
//! `urn:baton:handoff:v1` and in HTTP headers.
//!
//! The rules: take the largest `hops`, the longest `chain` and the earliest
//! `deadline` among what the ledger knows of the task's lineage, the
//! metadata and the headers; a caller may shorten limits but never lengthen
//! them. Delivering to agent X adds one hop and appends X to the chain.

use crate::protocol::{HANDOFF_EXTENSION, wire};
use axum::http::HeaderName;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use std::time::Duration;

// Header names made at compile time: a name given as text is parsed again
// at every lookup and every request built.
/// `Baton-Hops`.
pub const HOPS_HEADER: HeaderName = HeaderName::from_static("baton-hops");
/// `Baton-Chain`: agent ids, comma-separated.
pub const CHAIN_HEADER: HeaderName = HeaderName::from_static("baton-chain");
/// `Baton-Deadline`: RFC 3339 UTC, milliseconds.
pub const DEADLINE_HEADER: HeaderName = HeaderName::from_static("baton-deadline");
/// W3C trace context.
pub const TRACEPARENT_HEADER: HeaderName = HeaderName::from_static("traceparent");
/// W3C trace state: vendors' entries, passed on unchanged.
pub const TRACESTATE_HEADER: HeaderName = HeaderName::from_static("tracestate");

/// The control metadata of one line of work. Read leniently, field by
/// field: a field of the wrong type counts as absent, not the whole control,
/// since another vendor's `null` would otherwise reset the hops, chain and
/// deadline that stop loops.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Control {
    /// W3C trace id, 32 lowercase hex digits.
    #[serde(default, deserialize_with = "lenient::text")]
    pub trace_id: String,
    /// How many times a gateway has forwarded this line of work.
    #[serde(default, deserialize_with = "lenient::count")]
    pub hops: u32,
    /// Largest `hops` allowed.
    #[serde(default, deserialize_with = "lenient::count")]
    pub max_hops: u32,
    /// The agents that have held this line of work, last the current one.
    #[serde(default, deserialize_with = "lenient::texts")]
    pub chain: Vec<String>,
    /// When the work must be done.
    #[serde(
        default,
        serialize_with = "wire::opt_timestamp::serialize",
        deserialize_with = "lenient::timestamp",
        skip_serializing_if = "Option::is_none"
    )]
    pub deadline: Option<DateTime<Utc>>,
    /// The gateway task this one is a child of.
    #[serde(
        default,
        deserialize_with = "lenient::opt_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub parent_task_id: Option<String>,
    /// The handoff this work came from.
    #[serde(
        default,
        deserialize_with = "lenient::opt_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub handoff_id: Option<String>,
    /// A caller's correlation id, passed on.
    #[serde(
        default,
        deserialize_with = "lenient::opt_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub correlation_id: Option<String>,
    /// How long a handoff's target has to acknowledge it, in ms (0: not
    /// set). §3.1 has no field for it, yet a request may shorten the
    /// gateway's and the agent's ackTimeout (§3.4): never lengthen it.
    #[serde(
        default,
        deserialize_with = "lenient::count",
        skip_serializing_if = "is_unset"
    )]
    pub ack_timeout_ms: u32,
    /// The W3C `tracestate` the work came with, passed on unchanged to
    /// every later hop (kept here because a later hop's delivery is not
    /// the request that brought the header).
    #[serde(
        default,
        deserialize_with = "lenient::opt_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub trace_state: Option<String>,
}

fn is_unset(ms: &u32) -> bool {
    *ms == 0
}

/// Whether `value` may be sent as a header value as it is: what
/// `HeaderValue::from_str` accepts (visible ASCII, spaces and tabs, and
/// bytes above ASCII), so never a line break.
pub fn is_header_value(value: &str) -> bool {
    value
        .bytes()
        .all(|b| b == b'\t' || (b >= b' ' && b != 0x7f))
}

/// A count written as text (a header's, or in JSON): negative is zero,
/// beyond `u32` is `u32::MAX`, anything else zero.
fn saturating_count_text(text: &str) -> u32 {
    saturate(text.trim().parse::<f64>().ok())
}

fn saturate(number: Option<f64>) -> u32 {
    number.map_or(0, |n| n.clamp(0.0, f64::from(u32::MAX)) as u32)
}

/// The control's field readers: each takes a value of another type as
/// absent, and never fails.
mod lenient {
    use super::{saturate, saturating_count_text, wire};
    use chrono::{DateTime, Utc};
    use serde::Deserializer;
    use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
    use std::fmt;

    /// What one JSON value is, as far as the control cares.
    enum Shape {
        Text(String),
        Number(f64),
        /// An array, with the strings among its items.
        Texts(Vec<String>),
        Other,
    }

    /// Reads any value as a [`Shape`].
    struct AnyShape;

    impl<'de> DeserializeSeed<'de> for AnyShape {
        type Value = Shape;

        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Shape, D::Error> {
            d.deserialize_any(self)
        }
    }

    impl<'de> Visitor<'de> for AnyShape {
        type Value = Shape;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("any JSON value")
        }
        fn visit_str<E>(self, text: &str) -> Result<Shape, E> {
            Ok(Shape::Text(text.to_owned()))
        }
        fn visit_string<E>(self, text: String) -> Result<Shape, E> {
            Ok(Shape::Text(text))
        }
        fn visit_i64<E>(self, n: i64) -> Result<Shape, E> {
            Ok(Shape::Number(n as f64))
        }
        fn visit_u64<E>(self, n: u64) -> Result<Shape, E> {
            Ok(Shape::Number(n as f64))
        }
        fn visit_f64<E>(self, n: f64) -> Result<Shape, E> {
            Ok(Shape::Number(n))
        }
        fn visit_bool<E>(self, _: bool) -> Result<Shape, E> {
            Ok(Shape::Other)
        }
        fn visit_unit<E>(self) -> Result<Shape, E> {
            Ok(Shape::Other)
        }
        fn visit_none<E>(self) -> Result<Shape, E> {
            Ok(Shape::Other)
        }
        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Shape, D::Error> {
            d.deserialize_any(self)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Shape, A::Error> {
            let mut texts = Vec::with_capacity(seq.size_hint().unwrap_or(0));
            while let Some(item) = seq.next_element_seed(AnyShape)? {
                if let Shape::Text(text) = item {
                    texts.push(text);
                }
            }
            Ok(Shape::Texts(texts))
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Shape, A::Error> {
            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            Ok(Shape::Other)
        }
    }

    fn shape<'de, D: Deserializer<'de>>(d: D) -> Result<Shape, D::Error> {
        d.deserialize_any(AnyShape)
    }

    /// A string, else `None`.
    pub fn opt_text<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
        Ok(match shape(d)? {
            Shape::Text(text) => Some(text),
            _ => None,
        })
    }

    /// A string, else empty.
    pub fn text<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
        Ok(opt_text(d)?.unwrap_or_default())
    }

    /// The strings of an array, its other items left out; else empty.
    pub fn texts<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
        Ok(match shape(d)? {
            Shape::Texts(texts) => texts,
            _ => Vec::new(),
        })
    }

    /// A count, as a number or a numeric string, saturated to `u32` so that
    /// a hop limit still holds; anything else zero.
    pub fn count<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
        Ok(match shape(d)? {
            Shape::Number(n) => saturate(Some(n)),
            Shape::Text(text) => saturating_count_text(&text),
            _ => 0,
        })
    }

    /// An RFC 3339 timestamp, else `None`.
    pub fn timestamp<'de, D: Deserializer<'de>>(d: D) -> Result<Option<DateTime<Utc>>, D::Error> {
        Ok(opt_text(d)?.and_then(|text| wire::parse_timestamp(&text).ok()))
    }
}

/// The limits that apply to a call: the gateway's, narrowed by the agent's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest hop count.
    pub max_hops: u32,
    /// Longest a task may take.
    pub task_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_hops: 5,
            task_timeout: Duration::from_secs(300),
        }
    }
}

/// What a request carries, from wherever it came.
#[derive(Clone, Debug, Default)]
pub struct Incoming {
    /// `message.metadata["urn:baton:handoff:v1"]`.
    pub metadata: Option<Control>,
    /// `traceparent`.
    pub traceparent: Option<String>,
    /// `tracestate`.
    pub tracestate: Option<String>,
    /// `Baton-Hops`.
    pub hops: Option<u32>,
    /// `Baton-Chain`.
    pub chain: Option<Vec<String>>,
    /// `Baton-Deadline`.
    pub deadline: Option<DateTime<Utc>>,
}

impl Incoming {
    /// Reads the headers and the message metadata of a request.
    pub fn read(headers: &axum::http::HeaderMap, message_metadata: Option<&wire::Struct>) -> Self {
        let header = |name: HeaderName| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
                .filter(|v| !v.is_empty())
                .map(str::to_string)
        };
        Self {
            metadata: message_metadata
                .and_then(|m| m.get(HANDOFF_EXTENSION))
                .and_then(|v| serde_json::from_value(v.clone()).ok()),
            traceparent: header(TRACEPARENT_HEADER),
            tracestate: header(TRACESTATE_HEADER),
            hops: header(HOPS_HEADER).map(|v| saturating_count_text(&v)),
            chain: header(CHAIN_HEADER).map(|v| {
                v.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .collect()
            }),
            deadline: header(DEADLINE_HEADER).and_then(|v| wire::parse_timestamp(&v).ok()),
        }
    }
}

/// The trace id of a W3C `traceparent` (`00-<trace>-<span>-<flags>`).
pub fn trace_id_of(traceparent: &str) -> Option<String> {
    let mut parts = traceparent.split('-');
    let (_version, trace, span) = (parts.next()?, parts.next()?, parts.next()?);
    (is_hex(span, 16) && span.chars().any(|c| c != '0'))
        .then(|| valid_trace_id(trace))
        .flatten()
}

/// `id` as a W3C trace id (32 hex digits, not all zeros), lowercased; `None`
/// if it cannot be one. A trace id from metadata is the caller's word, and
/// goes into every later hop's `traceparent` header.
pub fn valid_trace_id(id: &str) -> Option<String> {
    is_trace_id(id).then(|| id.to_ascii_lowercase())
}

/// Whether `id` is a W3C trace id, in either case.
fn is_trace_id(id: &str) -> bool {
    is_hex(id, 32) && id.chars().any(|c| c != '0')
}

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.chars().all(|c| c.is_ascii_hexdigit())
}

/// A fresh W3C trace id.
pub fn new_trace_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// A `traceparent` for the next hop: the same trace, a new span.
pub fn next_traceparent(trace_id: &str) -> String {
    let mut random = uuid::Uuid::encode_buffer();
    let span = &uuid::Uuid::new_v4().simple().encode_lower(&mut random)[..16];
    // Written in place: one allocation per forwarded call.
    let mut traceparent = String::with_capacity(3 + trace_id.len() + 1 + span.len() + 3);
    for part in ["00-", trace_id, "-", span, "-01"] {
        traceparent.push_str(part);
    }
    traceparent
}

impl Control {
    /// Takes a continuing caller's limits where they are shorter (DESIGN.md
    /// §3.1: a caller may shorten them, never lengthen them): the earlier
    /// deadline and the smaller `maxHops` of `incoming`'s headers and
    /// metadata. Says whether either changed. Hops and chain stay the
    /// task's: a continuation stays on its hop.
    pub fn shorten_to(&mut self, incoming: &Incoming) -> bool {
        let asked = incoming.metadata.as_ref();
        let deadline = [asked.and_then(|c| c.deadline), incoming.deadline]
            .into_iter()
            .flatten()
            .chain(self.deadline)
            .min();
        let max_hops = [asked.map_or(0, |c| c.max_hops), self.max_hops]
            .into_iter()
            .filter(|n| *n > 0)
            .min()
            .unwrap_or(0);
        let changed = deadline != self.deadline || max_hops != self.max_hops;
        (self.deadline, self.max_hops) = (deadline, max_hops);
        changed
    }

    /// The control of a request before delivery: the largest hops, longest
    /// chain and earliest deadline of `lineage`, the metadata and the
    /// headers; limits only ever shortened.
    pub fn merge(
        incoming: &Incoming,
        lineage: Option<&Control>,
        limits: Limits,
        now: DateTime<Utc>,
    ) -> Self {
        let sources: Vec<&Control> = incoming.metadata.iter().chain(lineage).collect();
        // The ledger's line of work keeps its trace, as it keeps its chain:
        // a caller's HTTP client may start a trace of its own. Without one,
        // the W3C header, then the metadata.
        let trace_id = lineage
            .and_then(|l| valid_trace_id(&l.trace_id))
            .or_else(|| incoming.traceparent.as_deref().and_then(trace_id_of))
            .or_else(|| sources.iter().find_map(|c| valid_trace_id(&c.trace_id)))
            .unwrap_or_else(new_trace_id);
        let hops = sources
            .iter()
            .map(|c| c.hops)
            .chain(incoming.hops)
            .max()
            .unwrap_or(0);
        // The lineage's chain is the ledger's record of who held the work:
        // a caller's chain counts only as an extension of it, so that none
        // can drop an agent from it (and slip a cycle past the check).
        let anchor = lineage.map_or(&[][..], |l| l.chain.as_slice());
        let chain = sources
            .iter()
            .map(|c| &c.chain)
            .chain(incoming.chain.as_ref())
            .filter(|chain| chain.starts_with(anchor))
            .fold(anchor, |longest, chain| {
                if chain.len() > longest.len() {
                    chain
                } else {
                    longest
                }
            })
            .to_vec();
        // A limit given along the line of work (0: not given), the smallest.
        let smallest =
            |limit: fn(&Control) -> u32| sources.iter().map(|c| limit(c)).filter(|n| *n > 0).min();
        let max_hops = smallest(|c| c.max_hops).map_or(limits.max_hops, |m| m.min(limits.max_hops));
        let timeout =
            chrono::Duration::from_std(limits.task_timeout).unwrap_or(chrono::Duration::MAX);
        let deadline = sources
            .iter()
            .filter_map(|c| c.deadline)
            .chain(incoming.deadline)
            .chain(now.checked_add_signed(timeout))
            .min();
        let first = |f: fn(&Control) -> Option<String>| sources.iter().find_map(|c| f(c));
        Self {
            trace_id,
            hops,
            max_hops,
            chain,
            deadline,
            parent_task_id: first(|c| c.parent_task_id.clone()),
            handoff_id: first(|c| c.handoff_id.clone()),
            correlation_id: first(|c| c.correlation_id.clone()),
            ack_timeout_ms: smallest(|c| c.ack_timeout_ms).unwrap_or(0),
            trace_state: incoming
                .tracestate
                .clone()
                .or_else(|| first(|c| c.trace_state.clone())),
        }
    }

    /// The control sent with a delivery to `agent`.
    pub fn delivered_to(&self, agent: &str) -> Self {
        let mut next = self.clone();
        // A caller's count is clamped, not trusted to leave room.
        next.hops = next.hops.saturating_add(1);
        next.chain.push(agent.to_string());
        next
    }

    /// As JSON, for `metadata["urn:baton:handoff:v1"]`.
    pub fn to_value(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or_default()
    }

    /// Puts this control into a metadata object.
    pub fn write_into(&self, metadata: &mut Option<wire::Struct>) {
        metadata
            .get_or_insert_with(Default::default)
            .insert(HANDOFF_EXTENSION.to_string(), self.to_value());
    }

    /// The control entry of a metadata object as it is, undecoded: what
    /// copies a control Baton wrote, or reads one field of it, uses.
    pub fn entry(metadata: Option<&wire::Struct>) -> Option<&serde_json::Value> {
        metadata?.get(HANDOFF_EXTENSION)
    }

    /// A metadata object holding only `metadata`'s control entry, copied as
    /// is (shared, not copied, when it is the only key): what a new task
    /// keeps of the message that started it.
    pub fn entry_alone(metadata: Option<&wire::Struct>) -> Option<wire::Struct> {
        let entry = Self::entry(metadata)?;
        if metadata.is_some_and(|m| m.len() == 1) {
            // Nothing else in it: shared, not copied.
            return metadata.cloned();
        }
        Some(wire::Struct::from_iter([(
            HANDOFF_EXTENSION.to_string(),
            entry.clone(),
        )]))
    }

    /// Names `task_id` as the parent in a metadata object's control, if it
    /// has one: what an agent working on gateway task `task_id` is sent, so
    /// that a handoff it makes quoting that control (DESIGN.md §3.1) is
    /// linked under the task it works on (§3.3). The task's own control,
    /// and its history's, keep naming the task's parent.
    pub fn name_parent(metadata: &mut Option<wire::Struct>, task_id: &str) {
        let has_control = Self::entry(metadata.as_ref()).is_some_and(serde_json::Value::is_object);
        let named = Self::parent_task_id_in(metadata.as_ref());
        if !has_control || task_id.is_empty() || named == Some(task_id) {
            return;
        }
        // A copy: the message's metadata is shared with the task's history.
        if let Some(serde_json::Value::Object(entry)) = metadata
            .as_mut()
            .and_then(|metadata| metadata.get_mut(HANDOFF_EXTENSION))
        {
            entry.insert(
                "parentTaskId".into(),
                serde_json::Value::String(task_id.into()),
            );
        }
    }

    /// The parent task a metadata object's control names.
    pub fn parent_task_id_in(metadata: Option<&wire::Struct>) -> Option<&str> {
        Self::entry(metadata)?.get("parentTaskId")?.as_str()
    }

    /// Reads the control from a metadata object; a field of the wrong type
    /// counts as absent (see [`Control`]), an entry that is not an object
    /// as no control.
    pub fn read_from(metadata: Option<&wire::Struct>) -> Option<Self> {
        // Decoded from the borrowed value: read several times per request,
        // and cloning the value first allocated its whole tree each time.
        // serde's derive would also read an array, field by position.
        let entry = Self::entry(metadata).filter(|entry| entry.is_object())?;
        Self::deserialize(entry).ok()
    }

    /// The ackTimeout the control asks for, if any.
    pub fn ack_timeout(&self) -> Option<Duration> {
        (self.ack_timeout_ms > 0).then(|| Duration::from_millis(self.ack_timeout_ms.into()))
    }

    /// The headers that carry this control to an agent.
    pub fn headers(&self) -> Vec<(HeaderName, String)> {
        // A control merged here holds a valid id; one read from a message
        // as it came (or a record an older build wrote) may not, and must
        // not make an invalid header. An uppercase one is the same trace.
        let rewritten;
        let lowercase = !self.trace_id.bytes().any(|b| b.is_ascii_uppercase());
        let trace_id = if is_trace_id(&self.trace_id) && lowercase {
            &self.trace_id
        } else {
            rewritten = valid_trace_id(&self.trace_id).unwrap_or_else(new_trace_id);
            &rewritten
        };
        // Agent ids are the caller's word in a chain: one that cannot be a
        // header value, or holds the list's comma, is left out of the header
        // rather than failing the call. Written in place, as `join` would.
        let mut chain = String::new();
        let shown = self
            .chain
            .iter()
            .filter(|id| is_header_value(id) && !id.contains(','));
        for (i, id) in shown.enumerate() {
            if i > 0 {
                chain.push(',');
            }
            chain.push_str(id);
        }
        let mut headers = vec![
            (TRACEPARENT_HEADER, next_traceparent(trace_id)),
            (HOPS_HEADER, self.hops.to_string()),
            (CHAIN_HEADER, chain),
        ];
        if let Some(deadline) = self.deadline {
            headers.push((DEADLINE_HEADER, wire::format_timestamp(&deadline)));
        }
        // Optional, so one that cannot be a header value (metadata may say
        // anything) is left out rather than failing the call.
        if let Some(state) = self.trace_state.as_ref().filter(|s| is_header_value(s)) {
            headers.push((TRACESTATE_HEADER, state.clone()));
        }
        headers
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(secs, 0).unwrap()
    }

    #[test]
    fn a_field_of_another_type_is_absent_and_the_rest_still_count() {
        let metadata = |entry: serde_json::Value| {
            wire::Struct::from_iter([(HANDOFF_EXTENSION.to_string(), entry)])
        };
        let read = |entry| Control::read_from(Some(&metadata(entry))).unwrap();
        let control = read(serde_json::json!({
            "traceId": null,
            "hops": 3,
            "chain": ["a", 7, "b"],
            "deadline": "",
            "correlationId": 42,
            "handoffId": "h1",
        }));
        assert_eq!(control.trace_id, "");
        assert_eq!(control.hops, 3);
        assert_eq!(control.chain, ["a", "b"]);
        assert_eq!((control.deadline, control.correlation_id), (None, None));
        assert_eq!(control.handoff_id.as_deref(), Some("h1"));
        // Counts beyond range hold the hop limit rather than reset it.
        assert_eq!(read(serde_json::json!({"hops": 1e12})).hops, u32::MAX);
        assert_eq!(
            read(serde_json::json!({"hops": "99999999999"})).hops,
            u32::MAX
        );
        assert_eq!(read(serde_json::json!({"hops": -2, "traceId": 5})).hops, 0);
        // Every field wrong at once: each absent, none failing the others.
        let control = read(serde_json::json!({
            "traceId": ["x"],
            "hops": "7",
            "maxHops": {"n": 1},
            "chain": "a,b",
            "deadline": "2030-01-01T00:00:00.000Z",
            "parentTaskId": true,
            "handoffId": [["h"]],
        }));
        assert_eq!((control.trace_id.as_str(), control.hops), ("", 7));
        assert_eq!((control.max_hops, control.chain.len()), (0, 0));
        assert!(control.deadline.is_some());
        assert_eq!((control.parent_task_id, control.handoff_id), (None, None));
        let nested = read(serde_json::json!({"chain": [["a"], "b", {"c": "d"}, null]}));
        assert_eq!(nested.chain, ["b"]);
        // An entry that is not an object is no control.
        for not_object in [serde_json::json!("x"), serde_json::json!([5, 5])] {
            assert_eq!(Control::read_from(Some(&metadata(not_object))), None);
        }
        let mut headers = axum::http::HeaderMap::new();
        headers.insert(HOPS_HEADER, "99999999999".parse().unwrap());
        assert_eq!(Incoming::read(&headers, None).hops, Some(u32::MAX));
    }

    #[test]
    fn a_fresh_request_starts_a_trace_at_hop_zero() {
        let control = Control::merge(&Incoming::default(), None, Limits::default(), at(1_000));
        assert_eq!(control.trace_id.len(), 32);
        assert_eq!((control.hops, control.max_hops), (0, 5));
        assert!(control.chain.is_empty());
        assert_eq!(control.deadline, Some(at(1_300)));
        let delivered = control.delivered_to("triage");
        assert_eq!(
            (delivered.hops, delivered.chain.clone()),
            (1, vec!["triage".to_string()])
        );
    }

    /// A parent task's stored chain is kept: a caller's chain that does not
    /// extend it (a header naming another agent, say) counts for nothing.
    #[test]
    fn the_lineages_chain_is_only_ever_extended() {
        let lineage = Control {
            chain: vec!["a".into()],
            ..Control::default()
        };
        let forged = Incoming {
            chain: Some(vec!["z".into()]),
            ..Incoming::default()
        };
        let merged = Control::merge(&forged, Some(&lineage), Limits::default(), at(0));
        assert_eq!(merged.chain, ["a"]);
        let extended = Incoming {
            metadata: Some(Control {
                chain: vec!["a".into(), "b".into()],
                ..Control::default()
            }),
            chain: Some(vec!["z".into(), "y".into(), "x".into()]),
            ..Incoming::default()
        };
        let merged = Control::merge(&extended, Some(&lineage), Limits::default(), at(0));
        assert_eq!(merged.chain, ["a", "b"]);
    }

    #[test]
    fn the_largest_hops_longest_chain_and_earliest_deadline_win() {
        let incoming = Incoming {
            metadata: Some(Control {
                trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".into(),
                hops: 1,
                max_hops: 9,
                chain: vec!["a".into()],
                deadline: Some(at(2_000)),
                ..Control::default()
            }),
            hops: Some(3),
            chain: Some(vec!["a".into(), "b".into()]),
            deadline: Some(at(1_100)),
            ..Incoming::default()
        };
        let control = Control::merge(&incoming, None, Limits::default(), at(1_000));
        assert_eq!(control.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(control.hops, 3);
        assert_eq!(control.chain, ["a", "b"]);
        assert_eq!(control.deadline, Some(at(1_100)));
        assert_eq!(
            control.max_hops, 5,
            "a caller cannot lengthen the hop limit"
        );
        let shorter = Incoming {
            metadata: Some(Control {
                max_hops: 2,
                ..Control::default()
            }),
            ..Incoming::default()
        };
        assert_eq!(
            Control::merge(&shorter, None, Limits::default(), at(0)).max_hops,
            2
        );
    }

    #[test]
    fn traceparent_wins_and_each_hop_gets_a_new_span() {
        let incoming = Incoming {
            traceparent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into()),
            ..Incoming::default()
        };
        let control = Control::merge(&incoming, None, Limits::default(), at(0));
        assert_eq!(control.trace_id, "0af7651916cd43dd8448eb211c80319c");
        let (_, first) = &control.headers()[0];
        let (_, second) = &control.headers()[0];
        assert!(first.starts_with("00-0af7651916cd43dd8448eb211c80319c-"));
        assert_ne!(first, second);
        // A well-formed traceparent (55 characters) that reads back.
        assert_eq!(first.len(), 55);
        assert_eq!(
            trace_id_of(first).as_deref(),
            Some("0af7651916cd43dd8448eb211c80319c")
        );
        assert_eq!(
            trace_id_of("00-00000000000000000000000000000000-b7ad6b7169203331-01"),
            None
        );
        assert_eq!(trace_id_of("garbage"), None);
        assert_eq!(
            trace_id_of("00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01"),
            None,
            "an all-zero parent id is invalid too"
        );
    }

    #[test]
    fn a_continuation_shortens_limits_and_never_lengthens_them() {
        let stored = Control {
            deadline: Some(at(60)),
            max_hops: 4,
            hops: 2,
            ..Control::default()
        };
        let asking = |deadline, max_hops, header| Incoming {
            metadata: Some(Control {
                deadline,
                max_hops,
                hops: 9,
                ..Control::default()
            }),
            deadline: header,
            ..Incoming::default()
        };
        let mut shorter = stored.clone();
        assert!(shorter.shorten_to(&asking(Some(at(30)), 3, Some(at(40)))));
        assert_eq!(
            (shorter.deadline, shorter.max_hops, shorter.hops),
            (Some(at(30)), 3, 2)
        );
        let mut longer = stored.clone();
        assert!(!longer.shorten_to(&asking(Some(at(90)), 8, None)));
        assert_eq!(longer, stored);
        // 0 is no maxHops given.
        assert!(!longer.shorten_to(&asking(None, 0, None)));
        assert_eq!(longer, stored);
    }

    /// A call linked under a task the ledger knows stays in that task's
    /// trace, whatever trace its HTTP client started.
    #[test]
    fn the_lineages_trace_wins_over_a_callers_new_traceparent() {
        let incoming = Incoming {
            traceparent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into()),
            ..Incoming::default()
        };
        let lineage = Control {
            trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".into(),
            ..Control::default()
        };
        let control = Control::merge(&incoming, Some(&lineage), Limits::default(), at(0));
        assert_eq!(control.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
        // A lineage without a valid trace id leaves the header's.
        let blank = Control::default();
        let control = Control::merge(&incoming, Some(&blank), Limits::default(), at(0));
        assert_eq!(control.trace_id, "0af7651916cd43dd8448eb211c80319c");
    }

    #[test]
    fn a_trace_id_from_metadata_is_taken_only_when_valid() {
        let with_trace_id = |trace_id: &str| Incoming {
            metadata: Some(Control {
                trace_id: trace_id.into(),
                ..Control::default()
            }),
            ..Incoming::default()
        };
        let merged = |trace_id: &str| {
            Control::merge(&with_trace_id(trace_id), None, Limits::default(), at(0))
        };
        assert_eq!(
            merged("0AF7651916CD43DD8448EB211C80319C").trace_id,
            "0af7651916cd43dd8448eb211c80319c"
        );
        for invalid in [
            "G".repeat(32),
            format!("{}\n", "a".repeat(31)),
            "0".repeat(32),
            "abc".into(),
        ] {
            let control = merged(&invalid);
            assert_ne!(control.trace_id, invalid);
            assert!(valid_trace_id(&control.trace_id).is_some(), "{invalid:?}");
        }
        // A control read from a message as it came makes a valid header.
        let read = Control {
            trace_id: format!("{}\n", "a".repeat(31)),
            ..Control::default()
        };
        let (_, traceparent) = &read.headers()[0];
        assert!(trace_id_of(traceparent).is_some(), "{traceparent:?}");
        assert!(is_header_value(traceparent));
        // An uppercase one is the same trace, lowercased.
        let uppercase = Control {
            trace_id: "0AF7651916CD43DD8448EB211C80319C".into(),
            ..Control::default()
        };
        let (_, traceparent) = &uppercase.headers()[0];
        assert!(traceparent.starts_with("00-0af7651916cd43dd8448eb211c80319c-"));
    }

    #[test]
    fn a_chain_entry_that_cannot_be_a_header_value_is_left_out_of_the_header() {
        let control = Control {
            chain: vec![
                "a".into(),
                "b\nX-Injected: 1".into(),
                "c,d".into(),
                "e".into(),
            ],
            ..Control::default()
        };
        let chain = control
            .headers()
            .into_iter()
            .find(|(name, _)| *name == CHAIN_HEADER)
            .map(|(_, value)| value);
        assert_eq!(chain.as_deref(), Some("a,e"));
    }

    #[test]
    fn trace_state_comes_from_the_header_else_the_lineage_and_is_sent_when_printable() {
        let sent = |control: &Control| {
            control
                .headers()
                .into_iter()
                .find(|(name, _)| *name == TRACESTATE_HEADER)
                .map(|(_, value)| value)
        };
        let lineage = Control {
            trace_state: Some("rojo=1".into()),
            ..Control::default()
        };
        let from_header = Incoming {
            tracestate: Some("congo=2".into()),
            ..Incoming::default()
        };
        let merged = Control::merge(&from_header, Some(&lineage), Limits::default(), at(0));
        assert_eq!(sent(&merged).as_deref(), Some("congo=2"));
        let merged = Control::merge(
            &Incoming::default(),
            Some(&lineage),
            Limits::default(),
            at(0),
        );
        assert_eq!(sent(&merged).as_deref(), Some("rojo=1"));
        assert_eq!(sent(&Control::default()), None);
        // Metadata may hold what no header can: left out, not a failed call.
        let unprintable = Control {
            trace_state: Some("rojo=1\r\nx: y".into()),
            ..Control::default()
        };
        assert_eq!(sent(&unprintable), None);
    }

    #[test]
    fn a_new_task_shares_a_control_that_is_alone_and_copies_it_from_among_others() {
        let mut alone = None;
        Control::default().write_into(&mut alone);
        let kept = Control::entry_alone(alone.as_ref()).unwrap();
        assert!(std::ptr::eq(&*kept, &**alone.as_ref().unwrap()));

        let mut mixed = Some(wire::Struct::from_iter([(
            "x-vendor".to_string(),
            serde_json::json!(1),
        )]));
        Control::default().write_into(&mut mixed);
        let kept = Control::entry_alone(mixed.as_ref()).unwrap();
        assert_eq!(kept.keys().collect::<Vec<_>>(), [HANDOFF_EXTENSION]);
        assert_eq!(kept.get(HANDOFF_EXTENSION), Control::entry(mixed.as_ref()));
    }

    #[test]
    fn metadata_round_trips_with_lenient_numbers() {
        let mut metadata = Some(wire::Struct::default());
        let control = Control {
            trace_id: new_trace_id(),
            hops: 2,
            max_hops: 5,
            chain: vec!["x".into(), "y".into()],
            deadline: Some(at(5)),
            ..Control::default()
        };
        control.write_into(&mut metadata);
        assert_eq!(Control::read_from(metadata.as_ref()), Some(control.clone()));
        assert_eq!(Control::parent_task_id_in(metadata.as_ref()), None);
        let child = Control {
            parent_task_id: Some("parent".into()),
            ..control
        };
        child.write_into(&mut metadata);
        assert_eq!(
            Control::parent_task_id_in(metadata.as_ref()),
            Some("parent")
        );
        let doubles = serde_json::json!({"urn:baton:handoff:v1": {"hops": 2.0, "maxHops": 4.0}});
        let doubles = doubles.as_object().cloned().map(wire::Struct::from);
        let read = Control::read_from(doubles.as_ref()).unwrap();
        assert_eq!((read.hops, read.max_hops), (2, 4));
    }
}
