//! The crash suite of issue 31: a real process serving DRA (the node's
//! claims opened and served with `gpu_dra::kubelet::serve` on Unix sockets,
//! an 8-GPU node of benches/support in a temp dir) killed with SIGKILL, then
//! started again on the same directory, as the agent is after a crash.
//!
//! The server is this test binary run again for just the one test with
//! `GPU_DRA_CRASH_CHILD=<test>=<node dir>` set: it opens the node's claims
//! (its allocations from `allocations.json` in the node's directory, as the
//! controller's feed would have left them), prints `ready <status JSON>` and
//! serves until killed (or until its stdin closes with the parent).
//!
//! After every restart the node's disk is checked against what the kubelet
//! (this test, a tonic DRA v1 client) saw: the checkpoint and the spec files
//! agree (a spec per prepared claim, the spec the checkpoint holds, no spec
//! without an entry, no `preparing` entry left), no device is held by two
//! claims, every claim seen prepared is still prepared and a repeat prepare
//! answers its CDI IDs, every claim seen unprepared is gone, and what start-up
//! did is what `status().recovery` says. The in-process cases (a failed
//! write, a race, recovery of a checkpoint written by hand) are the unit
//! tests in src/claims/tests.rs; these are the kills mid-write.

#[path = "../benches/support/mod.rs"]
mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use gpu_agent_proto::dra::v1::dra_plugin_client::DraPluginClient;
use gpu_dra::claims::checkpoint::{self, Checkpoint, EntryState, Loaded};
use gpu_dra::claims::{MemoryAllocations, NodeClaims, cdi};
use gpu_model::cdi::Spec;
use hostlib::HostRoot;
use serde_json::Value;
use tonic::transport::Channel;

const CHILD: &str = "GPU_DRA_CRASH_CHILD";
const ALLOCATIONS: &str = "allocations.json";
const BOOT: &str = "0b5e6f1c-1111-4c1e-9d2a-00000000c0de";
/// Kill rounds of each stream; every round restarts the server once.
const ROUNDS: u32 = 50;

// --- the server, in the child ----------------------------------------------

/// The node's directory when this process is the server of `test`.
fn child_root(test: &str) -> Option<PathBuf> {
    let v = std::env::var(CHILD).ok()?;
    let (t, root) = v.split_once('=')?;
    (t == test).then(|| PathBuf::from(root))
}

/// Serves the node in `root` until killed, or until the parent is gone
/// (stdin closed).
async fn serve_node(root: PathBuf) {
    let host = HostRoot::new(&root).unwrap();
    let allocs = Arc::new(MemoryAllocations::new());
    let text = std::fs::read_to_string(root.join(ALLOCATIONS)).unwrap();
    allocs.replace_all(serde_json::from_str(&text).unwrap());
    let claims = NodeClaims::open(host, support::options(), allocs, &support::inventory());
    let claims = Arc::new(claims.expect("the node's claims open after a crash"));
    println!("ready {}", serde_json::to_string(&claims.status()).unwrap());
    let parent_gone = async {
        let _ = tokio::task::spawn_blocking(|| std::io::stdin().read_to_end(&mut Vec::new())).await;
    };
    support::serve_claims(&support::dirs(&root.join("sockets")), claims, parent_gone)
        .await
        .unwrap();
}

// --- the node, its server and its disk, in the parent ---------------------------

/// A node directory and the test whose binary serves it.
struct Node {
    test: &'static str,
    dir: tempfile::TempDir,
    host: HostRoot,
}

/// A running server: its process and the status it printed when ready.
struct Server {
    child: Option<Child>,
    status: Value,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Server {
    /// Kills the server with SIGKILL after `after`, from another thread (so
    /// the moment is not the runtime's timer's); joined by the returned handle.
    fn kill_after(&mut self, after: Duration) -> std::thread::JoinHandle<()> {
        let mut child = self.child.take().expect("a running server");
        std::thread::spawn(move || {
            std::thread::sleep(after);
            child.kill().expect("SIGKILL");
            child.wait().expect("the killed server");
        })
    }

    fn recovery(&self) -> &Value {
        &self.status["recovery"]
    }
}

/// What is on the node's disk: the checkpoint, the claims' specs, and the
/// names of any other file in the CDI directory but the node spec.
#[derive(Debug)]
struct Disk {
    checkpoint: Checkpoint,
    specs: BTreeMap<String, Spec>,
    others: Vec<String>,
}

impl Node {
    /// A node whose allocations hold `claims` (UID, GPU).
    fn new(test: &'static str, claims: &[(String, u32)]) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let host = support::make_host(dir.path(), BOOT);
        let allocs = support::allocations(claims.iter().cloned());
        std::fs::write(
            dir.path().join(ALLOCATIONS),
            serde_json::to_string(&allocs).unwrap(),
        )
        .unwrap();
        Node { test, dir, host }
    }

