//! ProtoJSON helpers shared by the wire types: lenient input, exact output.
//!
//! Output follows ProtoJSON to the letter (RFC 3339 UTC timestamps with milliseconds,
//! standard padded base64). Input accepts what ProtoJSON parsers accept: `null` for a
//! default, numbers given as strings or as integral doubles, any RFC 3339 offset, and
//! standard or URL-safe base64 with or without padding.

use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
use chrono::{DateTime, SecondsFormat, Utc};
use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serializer};
use serde_json::value::RawValue;
use std::fmt;
use std::sync::{Arc, OnceLock};

/// A JSON object, as used for `google.protobuf.Struct` fields.
///
/// Shared rather than owned: a task's snapshot, history and events each hold
/// the same metadata, and copying one costs a reference count instead of
/// every key and value (a message's handoff control alone was ~12
/// allocations). A change through `&mut` copies the object only while it is
/// shared.
///
/// Its JSON is encoded once and kept: the same handoff control goes out in
/// the upstream request, twice in the task's record and twice in the reply.
/// So it serializes as serde_json's raw JSON, which only serde_json's own
/// serializers read (and pretty printing leaves compact): never flatten it
/// or hand it to another format.
#[derive(Clone, Default, PartialEq)]
pub struct Struct(Arc<SharedObject>);

/// The object behind a [`Struct`], with its JSON once encoded.
#[derive(Default)]
struct SharedObject {
    map: serde_json::Map<String, serde_json::Value>,
    json: OnceLock<Box<RawValue>>,
}

impl Clone for SharedObject {
    /// A copy is made to be changed: its JSON is encoded anew.
    fn clone(&self) -> Self {
        Self {
            map: self.map.clone(),
            json: OnceLock::new(),
        }
    }
}

impl PartialEq for SharedObject {
    fn eq(&self, other: &Self) -> bool {
        self.map == other.map
    }
}

impl fmt::Debug for Struct {
    /// As the object itself, as before it was shared.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.map.fmt(f)
    }
}

impl std::ops::Deref for Struct {
    type Target = serde_json::Map<String, serde_json::Value>;

    fn deref(&self) -> &Self::Target {
        &self.0.map
    }
}

impl std::ops::DerefMut for Struct {
    fn deref_mut(&mut self) -> &mut Self::Target {
        let shared = Arc::make_mut(&mut self.0);
        // About to change: the JSON kept so far no longer holds.
        shared.json = OnceLock::new();
        &mut shared.map
    }
}

impl From<serde_json::Map<String, serde_json::Value>> for Struct {
    fn from(map: serde_json::Map<String, serde_json::Value>) -> Self {
        Self(Arc::new(SharedObject {
            map,
            json: OnceLock::new(),
        }))
    }
}

impl FromIterator<(String, serde_json::Value)> for Struct {
    fn from_iter<I: IntoIterator<Item = (String, serde_json::Value)>>(entries: I) -> Self {
        serde_json::Map::from_iter(entries).into()
    }
}

impl serde::Serialize for Struct {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let shared = &*self.0;
        let json = match shared.json.get() {
            Some(json) => json,
            None => {
                let encoded = serde_json::value::to_raw_value(&shared.map)
                    .map_err(serde::ser::Error::custom)?;
                shared.json.get_or_init(|| encoded)
            }
        };
        json.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Struct {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        serde_json::Map::deserialize(deserializer).map(Self::from)
    }
}

/// Deserializes `null` as the type's default, as ProtoJSON does.
pub fn nullable<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// Formats a timestamp the way the spec prefers: UTC, `Z`, milliseconds.
pub fn format_timestamp(ts: &DateTime<Utc>) -> String {
    with_timestamp_text(ts, SecondsFormat::Millis, str::to_string)
}

/// Calls `use_text` with `ts` in RFC 3339 UTC with milliseconds or
/// microseconds (`format`), allocating only for what
/// [`write_timestamp_digits`] leaves to chrono.
fn with_timestamp_text<R>(
    ts: &DateTime<Utc>,
    format: SecondsFormat,
    use_text: impl FnOnce(&str) -> R,
) -> R {
    let digits = if format == SecondsFormat::Micros {
        6
    } else {
        3
    };
    let mut buf = [0; MICROS_TIMESTAMP_LEN];
    match write_timestamp_digits(ts, &mut buf[..UNFRACTIONED_LEN + digits as usize], digits) {
        Some(text) => use_text(text),
        None => use_text(&ts.to_rfc3339_opts(format, true)),
    }
}

