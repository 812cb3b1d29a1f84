//! The record file: where the applier keeps record buckets, out of sled.
//!
//! sled rewrites a value several times over as it consolidates and splits
//! the leaf holding it, and record buckets were nine tenths of what the
//! applier gave it. A bucket changes no more once written (a task that
//! leaves it gets a key of its own), so its sealed bytes are appended to
//! this file instead, and sled holds a pointer to them: where they start,
//! how many there are, and their CRC-32. Nothing is ever removed from it,
//! as no task is ever removed from the ledger.
//!
//! Durability: the file is synced at each checkpoint, before sled is
//! flushed and log segments are deleted, and the length it was synced to
//! goes into sled with that flush. A pointer whose bytes a crash lost thus
//! lies past that length, and belongs to writes the log still holds: at
//! start-up the applier removes such pointers and applies the log again
//! (see `Applier::recover`).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt as _;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// First byte of a sled value that points into the record file. A record
/// bucket stored in sled starts with 0 (plain) or `0xC1` (compressed).
const POINTER_MARKER: u8 = 0xF1;

/// Bytes of a pointer: the marker, the offset (u64 LE), the length (u32
/// LE) and the CRC-32 of the bytes (u32 LE).
const POINTER_LEN: usize = 17;

/// Where a record bucket's bytes are in the record file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pointer {
    offset: u64,
    len: u32,
    crc: u32,
}

impl Pointer {
    /// The pointer as sled stores it.
    pub fn encode(&self) -> [u8; POINTER_LEN] {
        let mut value = [0; POINTER_LEN];
        value[0] = POINTER_MARKER;
        value[1..9].copy_from_slice(&self.offset.to_le_bytes());
        value[9..13].copy_from_slice(&self.len.to_le_bytes());
        value[13..17].copy_from_slice(&self.crc.to_le_bytes());
        value
    }

    /// The pointer a sled value holds; `None` if it holds a bucket itself.
    pub fn decode(value: &[u8]) -> Option<Self> {
        let value: &[u8; POINTER_LEN] = value.try_into().ok()?;
        (value[0] == POINTER_MARKER).then(|| Self {
            offset: u64::from_le_bytes(value[1..9].try_into().expect("8 bytes")),
            len: u32::from_le_bytes(value[9..13].try_into().expect("4 bytes")),
            crc: u32::from_le_bytes(value[13..17].try_into().expect("4 bytes")),
        })
    }

    /// Where the pointed bytes end; `u64::MAX` for a damaged pointer that
    /// would end past it (no file is that long).
    pub fn end(&self) -> u64 {
        self.offset.saturating_add(u64::from(self.len))
    }
}

/// An append-only file of record buckets.
pub struct RecordFile {
    file: File,
    /// Where the next append goes; only the applier appends.
    end: AtomicU64,
    /// Set once a sync failed: after a failed `fsync` the kernel may have
    /// marked the unwritten pages clean, so a later sync's success proves
    /// nothing, and every later sync fails too (the log is then kept).
    sync_failed: AtomicBool,
}

impl RecordFile {
    /// Opens the record file at `path`, creating it if `may_create` (a
    /// missing file is otherwise `NotFound`). A file it creates has its
    /// directory entry synced, so that it is there after a crash as surely
    /// as the bytes a checkpoint syncs into it.
    pub fn open(path: &Path, may_create: bool) -> io::Result<Self> {
        let mut options = OpenOptions::new();
        options.read(true).write(true);
        let file = match options.open(path) {
            Ok(file) => file,
            Err(err) if err.kind() == io::ErrorKind::NotFound && may_create => {
                let file = options.create_new(true).open(path)?;
                let dir = path.parent().filter(|p| !p.as_os_str().is_empty());
                File::open(dir.unwrap_or(Path::new(".")))?.sync_all()?;
                file
            }
            Err(err) => return Err(err),
        };
        let end = file.metadata()?.len();
        Ok(Self {
            file,
            end: AtomicU64::new(end),
            sync_failed: AtomicBool::new(false),
        })
    }

    /// Where the file ends: the next append's offset.
    pub fn end(&self) -> u64 {
        self.end.load(Ordering::Acquire)
    }