    fn dirs(&self) -> gpu_dra::kubelet::Dirs {
        support::dirs(&self.dir.path().join("sockets"))
    }

    /// Starts the server; returns once it printed its status.
    fn start(&self) -> Server {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([self.test, "--exact", "--nocapture", "--test-threads=1"])
            .env(
                CHILD,
                format!("{}={}", self.test, self.dir.path().display()),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                // After libtest's "test <name> ... " when it shares the line.
                if let Some(at) = line.find("ready {") {
                    let _ = tx.send(line[at + "ready ".len()..].to_string());
                }
            }
        });
        let mut server = Server {
            child: Some(child),
            status: Value::Null,
        };
        let line = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the server printed no ready line (its stderr is above)");
        server.status = serde_json::from_str(&line).unwrap();
        server
    }

    async fn client(&self) -> DraPluginClient<Channel> {
        support::client(&self.dirs(), Duration::from_secs(10)).await
    }

    fn cdi_dir(&self) -> String {
        support::options().cdi_dir
    }

    fn spec_path(&self, uid: &str) -> String {
        cdi::spec_path(&self.cdi_dir(), uid)
    }

    fn checkpoint_path(&self) -> String {
        checkpoint::checkpoint_path(&support::options().state_dir)
    }

    fn disk(&self) -> Disk {
        let checkpoint = match checkpoint::load(&self.host, &self.checkpoint_path()).unwrap() {
            Loaded::Found(c) => c,
            other => panic!("the checkpoint is not readable: {other:?}"),
        };
        let mut specs = BTreeMap::new();
        let mut others = Vec::new();
        for name in self.host.read_dir_names(self.cdi_dir()).unwrap() {
            match cdi::uid_of_spec_file(&name) {
                Some(uid) => {
                    let path = format!("{}/{name}", self.cdi_dir());
                    let text = self.host.read_to_string(&path).unwrap();
                    let spec = serde_yaml_ng::from_str(&text)
                        .unwrap_or_else(|e| panic!("{path} is not a whole spec ({e}): {text}"));
                    specs.insert(uid.to_string(), spec);
                }
                None if name == gpu_model::cdi::SPEC_FILE => {}
                None => others.push(name),
            }
        }
        Disk {
            checkpoint,
            specs,
            others,
        }
    }
}

/// Status's list `key` of `recovery`, sorted.
fn listed(recovery: &Value, key: &str) -> BTreeSet<String> {
    recovery[key]
        .as_array()
        .unwrap_or_else(|| panic!("recovery has no {key}: {recovery}"))
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect()
}

impl Disk {
    /// The checkpoint and the specs agree, nothing is half done, and no
    /// device is held by two claims (none of these claims shares).
    fn check_agrees(&self, ctx: &str) {
        let prepared: BTreeSet<&String> = self.checkpoint.claims.keys().collect();
        let specs: BTreeSet<&String> = self.specs.keys().collect();
        assert_eq!(
            prepared, specs,
            "{ctx}: checkpoint vs spec files: {self:#?}"
        );
        let mut holders: BTreeMap<&str, &str> = BTreeMap::new();
        for (uid, e) in &self.checkpoint.claims {
            assert_eq!(
                e.state,
                EntryState::Prepared,
                "{ctx}: claim {uid} left half prepared"
            );
            assert_eq!(
                Some(&e.spec),
                self.specs.get(uid),
                "{ctx}: claim {uid}'s spec is not the one its checkpoint entry holds"
            );
            for d in &e.devices {
                if let Some(other) = holders.insert(&d.device, uid) {
                    panic!(
                        "{ctx}: device {} held by claims {other} and {uid}",
                        d.device
                    );
                }
            }
        }
    }

    /// The CDI IDs of prepared claim `uid`, from the checkpoint.
    fn ids(&self, uid: &str) -> Option<Vec<String>> {
        let e = self.checkpoint.claims.get(uid)?;
        Some(
            e.devices
                .iter()
                .flat_map(|d| d.cdi_device_ids.clone())
                .collect(),
        )
    }
}

