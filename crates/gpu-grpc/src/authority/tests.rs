use super::*;
use loona_hpack::Encoder;

const SOCK: &[u8] = b"/var/lib/kubelet/device-plugins/nvidia-gpu.sock";

fn request(authority: &[u8]) -> Vec<(&'static [u8], Vec<u8>)> {
    vec![
        (b":method", b"POST".to_vec()),
        (b":scheme", b"http".to_vec()),
        (b":path", b"/v1beta1.DevicePlugin/Allocate".to_vec()),
        (b":authority", authority.to_vec()),
        (b"content-type", b"application/grpc".to_vec()),
        (b"te", b"trailers".to_vec()),
    ]
}

fn encode(enc: &mut Encoder<'_>, headers: &[(&'static [u8], Vec<u8>)]) -> Vec<u8> {
    enc.encode(headers.iter().map(|(n, v)| (*n, v.as_slice())))
}

fn raw_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    frame(&mut out, kind, flags, stream, &[payload]);
    out
}

/// Splits the server-side bytes into (kind, flags, stream, payload) frames.
fn frames_of(bytes: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
    assert!(bytes.starts_with(PREFACE));
    let mut at = PREFACE.len();
    let mut out = Vec::new();
    while at < bytes.len() {
        let h = &bytes[at..at + 9];
        let len = usize::from(h[0]) << 16 | usize::from(h[1]) << 8 | usize::from(h[2]);
        let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]);
        out.push((h[3], h[4], stream, bytes[at + 9..at + 9 + len].to_vec()));
        at += 9 + len;
    }
    out
}

/// Header lists as the server decodes them (a decoder of its own).
fn server_headers(bytes: &[u8]) -> Vec<Vec<(Vec<u8>, Vec<u8>)>> {
    let mut dec = Decoder::new();
    let mut lists = Vec::new();
    let mut block = Vec::new();
    for (kind, flags, _, payload) in frames_of(bytes) {
        if kind == HEADERS || kind == CONTINUATION {
            let skip = if kind == HEADERS && flags & PRIORITY != 0 {
                5
            } else {
                0
            };
            block.extend_from_slice(&payload[skip..]);
            if flags & END_HEADERS != 0 {
                lists.push(dec.decode(&block).unwrap());
                block.clear();
            }
        }
    }
    lists
}

fn authority(list: &[(Vec<u8>, Vec<u8>)]) -> &[u8] {
    &list.iter().find(|(n, _)| n == b":authority").unwrap().1
}

/// Two requests on one connection, the second referring to the first's
/// indexed authority, with a DATA frame between them.
fn connection() -> Vec<u8> {
    let mut enc = Encoder::new();
    let mut c = PREFACE.to_vec();
    c.extend(raw_frame(0x4, 0, 0, &[])); // SETTINGS
    let first = encode(&mut enc, &request(SOCK));
    c.extend(raw_frame(HEADERS, END_HEADERS, 1, &first));
    c.extend(raw_frame(0x0, END_STREAM, 1, b"\0\0\0\0\x02\x0a\x00"));
    let second = encode(&mut enc, &request(SOCK));
    assert!(
        second.len() < first.len(),
        "the second block uses the dynamic table"
    );
    c.extend(raw_frame(HEADERS, END_HEADERS | END_STREAM, 3, &second));
    c
}

#[test]
fn the_socket_path_becomes_localhost_even_when_indexed() {
    let mut rw = Rewriter::default();
    let mut out = Vec::new();
    rw.process(&connection(), &mut out).unwrap();
    let lists = server_headers(&out);
    assert_eq!(lists.len(), 2);
    for list in &lists {
        assert_eq!(authority(list), b"localhost");
        let want: Vec<(Vec<u8>, Vec<u8>)> = request(b"localhost")
            .into_iter()
            .map(|(n, v)| (n.to_vec(), v))
            .collect();
        assert_eq!(list, &want, "every other header kept, in order");
    }
    assert_eq!(rw.rewritten, 2);
    // Frames other than HEADERS pass byte for byte, flags kept.
    let frames = frames_of(&out);
    assert_eq!(frames[0], (0x4, 0, 0, vec![]));
    assert_eq!(
        frames[2],
        (0x0, END_STREAM, 1, b"\0\0\0\0\x02\x0a\x00".to_vec())
    );
    assert_eq!(frames[3].1, END_HEADERS | END_STREAM);
}

