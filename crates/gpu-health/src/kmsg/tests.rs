use super::*;
use proptest::prelude::*;
use std::io::Write;
use std::time::Duration;

fn xid(line: &str) -> KernelXid {
    match parse_line(line) {
        Record::Xid(x) => x,
        other => panic!("{line:?}: {other:?}"),
    }
}

fn unparsed_reason(line: &str) -> String {
    match parse_line(line) {
        Record::Unparsed { reason, line: l } => {
            assert_eq!(l, line.trim_end_matches('\n'));
            reason
        }
        other => panic!("{line:?}: {other:?}"),
    }
}

#[test]
fn reads_the_current_driver_form_from_dev_kmsg() {
    let x = xid(
        "4,1873,1204567123,-;NVRM: Xid (PCI:0000:3B:00): 79, pid=1234, name=python, GPU has fallen off the bus.\n",
    );
    assert_eq!(
        x,
        KernelXid {
            bus_id: "0000:3b:00.0".into(),
            xid: 79,
            gpu_instance: None,
            compute_instance: None,
            pid: Some(1234),
            process: Some("python".into()),
            message: "GPU has fallen off the bus.".into(),
            seq: 1873,
            at_us: 1_204_567_123,
        }
    );
    assert_eq!(x.info().map(|i| i.xid), Some(79));
}

#[test]
fn unknown_pid_and_name_are_none() {
    let x = xid(
        "NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter",
    );
    assert_eq!((x.xid, x.pid, x.process), (13, None, None));
    assert_eq!(
        x.message,
        "Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter"
    );
}

#[test]
fn lines_without_a_process_and_old_drivers_lines() {
    let x = xid("NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus.");
    assert_eq!((x.pid, x.process.as_deref()), (None, None));
    assert_eq!(x.message, "GPU has fallen off the bus.");
    // Old drivers: no "PCI:" and the channel as the message.
    let x = xid("NVRM: Xid (0000:03:00): 14, Channel 00000001");
    assert_eq!((x.bus_id.as_str(), x.xid), ("0000:03:00.0", 14));
    assert_eq!(x.message, "Channel 00000001");
    // Old drivers, older still: no comma after the number.
    let x = xid("NVRM: Xid (PCI:0000:01:00): 32 Channel ID 00000000 intr 00004000");
    assert_eq!(
        (x.xid, x.message.as_str()),
        (32, "Channel ID 00000000 intr 00004000")
    );
    // A function number given by the kernel is kept.
    let x = xid("kernel: NVRM: Xid (PCI:0000:3b:00.1): 48, pid=77, name=a, DBE");
    assert_eq!(x.bus_id, "0000:3b:00.1");
}

#[test]
fn mig_attribution_is_read() {
    let x = xid(
        "NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, name=train, Contained: CE User Channel (0x9). RST: No, D-RST: No",
    );
    assert_eq!((x.gpu_instance, x.compute_instance), (Some(5), None));
    assert_eq!(x.process.as_deref(), Some("train"));
    assert_eq!(
        x.message,
        "Contained: CE User Channel (0x9). RST: No, D-RST: No"
    );
    let x =
        xid("NVRM: Xid (PCI:0000:3b:00 GPU-I:01 GPU-CI:02): 13, pid=9, name=a, Graphics Exception");
    assert_eq!((x.gpu_instance, x.compute_instance), (Some(1), Some(2)));
    assert_eq!(x.bus_id, "0000:3b:00.0");
}

#[test]
fn nvlink_and_recovery_action_lines() {
    let x = xid(
        "NVRM: Xid (PCI:0018:01:00): 149, NETIR_INT  Fatal   XC0 i0 Link -1 (0x000fe406 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)",
    );
    assert_eq!((x.bus_id.as_str(), x.xid), ("0018:01:00.0", 149));
    assert!(x.message.starts_with("NETIR_INT  Fatal"));
    let x = xid(
        "NVRM: Xid (PCI:0000:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)",
    );
    assert_eq!(x.xid, 154);
    let x = xid(
        "NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 caused by previous Xid 149",
    );
    assert_eq!((x.xid, x.pid), (45, Some(1_818_990)));
}