    /// Appends buckets, given as their sealed bytes one after another in
    /// `joined`, `lens` long each, in one write; returns their pointers.
    /// Not synced: see the module doc.
    pub fn append(&self, joined: &[u8], lens: &[usize]) -> io::Result<Vec<Pointer>> {
        let start = self.end();
        self.file.write_all_at(joined, start)?;
        let mut offset = start;
        let mut at = 0;
        let pointers = lens
            .iter()
            .map(|&len| {
                let bytes = &joined[at..at + len];
                let pointer = Pointer {
                    offset,
                    len: len as u32,
                    crc: crc32fast::hash(bytes),
                };
                at += len;
                offset += len as u64;
                pointer
            })
            .collect();
        self.end
            .store(start + joined.len() as u64, Ordering::Release);
        Ok(pointers)
    }

    /// Makes everything appended so far durable; returns the length that is.
    pub fn sync(&self) -> io::Result<u64> {
        if self.sync_failed.load(Ordering::Relaxed) {
            return Err(io::Error::other(
                "an earlier sync of the record file failed; the log is kept",
            ));
        }
        let end = self.end();
        if let Err(err) = self.file.sync_data() {
            self.sync_failed.store(true, Ordering::Relaxed);
            return Err(err);
        }
        Ok(end)
    }

    /// The bytes `pointer` points to; `None` when they are not there whole
    /// (cut short, or other bytes than were written: lost in a crash).
    pub fn read(&self, pointer: &Pointer) -> io::Result<Option<Vec<u8>>> {
        if pointer.end() > self.end() {
            return Ok(None);
        }
        let mut bytes = vec![0; pointer.len as usize];
        match self.file.read_exact_at(&mut bytes, pointer.offset) {
            Ok(()) => {}
            Err(err) if err.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(err) => return Err(err),
        }
        Ok((crc32fast::hash(&bytes) == pointer.crc).then_some(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A new record file in a fresh directory, with its path.
    fn new_file() -> (tempfile::TempDir, std::path::PathBuf, RecordFile) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("records");
        let file = RecordFile::open(&path, true).unwrap();
        (dir, path, file)
    }

    #[test]
    fn appended_buckets_are_read_back_through_their_pointers() {
        let (_dir, path, file) = new_file();
        let pointers = file.append(b"firstsecond!", &[5, 7]).unwrap();
        let more = file.append(b"third", &[5]).unwrap();
        assert_eq!(file.read(&pointers[0]).unwrap().unwrap(), b"first");
        assert_eq!(file.read(&pointers[1]).unwrap().unwrap(), b"second!");
        assert_eq!(file.read(&more[0]).unwrap().unwrap(), b"third");
        assert_eq!(file.sync().unwrap(), 17);

        let reopened = RecordFile::open(&path, true).unwrap();
        assert_eq!(reopened.end(), 17, "appends go on at the end");
        let decoded = Pointer::decode(&more[0].encode()).unwrap();
        assert_eq!(reopened.read(&decoded).unwrap().unwrap(), b"third");
    }

    #[test]
    fn bytes_lost_or_changed_are_not_read() {
        let (_dir, path, file) = new_file();
        let pointers = file.append(b"keptlost", &[4, 4]).unwrap();
        drop(file);

        // A crash kept the first bucket and lost the second's bytes.
        std::fs::write(&path, b"kept\0\0").unwrap();
        let file = RecordFile::open(&path, true).unwrap();
        assert_eq!(file.read(&pointers[0]).unwrap().unwrap(), b"kept");
        assert_eq!(file.read(&pointers[1]).unwrap(), None, "cut short");
        std::fs::write(&path, b"keptLOST").unwrap();
        let file = RecordFile::open(&path, true).unwrap();
        assert_eq!(file.read(&pointers[1]).unwrap(), None, "other bytes");
    }

    #[test]
    fn a_pointer_ending_past_the_largest_offset_reads_nothing() {
        let (_dir, _, file) = new_file();
        file.append(b"bytes", &[5]).unwrap();
        let damaged = Pointer {
            offset: u64::MAX - 1,
            len: 5,
            crc: 0,
        };
        assert_eq!(damaged.end(), u64::MAX);
        assert_eq!(file.read(&damaged).unwrap(), None);
    }

    #[test]
    fn only_a_pointer_decodes_as_one() {
        let pointer = Pointer {
            offset: 1 << 40,
            len: 6000,
            crc: 0xDEAD_BEEF,
        };
        assert_eq!(Pointer::decode(&pointer.encode()), Some(pointer));
        assert_eq!(Pointer::decode(&[0; POINTER_LEN]), None, "a plain bucket");
        assert_eq!(Pointer::decode(&pointer.encode()[..16]), None);
        let mut compressed = pointer.encode();
        compressed[0] = 0xC1;
        assert_eq!(Pointer::decode(&compressed), None);
    }
}
