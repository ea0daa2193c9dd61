//! A session file: a header naming what its K/V is valid for, then segments appended turn by
//! turn. A segment replaces the session's pages from `first_page` on and its token history from
//! that page's first position, so a grown session appends only its new pages and a session
//! that diverged appends from the page where it did.
//!
//! Every part carries a CRC-32: the header, each segment's description and tokens, and each
//! page block. Reading stops at the first part that is short or does not check out (the tail a
//! `kill -9` tore): what came before it is the session as of its last complete segment. A
//! segment also names a hash of the history it continues; one written by another process whose
//! history had diverged (two replicas sharing the directory) does not continue this one and
//! ends the reading as a torn one does. Nothing is ever loaded that was not written whole.
//!
//! ```text
//! header:  "MTPXSES1" | u32 n | n bytes of JSON (Header) | u32 crc
//! segment: b'S' | u32 first_page | u32 total_len | u64 prefix_hash | u32 num_pages
//!          | u32 num_tokens | num_tokens × u32 | u32 crc | num_pages × (page | u32 crc)
//! ```
//! (little-endian throughout)

use crate::kv::{KvDtype, KvStorage};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

const MAGIC: &[u8; 8] = b"MTPXSES1";
const SEGMENT: u8 = b'S';
pub const FORMAT_VERSION: u32 = 1;

/// What a file's pages are valid for: a file for another model, element type, page size or
/// (q8) key scaling is never loaded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    pub dtype: KvDtype,
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub page_size: usize,
    pub page_bytes: usize,
    /// q8 only: the sha256 of the key channel scales the keys are stored divided by.
    pub key_channels_sha256: Option<String>,
}

impl KvLayout {
    pub fn of(kv: &KvStorage) -> Self {
        let shape = kv.shape();
        let key_channels_sha256 = kv.all_key_channels().map(|c| {
            let mut h = Sha256::new();
            c.iter().for_each(|x| h.update(x.to_le_bytes()));
            hex::encode(h.finalize())
        });
        Self {
            dtype: kv.dtype(),
            num_layers: shape.num_layers,
            num_kv_heads: shape.num_kv_heads,
            head_dim: shape.head_dim,
            page_size: shape.page_size,
            page_bytes: shape.page_bytes(kv.dtype()),
            key_channels_sha256,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    pub format: u32,
    pub model_sha256: String,
    pub kv: KvLayout,
    /// The API-key scope and the client's session id: a file is only ever restored for both.
    pub scope: String,
    pub session_id: String,
}

pub fn encode_header(header: &Header) -> Vec<u8> {
    let json = serde_json::to_vec(header).expect("a header serialises");
    let mut out = Vec::with_capacity(json.len() + 16);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(json.len() as u32).to_le_bytes());
    out.extend_from_slice(&json);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// A hash of the history a segment continues (the tokens before its first page).
pub fn prefix_hash(tokens: &[u32]) -> u64 {
    let mut h = Sha256::new();
    tokens.iter().for_each(|t| h.update(t.to_le_bytes()));
    u64::from_le_bytes(h.finalize()[..8].try_into().expect("8 bytes"))
}

/// One turn's addition: pages `first_page..` and the history from `first_page * page_size`.
pub struct Segment<'a> {
    pub first_page: usize,
    /// The session's positions once the segment is applied.
    pub total_len: usize,
    /// [`prefix_hash`] of the history before `first_page`.
    pub prefix_hash: u64,
    pub tokens: &'a [u32],
    /// Whole pages as [`KvStorage::export_pages`] writes them.
    pub pages: &'a [u8],
}

pub fn encode_segment(seg: &Segment, page_bytes: usize) -> Vec<u8> {
    let num_pages = seg.pages.len() / page_bytes;
    let mut out = Vec::with_capacity(seg.pages.len() + num_pages * 4 + seg.tokens.len() * 4 + 40);
    out.push(SEGMENT);
    out.extend_from_slice(&(seg.first_page as u32).to_le_bytes());
    out.extend_from_slice(&(seg.total_len as u32).to_le_bytes());
    out.extend_from_slice(&seg.prefix_hash.to_le_bytes());
    out.extend_from_slice(&(num_pages as u32).to_le_bytes());
    out.extend_from_slice(&(seg.tokens.len() as u32).to_le_bytes());
    seg.tokens
        .iter()
        .for_each(|t| out.extend_from_slice(&t.to_le_bytes()));
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    for page in seg.pages.chunks_exact(page_bytes) {
        out.extend_from_slice(page);
        out.extend_from_slice(&crc32fast::hash(page).to_le_bytes());
    }
    out
}

/// A session read back: its history and the pages holding it (`len.div_ceil(page_size)` of
/// them, back to back).
#[derive(Debug)]
pub struct Decoded {
    pub header: Header,
    pub tokens: Vec<u32>,
    pub pages: Vec<u8>,
    /// Bytes up to the end of the last segment applied: appending goes there.
    pub valid_bytes: usize,
    /// Whether reading stopped before the end of the file (a torn, corrupt or foreign tail).
    pub torn: bool,
}

/// Why a file is not a session at all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("not a session file, or its header is torn or corrupt")]
    BadHeader,
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n)?;
        let out = self.bytes.get(self.at..end)?;
        self.at = end;
        Some(out)
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
}