#[test]
fn dmesg_and_journal_lines_are_accepted() {
    let x = xid("[ 5107.644336] NVRM: Xid (PCI:0000:03:00): 79, GPU has fallen off the bus.");
    assert_eq!((x.seq, x.at_us), (0, 5_107_644_336));
    let x =
        xid("[12345.678] NVRM: Xid (PCI:0000:3b:00.0): 79, pid=1234, GPU has fallen off the bus.");
    assert_eq!(x.at_us, 12_345_678_000);
    let x = xid(
        "May 18 19:02:39 gpu-7 kernel: NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus.",
    );
    assert_eq!((x.bus_id.as_str(), x.at_us), ("0000:2b:00.0", 0));
    let x = xid(
        "[Fri Aug 30 11:43:14 2024] NVRM: Xid (PCI:0000:cb:00): 109, pid=1797828, name=pt_main_thread, Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x58005",
    );
    assert_eq!((x.xid, x.at_us), (109, 0));
    assert_eq!(x.process.as_deref(), Some("pt_main_thread"));
}

#[test]
fn xid_lines_that_cannot_be_read_are_surfaced_with_a_reason() {
    assert!(
        unparsed_reason("NVRM: Xid 154, GPU recovery action changed to 0x2 (Node Reboot Required)")
            .contains("(PCI:")
    );
    assert!(
        unparsed_reason("NVRM: Xid (PCI:0000:08:00/0000:09:00): 154 ... GPU Reset Required")
            .contains("bad PCI address")
    );
    assert!(
        unparsed_reason("NVRM: Xid (PCI:0000:66:00): abc, pid=2280636").contains("no XID number")
    );
    assert!(
        unparsed_reason("NVRM: Xid (PCI:0000:66:00): 99999999999999999999999, x")
            .contains("out of range")
    );
    assert!(unparsed_reason("NVRM: Xid (PCI:0000:66:00): 79abc").contains("right after XID 79"));
    assert!(unparsed_reason("NVRM: Xid (PCI:0000:66:00 GPU-I:x): 43").contains("GPU instance"));
    assert!(unparsed_reason("NVRM: Xid (PCI:0000:66:00: 43").contains("not closed"));
    assert!(unparsed_reason("NVRM: something about an Xid").contains("no \"NVRM: Xid\""));
    assert!(unparsed_reason("6,12,34,-;NVRM: Xid").contains("(PCI:"));
}

#[test]
fn xid_lines_written_from_user_space_are_not_trusted() {
    // `echo ... > /dev/kmsg` is stamped with facility LOG_USER (1): 14 = 1<<3 | 6.
    let reason = unparsed_reason(
        "14,2201,99000000,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus.",
    );
    assert!(
        reason.contains("user space (syslog facility 1)"),
        "{reason}"
    );
}

#[test]
fn other_lines_are_other() {
    for line in [
        "",
        "\n",
        "6,0,0,-;Linux version 6.8.0",
        "6,339,5140900,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.14",
        "[    3.1] nvidia 0000:3b:00.0: enabling device (0000 -> 0003)",
        " SUBSYSTEM=pci",
        "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error",
    ] {
        assert_eq!(parse_line(line), Record::Other, "{line:?}");
    }
}

#[test]
fn bus_ids_are_normalised() {
    for (given, want) in [
        ("0000:3b:00", Some("0000:3b:00.0")),
        ("0000:3B:00.0", Some("0000:3b:00.0")),
        ("00000000:3b:00.0", Some("0000:3b:00.0")),
        ("3b:00", Some("0000:3b:00.0")),
        ("0018:01:00", Some("0018:01:00.0")),
        ("10000:01:00.7", Some("10000:01:00.7")),
        ("0000:3b:1f.0", Some("0000:3b:1f.0")),
        ("0000:3b:20.0", None),
        ("0000:3b:00.8", None),
        ("0000:3b:00.", None),
        ("0000:+3:00", None),
        ("0000:123:00", None),
        ("000000000:3b:00", None),
        ("3b", None),
        ("", None),
        ("a:b:c:d", None),
    ] {
        assert_eq!(normalise_bus_id(given).as_deref(), want, "{given:?}");
    }
}

