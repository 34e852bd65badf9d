//! Lets every gRPC client reach our servers on Unix sockets, whatever it
//! sends as `:authority`.
//!
//! HTTP/2 servers built on `h2` (tonic's) reset every request whose
//! `:authority` is not a valid URI authority. Over a Unix socket many clients
//! send the socket's path there: kubelets before 1.26, grpcio (the path
//! percent-encoded), grpc-java, grpcurl's `-unix`. NVIDIA's plugin (grpc-go)
//! serves them; so must we. `h2` has no setting for it, so this layer sits
//! between the socket and the server and rewrites, in the client's byte
//! stream, each header block whose `:authority` the server would refuse:
//! that value becomes `localhost` (what kubelets since 1.26 send), every
//! other header is kept as it came.
//!
//! HPACK state makes a plain byte substitution wrong (the client may index
//! the authority in its dynamic table and refer to it later), so every
//! header block is decoded with the connection's own decoder and encoded
//! again as literals without indexing: the server's table is never used and
//! cannot drift from the client's. Frames other than HEADERS and
//! CONTINUATION pass through untouched, without being buffered; the server
//! to client direction is not looked at.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use loona_hpack::Decoder;
use loona_hpack::encoder::encode_integer_into;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The client connection preface (RFC 9113 §3.4).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The largest header block taken (all its frames together, encoded); a
/// device-plugin request's is well under 1 KiB.
pub const MAX_HEADER_BLOCK: usize = 256 * 1024;
/// The largest header list taken once decoded (names, values and 32 bytes
/// a field, as HPACK counts them): indexed fields expand, so the encoded
/// bound alone would not bound memory.
pub const MAX_HEADER_LIST: usize = 64 * 1024;
/// The frames we write and take: no larger than the size every HTTP/2
/// server allows unless it announces more (tonic's does not).
const MAX_FRAME: usize = 16_384;
/// The largest HPACK dynamic table a client may ask for: the 4096 bytes a
/// server allows unless it announces more (tonic's does not).
const MAX_TABLE: usize = 4_096;
/// What a refused authority becomes.
const LOCALHOST: &[u8] = b"localhost";

/// A client byte stream that cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum AuthorityError {
    #[error("HTTP/2 stream {stream}: cannot decode the header block: {message}")]
    Hpack { stream: u32, message: String },
    #[error(
        "HTTP/2 stream {stream}: header block larger than {MAX_HEADER_BLOCK} bytes, a frame over {MAX_FRAME}, or a header list over {MAX_HEADER_LIST} decoded"
    )]
    TooLarge { stream: u32 },
    #[error("the connection already failed: {0}")]
    Failed(String),
    #[error("HTTP/2 stream {stream}: {message}")]
    Protocol { stream: u32, message: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Bytes of the preface seen so far.
    Preface(usize),
    Frames,
    /// Not HTTP/2 with prior knowledge: the server answers it as it will.
    Passthrough,
    /// A refused byte stream: nothing more is taken.
    Failed,
}

/// A header block whose CONTINUATION frames are still to come.
#[derive(Debug)]
struct Pending {
    stream: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    block: Vec<u8>,
}

/// Rewrites one connection's client-to-server bytes (sans I/O: bytes in,
/// bytes out).
pub struct Rewriter {
    phase: Phase,
    /// Received bytes not yet handled (at most one frame header, or one
    /// HEADERS/CONTINUATION frame).
    buf: Vec<u8>,
    /// Payload bytes of a passed-through frame still to copy.
    copy: usize,
    pending: Option<Pending>,
    decoder: Decoder<'static>,
    /// Header blocks whose authority was replaced.
    pub rewritten: u64,
}

impl std::fmt::Debug for Rewriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rewriter")
            .field("phase", &self.phase)
            .field("rewritten", &self.rewritten)
            .finish()
    }
}

impl Default for Rewriter {
    fn default() -> Self {
        let mut decoder = Decoder::new();
        decoder.set_max_allowed_table_size(MAX_TABLE);
        Rewriter {
            phase: Phase::Preface(0),
            buf: Vec::new(),
            copy: 0,
            pending: None,
            decoder,
            rewritten: 0,
        }
    }
}

/// True when `h2` takes `value` as an `:authority`.
pub fn acceptable(value: &[u8]) -> bool {
    http::uri::Authority::try_from(value).is_ok()
}

