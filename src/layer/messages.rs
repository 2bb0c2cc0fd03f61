//! gRPC messages counted from the bytes of an HTTP/2 body: each message is a 5-byte prefix (a
//! compressed flag and a big-endian 32-bit length) followed by that many bytes of payload
//! (gRPC over HTTP/2, "Length-Prefixed-Message"). The payload is skipped, never decoded.

/// Where a body stands in its sequence of length-prefixed messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framer {
    /// Reading a prefix: `have` of its 5 bytes seen, the length's bytes so far in `len`.
    Prefix { have: u8, len: u32 },
    /// Inside a payload: `left` bytes of it still to come.
    Payload { left: u32 },
    /// A frame's bytes could not all be read (a `Buf` that shows only part of itself): the
    /// framing is lost, and every data frame from then on counts as one message.
    Lost,
}

impl Default for Framer {
    fn default() -> Self {
        Self::Prefix { have: 0, len: 0 }
    }
}

/// What [`Framer::scan`] found in a run of bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Scan {
    /// How many of the bytes may pass.
    pub(crate) bytes: usize,
    /// The messages those bytes start: a message counts when its prefix is complete.
    pub(crate) messages: u64,
    /// Where the body stands once those bytes passed.
    pub(crate) next: Framer,
}

impl Framer {
    /// Scans `data` (the bytes that follow those already seen), letting through as many as
    /// complete at most `room` prefixes: it stops at the start of the message past them (or,
    /// within a prefix begun before, before its last byte). A message split across frames counts once, in the frame where its prefix ends;
    /// several messages in one frame each count; a zero-length message counts when its prefix
    /// ends. The compressed flag is not looked at.
    pub(crate) fn scan(self, data: &[u8], room: u64) -> Scan {
        let mut state = self;
        let mut at = 0;
        let mut messages = 0;
        while at < data.len() {
            match state {
                Self::Lost => {
                    if messages == room {
                        break;
                    }
                    messages += 1;
                    at = data.len();
                }
                Self::Payload { left } => {
                    let skip = (data.len() - at).min(left as usize);
                    at += skip;
                    // `skip` <= `left`, a `u32`.
                    let left = left - skip as u32;
                    state = if left == 0 { Self::default() } else { Self::Payload { left } };
                }
                Self::Prefix { have, len } => {
                    // At a message's start (or, resuming a prefix, before its last byte).
                    if messages == room && (have == 0 || have == 4) {
                        break;
                    }
                    let byte = data[at];
                    at += 1;
                    // Byte 0 is the compressed flag; bytes 1 to 4 the length, big-endian.
                    let len = if have == 0 { 0 } else { (len << 8) | u32::from(byte) };
                    state = match have {
                        4 => {
                            messages += 1;
                            if len == 0 { Self::default() } else { Self::Payload { left: len } }
                        }
                        _ => Self::Prefix { have: have + 1, len },
                    };
                }
            }
        }
        Scan { bytes: at, messages, next: state }
    }

    /// Counts the messages a whole data frame starts, whatever its `Buf` type, and moves past
    /// it. The bytes are read where they are (`Buf::chunks_vectored`), never copied; a frame
    /// whose bytes are not all visible that way loses the framing ([`Framer::Lost`]).
    pub(crate) fn count<D: bytes::Buf>(&mut self, data: &D) -> u64 {
        let remaining = data.remaining();
        if remaining == 0 {
            return 0;
        }
        if *self == Self::Lost {
            return 1;
        }
        let mut slices = [std::io::IoSlice::new(&[]); 16];
        let filled = data.chunks_vectored(&mut slices);
        let seen: usize = slices[..filled].iter().map(|s| s.len()).sum();
        if seen < remaining {
            tracing::debug!("tollgate: a body's bytes are not all readable; counting frames");
            // What was seen still counts; each frame from now on counts once.
            let mut messages = 0;
            for slice in &slices[..filled] {
                let scan = self.scan(slice, u64::MAX);
                messages += scan.messages;
                *self = scan.next;
            }
            *self = Self::Lost;
            return messages.max(1);
        }
        let mut messages = 0;
        for slice in &slices[..filled] {
            let scan = self.scan(slice, u64::MAX);
            messages += scan.messages;
            *self = scan.next;
        }
        messages
    }
}

#[cfg(test)]
mod tests {
    use bytes::{Buf, Bytes};

    use super::*;

    /// A message as gRPC frames it: the flag, the big-endian length, the payload.
    fn message(compressed: bool, payload: &[u8]) -> Vec<u8> {
        let mut out = vec![u8::from(compressed)];
        out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        out.extend_from_slice(payload);
        out
    }

    /// Counts the messages of `frames`, fed one after the other.
    fn count(frames: &[&[u8]]) -> Vec<u64> {
        let mut framer = Framer::default();
        frames.iter().map(|f| framer.count(&Bytes::copy_from_slice(f))).collect()
    }

