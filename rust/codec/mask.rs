//! Masking (RFC 6455 section 5.3) and the payload of a frame as it sits in the input, still
//! masked: what the websocket decoder yields and what a dialect's scanner reads (`scanner`),
//! unmasked eight bytes at a time only where a copy is made anyway.

/// Chunk used to validate UTF-8 of a masked payload without allocating; a multiple of 4 so
/// every chunk starts at mask phase 0.
pub(crate) const UTF8_CHUNK: usize = 1024;

/// The mask repeated to eight bytes, for word-at-a-time XOR. Load and store use the same
/// (native) byte order, so byte `i` of a word always meets `mask[i % 4]`.
#[inline]
pub(crate) fn mask_word(mask: [u8; 4]) -> u64 {
    let [a, b, c, d] = mask;
    u64::from_ne_bytes([a, b, c, d, a, b, c, d])
}

/// XOR `buf` with the mask in place, starting at mask phase 0 (RFC 6455 section 5.3).
pub fn apply_mask(buf: &mut [u8], mask: [u8; 4]) {
    let word = mask_word(mask);
    let mut chunks = buf.chunks_exact_mut(8);
    for chunk in &mut chunks {
        let v = u64::from_ne_bytes(chunk.try_into().expect("8-byte chunk")) ^ word;
        chunk.copy_from_slice(&v.to_ne_bytes());
    }
    // The remainder starts at a multiple of 8, so at mask phase 0 again.
    for (i, b) in chunks.into_remainder().iter_mut().enumerate() {
        *b ^= mask[i & 3];
    }
}

/// `dst = src ^ mask`, fusing the copy and the unmasking into one pass.
pub fn copy_masked(dst: &mut [u8], src: &[u8], mask: [u8; 4]) {
    assert_eq!(dst.len(), src.len(), "copy_masked needs equal lengths");
    let word = mask_word(mask);
    let mut d = dst.chunks_exact_mut(8);
    let mut s = src.chunks_exact(8);
    for (dc, sc) in (&mut d).zip(&mut s) {
        let v = u64::from_ne_bytes(sc.try_into().expect("8-byte chunk")) ^ word;
        dc.copy_from_slice(&v.to_ne_bytes());
    }
    for (i, (db, sb)) in d.into_remainder().iter_mut().zip(s.remainder()).enumerate() {
        *db = sb ^ mask[i & 3];
    }
}

/// The mask as seen from payload offset `start` (the key repeats every four bytes).
#[inline]
pub(crate) fn rotate_mask(mask: [u8; 4], start: usize) -> [u8; 4] {
    let s = start & 3;
    [
        mask[s],
        mask[(s + 1) & 3],
        mask[(s + 2) & 3],
        mask[(s + 3) & 3],
    ]
}

/// A frame payload as it sits in the input: still masked when `mask` is set.
#[derive(Debug, Clone, Copy)]
pub struct Payload<'a> {
    pub(crate) bytes: &'a [u8],
    pub(crate) mask: Option<[u8; 4]>,
}

impl<'a> Payload<'a> {
    pub fn new(bytes: &'a [u8], mask: Option<[u8; 4]>) -> Self {
        Payload { bytes, mask }
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The bytes when they need no unmasking (the caller can copy them as they are).
    pub fn as_unmasked(&self) -> Option<&'a [u8]> {
        match self.mask {
            None => Some(self.bytes),
            Some(_) => None,
        }
    }

    /// Write the unmasked payload into `out` (exactly `len()` bytes).
    pub fn copy_to(&self, out: &mut [u8]) {
        match self.mask {
            Some(mask) => copy_masked(out, self.bytes, mask),
            None => out.copy_from_slice(self.bytes),
        }
    }

    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = vec![0; self.len()];
        self.copy_to(&mut out);
        out
    }

    /// Write the unmasked bytes `start..start + out.len()` into `out`: a header read without
    /// unmasking the rest, or the tail of a message copied behind a rewritten header.
    pub fn copy_range_to(&self, start: usize, out: &mut [u8]) {
        let src = &self.bytes[start..start + out.len()];
        match self.mask {
            // byte `i` of the payload meets mask[i % 4]: rotate so `start` is phase 0
            Some(mask) => copy_masked(out, src, rotate_mask(mask, start)),
            None => out.copy_from_slice(src),
        }
    }

    /// The first `N` bytes unmasked, or None when the payload is shorter.
    pub fn prefix<const N: usize>(&self) -> Option<[u8; N]> {
        if self.len() < N {
            return None;
        }
        let mut out = [0u8; N];
        self.copy_range_to(0, &mut out);
        Some(out)
    }

    /// Whether the unmasked payload is UTF-8, unmasking chunk by chunk on the stack.
    pub(crate) fn is_utf8(&self) -> bool {
        let Some(mask) = self.mask else {
            return std::str::from_utf8(self.bytes).is_ok();
        };
        // Room for a chunk plus up to 3 bytes of a character cut by the previous chunk.
        let mut tmp = [0u8; UTF8_CHUNK + 3];
        let mut carry = 0;
        for chunk in self.bytes.chunks(UTF8_CHUNK) {
            let end = carry + chunk.len();
            copy_masked(&mut tmp[carry..end], chunk, mask);
            match std::str::from_utf8(&tmp[..end]) {
                Ok(_) => carry = 0,
                // An incomplete character at the end: carry it into the next chunk.
                Err(e) if e.error_len().is_none() => {
                    let valid = e.valid_up_to();
                    tmp.copy_within(valid..end, 0);
                    carry = end - valid;
                }
                Err(_) => return false,
            }
        }
        carry == 0
    }
}