/// What a restart must say it did, from the disk the killed server left.
fn check_recovery(before: &Disk, node: &Node, server: &Server, ctx: &str) {
    let rec = server.recovery();
    assert_eq!(rec["checkpoint"]["found"], "loaded", "{ctx}: {rec}");
    assert_eq!(
        rec["checkpoint"]["claims"],
        before.checkpoint.claims.len(),
        "{ctx}: {rec}"
    );
    let half: BTreeSet<String> = before
        .checkpoint
        .claims
        .iter()
        .filter(|(_, e)| e.state == EntryState::Preparing)
        .map(|(u, _)| u.clone())
        .collect();
    assert_eq!(listed(rec, "rolledBack"), half, "{ctx}: {rec}");
    // Stray specs, and the temp files of spec writes the kill cut short.
    let stray: BTreeSet<String> = before
        .specs
        .keys()
        .filter(|u| !before.checkpoint.claims.contains_key(*u))
        .map(|u| node.spec_path(u))
        .chain(
            before
                .others
                .iter()
                .filter(|n| n.contains(".gpu-agent-tmp."))
                .map(|n| format!("{}/{n}", node.cdi_dir())),
        )
        .collect();
    assert_eq!(listed(rec, "removed"), stray, "{ctx}: {rec}");
    let after = node.disk();
    assert!(
        after.others.iter().all(|n| !n.contains(".gpu-agent-tmp.")),
        "{ctx}: temp files left after the restart: {:?}",
        after.others
    );
    let rewritten: BTreeSet<String> = before
        .checkpoint
        .claims
        .iter()
        .filter(|(u, e)| e.state == EntryState::Prepared && before.specs.get(*u) != Some(&e.spec))
        .map(|(u, _)| u.clone())
        .collect();
    assert_eq!(listed(rec, "rewritten"), rewritten, "{ctx}: {rec}");
    assert_eq!(listed(rec, "problems"), BTreeSet::new(), "{ctx}: {rec}");
}

// --- the streams ---------------------------------------------------------------

/// What the kubelet saw of one claim.
#[derive(Clone, Debug, PartialEq)]
enum Seen {
    /// Asked; no answer came (the server died).
    Sent,
    Prepared(Vec<String>),
    Unprepared,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    Prepare,
    Unprepare,
}

/// Calls `op` for each claim in turn until one gets no answer; what was seen.
async fn stream(
    mut client: DraPluginClient<Channel>,
    op: Op,
    claims: Vec<String>,
    seen: Arc<Mutex<BTreeMap<String, Seen>>>,
) {
    for uid in claims {
        seen.lock().unwrap().insert(uid.clone(), Seen::Sent);
        let answer = match op {
            Op::Prepare => support::prepare(&mut client, &uid)
                .await
                .map(|r| r.map(Seen::Prepared)),
            Op::Unprepare => support::unprepare(&mut client, &uid)
                .await
                .map(|r| r.map(|()| Seen::Unprepared)),
        };
        match answer {
            Ok(Ok(s)) => {
                seen.lock().unwrap().insert(uid, s);
            }
            Ok(Err(e)) => panic!("claim {uid} failed while the server was up: {e}"),
            Err(_) => return,
        }
    }
}

/// A small xorshift generator: the kill moments, reproducible with
/// `GPU_DRA_CRASH_SEED`.
struct Rng(u64);

impl Rng {
    fn new(test: &str) -> Rng {
        let seed = std::env::var("GPU_DRA_CRASH_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
            });
        eprintln!("{test}: GPU_DRA_CRASH_SEED={seed}");
        Rng(seed | 1)
    }

    fn below(&mut self, d: Duration) -> Duration {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        d.mul_f64((self.0 % 10_000) as f64 / 10_000.0)
    }
}

/// Round `round`'s claims: one per GPU.
fn round_claims(round: u32) -> Vec<(String, u32)> {
    (0..support::GPUS)
        .map(|g| (support::claim_uid(round, g), g))
        .collect()
}

/// Round `round`'s rival of GPU `gpu`: another claim allocated the GPU of
/// a claim whose prepare got no answer.
fn rival(round: u32, gpu: u32) -> String {
    support::claim_uid(1000 + round, gpu)
}

fn all_claims() -> Vec<(String, u32)> {
    let rivals = (0..=ROUNDS).flat_map(|r| (0..support::GPUS).map(move |g| (rival(r, g), g)));
    (0..=ROUNDS).flat_map(round_claims).chain(rivals).collect()
}

