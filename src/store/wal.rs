//! The ledger's write-ahead log: what makes a write durable.
//!
//! Every ledger write is appended here as one frame and the flusher makes a
//! group of frames durable with one synchronous write (`O_DSYNC`). sled holds the same data as
//! the queryable store, applied in the background and flushed only at
//! checkpoints (see [`super::applier`]); after a crash, the frames still in
//! the log are applied again at start-up.
//!
//! Why not sled's own flush: measured on a 2-core machine, a sled flush costs
//! ~0.3 ms of CPU across its IO threads, and every new key a transition
//! inserts costs ~10 µs, which capped durable transitions at ~5 k/s. A frame
//! append is a `memcpy`, and the log's sync is shared by every writer
//! waiting on it.
//!
//! Layout: segment files `wal/<number>.log`, each a run of frames
//! `[payload length u32 LE][crc32 of payload u32 LE][payload JSON]`, then
//! zeros (space allocated ahead). A zero length ends a segment's frames.
//! The last segment may also end at a frame that fails its checksum and is
//! followed by zeros only: the write a crash interrupted, whose writers were
//! never answered. Any other end is damage, and the log ends before it (see
//! [`read_all`]).

use super::TaskRecord;
use super::append::ArtifactChange;
use crate::protocol::{Message, StreamResponse};
use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

/// Size after which the flusher starts a new segment and the old one is
/// checkpointed away.
pub const SEGMENT_LIMIT: u64 = 64 * 1024 * 1024;

/// Header bytes before each frame's payload.
const HEADER: usize = 8;

/// One logged write, as encoded (borrowing, so the hot path clones nothing).
#[derive(Serialize)]
#[serde(rename_all = "camelCase", tag = "op")]
pub enum EntryRef<'a> {
    /// A task's record after the write, and the events it appended.
    Task {
        /// The record after the write, already encoded (the applier stores
        /// these same bytes in sled).
        record: &'a serde_json::value::RawValue,
        /// The appended events with their sequence numbers, already
        /// encoded (streams and the applier reuse the same bytes).
        events: Vec<(u64, &'a serde_json::value::RawValue)>,
    },
    /// A large task's record after a write that only added to its history
    /// and artifacts, as what it added (see [`super::append`]).
    TaskAppend {
        /// The record after the write without history or artifacts.
        head: &'a serde_json::value::RawValue,
        /// The history's length before the write.
        #[serde(rename = "historyFrom")]
        history_from: usize,
        /// The messages the write added.
        #[serde(skip_serializing_if = "<[Message]>::is_empty")]
        history: &'a [Message],
        /// The artifacts the write changed or added.
        #[serde(skip_serializing_if = "<[ArtifactChange]>::is_empty")]
        artifacts: &'a [ArtifactChange],
        /// As in [`EntryRef::Task`].
        #[serde(skip_serializing_if = "Vec::is_empty")]
        events: Vec<(u64, &'a serde_json::value::RawValue)>,
    },
    /// A raw key set (push configs, idempotency records, agents).
    Put {
        /// Key.
        key: &'a [u8],
        /// Value.
        value: &'a [u8],
    },
    /// A raw key removed.
    Remove {
        /// Key.
        key: &'a [u8],
    },
}

/// One logged write, as read back at start-up.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", tag = "op")]
pub enum Entry {
    /// See [`EntryRef::Task`].
    Task {
        /// The record after the write.
        record: Box<TaskRecord>,
        /// The appended events with their sequence numbers.
        events: Vec<(u64, StreamResponse)>,
    },
    /// See [`EntryRef::TaskAppend`].
    TaskAppend {
        /// The record after the write without history or artifacts.
        head: Box<TaskRecord>,
        /// The history's length before the write.
        #[serde(rename = "historyFrom")]
        history_from: usize,
        /// The messages the write added.
        #[serde(default)]
        history: Vec<Message>,
        /// The artifacts the write changed or added.
        #[serde(default)]
        artifacts: Vec<ArtifactChange>,
        /// The appended events with their sequence numbers.
        #[serde(default)]
        events: Vec<(u64, StreamResponse)>,
    },
    /// See [`EntryRef::Put`].
    Put {
        /// Key.
        key: Vec<u8>,
        /// Value.
        value: Vec<u8>,
    },
    /// See [`EntryRef::Remove`].
    Remove {
        /// Key.
        key: Vec<u8>,
    },
}

/// Appends `entry` as one frame to `buf`.
pub fn encode(buf: &mut Vec<u8>, entry: &EntryRef<'_>) -> Result<(), serde_json::Error> {
    let start = buf.len();
    buf.extend_from_slice(&[0; HEADER]);
    serde_json::to_writer(&mut *buf, entry)?;
    let payload = &buf[start + HEADER..];
    let len = payload.len() as u32;
    let crc = crc32fast::hash(payload);
    buf[start..start + 4].copy_from_slice(&len.to_le_bytes());
    buf[start + 4..start + HEADER].copy_from_slice(&crc.to_le_bytes());
    Ok(())
}

/// The segment files in `dir`, oldest first.
pub fn segments(dir: &Path) -> io::Result<Vec<(u64, PathBuf)>> {
    let mut found = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(found),
        Err(err) => return Err(err),
    };
    for entry in entries {
        let path = entry?.path();
        let number = path
            .file_name()
            .and_then(|name| name.to_str())
            .and_then(|name| name.strip_suffix(".log"))
            .and_then(|stem| stem.parse::<u64>().ok());
        if let Some(number) = number {
            found.push((number, path));
        }
    }
    found.sort();
    Ok(found)
}

