//! Kernel log lines (`/dev/kmsg` records and `dmesg` lines): every line is
//! an XID, another line, or "unparsed" with a reason; the record splitter
//! finds the same XIDs whatever the reads' sizes. Never a panic.
#![no_main]

use gpu_agent::health::kmsg::{self, Record, RecordSplitter};
use libfuzzer_sys::fuzz_target;

fn xids(records: &[String]) -> Vec<String> {
    records
        .iter()
        .filter_map(|r| match kmsg::parse_record(r) {
            Record::Xid(x) => Some(format!("{x:?}")),
            _ => None,
        })
        .collect()
}

fuzz_target!(|data: &[u8]| {
    let Some((&chunk, stream)) = data.split_first() else {
        return;
    };
    // One read with everything, then reads of `chunk` bytes.
    let mut whole = RecordSplitter::default();
    let mut all = whole.push(stream);
    all.extend(whole.finish());
    let mut split = RecordSplitter::default();
    let mut pieces = Vec::new();
    for c in stream.chunks(usize::from(chunk).max(1)) {
        pieces.extend(split.push(c));
    }
    pieces.extend(split.finish());
    assert_eq!(
        xids(&all),
        xids(&pieces),
        "the XIDs found depend on the reads"
    );
    for r in &all {
        if let Record::Xid(x) = kmsg::parse_record(r) {
            assert_eq!(
                kmsg::normalise_bus_id(&x.bus_id).as_deref(),
                Some(x.bus_id.as_str()),
                "an XID's bus id is not normalised"
            );
            let _ = x.info();
        }
    }
    let text = String::from_utf8_lossy(stream);
    for line in text.lines() {
        let _ = kmsg::parse_line(line);
        let _ = kmsg::split_prefix(line);
    }
});