async fn prepare_ok(client: &mut DraPluginClient<Channel>, uid: &str, gpu: u32, ctx: &str) {
    let got = support::prepare(client, uid)
        .await
        .expect("the prepare call");
    assert_eq!(got, Ok(support::cdi_ids(uid, gpu)), "{ctx}: claim {uid}");
}

async fn unprepare_ok(client: &mut DraPluginClient<Channel>, uid: &str, ctx: &str) {
    let got = support::unprepare(client, uid)
        .await
        .expect("the unprepare call");
    assert_eq!(got, Ok(()), "{ctx}: claim {uid}");
}

/// How often each outcome came up over the rounds.
#[derive(Debug, Default)]
struct Tally {
    mid_stream: u32,
    unanswered: u32,
    rolled_back: usize,
    stray_removed: usize,
    rewritten: usize,
}

/// Kill rounds of `op`: each round streams `op` over one claim per GPU (an
/// unprepare round prepares them first) and kills the server at a random
/// moment within the time a whole stream takes (measured in round 0, not
/// killed; shortened when a kill comes after the stream's end); then checks
/// the restarted server's disk, status and answers against what was seen,
/// retries what got no answer (a prepare after a rival claim of its GPU,
/// which must be refused exactly when the claim kept it), and unprepares
/// the round's claims.
async fn kill_rounds(test: &'static str, op: Op) {
    let node = Node::new(test, &all_claims());
    let mut rng = Rng::new(test);
    let mut server = node.start();
    let mut span = Duration::ZERO;
    let mut tally = Tally::default();
    let started = Instant::now();
    for round in 0..=ROUNDS {
        let ctx = format!("{test} round {round}");
        let claims = round_claims(round);
        let mut client = node.client().await;
        if op == Op::Unprepare {
            for (uid, gpu) in &claims {
                prepare_ok(&mut client, uid, *gpu, &ctx).await;
            }
        }
        let seen = Arc::new(Mutex::new(BTreeMap::new()));
        let uids = claims.iter().map(|(u, _)| u.clone()).collect();
        let t = Instant::now();
        let task = tokio::spawn(stream(client, op, uids, Arc::clone(&seen)));
        if round == 0 {
            task.await.unwrap();
            span = t.elapsed();
            server.kill_after(Duration::ZERO).join().unwrap();
        } else {
            let killer = server.kill_after(rng.below(span));
            task.await.unwrap();
            killer.join().unwrap();
        }
        let seen = seen.lock().unwrap().clone();
        let unanswered = seen.values().any(|s| *s == Seen::Sent);
        tally.unanswered += u32::from(unanswered);
        if round > 0 && (unanswered || seen.len() < claims.len()) {
            tally.mid_stream += 1;
        } else if round > 0 {
            span = span.mul_f64(0.8);
        }

        let before = node.disk();
        server = node.start();
        check_recovery(&before, &node, &server, &ctx);
        tally.rolled_back += listed(server.recovery(), "rolledBack").len();
        tally.stray_removed += listed(server.recovery(), "removed").len();
        tally.rewritten += listed(server.recovery(), "rewritten").len();
        let after = node.disk();
        after.check_agrees(&ctx);
        let mut client = node.client().await;
        for (uid, gpu) in &claims {
            let ctx = format!("{ctx}, seen {:?}", seen.get(uid));
            match (op, seen.get(uid)) {
                (Op::Prepare, Some(Seen::Prepared(ids))) => {
                    assert_eq!(after.ids(uid).as_ref(), Some(ids), "{ctx}: {uid} lost");
                    prepare_ok(&mut client, uid, *gpu, &ctx).await;
                }
                // No answer: prepared or rolled back, and its GPU with it.
                (Op::Prepare, Some(Seen::Sent)) => {
                    let rival = rival(round, *gpu);
                    let got = support::prepare(&mut client, &rival).await.unwrap();
                    if after.ids(uid).is_some() {
                        let device = support::device(*gpu);
                        assert!(
                            got.as_ref()
                                .is_err_and(|e| e.contains(&device) && e.contains(uid)),
                            "{ctx}: rival {rival} of {uid} got {got:?}"
                        );
                    } else {
                        assert_eq!(got, Ok(support::cdi_ids(&rival, *gpu)), "{ctx}");
                        unprepare_ok(&mut client, &rival, &ctx).await;
                    }
                    // The kubelet retries a prepare it got no answer to.
                    prepare_ok(&mut client, uid, *gpu, &ctx).await;
                }
                (Op::Prepare, None) => assert_eq!(after.ids(uid), None, "{ctx}: {uid}"),
                (Op::Unprepare, Some(Seen::Unprepared)) => {
                    assert_eq!(after.ids(uid), None, "{ctx}: {uid} came back")
                }
                // Prepared, and the unprepare not sent or not answered.
                (Op::Unprepare, _) => {
                    if !seen.contains_key(uid) {
                        let ids = support::cdi_ids(uid, *gpu);
                        assert_eq!(after.ids(uid), Some(ids), "{ctx}: {uid} lost");
                    }
                    if after.ids(uid).is_some() {
                        prepare_ok(&mut client, uid, *gpu, &ctx).await;
                    }
                }
                (_, s) => panic!("{ctx}: claim {uid} seen as {s:?}"),
            }
        }
        for (uid, _) in &claims {
            unprepare_ok(&mut client, uid, &ctx).await;
        }
        let clean = node.disk();
        assert!(
            clean.checkpoint.claims.is_empty() && clean.specs.is_empty(),
            "{ctx}: {clean:#?}"
        );
    }
    let leftovers = node.disk().others;
    eprintln!(
        "{test}: {ROUNDS} kills, within {:.1} ms of the stream's start at the end, in {:.1} s: {tally:?}; \
         other files left in the CDI directory: {leftovers:?}",
        span.as_secs_f64() * 1e3,
        started.elapsed().as_secs_f64()
    );
    assert!(
        tally.mid_stream >= ROUNDS / 2,
        "only {} of {ROUNDS} kills hit the stream",
        tally.mid_stream
    );
    // Temp files of checkpoint writes the kills cut short are gone with
    // the next write; nothing else was set aside.
    let state = node
        .host
        .read_dir_names(support::options().state_dir)
        .unwrap();
    assert_eq!(
        state,
        [checkpoint::CHECKPOINT_FILE],
        "{test}: the state directory"
    );
    // A temp file of a write the kill cut short is never a spec the CDI
    // cache reads (a dot file, not .yaml/.json).
    for name in &leftovers {
        assert!(
            name.starts_with('.') && !name.ends_with(".yaml") && !name.ends_with(".json"),
            "{test}: {name} left in the CDI directory"
        );
    }
    drop(server);
}