/// Reads every whole frame of the segments in `dir`, in order. The log
/// ends at the first damage, later segments included: what follows it must
/// not be applied over the hole. A segment's frames end in zeros up to the
/// file's end or, in the last segment only, in a torn frame (see
/// `SegmentEnd::Torn`); any other end is damage. The damaged segment and
/// those after it are moved to `dir/damaged/`, kept for an operator rather
/// than deleted with the replayed ones.
pub fn read_all(dir: &Path) -> io::Result<Vec<Entry>> {
    let mut entries = Vec::new();
    let segments = segments(dir)?;
    for (index, (_, path)) in segments.iter().enumerate() {
        let bytes = std::fs::read(path)?;
        let later = segments.len() - index - 1;
        let why = match read_segment(&bytes, &mut entries) {
            SegmentEnd::Clean => continue,
            SegmentEnd::Torn if later == 0 => {
                tracing::warn!(path = %path.display(), "the ledger log ends at a frame a crash cut short");
                break;
            }
            // A crash tears only the last frame written.
            SegmentEnd::Torn => "a frame failing its checksum".to_string(),
            SegmentEnd::Damaged(why) => why,
        };
        let kept = keep_damaged(dir, &segments[index..])?;
        tracing::error!(path = %path.display(), later, kept = %kept.display(), "the ledger log ends at {why}; it and any later segments are not replayed, and are kept");
        break;
    }
    Ok(entries)
}

/// How a segment's frames end.
enum SegmentEnd {
    /// A zero length, then zeros only.
    Clean,
    /// A frame inside the file failing its checksum, then zeros only: the
    /// last write, which a crash cut short. Space is zero-filled ahead of
    /// every append, so a frame written even in part lies within the file,
    /// and nothing is written after it.
    Torn,
    /// Anything else: the disk lost or changed data, or an older binary
    /// meets a frame it does not know (its checksum holds).
    Damaged(String),
}