impl Rewriter {
    /// Handles `input` (the next bytes from the client) and appends what
    /// the server should read to `out`.
    pub fn process(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<(), AuthorityError> {
        if self.phase == Phase::Failed {
            return Err(AuthorityError::Failed(
                "a client stream that was refused".into(),
            ));
        }
        let result = self.take(input, out);
        if result.is_err() {
            self.phase = Phase::Failed;
            self.buf = Vec::new();
            self.pending = None;
        }
        result
    }

    fn take(&mut self, mut input: &[u8], out: &mut Vec<u8>) -> Result<(), AuthorityError> {
        if let Phase::Preface(seen) = self.phase {
            let want = &PREFACE[seen..];
            let n = want.len().min(input.len());
            if input[..n] != want[..n] {
                // What matched so far was already passed on.
                self.phase = Phase::Passthrough;
            } else {
                out.extend_from_slice(&input[..n]);
                input = &input[n..];
                self.phase = if seen + n == PREFACE.len() {
                    Phase::Frames
                } else {
                    Phase::Preface(seen + n)
                };
            }
        }
        match self.phase {
            Phase::Preface(_) => return Ok(()),
            Phase::Passthrough => {
                out.extend_from_slice(input);
                return Ok(());
            }
            Phase::Frames => {}
            Phase::Failed => unreachable!("checked by process"),
        }
        // Payload of a passed-through frame: straight from the input.
        if self.buf.is_empty() && self.copy > 0 {
            let n = self.copy.min(input.len());
            out.extend_from_slice(&input[..n]);
            self.copy -= n;
            input = &input[n..];
        }
        let mut buf = std::mem::take(&mut self.buf);
        buf.extend_from_slice(input);
        let result = self.frames(&buf, out);
        match result {
            Ok(used) => {
                buf.drain(..used);
                self.buf = buf;
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Handles whole frames at the start of `buf`; returns the bytes used.
    fn frames(&mut self, buf: &[u8], out: &mut Vec<u8>) -> Result<usize, AuthorityError> {
        let mut at = 0;
        loop {
            let rest = &buf[at..];
            if self.copy > 0 {
                let n = self.copy.min(rest.len());
                out.extend_from_slice(&rest[..n]);
                self.copy -= n;
                at += n;
                if self.copy > 0 {
                    return Ok(at);
                }
                continue;
            }
            if rest.len() < FRAME_HEADER {
                return Ok(at);
            }
            let len = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
            let (kind, flags) = (rest[3], rest[4]);
            let stream = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]) & 0x7fff_ffff;
            if kind != HEADERS && kind != CONTINUATION {
                if self.pending.is_some() {
                    return Err(AuthorityError::Protocol {
                        stream,
                        message: format!("frame of type {kind} inside a header block"),
                    });
                }
                out.extend_from_slice(&rest[..FRAME_HEADER]);
                self.copy = len;
                at += FRAME_HEADER;
                continue;
            }
            if len > MAX_FRAME {
                return Err(AuthorityError::TooLarge { stream });
            }
            if rest.len() < FRAME_HEADER + len {
                return Ok(at);
            }
            let payload = &rest[FRAME_HEADER..FRAME_HEADER + len];
            if kind == HEADERS {
                self.headers(flags, stream, payload, out)?;
            } else {
                self.continuation(flags, stream, payload, out)?;
            }
            at += FRAME_HEADER + len;
        }
    }

    fn headers(
        &mut self,
        flags: u8,
        stream: u32,
        payload: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), AuthorityError> {
        let malformed = |message: &str| AuthorityError::Protocol {
            stream,
            message: message.to_string(),
        };
        if self.pending.is_some() {
            return Err(malformed("HEADERS inside another header block"));
        }
        let mut p = payload;
        let mut pad = 0;
        if flags & PADDED != 0 {
            let (&n, r) = p
                .split_first()
                .ok_or_else(|| malformed("padded HEADERS without a pad length"))?;
            pad = usize::from(n);
            p = r;
        }
        let mut priority = None;
        if flags & PRIORITY != 0 {
            if p.len() < 5 {
                return Err(malformed("HEADERS too short for its priority"));
            }
            let (fields, r) = p.split_at(5);
            priority = Some(fields.try_into().expect("5 bytes"));
            p = r;
        }
        if pad > p.len() {
            return Err(malformed("HEADERS padding longer than the frame"));
        }
        let pending = Pending {
            stream,
            end_stream: flags & END_STREAM != 0,
            priority,
            block: p[..p.len() - pad].to_vec(),
        };
        if flags & END_HEADERS != 0 {
            self.emit(pending, out)
        } else {
            self.pending = Some(pending);
            Ok(())
        }
    }

    fn continuation(
        &mut self,
        flags: u8,
        stream: u32,
        payload: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), AuthorityError> {
        let Some(mut pending) = self.pending.take() else {
            return Err(AuthorityError::Protocol {
                stream,
                message: "CONTINUATION without HEADERS".into(),
            });
        };
        if pending.stream != stream {
            return Err(AuthorityError::Protocol {
                stream,
                message: format!("CONTINUATION of stream {}'s header block", pending.stream),
            });
        }
        if pending.block.len() + payload.len() > MAX_HEADER_BLOCK {
            return Err(AuthorityError::TooLarge { stream });
        }
        pending.block.extend_from_slice(payload);
        if flags & END_HEADERS != 0 {
            self.emit(pending, out)
        } else {
            self.pending = Some(pending);
            Ok(())
        }
    }

    /// Decodes a whole header block, encodes it again (authority fixed) and
    /// writes it as HEADERS (+ CONTINUATION) frames.
    fn emit(&mut self, p: Pending, out: &mut Vec<u8>) -> Result<(), AuthorityError> {
        let mut block = Vec::with_capacity(p.block.len() * 2 + 16);
        let mut replaced = None;
        let mut list_size = 0usize;
        self.decoder
            .decode_with_cb(&p.block, |name, value| {
                list_size += name.len() + value.len() + 32;
                if list_size > MAX_HEADER_LIST {
                    return;
                }
                let value: &[u8] = if &*name == b":authority" && !acceptable(&value) {
                    replaced = Some(String::from_utf8_lossy(&value).into_owned());
                    LOCALHOST
                } else {
                    &value
                };
                // Literal header field without indexing, new name (RFC 7541 §6.2.2).
                block.push(0);
                put_string(&mut block, &name);
                put_string(&mut block, value);
            })
            .map_err(|e| AuthorityError::Hpack {
                stream: p.stream,
                message: e.to_string(),
            })?;
        if list_size > MAX_HEADER_LIST {
            return Err(AuthorityError::TooLarge { stream: p.stream });
        }
        if let Some(was) = replaced {
            self.rewritten += 1;
            tracing::debug!(stream = p.stream, authority = %was, "client sent an :authority the server would refuse; serving it as localhost");
        }
        let prio: &[u8] = p.priority.as_ref().map_or(&[], |b| b.as_slice());
        let first_room = MAX_FRAME - prio.len();
        let (first, mut rest) = block.split_at(first_room.min(block.len()));
        let mut flags = if p.end_stream { END_STREAM } else { 0 };
        if p.priority.is_some() {
            flags |= PRIORITY;
        }
        if rest.is_empty() {
            flags |= END_HEADERS;
        }
        frame(out, HEADERS, flags, p.stream, &[prio, first]);
        while !rest.is_empty() {
            let (chunk, r) = rest.split_at(MAX_FRAME.min(rest.len()));
            rest = r;
            let flags = if rest.is_empty() { END_HEADERS } else { 0 };
            frame(out, CONTINUATION, flags, p.stream, &[chunk]);
        }
        Ok(())
    }
}

/// An HPACK string literal, not Huffman-coded.
fn put_string(out: &mut Vec<u8>, s: &[u8]) {
    encode_integer_into(s.len(), 7, 0, out).expect("writing to a Vec");
    out.extend_from_slice(s);
}

fn frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, parts: &[&[u8]]) {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let len = u32::try_from(len)
        .expect("frame under 16 KiB")
        .to_be_bytes();
    out.extend_from_slice(&len[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
    for p in parts {
        out.extend_from_slice(p);
    }
}

/// A connection whose client bytes go through a [`Rewriter`]; writes go
/// straight to the inner connection.
#[derive(Debug)]
pub struct AuthorityFix<IO> {
    inner: IO,
    rewriter: Rewriter,
    /// Rewritten bytes not yet read by the server, from `at`.
    out: Vec<u8>,
    at: usize,
    scratch: Box<[u8]>,
}

impl<IO> AuthorityFix<IO> {
    pub fn new(inner: IO) -> Self {
        AuthorityFix {
            inner,
            rewriter: Rewriter::default(),
            out: Vec::new(),
            at: 0,
            scratch: vec![0; 16 * 1024].into_boxed_slice(),
        }
    }

    pub fn get_ref(&self) -> &IO {
        &self.inner
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for AuthorityFix<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.at < this.out.len() {
                let n = buf.remaining().min(this.out.len() - this.at);
                buf.put_slice(&this.out[this.at..this.at + n]);
                this.at += n;
                if this.at == this.out.len() {
                    this.out.clear();
                    this.at = 0;
                }
                return Poll::Ready(Ok(()));
            }
            let mut rb = ReadBuf::new(&mut this.scratch);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut rb))?;
            let got = rb.filled();
            if got.is_empty() {
                return Poll::Ready(Ok(()));
            }
            this.rewriter
                .process(got, &mut this.out)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;