/// Length of `YYYY-MM-DDTHH:MM:SS.Z`: a timestamp without its fraction digits.
const UNFRACTIONED_LEN: usize = 21;

/// Length of `YYYY-MM-DDTHH:MM:SS.mmmZ`.
#[cfg(test)]
const TIMESTAMP_LEN: usize = UNFRACTIONED_LEN + 3;

/// Length of `YYYY-MM-DDTHH:MM:SS.uuuuuuZ`.
const MICROS_TIMESTAMP_LEN: usize = UNFRACTIONED_LEN + 6;

/// Writes `ts` in RFC 3339 UTC with `fraction_digits` (3 or 6) digits of
/// seconds into `buf`, which is exactly long enough for them, without
/// allocating: every task status carries one, and chrono's general
/// formatter was 4 % of the ledger's CPU. `None` for what chrono must
/// format (years outside 0..=9999, leap seconds).
fn write_timestamp_digits<'a>(
    ts: &DateTime<Utc>,
    buf: &'a mut [u8],
    fraction_digits: u32,
) -> Option<&'a str> {
    debug_assert!(fraction_digits <= 9 && buf.len() == UNFRACTIONED_LEN + fraction_digits as usize);
    let (secs, nanos) = (ts.timestamp(), ts.timestamp_subsec_nanos());
    if nanos >= 1_000_000_000 {
        return None;
    }
    let (second, rest) = buf.split_at_mut(SECOND_TEXT_LEN);
    second.copy_from_slice(&second_text(secs)?);
    rest[0] = b'.';
    let digits = fraction_digits as usize;
    let mut fraction = nanos / 10u32.pow(9 - fraction_digits);
    for at in (1..=digits).rev() {
        rest[at] = b'0' + (fraction % 10) as u8;
        fraction /= 10;
    }
    rest[digits + 1] = b'Z';
    std::str::from_utf8(buf).ok()
}

/// Length of `YYYY-MM-DDTHH:MM:SS`.
const SECOND_TEXT_LEN: usize = 19;

thread_local! {
    /// The second last written on this thread, and its text: a task's
    /// timestamps, and those of tasks written together, mostly fall in one
    /// second, and its calendar date took most of a timestamp's ~450
    /// instructions (callgrind).
    static LAST_SECOND: std::cell::Cell<(i64, [u8; SECOND_TEXT_LEN])> =
        const { std::cell::Cell::new((i64::MIN, [0; SECOND_TEXT_LEN])) };
}

/// `YYYY-MM-DDTHH:MM:SS` of the second `secs` after the epoch; `None`
/// outside years 0..=9999.
fn second_text(secs: i64) -> Option<[u8; SECOND_TEXT_LEN]> {
    let (last, text) = LAST_SECOND.get();
    if last == secs {
        return Some(text);
    }
    let (year, month, day) = civil_from_days(secs.div_euclid(86_400));
    if !(0..=9999).contains(&year) {
        return None;
    }
    let second_of_day = secs.rem_euclid(86_400) as u32;
    let fields = [
        (0, 4, year as u32),
        (5, 2, month),
        (8, 2, day),
        (11, 2, second_of_day / 3600),
        (14, 2, second_of_day / 60 % 60),
        (17, 2, second_of_day % 60),
    ];
    let mut text = *b"0000-00-00T00:00:00";
    for (start, width, mut value) in fields {
        for at in (start..start + width).rev() {
            text[at] = b'0' + (value % 10) as u8;
            value /= 10;
        }
    }
    LAST_SECOND.set((secs, text));
    Some(text)
}

/// The proleptic Gregorian (year, month, day) of a day counted from
/// 1970-01-01: arithmetic only, where chrono's calendar fields each
/// decode its packed date again (H. Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let days = days + 719_468;
    let era = days.div_euclid(146_097);
    let day_of_era = days.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * shifted_month + 2) / 5 + 1) as u32;
    let month = if shifted_month < 10 {
        shifted_month + 3
    } else {
        shifted_month - 9
    } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Parses an RFC 3339 timestamp with any offset, normalised to UTC.