/// Reads the whole frames of one segment's `bytes` into `entries`, up to
/// where they end.
fn read_segment(bytes: &[u8], entries: &mut Vec<Entry>) -> SegmentEnd {
    let zeros_from = |at: usize| {
        bytes
            .get(at..)
            .is_none_or(|rest| rest.iter().all(|&b| b == 0))
    };
    let mut at = 0;
    while let Some(header) = bytes.get(at..at + HEADER) {
        let len = u32::from_le_bytes(header[..4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(header[4..].try_into().expect("4 bytes"));
        if len == 0 {
            break;
        }
        let Some(payload) = bytes.get(at + HEADER..at + HEADER + len) else {
            return SegmentEnd::Damaged("a frame running past the segment's end".into());
        };
        if crc32fast::hash(payload) != crc {
            return if zeros_from(at + HEADER + len) {
                SegmentEnd::Torn
            } else {
                SegmentEnd::Damaged("a frame failing its checksum, with data after it".into())
            };
        }
        match super::decode_stored(payload) {
            Ok(entry) => entries.push(entry),
            Err(err) => return SegmentEnd::Damaged(format!("an undecodable frame ({err})")),
        }
        at += HEADER + len;
    }
    if zeros_from(at) {
        SegmentEnd::Clean
    } else {
        SegmentEnd::Damaged("data after a zero frame length".into())
    }
}

/// Moves `segments` to a folder of their own under `dir/damaged/`, named
/// by the time, and returns it.
pub fn keep_damaged(dir: &Path, segments: &[(u64, PathBuf)]) -> io::Result<PathBuf> {
    let stamp = chrono::Utc::now().format("%Y%m%dT%H%M%S%.3fZ").to_string();
    let damaged = dir.join("damaged");
    let kept = damaged.join(stamp);
    std::fs::create_dir_all(&kept)?;
    for (_, path) in segments {
        if let Some(name) = path.file_name() {
            std::fs::rename(path, kept.join(name))?;
        }
    }
    // Durable before start-up deletes the replayed segments: the moved ones
    // are then the only copy of what follows the damage.
    for moved in [&kept, &damaged, dir] {
        File::open(moved)?.sync_all()?;
    }
    Ok(kept)
}

/// The segment being appended to.
pub struct Segment {
    dir: PathBuf,
    number: u64,
    /// For zero-filling ahead, synced explicitly.
    file: File,
    /// The same file opened `O_DSYNC`: each append returns once durable.
    appends: File,
    /// Bytes of frames written.
    len: u64,
    /// Bytes of the file, zero-filled ahead of `len`.
    allocated: u64,
}

/// How far ahead of the frames a segment is zero-filled. Overwriting
/// allocated blocks lets a data sync skip the file-size metadata write:
/// measured here, 165–190 µs per sync instead of 260–350 µs.
const PREALLOCATE: u64 = 1024 * 1024;

/// What a preallocation writes from, a block at a time. Static: a fresh
/// `vec![0; 1 MiB]` per preallocation meant mimalloc clearing memory the
/// process had not touched, 256 page faults of 2–9 µs each on the 2-core VM
/// (README history, round 26). 64 KiB keeps the binary small; a block is one `pwrite`.
static ZEROS: [u8; 64 * 1024] = [0; 64 * 1024];

#[cfg(test)]
thread_local! {
    /// Makes this thread's next [`Segment::create`] fail.
    pub(crate) static FAIL_NEXT_CREATE: std::cell::Cell<bool> =
        const { std::cell::Cell::new(false) };
}

impl Segment {
    /// Creates segment `number` in `dir` (and `dir` itself if needed).
    pub fn create(dir: &Path, number: u64) -> io::Result<Self> {
        #[cfg(test)]
        if FAIL_NEXT_CREATE.take() {
            return Err(io::Error::other("injected by a test"));
        }
        let new_dir = !dir.exists();
        std::fs::create_dir_all(dir)?;
        let path = segment_path(dir, number);
        let file = OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .open(&path)?;
        // One `pwrite` on an `O_DSYNC` file instead of `pwrite` + `fdatasync`:
        // one syscall; p50 159–175 µs against 158–229 µs in three runs here.
        let appends = OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DSYNC)
            .open(&path)?;
        let mut segment = Self {
            dir: dir.to_path_buf(),
            number,
            file,
            appends,
            len: 0,
            allocated: 0,
        };
        segment.preallocate(0)?;
        // The new file's directory entry must be durable before frames in it
        // count, and so must a new directory's own entry (at the first start;
        // a rotation has nothing more to sync).
        File::open(dir)?.sync_all()?;
        if new_dir {
            let parent = dir.parent().filter(|p| !p.as_os_str().is_empty());
            File::open(parent.unwrap_or(Path::new(".")))?.sync_all()?;
        }
        Ok(segment)
    }

    /// Zero-fills the file so that `needed` more bytes fit after the frames.
    fn preallocate(&mut self, needed: u64) -> io::Result<()> {
        let target = self.len + needed.max(PREALLOCATE);
        if target <= self.allocated {
            return Ok(());
        }
        let mut at = self.allocated;
        while at < target {
            let block = (target - at).min(ZEROS.len() as u64);
            self.file.write_all_at(&ZEROS[..block as usize], at)?;
            at += block;
        }
        self.file.sync_all()?;
        self.allocated = target;
        Ok(())
    }

    /// Appends frames and makes them durable.
    pub fn append_durably(&mut self, frames: &[u8]) -> io::Result<()> {
        let needed = frames.len() as u64;
        if self.len + needed > self.allocated {
            self.preallocate(needed)?;
        }
        self.appends.write_all_at(frames, self.len)?;
        self.len += needed;
        Ok(())
    }

    /// Whether this segment has reached [`SEGMENT_LIMIT`].
    pub fn is_full(&self) -> bool {
        self.len >= SEGMENT_LIMIT
    }

    /// Starts the next segment; returns the path of this one.
    pub fn rotate(&mut self) -> io::Result<PathBuf> {
        let next = Segment::create(&self.dir, self.number + 1)?;
        let old = std::mem::replace(self, next);
        Ok(segment_path(&old.dir, old.number))
    }
}

fn segment_path(dir: &Path, number: u64) -> PathBuf {
    dir.join(format!("{number:020}.log"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_read_back_until_a_torn_tail() {
        let dir = tempfile::tempdir().unwrap();
        let mut segment = Segment::create(dir.path(), 7).unwrap();
        let mut frames = Vec::new();
        encode(
            &mut frames,
            &EntryRef::Put {
                key: b"k1",
                value: b"v1",
            },
        )
        .unwrap();
        encode(&mut frames, &EntryRef::Remove { key: b"k2" }).unwrap();
        segment.append_durably(&frames).unwrap();
        // A frame cut short, as a crash mid-write leaves it.
        let mut torn = Vec::new();
        encode(&mut torn, &EntryRef::Remove { key: b"k3" }).unwrap();
        segment.append_durably(&torn[..torn.len() - 2]).unwrap();

        let entries = read_all(dir.path()).unwrap();
        assert_eq!(entries.len(), 2);
        assert!(matches!(&entries[0], Entry::Put { key, value } if key == b"k1" && value == b"v1"));
        assert!(matches!(&entries[1], Entry::Remove { key } if key == b"k2"));
    }

    #[test]
    fn a_damaged_frame_ends_the_log_later_segments_included() {
        let dir = tempfile::tempdir().unwrap();
        let put = |frames: &mut Vec<u8>, key: &[u8]| {
            encode(frames, &EntryRef::Put { key, value: b"v" }).unwrap();
        };
        let mut first = Segment::create(dir.path(), 1).unwrap();
        let mut frames = Vec::new();
        put(&mut frames, b"k1");
        let damaged_at = frames.len() + HEADER;
        put(&mut frames, b"k2");
        frames[damaged_at] ^= 0xff;
        first.append_durably(&frames).unwrap();
        let mut second = Segment::create(dir.path(), 2).unwrap();
        let mut later = Vec::new();
        put(&mut later, b"k3");
        second.append_durably(&later).unwrap();

        let entries = read_all(dir.path()).unwrap();
        assert_eq!(entries.len(), 1, "only what precedes the damage");
        assert!(matches!(&entries[0], Entry::Put { key, .. } if key == b"k1"));
        // Kept aside whole, and no longer among the log's segments.
        assert!(segments(dir.path()).unwrap().is_empty());
        let kept: Vec<PathBuf> = std::fs::read_dir(dir.path().join("damaged"))
            .unwrap()
            .map(|entry| entry.unwrap().path())
            .collect();
        let [kept] = kept.as_slice() else {
            panic!("one folder of damaged segments: {kept:?}");
        };
        assert_eq!(
            std::fs::read(segment_path(kept, 1)).unwrap()[..frames.len()],
            frames
        );
        assert_eq!(
            std::fs::read(segment_path(kept, 2)).unwrap()[..later.len()],
            later
        );
    }

    #[test]
    fn a_segment_ends_at_zeros_or_a_torn_frame_and_anything_else_is_damage() {
        let mut whole = Vec::new();
        encode(&mut whole, &EntryRef::Remove { key: b"a" }).unwrap();
        let mut next = Vec::new();
        encode(&mut next, &EntryRef::Remove { key: b"b" }).unwrap();
        let zeros = [0; 64];
        let cut_short = [&next[..next.len() - 2], &zeros].concat();
        let mut flipped = next.clone();
        flipped[HEADER] ^= 0xff;
        let mut too_long = next.clone();
        too_long[..4].copy_from_slice(&1000u32.to_le_bytes());
        let mut stray = zeros.to_vec();
        stray[20] = 1;
        let payload = br#"{"op":"Bogus"}"#;
        let mut undecodable = (payload.len() as u32).to_le_bytes().to_vec();
        undecodable.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
        undecodable.extend_from_slice(payload);
        // What follows one whole frame, and how the segment then ends
        // (damage as its reason, up to any detail in brackets).
        let cases = [
            ("zeros", zeros.to_vec(), "clean"),
            ("nothing", Vec::new(), "clean"),
            ("a frame cut short", cut_short, "torn"),
            (
                "a frame failing its checksum, then a frame",
                [&flipped[..], &next, &zeros].concat(),
                "a frame failing its checksum, with data after it",
            ),
            (
                "a length past the file's end",
                [&too_long[..], &zeros[..8]].concat(),
                "a frame running past the segment's end",
            ),
            (
                "data after a zero length",
                stray,
                "data after a zero frame length",
            ),
            (
                "a frame whose checksum holds but does not decode",
                [&undecodable[..], &zeros].concat(),
                "an undecodable frame",
            ),
        ];
        for (case, after, expected) in cases {
            let mut entries = Vec::new();
            let end = match read_segment(&[&whole[..], &after].concat(), &mut entries) {
                SegmentEnd::Clean => "clean".to_string(),
                SegmentEnd::Torn => "torn".to_string(),
                SegmentEnd::Damaged(why) => why.split(" (").next().unwrap().to_string(),
            };
            assert_eq!(end, expected, "{case}");
            assert_eq!(entries.len(), 1, "{case}: the frame before");
        }
    }

    /// After the frames, zeros only, up to the zero-filled end.
    fn assert_zero_filled_after_the_frames(segment: &Segment) {
        let bytes = std::fs::read(segment_path(&segment.dir, segment.number)).unwrap();
        assert_eq!(bytes.len() as u64, segment.allocated);
        assert!(bytes[segment.len as usize..].iter().all(|&b| b == 0));
    }

    #[test]
    fn frames_of_many_sizes_read_back_past_the_zero_filled_space() {
        let dir = tempfile::tempdir().unwrap();
        let mut segment = Segment::create(dir.path(), 1).unwrap();
        let written: Vec<(String, Vec<u8>)> = (0..300)
            .map(|i| {
                (
                    format!("k{i}"),
                    vec![b'a' + (i % 26) as u8; (i * 37) % 3000],
                )
            })
            .collect();
        for (n, pair) in written.chunks(2).enumerate() {
            let mut frames = Vec::new();
            for (key, value) in pair {
                let entry = EntryRef::Put {
                    key: key.as_bytes(),
                    value,
                };
                encode(&mut frames, &entry).unwrap();
                if n % 2 == 0 {
                    segment.append_durably(&frames).unwrap();
                    frames.clear();
                }
            }
            // Every other pair goes in one append.
            if !frames.is_empty() {
                segment.append_durably(&frames).unwrap();
            }
        }
        assert!(segment.len > PREALLOCATE);
        let read: Vec<(Vec<u8>, Vec<u8>)> = read_all(dir.path())
            .unwrap()
            .into_iter()
            .map(|entry| match entry {
                Entry::Put { key, value } => (key, value),
                _ => panic!("only puts were written"),
            })
            .collect();
        let expected: Vec<(Vec<u8>, Vec<u8>)> = written
            .into_iter()
            .map(|(key, value)| (key.into_bytes(), value))
            .collect();
        assert_eq!(read, expected);
        assert_zero_filled_after_the_frames(&segment);
    }

    #[test]
    fn a_frame_larger_than_the_preallocation_step_is_zero_filled_for_and_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut segment = Segment::create(dir.path(), 1).unwrap();
        let sizes = [10, 2 * PREALLOCATE as usize + 12_345, 20];
        for (n, size) in sizes.iter().enumerate() {
            let mut frames = Vec::new();
            let key = format!("k{n}");
            let value = vec![b'v'; *size];
            encode(
                &mut frames,
                &EntryRef::Put {
                    key: key.as_bytes(),
                    value: &value,
                },
            )
            .unwrap();
            segment.append_durably(&frames).unwrap();
        }
        let read: Vec<usize> = read_all(dir.path())
            .unwrap()
            .into_iter()
            .map(|entry| match entry {
                Entry::Put { value, .. } => value.len(),
                _ => panic!("only puts were written"),
            })
            .collect();
        assert_eq!(read, sizes);
        assert!(segment.allocated > segment.len + PREALLOCATE / 2);
        assert_zero_filled_after_the_frames(&segment);
    }

    #[test]
    fn a_corrupt_frame_ends_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let mut segment = Segment::create(dir.path(), 1).unwrap();
        let mut frames = Vec::new();
        encode(&mut frames, &EntryRef::Remove { key: b"a" }).unwrap();
        let first_len = frames.len();
        encode(&mut frames, &EntryRef::Remove { key: b"b" }).unwrap();
        frames[first_len + HEADER + 3] ^= 0xff;
        segment.append_durably(&frames).unwrap();
        assert_eq!(read_all(dir.path()).unwrap().len(), 1);
    }

    #[test]
    fn rotation_keeps_segment_order() {
        let dir = tempfile::tempdir().unwrap();
        let mut segment = Segment::create(dir.path(), 1).unwrap();
        let old = segment.rotate().unwrap();
        assert!(old.ends_with("00000000000000000001.log"));
        let numbers: Vec<u64> = segments(dir.path())
            .unwrap()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(numbers, vec![1, 2]);
    }
}