#[test]
fn byte_by_byte_gives_the_same_bytes() {
    let input = connection();
    let mut whole = Vec::new();
    Rewriter::default().process(&input, &mut whole).unwrap();
    let mut rw = Rewriter::default();
    let mut split = Vec::new();
    for b in &input {
        rw.process(std::slice::from_ref(b), &mut split).unwrap();
    }
    assert_eq!(whole, split);
}

#[test]
fn acceptable_authorities_are_kept_and_empty_is_replaced() {
    for (sent, served) in [
        (&b"localhost"[..], &b"localhost"[..]),
        (b"127.0.0.1:50051", b"127.0.0.1:50051"),
        (b"%2Fvar%2Flib%2Fkubelet%2Fkubelet.sock", b"localhost"),
        (b"", b"localhost"),
        (SOCK, b"localhost"),
    ] {
        let mut c = PREFACE.to_vec();
        let block = encode(&mut Encoder::new(), &request(sent));
        c.extend(raw_frame(HEADERS, END_HEADERS, 1, &block));
        let mut out = Vec::new();
        Rewriter::default().process(&c, &mut out).unwrap();
        assert_eq!(authority(&server_headers(&out)[0]), served, "{sent:?}");
    }
}

#[test]
fn padding_priority_and_continuations_are_joined_and_large_blocks_split() {
    let mut headers = request(SOCK);
    headers.push((b"x-big", vec![b'a'; 40_000]));
    let block = encode(&mut Encoder::new(), &headers);
    // HEADERS (padded, with priority) + two CONTINUATIONs.
    let (a, rest) = block.split_at(100);
    let mut first = vec![3u8]; // pad length
    first.extend([0, 0, 0, 0, 15]); // stream dependency + weight
    first.extend(a);
    first.extend([0, 0, 0]);
    let mut input = PREFACE.to_vec();
    input.extend(raw_frame(
        HEADERS,
        PADDED | PRIORITY | END_STREAM,
        5,
        &first,
    ));
    let chunks: Vec<&[u8]> = rest.chunks(16_000).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        let flags = if i + 1 == chunks.len() {
            END_HEADERS
        } else {
            0
        };
        input.extend(raw_frame(CONTINUATION, flags, 5, chunk));
    }
    let mut out = Vec::new();
    Rewriter::default().process(&input, &mut out).unwrap();
    let frames = frames_of(&out);
    assert!(frames.len() >= 3, "40 KB needs HEADERS and CONTINUATIONs");
    assert!(frames.iter().all(|f| f.3.len() <= MAX_FRAME && f.2 == 5));
    assert_eq!(frames[0].0, HEADERS);
    assert_eq!(frames[0].1, PRIORITY | END_STREAM);
    assert_eq!(&frames[0].3[..5], &[0, 0, 0, 0, 15]);
    assert!(frames[1..].iter().all(|f| f.0 == CONTINUATION));
    assert_eq!(frames.last().unwrap().1, END_HEADERS);
    let list = &server_headers(&out)[0];
    assert_eq!(authority(list), b"localhost");
    assert_eq!(list.last().unwrap().1.len(), 40_000);
}

#[test]
fn other_protocols_pass_untouched() {
    // "PUT" shares its first byte with the preface: split after it.
    for http1 in [
        &b"GET / HTTP/1.1\r\nHost: /var/run/x.sock\r\n\r\n"[..],
        b"PUT / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"PRI * HTTP/1.1\r\n\r\n",
    ] {
        for cut in [1, 3, 10] {
            let mut out = Vec::new();
            let mut rw = Rewriter::default();
            rw.process(&http1[..cut], &mut out).unwrap();
            rw.process(&http1[cut..], &mut out).unwrap();
            assert_eq!(out, http1, "cut at {cut}");
        }
    }
}