#[test]
fn kmsg_prefixes_are_split() {
    let (p, body) = split_prefix("4,1873,1204567123,-,caller=T42;NVRM: x").unwrap();
    assert_eq!(
        p,
        KmsgPrefix {
            facility: 0,
            level: 4,
            seq: 1873,
            at_us: 1_204_567_123
        }
    );
    assert_eq!(body, "NVRM: x");
    assert_eq!(split_prefix("4,1873,12;no flags"), None);
    assert_eq!(split_prefix("NVRM: a;b"), None);
    assert_eq!(split_prefix("4,-1,12,-;x"), None);
}

#[test]
fn continuation_lines_belong_to_their_record() {
    let mut s = RecordSplitter::default();
    let recs = s.push(
            b"4,10,100,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.\n SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0\n6,11,200,-;next\n",
        );
    assert_eq!(
        recs,
        [
            "4,10,100,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.\n SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0",
            "6,11,200,-;next"
        ]
    );
    assert_eq!(
        parse_record(&recs[0]),
        parse_line(recs[0].lines().next().unwrap())
    );
    assert!(matches!(parse_record(&recs[0]), Record::Xid(x) if x.xid == 79));
    assert_eq!(s.finish(), Vec::<String>::new());
}

#[test]
fn records_split_across_reads_are_put_back_together() {
    let mut s = RecordSplitter::default();
    assert_eq!(
        s.push(b"4,10,100,-;NVRM: Xid (PCI:00"),
        Vec::<String>::new()
    );
    assert_eq!(
        s.push(b"00:3b:00): 48, DBE\n SUBSYSTEM=pci\n6,11,"),
        ["4,10,100,-;NVRM: Xid (PCI:0000:3b:00): 48, DBE\n SUBSYSTEM=pci"]
    );
    assert_eq!(s.push(b"200,-;tail"), Vec::<String>::new());
    assert_eq!(s.finish(), ["6,11,200,-;tail"]);
    // A partial line starting with a space may be a continuation: wait.
    assert_eq!(s.push(b"6,12,300,-;a\n SUB"), Vec::<String>::new());
    assert_eq!(s.push(b"SYSTEM=pci\n"), ["6,12,300,-;a\n SUBSYSTEM=pci"]);
    // A line longer than MAX_LINE is cut, not buffered forever.
    let mut s = RecordSplitter::default();
    let long = vec![b'x'; MAX_LINE + 10];
    let recs = s.push(&long);
    assert_eq!(recs.len(), 1);
    assert_eq!(recs[0].len(), MAX_LINE);
    assert_eq!(s.finish(), ["x".repeat(10)]);
}

#[test]
fn sequence_gaps_count_lost_records() {
    let mut t = SeqTracker::default();
    assert_eq!(t.observe(5), None);
    assert_eq!(t.observe(6), None);
    assert_eq!(t.observe(10), Some(3));
    // A new writer starting over (a FIFO) is not a loss.
    assert_eq!(t.observe(1), None);
    assert_eq!(t.observe(u64::MAX), Some(u64::MAX - 2));
}

#[test]
fn open_errors_say_what_is_missing() {
    let e = open_error(
        Path::new("/dev/kmsg"),
        io::Error::from_raw_os_error(libc::EPERM),
    );
    assert!(matches!(e, KmsgError::NeedsCapSyslog { .. }));
    assert_eq!(
        e.to_string(),
        "/dev/kmsg: not allowed to read the kernel log: it needs CAP_SYSLOG while the sysctl kernel.dmesg_restrict is 1"
    );
    let e = open_error(
        Path::new("/host/dev/kmsg"),
        io::Error::from_raw_os_error(libc::ENOENT),
    );
    assert!(
        e.to_string().starts_with("/host/dev/kmsg: No such file"),
        "{e}"
    );
}