    #[test]
    fn several_messages_in_one_frame_each_count() {
        let mut frame = message(false, b"one");
        frame.extend(message(false, b"two"));
        frame.extend(message(false, b"three"));
        assert_eq!(count(&[&frame]), vec![3]);
    }

    #[test]
    fn a_message_split_across_frames_counts_once_where_its_prefix_ends() {
        let bytes = message(false, &[9; 100]);
        // The prefix itself split after 2 bytes, then the payload in three frames.
        assert_eq!(
            count(&[&bytes[..2], &bytes[2..40], &bytes[40..70], &bytes[70..]]),
            vec![0, 1, 0, 0]
        );
        // Split after each byte of the prefix.
        let frames: Vec<&[u8]> = (0..5).map(|i| &bytes[i..=i]).chain([&bytes[5..]]).collect();
        assert_eq!(count(&frames), vec![0, 0, 0, 0, 1, 0]);
    }

    #[test]
    fn zero_length_messages_count() {
        let mut frame = message(false, b"");
        frame.extend(message(false, b""));
        frame.extend(message(false, b"x"));
        frame.extend(message(false, b""));
        assert_eq!(count(&[&frame]), vec![4]);
        // A zero-length message whose prefix ends a frame, then the next message.
        let next = message(false, b"abc");
        assert_eq!(count(&[&message(false, b""), &next[..3], &next[3..]]), vec![1, 0, 1]);
    }

    #[test]
    fn the_compressed_flag_is_not_looked_at() {
        let mut frame = message(true, &[0xff; 7]);
        frame.extend(message(false, &[0; 3]));
        frame.extend(message(true, b""));
        assert_eq!(count(&[&frame]), vec![3]);
    }

    #[test]
    fn a_length_of_four_bytes_is_read_big_endian() {
        // 0x0001_0002 = 65,538 bytes of payload: a length misread little-endian, or from one
        // byte, would count a message in the payload.
        let payload = vec![0u8; 65_538];
        let mut frame = message(false, &payload);
        frame.extend(message(false, b"z"));
        assert_eq!(&frame[1..5], &[0, 1, 0, 2]);
        assert_eq!(count(&[&frame[..30_000], &frame[30_000..]]), vec![1, 1]);
    }

    #[test]
    fn a_scan_stops_before_the_prefix_past_its_room() {
        let mut frame = message(false, b"aa");
        frame.extend(message(false, b"bbb"));
        frame.extend(message(false, b""));
        // Room for one: the first message whole, up to the start of the next.
        let one = Framer::default().scan(&frame, 1);
        assert_eq!((one.bytes, one.messages), (7, 1));
        assert_eq!(one.next, Framer::default());
        // Then the rest, with room for two.
        let rest = one.next.scan(&frame[one.bytes..], 2);
        assert_eq!((rest.bytes, rest.messages), (frame.len() - 7, 2));
        assert_eq!(rest.next, Framer::default());
        // No room: a payload's bytes still pass, the next message does not start.
        let payload = Framer::Payload { left: 3 }.scan(&frame, 0);
        assert_eq!((payload.bytes, payload.messages), (3, 0));
        // A prefix begun in an earlier frame stops before its last byte.
        let begun = Framer::Prefix { have: 2, len: 0 }.scan(&[0, 0, 0], 0);
        assert_eq!((begun.bytes, begun.messages), (2, 0));
        let ended = begun.next.scan(&[0, 0, 0], 1);
        assert_eq!((ended.bytes, ended.messages, ended.next), (1, 1, Framer::default()));
    }

    #[test]
    fn a_frame_that_hides_part_of_its_bytes_loses_the_framing() {
        let first = Bytes::from(message(false, b"abc"));
        let second = Bytes::from(message(false, b"de"));
        // A `Chain` shows both halves; a `Take` over it shows only what it covers.
        let mut framer = Framer::default();
        assert_eq!(framer.count(&first.clone().chain(second.clone())), 2);
        assert_eq!(framer, Framer::default());
        /// A `Buf` whose `chunk` shows one byte at a time.
        struct Dribble(Bytes);
        impl Buf for Dribble {
            fn remaining(&self) -> usize {
                self.0.len()
            }
            fn chunk(&self) -> &[u8] {
                &self.0[..self.0.len().min(1)]
            }
            fn advance(&mut self, n: usize) {
                self.0.advance(n);
            }
        }
        assert_eq!(framer.count(&Dribble(first.clone())), 1);
        assert_eq!(framer, Framer::Lost);
        // From then on, a frame is a message.
        assert_eq!(framer.count(&first.chain(second)), 1);
        assert_eq!(framer.count(&Bytes::new()), 0);
    }
}