pub fn parse_timestamp(text: &str) -> Result<DateTime<Utc>, String> {
    DateTime::parse_from_rfc3339(text)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| format!("invalid RFC 3339 timestamp {text:?}: {e}"))
}

/// Serde adapter for `Option<DateTime<Utc>>` timestamp fields.
pub mod opt_timestamp {
    use super::*;

    /// Writes the timestamp in RFC 3339 UTC with milliseconds.
    pub fn serialize<S: Serializer>(ts: &Option<DateTime<Utc>>, s: S) -> Result<S::Ok, S::Error> {
        match ts {
            Some(ts) => {
                with_timestamp_text(ts, SecondsFormat::Millis, |text| s.serialize_str(text))
            }
            None => s.serialize_none(),
        }
    }

    /// Reads an RFC 3339 timestamp, or `null`.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<DateTime<Utc>>, D::Error> {
        match Option::<String>::deserialize(d)? {
            Some(text) => parse_timestamp(&text).map(Some).map_err(de::Error::custom),
            None => Ok(None),
        }
    }
}

/// Serde adapter for the ledger's own `DateTime<Utc>` fields (not A2A
/// types; traces show them): RFC 3339 UTC with microseconds, written without chrono's general
/// formatter. Reads any RFC 3339 text, as chrono's own format did.
pub mod record_timestamp {
    use super::*;

    /// Writes the timestamp with microseconds.
    pub fn serialize<S: Serializer>(ts: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
        with_timestamp_text(ts, SecondsFormat::Micros, |text| s.serialize_str(text))
    }

    /// Reads an RFC 3339 timestamp.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DateTime<Utc>, D::Error> {
        DateTime::<Utc>::deserialize(d)
    }

    /// The same for optional fields.
    pub mod option {
        use super::*;

        /// Writes the timestamp with microseconds, or `null`.
        pub fn serialize<S: Serializer>(
            ts: &Option<DateTime<Utc>>,
            s: S,
        ) -> Result<S::Ok, S::Error> {
            match ts {
                Some(ts) => super::serialize(ts, s),
                None => s.serialize_none(),
            }
        }

        /// Reads an RFC 3339 timestamp, or `null`.
        pub fn deserialize<'de, D: Deserializer<'de>>(
            d: D,
        ) -> Result<Option<DateTime<Utc>>, D::Error> {
            Option::<DateTime<Utc>>::deserialize(d)
        }
    }
}

/// Decodes base64 in any of the alphabets and paddings ProtoJSON parsers accept.
pub fn decode_base64(text: &str) -> Result<Vec<u8>, String> {
    let engines = [&STANDARD, &STANDARD_NO_PAD, &URL_SAFE, &URL_SAFE_NO_PAD];
    engines
        .iter()
        .find_map(|engine| engine.decode(text).ok())
        .ok_or_else(|| "invalid base64 in bytes field".to_string())
}

/// Reads an optional `bytes` field: base64 as [`decode_base64`] takes it, or
/// `null`.
pub fn opt_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
    match Option::<String>::deserialize(d)? {
        Some(text) => decode_base64(&text).map(Some).map_err(de::Error::custom),
        None => Ok(None),
    }
}

/// Encodes bytes as standard padded base64, as ProtoJSON writes them.
pub fn encode_base64(bytes: &[u8]) -> String {
    STANDARD.encode(bytes)
}

/// Serde adapter for `Option<i32>` fields: accepts numbers, integral doubles
/// (SDKs built on protobuf send `10.0`) and numeric strings; rejects the rest.
pub mod opt_int32 {
    use super::*;

    /// Writes the number when it is set.
    pub fn serialize<S: Serializer>(value: &Option<i32>, s: S) -> Result<S::Ok, S::Error> {
        match value {
            Some(v) => s.serialize_i32(*v),
            None => s.serialize_none(),
        }
    }

    /// Reads an int32 leniently, or `null`.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i32>, D::Error> {
        d.deserialize_any(Int32Visitor)
    }
}