#[test]
fn a_regular_file_is_refused_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("dev")).unwrap();
    std::fs::write(dir.path().join("dev/kmsg"), "6,1,1,-;hello\n").unwrap();
    let host = HostRoot::new(dir.path()).unwrap();
    let err = KmsgReader::open(&host).unwrap_err();
    assert!(matches!(err, KmsgError::NotPollable { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("dev/kmsg: is a regular file, which epoll cannot watch"),
        "{msg}"
    );
    assert!(msg.starts_with(&host.path().display().to_string()), "{msg}");
    // A missing one names the path too.
    let empty = tempfile::tempdir().unwrap();
    let host = HostRoot::new(empty.path()).unwrap();
    let err = KmsgReader::open(&host).unwrap_err();
    assert!(err.to_string().contains("dev/kmsg: No such file"), "{err}");
}

#[test]
fn the_monotonic_clock_moves_forward() {
    let a = monotonic_now_us();
    std::thread::sleep(Duration::from_millis(2));
    let b = monotonic_now_us();
    assert!(a > 0 && b >= a + 1_000, "{a} {b}");
}

async fn recv(rx: &mut mpsc::UnboundedReceiver<KernelXid>) -> KernelXid {
    tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .expect("an XID within 5 s")
        .expect("the reader is running")
}

#[tokio::test]
async fn a_fifo_stands_in_for_dev_kmsg() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("dev")).unwrap();
    let fifo = dir.path().join("dev/kmsg");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let host = HostRoot::new(dir.path()).unwrap();
    let reader = KmsgReader::open(&host).unwrap().since_boot_us(1_000_000);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(reader.run(tx, async {
        stopped.await.ok();
    }));

    let mut w = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
    let started = std::time::Instant::now();
    // Before the cut-off: logged, not sent. Then a live one with its
    // continuation lines, all in one write.
    w.write_all(
            b"4,90,500000,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.\n\
              6,91,1500000,-;nvidia 0000:3b:00.0: something else\n SUBSYSTEM=pci\n\
              4,92,2000000,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.\n SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0\n",
        )
        .unwrap();
    let x = recv(&mut rx).await;
    assert_eq!(
        (x.bus_id.as_str(), x.xid, x.seq, x.pid),
        ("0000:3b:00.0", 79, 92, Some(1234))
    );
    // A record split across two writes.
    w.write_all(b"4,93,2100000,-;NVRM: Xid (PCI:0000:86:0")
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    w.write_all(b"0.0): 48, pid='<unknown>', name=<unknown>, DBE (0x1)\n")
        .unwrap();
    let x = recv(&mut rx).await;
    assert_eq!(
        (x.bus_id.as_str(), x.xid, x.pid),
        ("0000:86:00.0", 48, None)
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );

    // The writer goes away and a new one comes: the reader reopens.
    w.write_all(b"[ 3.5] NVRM: Xid (PCI:0000:3b:00): 94, pid=7, name=t, Contained")
        .unwrap();
    drop(w);
    let x = recv(&mut rx).await;
    assert_eq!((x.xid, x.at_us), (94, 3_500_000));
    let mut w = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
    w.write_all(b"4,95,3000000,-;NVRM: Xid (PCI:0000:3b:00 GPU-I:02): 13, pid=8, name=u, Graphics Exception\n")
            .unwrap();
    let x = recv(&mut rx).await;
    assert_eq!((x.xid, x.gpu_instance), (13, Some(2)));

    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(rx.try_recv().is_err(), "nothing else was sent");
}

#[tokio::test]
async fn the_reader_stops_when_nobody_listens() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("dev")).unwrap();
    let fifo = dir.path().join("dev/kmsg");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let host = HostRoot::new(dir.path()).unwrap();
    let reader = KmsgReader::open(&host).unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    drop(rx);
    let done = tokio::time::timeout(
        Duration::from_secs(5),
        reader.run(tx, std::future::pending()),
    )
    .await;
    assert!(matches!(done, Ok(Ok(()))), "{done:?}");
}

/// The real `/dev/kmsg`: either it is read (one whole record per read,
/// EAGAIN when done) or the error says why.
#[tokio::test]
async fn the_real_dev_kmsg_is_read_or_refused_clearly() {
    match KmsgReader::open(&HostRoot::system()) {
        Ok(reader) => {
            let reader = reader.since_boot_us(monotonic_now_us());
            let (tx, _rx) = mpsc::unbounded_channel();
            let done = reader
                .run(tx, tokio::time::sleep(Duration::from_millis(200)))
                .await;
            assert!(done.is_ok(), "{done:?}");
        }
        Err(e) => assert!(e.to_string().starts_with("/dev/kmsg: "), "{e}"),
    }
}