pub fn decode(bytes: &[u8]) -> Result<Decoded, DecodeError> {
    let mut r = Reader { bytes, at: 0 };
    let header = read_header(&mut r).ok_or(DecodeError::BadHeader)?;
    let (page_size, page_bytes) = (header.kv.page_size, header.kv.page_bytes);
    let mut out = Decoded {
        header,
        tokens: Vec::new(),
        pages: Vec::new(),
        valid_bytes: r.at,
        torn: false,
    };
    while r.at < bytes.len() {
        if !read_segment(&mut r, &mut out, page_size, page_bytes) {
            out.torn = true;
            break;
        }
        out.valid_bytes = r.at;
    }
    Ok(out)
}

fn read_header(r: &mut Reader) -> Option<Header> {
    if r.take(8)? != MAGIC {
        return None;
    }
    let n = r.u32()? as usize;
    let json = r.take(n)?;
    let crc = r.u32()?;
    if crc32fast::hash(&r.bytes[..r.at - 4]) != crc {
        return None;
    }
    let header: Header = serde_json::from_slice(json).ok()?;
    (header.format == FORMAT_VERSION && header.kv.page_size > 0 && header.kv.page_bytes > 0)
        .then_some(header)
}

/// Applies the next segment to `out`; `false` when it is torn, corrupt or does not continue the
/// history read so far (then `out` is unchanged).
fn read_segment(r: &mut Reader, out: &mut Decoded, page_size: usize, page_bytes: usize) -> bool {
    let start = r.at;
    let Some((first_page, total_len, hash, num_pages, num_tokens)) = (|| {
        if r.take(1)? != [SEGMENT] {
            return None;
        }
        Some((
            r.u32()? as usize,
            r.u32()? as usize,
            r.u64()?,
            r.u32()? as usize,
            r.u32()? as usize,
        ))
    })() else {
        return false;
    };
    let Some(token_bytes) = r.take(num_tokens * 4) else {
        return false;
    };
    let Some(crc) = r.u32() else { return false };
    if crc32fast::hash(&r.bytes[start..r.at - 4]) != crc {
        return false;
    }
    let from = first_page * page_size;
    let continues = from <= out.tokens.len()
        && from + num_tokens == total_len
        && total_len.div_ceil(page_size) == first_page + num_pages
        && prefix_hash(&out.tokens[..from]) == hash;
    if !continues {
        return false;
    }
    // Every page is checked before any is kept: the pages are copied once, into `out`.
    let mut pages = Vec::with_capacity(num_pages);
    for _ in 0..num_pages {
        let (Some(page), Some(crc)) = (r.take(page_bytes), r.u32()) else {
            return false;
        };
        if crc32fast::hash(page) != crc {
            return false;
        }
        pages.push(page);
    }
    out.tokens.truncate(from);
    out.tokens.extend(
        token_bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes"))),
    );
    out.pages.truncate(first_page * page_bytes);
    out.pages.reserve(num_pages * page_bytes);
    pages
        .iter()
        .for_each(|page| out.pages.extend_from_slice(page));
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    const PS: usize = 4;
    const PB: usize = 10;

    fn header() -> Header {
        Header {
            format: FORMAT_VERSION,
            model_sha256: "ab".repeat(32),
            kv: KvLayout {
                dtype: KvDtype::F16,
                num_layers: 1,
                num_kv_heads: 1,
                head_dim: 1,
                page_size: PS,
                page_bytes: PB,
                key_channels_sha256: None,
            },
            scope: "key-a".into(),
            session_id: "s1".into(),
        }
    }

    fn pages(n: usize, fill: u8) -> Vec<u8> {
        (0..n * PB).map(|i| fill.wrapping_add(i as u8)).collect()
    }

    fn segment(history: &[u32], first_page: usize, pages: &[u8]) -> Vec<u8> {
        let from = first_page * PS;
        encode_segment(
            &Segment {
                first_page,
                total_len: history.len(),
                prefix_hash: prefix_hash(&history[..from]),
                tokens: &history[from..],
                pages,
            },
            PB,
        )
    }

    /// A file of three turns: 6 positions, grown to 11, then diverged at 5 and grown to 9.
    fn three_turns() -> (Vec<u8>, Vec<usize>) {
        let mut file = encode_header(&header());
        let mut ends = vec![file.len()];
        let t1: Vec<u32> = (0..6).collect();
        file.extend(segment(&t1, 0, &pages(2, 0)));
        ends.push(file.len());
        let t2: Vec<u32> = (0..11).collect();
        file.extend(segment(&t2, 1, &pages(2, 50)));
        ends.push(file.len());
        let t3: Vec<u32> = (0..5).chain(100..104).collect();
        file.extend(segment(&t3, 1, &pages(2, 90)));
        ends.push(file.len());
        (file, ends)
    }

    #[test]
    fn segments_replace_pages_and_history_from_their_first_page() {
        let (file, ends) = three_turns();
        let d = decode(&file).unwrap();
        assert_eq!(d.header, header());
        assert_eq!(d.tokens, (0..5).chain(100..104).collect::<Vec<u32>>());
        let mut want = pages(1, 0);
        want.extend(pages(2, 90));
        assert_eq!(d.pages, want);
        assert_eq!((d.valid_bytes, d.torn), (file.len(), false));
        assert_eq!(d.valid_bytes, ends[3]);
    }

    #[test]
    fn a_file_cut_anywhere_reads_as_its_last_complete_segment() {
        let (file, ends) = three_turns();
        let full: Vec<Decoded> = ends.iter().map(|&e| decode(&file[..e]).unwrap()).collect();
        for cut in ends[0]..file.len() {
            let d = decode(&file[..cut]).unwrap();
            let whole = ends.iter().rposition(|&e| e <= cut).unwrap();
            assert_eq!(d.tokens, full[whole].tokens, "cut at {cut}");
            assert_eq!(d.pages, full[whole].pages, "cut at {cut}");
            assert_eq!(d.valid_bytes, ends[whole]);
            assert_eq!(d.torn, cut != ends[whole]);
        }
        for cut in 0..ends[0] {
            assert_eq!(decode(&file[..cut]).unwrap_err(), DecodeError::BadHeader);
        }
    }

    #[test]
    fn a_flipped_byte_anywhere_loses_at_most_the_segments_from_it_on() {
        let (file, ends) = three_turns();
        for at in 0..file.len() {
            let mut bad = file.clone();
            bad[at] ^= 0x20;
            match decode(&bad) {
                Err(DecodeError::BadHeader) => assert!(at < ends[0], "byte {at}"),
                Ok(d) => {
                    let hit = ends.iter().position(|&e| e > at).unwrap();
                    let want = decode(&file[..ends[hit - 1]]).unwrap();
                    assert!(d.torn, "byte {at}");
                    assert_eq!((d.tokens, d.pages), (want.tokens, want.pages), "byte {at}");
                }
            }
        }
    }

    #[test]
    fn a_segment_that_continues_another_history_is_not_applied() {
        let (mut file, ends) = three_turns();
        // Written by a process whose history had 7 in position 2: it does not continue this one.
        let other: Vec<u32> = vec![0, 1, 7, 3, 4, 5, 6, 8, 9];
        file.extend(segment(&other, 1, &pages(2, 7)));
        let d = decode(&file).unwrap();
        assert!(d.torn);
        assert_eq!(d.valid_bytes, ends[3]);
        assert_eq!(d.tokens, (0..5).chain(100..104).collect::<Vec<u32>>());
    }
}