// --- the cases ---------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_prepares_loses_and_doubles_nothing() {
    const TEST: &str = "kill_9_during_prepares_loses_and_doubles_nothing";
    if let Some(root) = child_root(TEST) {
        return serve_node(root).await;
    }
    kill_rounds(TEST, Op::Prepare).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_unprepares_loses_and_doubles_nothing() {
    const TEST: &str = "kill_9_during_unprepares_loses_and_doubles_nothing";
    if let Some(root) = child_root(TEST) {
        return serve_node(root).await;
    }
    kill_rounds(TEST, Op::Unprepare).await;
}

/// Prepares `claims` on a fresh server of `node` and kills it with SIGKILL.
async fn prepared_then_killed(node: &Node, claims: &[(String, u32)]) -> Disk {
    let mut server = node.start();
    let mut client = node.client().await;
    for (uid, gpu) in claims {
        prepare_ok(&mut client, uid, *gpu, node.test).await;
    }
    server.kill_after(Duration::ZERO).join().unwrap();
    let disk = node.disk();
    disk.check_agrees(node.test);
    assert_eq!(disk.checkpoint.claims.len(), claims.len());
    disk
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_writes_the_specs_deleted_while_down_again() {
    const TEST: &str = "a_restart_writes_the_specs_deleted_while_down_again";
    if let Some(root) = child_root(TEST) {
        return serve_node(root).await;
    }
    let claims = round_claims(1)[..4].to_vec();
    let other = (support::claim_uid(2, 0), 0);
    let node = Node::new(TEST, &[&claims[..], std::slice::from_ref(&other)].concat());
    let before = prepared_then_killed(&node, &claims).await;
    for (uid, _) in &claims[..2] {
        assert!(node.host.remove_file(node.spec_path(uid)).unwrap());
    }
    let server = node.start();
    let rec = server.recovery();
    let deleted: BTreeSet<String> = claims[..2].iter().map(|(u, _)| u.clone()).collect();
    assert_eq!(listed(rec, "rewritten"), deleted, "{rec}");
    assert_eq!(rec["checkpoint"]["claims"], 4, "{rec}");
    let after = node.disk();
    after.check_agrees(TEST);
    assert_eq!(
        after.specs, before.specs,
        "the specs written again are the same"
    );
    let mut client = node.client().await;
    for (uid, gpu) in &claims {
        prepare_ok(&mut client, uid, *gpu, TEST).await;
    }
    // Their GPUs are still theirs.
    let got = support::prepare(&mut client, &other.0).await.unwrap();
    assert!(
        got.as_ref()
            .is_err_and(|e| e.contains("gpu-0") && e.contains(&claims[0].0)),
        "{got:?}"
    );
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_checkpoint_after_kill_9_is_set_aside_and_rebuilt_from_the_specs() {
    const TEST: &str = "a_corrupt_checkpoint_after_kill_9_is_set_aside_and_rebuilt_from_the_specs";
    if let Some(root) = child_root(TEST) {
        return serve_node(root).await;
    }
    let mut claims = round_claims(1)[..3].to_vec();
    claims.push((support::claim_uid(2, 0), 0));
    let node = Node::new(TEST, &claims);
    let before = prepared_then_killed(&node, &claims[..3]).await;
    let garbage = b"{\"version\":1,\"bootId\":\"0b5e\xff\xfe\x00\x01garbage";
    let path = node.checkpoint_path();
    node.host.write_atomic(&path, garbage, 0o600).unwrap();

    let server = node.start();
    let rec = server.recovery();
    let found = &rec["checkpoint"];
    assert_eq!(found["found"], "corrupt", "{rec}");
    let aside = found["setAside"]
        .as_str()
        .unwrap_or_else(|| panic!("no set-aside path in {rec}"));
    assert!(aside.starts_with(&format!("{path}.corrupt-")), "{rec}");
    let kept = std::fs::read(node.host.resolve(aside).unwrap()).unwrap();
    assert_eq!(kept, garbage, "the corrupt checkpoint is kept as it was");
    let uids: BTreeSet<String> = claims[..3].iter().map(|(u, _)| u.clone()).collect();
    assert_eq!(listed(found, "rebuilt"), uids, "{rec}");
    let after = node.disk();
    after.check_agrees(TEST);
    assert_eq!(after.specs, before.specs);
    assert!(after.checkpoint.claims.values().all(|e| e.recovered));

    let mut client = node.client().await;
    // A rebuilt claim's GPU is not handed to another claim.
    let got = support::prepare(&mut client, &claims[3].0).await.unwrap();
    assert!(
        got.as_ref()
            .is_err_and(|e| e.contains("gpu-0") && e.contains(&claims[0].0)),
        "{got:?}"
    );
    for (uid, gpu) in &claims[..3] {
        prepare_ok(&mut client, uid, *gpu, TEST).await;
    }
    let again = node.disk();
    again.check_agrees(TEST);
    assert!(again.checkpoint.claims.values().all(|e| !e.recovered));
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_reboot_the_old_boots_claims_are_dropped_and_prepared_again() {
    const TEST: &str = "after_a_reboot_the_old_boots_claims_are_dropped_and_prepared_again";
    if let Some(root) = child_root(TEST) {
        return serve_node(root).await;
    }
    let claims = round_claims(1)[..3].to_vec();
    let node = Node::new(TEST, &claims);
    prepared_then_killed(&node, &claims).await;
    let new_boot = "0b5e6f1c-2222-4c1e-9d2a-00000000c0de";
    node.host
        .write_atomic(
            support::BOOT_ID_PATH,
            format!("{new_boot}\n").as_bytes(),
            0o444,
        )
        .unwrap();

    let server = node.start();
    let rec = server.recovery();
    let found = &rec["checkpoint"];
    assert_eq!(found["found"], "otherBoot", "{rec}");
    let old = found["bootId"].as_str();
    assert_eq!(old, Some(BOOT), "{rec}");
    let uids: BTreeSet<String> = claims.iter().map(|(u, _)| u.clone()).collect();
    assert_eq!(listed(found, "dropped"), uids, "{rec}");
    let paths: BTreeSet<String> = claims.iter().map(|(u, _)| node.spec_path(u)).collect();
    assert_eq!(listed(rec, "removed"), paths, "{rec}");
    let after = node.disk();
    assert_eq!(after.checkpoint.boot_id, new_boot);
    after.check_agrees(TEST);
    assert!(after.checkpoint.claims.is_empty(), "{after:#?}");

    // The kubelet prepares them again after a reboot.
    let mut client = node.client().await;
    for (uid, gpu) in &claims {
        prepare_ok(&mut client, uid, *gpu, TEST).await;
    }
    let again = node.disk();
    again.check_agrees(TEST);
    assert_eq!(again.checkpoint.claims.len(), 3);
    drop(server);
}