#[test]
fn indexed_fields_cannot_blow_up_memory() {
    // One 3 KB value indexed, then referred to 1,000 times in one block:
    // 4 KB encoded, 3 MB decoded.
    let mut enc = Encoder::new();
    let mut c = PREFACE.to_vec();
    let mut first = request(SOCK);
    first.push((b"x-big", vec![b'a'; 3_000]));
    c.extend(raw_frame(
        HEADERS,
        END_HEADERS,
        1,
        &encode(&mut enc, &first),
    ));
    let refs = vec![0x80 | 62u8; 1_000]; // the newest dynamic entry, indexed
    c.extend(raw_frame(HEADERS, END_HEADERS, 3, &refs));
    let mut rw = Rewriter::default();
    let err = rw.process(&c, &mut Vec::new()).unwrap_err();
    assert!(
        matches!(err, AuthorityError::TooLarge { stream: 3 }),
        "{err}"
    );
    // Refused for good: later bytes are not taken.
    assert!(matches!(
        rw.process(b"\0", &mut Vec::new()),
        Err(AuthorityError::Failed(_))
    ));
    // A client may not grow the table past what the server allows.
    let mut c = PREFACE.to_vec();
    c.extend(raw_frame(
        HEADERS,
        END_HEADERS,
        1,
        &[0x3f, 0xe1, 0x7f, 0x82],
    ));
    let err = Rewriter::default()
        .process(&c, &mut Vec::new())
        .unwrap_err();
    assert!(
        matches!(err, AuthorityError::Hpack { stream: 1, .. }),
        "{err}"
    );
}

#[test]
fn broken_streams_are_refused_with_the_stream() {
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            raw_frame(CONTINUATION, END_HEADERS, 1, b"\x82"),
            "stream 1: CONTINUATION without HEADERS",
        ),
        (
            raw_frame(
                HEADERS,
                END_HEADERS,
                3,
                &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
            ),
            "stream 3: cannot decode",
        ),
        (
            raw_frame(HEADERS, END_HEADERS, 7, &[0x80 | 70]),
            "stream 7: cannot decode",
        ),
        (
            raw_frame(HEADERS, PADDED | END_HEADERS, 9, &[9, 0x82]),
            "stream 9: HEADERS padding",
        ),
        (
            [
                raw_frame(HEADERS, 0, 1, b"\x82"),
                raw_frame(0x0, 0, 1, b"x"),
            ]
            .concat(),
            "frame of type 0 inside a header block",
        ),
        (
            [
                raw_frame(HEADERS, 0, 1, b"\x82"),
                raw_frame(CONTINUATION, 0, 3, b"\x82"),
            ]
            .concat(),
            "stream 3: CONTINUATION of stream 1",
        ),
    ];
    for (frames, want) in cases {
        let input = [PREFACE, &frames].concat();
        let err = Rewriter::default()
            .process(&input, &mut Vec::new())
            .unwrap_err()
            .to_string();
        assert!(err.contains(want), "{err} should say {want}");
    }
    let mut huge = PREFACE.to_vec();
    huge.extend_from_slice(&[0x00, 0x40, 0x01, HEADERS, 0, 0, 0, 0, 1]);
    let err = Rewriter::default()
        .process(&huge, &mut Vec::new())
        .unwrap_err();
    assert!(
        matches!(err, AuthorityError::TooLarge { stream: 1 }),
        "{err}"
    );
}

proptest::proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(chunks in proptest::collection::vec(proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64), 0..32)) {
        let mut rw = Rewriter::default();
        let mut out = Vec::new();
        let _ = rw.process(PREFACE, &mut out);
        for c in chunks {
            if rw.process(&c, &mut out).is_err() {
                break;
            }
        }
    }

    #[test]
    fn any_split_of_a_connection_gives_the_same_bytes(cuts in proptest::collection::vec(0usize..400, 0..12)) {
        let input = connection();
        let mut whole = Vec::new();
        Rewriter::default().process(&input, &mut whole).unwrap();
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % input.len()).collect();
        cuts.sort_unstable();
        let mut rw = Rewriter::default();
        let mut split = Vec::new();
        let mut from = 0;
        for c in cuts.into_iter().chain([input.len()]) {
            rw.process(&input[from..c.max(from)], &mut split).unwrap();
            from = c.max(from);
        }
        proptest::prop_assert_eq!(whole, split);
    }
}