/// Reads a plain (non-optional) int32 leniently; `null` is 0.
pub fn int32<'de, D: Deserializer<'de>>(d: D) -> Result<i32, D::Error> {
    Ok(d.deserialize_any(Int32Visitor)?.unwrap_or_default())
}

struct Int32Visitor;

impl<'de> Visitor<'de> for Int32Visitor {
    type Value = Option<i32>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a 32-bit integer")
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        i32::try_from(v)
            .map(Some)
            .map_err(|_| E::custom(format!("{v} is out of the int32 range")))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        i32::try_from(v)
            .map(Some)
            .map_err(|_| E::custom(format!("{v} is out of the int32 range")))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        if v.fract() != 0.0 || !v.is_finite() {
            return Err(E::custom(format!("{v} is not an integer")));
        }
        if v < f64::from(i32::MIN) || v > f64::from(i32::MAX) {
            return Err(E::custom(format!("{v} is out of the int32 range")));
        }
        Ok(Some(v as i32))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        let text = v.trim();
        if let Ok(n) = text.parse::<i64>() {
            return self.visit_i64(n);
        }
        // A quoted number in any JSON form ("1e1", "10.0"), as protobuf's
        // own ProtoJSON readers take it; not Rust's "inf" or "NaN".
        let json_number = text.starts_with(|c: char| c == '-' || c.is_ascii_digit())
            && text
                .bytes()
                .all(|b| b.is_ascii_digit() || b"+-.eE".contains(&b));
        match text.parse::<f64>() {
            Ok(n) if json_number => self.visit_f64(n),
            _ => Err(E::custom(format!("{v:?} is not an integer"))),
        }
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}

/// A proto field name (`snake_case`) in its ProtoJSON spelling (`snakeCase`);
/// names without `_` are unchanged.
pub fn to_camel_case(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut upper = false;
    for c in name.chars() {
        if c == '_' {
            upper = true;
        } else if upper {
            out.extend(c.to_uppercase());
            upper = false;
        } else {
            out.push(c);
        }
    }
    out
}

/// Skips a `bool` field at its default when serializing.
pub fn is_false(value: &bool) -> bool {
    !*value
}

/// Skips a plain (non-optional) `int32` field at its default when serializing.
pub fn is_zero(value: &i32) -> bool {
    *value == 0
}

/// Enums on the wire: the proto name on output; the name, a lenient alias or
/// the number on input.
pub trait ProtoEnum: Sized + Copy + 'static {
    /// Every value with its proto name and number.
    const VALUES: &'static [(Self, &'static str, i32)];
    /// What the enum is called in errors.
    const TYPE_NAME: &'static str;

    /// Extra spellings accepted on input (for example v0.3 lowercase names).
    fn from_alias(_text: &str) -> Option<Self> {
        None
    }

    /// The proto name.
    fn proto_name(self) -> &'static str
    where
        Self: PartialEq,
    {
        Self::VALUES
            .iter()
            .find(|(v, _, _)| *v == self)
            .map(|(_, name, _)| *name)
            .unwrap_or("")
    }

    /// Parses a proto name or alias.
    fn from_name(text: &str) -> Option<Self> {
        Self::VALUES
            .iter()
            .find(|(_, name, _)| *name == text)
            .map(|(v, _, _)| *v)
            .or_else(|| Self::from_alias(text))
    }

    /// Parses a proto number.
    fn from_number(n: i64) -> Option<Self> {
        Self::VALUES
            .iter()
            .find(|(_, _, num)| i64::from(*num) == n)
            .map(|(v, _, _)| *v)
    }
}