/// Writes one line to the machine's kernel log and reads it back: the
/// kernel stamps it as user space, so it must not come out as an XID.
#[tokio::test]
#[ignore = "writes to the real kernel log (needs root); run by hand"]
async fn injected_xid_lines_on_the_real_dev_kmsg_are_not_trusted() {
    let reader = KmsgReader::open(&HostRoot::system())
        .unwrap()
        .since_boot_us(0);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let marker = format!("gpu-agent-test-{}", std::process::id());
    std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/kmsg")
        .unwrap()
        .write_all(
            format!("NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name={marker}, injected\n").as_bytes(),
        )
        .unwrap();
    let done = reader
        .run(tx, tokio::time::sleep(Duration::from_millis(500)))
        .await;
    assert!(done.is_ok(), "{done:?}");
    while let Ok(x) = rx.try_recv() {
        assert_ne!(x.process.as_deref(), Some(marker.as_str()));
    }
    // The record is there, one per read, and reads as user space.
    let mut f = open_nonblocking(Path::new("/dev/kmsg")).unwrap();
    let mut buf = vec![0u8; READ_BUFFER];
    let mut found = None;
    loop {
        match f.read(&mut buf) {
            Ok(n) => {
                let rec = String::from_utf8_lossy(&buf[..n]).into_owned();
                assert!(rec.ends_with('\n'), "{rec:?}");
                if rec.contains(&marker) {
                    found = Some(rec);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {}
            Err(e) => panic!("{e}"),
        }
    }
    let rec = found.expect("the injected record");
    match parse_record(&rec) {
        Record::Unparsed { reason, .. } => assert!(reason.contains("user space"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

fn xid_or_unparsed(r: &Record) -> bool {
    matches!(r, Record::Xid(_) | Record::Unparsed { .. })
}

proptest! {
    #[test]
    fn any_string_parses_and_xid_lines_are_never_other(s in ".*") {
        let r = parse_line(&s);
        if s.contains("NVRM") && s.contains("Xid") {
            prop_assert!(xid_or_unparsed(&r), "{:?} -> {:?}", s, r);
        }
    }

    #[test]
    fn near_misses_of_real_lines_are_never_other(
        prefix in "([0-9]{1,3},[0-9]{1,5},[0-9]{1,9},[-c+];)?",
        addr in "(PCI:)?[0-9a-fA-F:.]{0,14}( GPU-I:[0-9x]{1,3})?( GPU-CI:[0-9]{1,3})?",
        number in "[0-9a-z]{0,22}",
        tail in "(, pid=[0-9'<>a-z]{0,12}(, name=[ -~]{0,12})?)?[ -~]{0,40}",
    ) {
        let line = format!("{prefix}NVRM: Xid ({addr}): {number}{tail}");
        let r = parse_line(&line);
        prop_assert!(xid_or_unparsed(&r), "{:?} -> {:?}", line, r);
        if let Record::Xid(x) = &r {
            prop_assert!(normalise_bus_id(&x.bus_id).as_deref() == Some(x.bus_id.as_str()));
        }
    }

    #[test]
    fn any_bytes_parse_and_xid_lines_are_never_other(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let s = String::from_utf8_lossy(&bytes);
        let r = parse_line(&s);
        if s.contains("NVRM") && s.contains("Xid") {
            prop_assert!(xid_or_unparsed(&r));
        }
    }

    #[test]
    fn any_chunking_gives_the_same_xids(
        lines in proptest::collection::vec(
            prop_oneof![
                Just("4,7,9000,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.".to_string()),
                Just(" SUBSYSTEM=pci".to_string()),
                Just(" NVRM: Xid (PCI:0000:3b:00): 48, x".to_string()),
                Just("NVRM: Xid 154, no address".to_string()),
                "[ -~]{0,30}",
                proptest::collection::vec(any::<u8>(), 0..40)
                    .prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
            ],
            0..12,
        ),
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..8),
    ) {
        let text = lines.join("\n");
        let bytes = text.as_bytes();
        let mut at: Vec<usize> = cuts.iter().map(|i| i.index(bytes.len() + 1)).collect();
        at.sort_unstable();
        let mut s = RecordSplitter::default();
        let mut recs = Vec::new();
        let mut from = 0;
        for to in at.into_iter().chain([bytes.len()]) {
            recs.extend(s.push(&bytes[from..to]));
            from = to;
        }
        recs.extend(s.finish());
        let got: Vec<Record> = recs.iter().map(|r| parse_record(r)).filter(xid_or_unparsed).collect();
        let want: Vec<Record> = text.split('\n').map(parse_line).filter(xid_or_unparsed).collect();
        prop_assert_eq!(got, want);
    }
}