/// Deserializes a [`ProtoEnum`] from its name, an alias or its number.
pub fn deserialize_enum<'de, D, E>(d: D) -> Result<E, D::Error>
where
    D: Deserializer<'de>,
    E: ProtoEnum + Default,
{
    struct EnumVisitor<E>(std::marker::PhantomData<E>);

    impl<'de, E: ProtoEnum + Default> Visitor<'de> for EnumVisitor<E> {
        type Value = E;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            write!(f, "a {} name or number", E::TYPE_NAME)
        }

        fn visit_str<Er: de::Error>(self, v: &str) -> Result<E, Er> {
            E::from_name(v).ok_or_else(|| Er::custom(format!("unknown {} {v:?}", E::TYPE_NAME)))
        }

        fn visit_i64<Er: de::Error>(self, v: i64) -> Result<E, Er> {
            E::from_number(v).ok_or_else(|| Er::custom(format!("unknown {} {v}", E::TYPE_NAME)))
        }

        fn visit_u64<Er: de::Error>(self, v: u64) -> Result<E, Er> {
            self.visit_i64(i64::try_from(v).unwrap_or(i64::MAX))
        }

        fn visit_f64<Er: de::Error>(self, v: f64) -> Result<E, Er> {
            if v.fract() == 0.0 && v.is_finite() {
                self.visit_i64(v as i64)
            } else {
                Err(Er::custom(format!("unknown {} {v}", E::TYPE_NAME)))
            }
        }

        fn visit_unit<Er: de::Error>(self) -> Result<E, Er> {
            Ok(E::default())
        }

        fn visit_none<Er: de::Error>(self) -> Result<E, Er> {
            Ok(E::default())
        }
    }

    d.deserialize_any(EnumVisitor(std::marker::PhantomData))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_int32_is_read_from_any_json_number_quoted_or_not() {
        let read = |json: &str| -> Result<i32, String> {
            let mut d = serde_json::Deserializer::from_str(json);
            int32(&mut d).map_err(|e| e.to_string())
        };
        for (json, value) in [
            ("10", 10),
            ("10.0", 10),
            ("1e1", 10),
            (r#""10""#, 10),
            (r#"" 10 ""#, 10),
            (r#""1e1""#, 10),
            (r#""1.0E1""#, 10),
            (r#""-2.0""#, -2),
            (r#""2147483647""#, i32::MAX),
            ("null", 0),
        ] {
            assert_eq!(read(json), Ok(value), "{json}");
        }
        for json in [
            r#""abc""#,
            r#""1.5""#,
            r#""1e10""#,
            r#""2147483648""#,
            r#""inf""#,
            r#""NaN""#,
            r#""infinity""#,
            r#""""#,
            "1.5",
            "true",
        ] {
            assert!(read(json).is_err(), "{json} was read");
        }
    }

    #[test]
    fn a_struct_is_shared_until_changed_and_reads_and_writes_as_a_plain_object() {
        let text = r#"{"a":{"b":[1,"two"]},"c":null}"#;
        let original: Struct = serde_json::from_str(text).unwrap();
        assert_eq!(serde_json::to_string(&original).unwrap(), text);
        let mut copy = original.clone();
        assert!(Arc::ptr_eq(&original.0, &copy.0));
        copy.insert("d".into(), serde_json::json!(true));
        assert!(
            !original.contains_key("d"),
            "a change must not reach the original"
        );
        assert_eq!(copy.len(), 3);
        assert_eq!(
            format!("{copy:?}"),
            format!("{:?}", serde_json::Map::clone(&copy))
        );
        assert!(serde_json::from_str::<Struct>("[1]").is_err());

        // The JSON kept from an earlier write follows every change.
        assert_eq!(serde_json::to_string(&original).unwrap(), text);
        assert_eq!(
            serde_json::to_string(&copy).unwrap(),
            r#"{"a":{"b":[1,"two"]},"c":null,"d":true}"#
        );
        copy.remove("a");
        assert_eq!(
            serde_json::to_string(&copy).unwrap(),
            r#"{"c":null,"d":true}"#
        );
        assert_eq!(
            serde_json::to_value(&copy).unwrap(),
            serde_json::json!({"c": null, "d": true})
        );
    }

    #[test]
    fn base64_accepts_every_alphabet() {
        assert_eq!(decode_base64("aGk=").unwrap(), b"hi");
        assert_eq!(decode_base64("aGk").unwrap(), b"hi");
        assert_eq!(decode_base64("-_8=").unwrap(), vec![0xfb, 0xff]);
        assert!(decode_base64("not base64!").is_err());
        assert_eq!(encode_base64(&[0xfb, 0xff]), "+/8=");
    }

    #[test]
    fn timestamps_normalise_to_utc_millis() {
        let ts = parse_timestamp("2026-01-02T03:04:05+02:00").unwrap();
        assert_eq!(format_timestamp(&ts), "2026-01-02T01:04:05.000Z");
        assert!(parse_timestamp("yesterday").is_err());
    }

    #[test]
    fn the_fast_timestamp_writer_agrees_with_chrono() {
        let cases = [
            "1970-01-01T00:00:00Z",
            "2026-11-30T23:59:59.999Z",
            // The same second again (the cached text), then the next.
            "2026-11-30T23:59:59.001Z",
            "2026-12-01T00:00:00.001Z",
            "2026-02-03T04:05:06.007891Z",
            "0001-01-01T00:00:00.100Z",
            "9999-12-31T23:59:59.5Z",
            "2024-02-29T12:00:00.050+05:30",
        ];
        for text in cases {
            let ts = parse_timestamp(text).unwrap();
            let mut buf = [0; TIMESTAMP_LEN];
            let fast = write_timestamp_digits(&ts, &mut buf, 3)
                .unwrap()
                .to_string();
            assert_eq!(
                fast,
                ts.to_rfc3339_opts(SecondsFormat::Millis, true),
                "{text}"
            );
            assert_eq!(format_timestamp(&ts), fast);
            let mut buf = [0; MICROS_TIMESTAMP_LEN];
            let micros = write_timestamp_digits(&ts, &mut buf, 6).unwrap();
            assert_eq!(
                micros,
                ts.to_rfc3339_opts(SecondsFormat::Micros, true),
                "{text}"
            );
        }
    }

    #[test]
    fn the_civil_date_agrees_with_chrono_across_four_centuries_and_more() {
        use chrono::Datelike;
        // Every day from 1600 to 2400 (leap centuries and not), then the
        // first and last days the fast writer takes.
        let from = chrono::NaiveDate::from_ymd_opt(1600, 1, 1).unwrap();
        let to = chrono::NaiveDate::from_ymd_opt(2400, 12, 31).unwrap();
        let epoch = chrono::NaiveDate::from_ymd_opt(1970, 1, 1).unwrap();
        let first = chrono::NaiveDate::from_ymd_opt(0, 1, 1).unwrap();
        let last = chrono::NaiveDate::from_ymd_opt(9999, 12, 31).unwrap();
        for date in from
            .iter_days()
            .take_while(|d| *d <= to)
            .chain([first, last])
        {
            let days = (date - epoch).num_days();
            assert_eq!(
                civil_from_days(days),
                (i64::from(date.year()), date.month(), date.day()),
                "{date}"
            );
        }
    }

    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    struct Stamped {
        #[serde(with = "record_timestamp")]
        at: DateTime<Utc>,
        #[serde(default, with = "record_timestamp::option")]
        maybe: Option<DateTime<Utc>>,
    }

    #[test]
    fn record_timestamps_leave_leap_seconds_and_far_years_to_chrono() {
        let leap = chrono::NaiveDate::from_ymd_opt(2016, 12, 31)
            .unwrap()
            .and_hms_nano_opt(23, 59, 59, 1_250_000_000)
            .unwrap()
            .and_utc();
        // 10000-01-01T00:00:00.5Z
        let far = DateTime::from_timestamp(253_402_300_800, 500_000_000).unwrap();
        assert_eq!(chrono::Datelike::year(&far), 10_000);
        for ts in [leap, far] {
            let json = serde_json::to_value(Stamped {
                at: ts,
                maybe: None,
            })
            .unwrap();
            assert_eq!(json["at"], ts.to_rfc3339_opts(SecondsFormat::Micros, true));
        }
    }

    #[test]
    fn record_timestamps_keep_microseconds_and_read_chronos_own_format() {
        let at = parse_timestamp("2026-11-30T23:59:59.123456789Z").unwrap();
        let stamped = Stamped {
            at,
            maybe: Some(at),
        };
        let json = serde_json::to_string(&stamped).unwrap();
        assert_eq!(
            json,
            r#"{"at":"2026-11-30T23:59:59.123456Z","maybe":"2026-11-30T23:59:59.123456Z"}"#
        );
        // Records written before this adapter carry chrono's nanoseconds.
        let older = r#"{"at":"2026-11-30T23:59:59.123456789Z","maybe":null}"#;
        let read: Stamped = serde_json::from_str(older).unwrap();
        assert_eq!(read, Stamped { at, maybe: None });
    }
}
