//! The mapping between the kubelet's messages and [`Claims`], and the
//! one-entry-per-claim rule.

use std::sync::Mutex;

use gpu_agent_proto::dra::v1::dra_plugin_server::DraPlugin as V1;
use gpu_agent_proto::dra::v1beta1::dra_plugin_server::DraPlugin as V1beta1;

use super::*;

fn claim(uid: &str, name: &str) -> ClaimRef {
    ClaimRef {
        namespace: "default".to_string(),
        uid: uid.to_string(),
        name: name.to_string(),
    }
}

fn device(uid: &str, share: Option<&str>) -> PreparedDevice {
    PreparedDevice {
        request_names: vec!["gpu".to_string()],
        pool_name: "node-a".to_string(),
        device_name: "gpu-0".to_string(),
        cdi_device_ids: vec![format!("k8s.gpu.nvidia.com/claim={uid}-gpu-0")],
        share_id: share.map(str::to_string),
    }
}

/// Answers from a script: a claim named `broken` fails, `silent` gets no
/// answer, and an extra answer for `stranger` comes with every batch; or it
/// panics.
#[derive(Default)]
struct Scripted {
    panic: bool,
    batches: Mutex<Vec<Vec<ClaimRef>>>,
}

impl Claims for Scripted {
    fn prepare(&self, claims: &[ClaimRef]) -> BTreeMap<String, PrepareOutcome> {
        assert!(!self.panic, "scripted panic");
        self.batches.lock().unwrap().push(claims.to_vec());
        let mut out: BTreeMap<_, _> = claims
            .iter()
            .filter(|c| c.name != "silent")
            .map(|c| {
                let outcome = if c.name == "broken" {
                    Err(format!("claim {}: /dev/nvidia9 is missing", c.uid))
                } else {
                    Ok(vec![device(
                        &c.uid,
                        c.name.starts_with("shared").then_some("s-1"),
                    )])
                };
                (c.uid.clone(), outcome)
            })
            .collect();
        out.insert("stranger".to_string(), Ok(Vec::new()));
        out
    }

    fn unprepare(&self, claims: &[ClaimRef]) -> BTreeMap<String, Result<(), String>> {
        assert!(!self.panic, "scripted panic");
        claims
            .iter()
            .filter(|c| c.name != "silent")
            .map(|c| {
                let outcome = if c.name == "broken" {
                    Err("busy".to_string())
                } else {
                    Ok(())
                };
                (c.uid.clone(), outcome)
            })
            .collect()
    }
}

#[test]
fn complete_answers_every_requested_claim_and_nothing_else() {
    let requested = [claim("a", "one"), claim("b", "two")];
    let mut outcomes: BTreeMap<String, Result<(), String>> = BTreeMap::new();
    outcomes.insert("a".to_string(), Ok(()));
    outcomes.insert("zzz".to_string(), Ok(()));
    let answers = complete(Call::Unprepare, &requested, outcomes);
    assert_eq!(answers.keys().collect::<Vec<_>>(), ["a", "b"]);
    assert_eq!(answers["a"], Ok(()));
    let err = answers["b"].as_ref().unwrap_err();
    assert!(err.contains("unprepare of claim default/two (b)"), "{err}");
}

#[test]
fn a_repeated_uid_is_asked_about_once() {
    let d = distinct(vec![
        claim("a", "one"),
        claim("b", "two"),
        claim("a", "again"),
    ]);
    assert_eq!(d, [claim("a", "one"), claim("b", "two")]);
}

#[test]
fn v1_keeps_the_share_id_v1beta1_has_none() {
    let mut answers = BTreeMap::new();
    answers.insert("a".to_string(), Ok(vec![device("a", Some("s-1"))]));
    answers.insert("b".to_string(), Err("claim b: no".to_string()));
    let r1 = v1::prepare_response(answers.clone());
    assert_eq!(r1.claims.len(), 2);
    let d = &r1.claims["a"].devices[0];
    assert_eq!(d.share_id.as_deref(), Some("s-1"));
    assert_eq!(d.pool_name, "node-a");
    assert_eq!(d.device_name, "gpu-0");
    assert_eq!(d.request_names, ["gpu"]);
    assert_eq!(d.cdi_device_ids, ["k8s.gpu.nvidia.com/claim=a-gpu-0"]);
    assert_eq!(r1.claims["a"].error, "");
    assert!(r1.claims["b"].devices.is_empty());
    assert_eq!(r1.claims["b"].error, "claim b: no");
    let rb = v1beta1::prepare_response(answers);
    let d = &rb.claims["a"].devices[0];
    assert_eq!(d.cdi_device_ids, ["k8s.gpu.nvidia.com/claim=a-gpu-0"]);
    assert_eq!(rb.claims["b"].error, "claim b: no");
}

#[test]
fn an_unprepare_entry_is_empty_unless_it_failed() {
    let mut answers = BTreeMap::new();
    answers.insert("a".to_string(), Ok(()));
    answers.insert("b".to_string(), Err("busy".to_string()));
    let r = v1::unprepare_response(answers.clone());
    assert_eq!(r.claims["a"].error, "");
    assert_eq!(r.claims["b"].error, "busy");
    let r = v1beta1::unprepare_response(answers);
    assert_eq!(r.claims["a"].error, "");
    assert_eq!(r.claims["b"].error, "busy");
}

#[test]
fn claims_come_over_as_the_kubelet_named_them() {
    let refs = v1::claim_refs(vec![proto::v1::Claim {
        namespace: "ns".to_string(),
        uid: "u-1".to_string(),
        name: "c".to_string(),
    }]);
    assert_eq!(
        refs,
        [ClaimRef {
            namespace: "ns".to_string(),
            uid: "u-1".to_string(),
            name: "c".to_string()
        }]
    );
}

#[tokio::test]
async fn prepare_through_both_versions_one_entry_per_claim() {
    let scripted = Arc::new(Scripted::default());
    let svc = DraService::new(scripted.clone());
    let claims = ["a:one", "b:broken", "c:silent", "d:shared", "a:one"]
        .map(|s| {
            let (uid, name) = s.split_once(':').unwrap();
            (uid.to_string(), name.to_string())
        })
        .to_vec();
    let r1 = V1::node_prepare_resources(
        &svc,
        Request::new(proto::v1::NodePrepareResourcesRequest {
            claims: claims
                .iter()
                .map(|(uid, name)| proto::v1::Claim {
                    namespace: "default".to_string(),
                    uid: uid.clone(),
                    name: name.clone(),
                })
                .collect(),
        }),
    )
    .await
    .unwrap()
    .into_inner();
    let mut keys: Vec<_> = r1.claims.keys().cloned().collect();
    keys.sort();
    assert_eq!(keys, ["a", "b", "c", "d"]);
    assert_eq!(r1.claims["a"].devices.len(), 1);
    assert!(r1.claims["b"].error.contains("/dev/nvidia9 is missing"));
    assert!(
        r1.claims["c"].error.contains("default/silent (c)"),
        "{:?}",
        r1.claims["c"]
    );
    assert_eq!(r1.claims["d"].devices[0].share_id.as_deref(), Some("s-1"));
    // The batch went to Claims once, each UID once.
    assert_eq!(scripted.batches.lock().unwrap()[0].len(), 4);

    let rb = V1beta1::node_unprepare_resources(
        &svc,
        Request::new(proto::v1beta1::NodeUnprepareResourcesRequest {
            claims: claims
                .iter()
                .map(|(uid, name)| proto::v1beta1::Claim {
                    namespace: "default".to_string(),
                    uid: uid.clone(),
                    name: name.clone(),
                })
                .collect(),
        }),
    )
    .await
    .unwrap()
    .into_inner();
    assert_eq!(rb.claims.len(), 4);
    assert_eq!(rb.claims["a"].error, "");
    assert_eq!(rb.claims["b"].error, "busy");
    assert!(
        rb.claims["c"]
            .error
            .contains("unprepare of claim default/silent (c)")
    );
}

#[tokio::test]
async fn a_panicking_worker_fails_each_claim_by_name() {
    let svc = DraService::new(Arc::new(Scripted {
        panic: true,
        ..Scripted::default()
    }));
    let answers = svc
        .prepare("v1", vec![claim("a", "one"), claim("b", "two")])
        .await;
    assert_eq!(answers.len(), 2);
    let err = answers["b"].as_ref().unwrap_err();
    assert!(
        err.starts_with("prepare of claim default/two (b): the worker failed"),
        "{err}"
    );
    let answers = svc.unprepare("v1", vec![claim("a", "one")]).await;
    assert!(
        answers["a"]
            .as_ref()
            .unwrap_err()
            .contains("default/one (a)")
    );
}

#[tokio::test]
async fn an_empty_batch_gets_an_empty_answer() {
    let svc = DraService::new(Arc::new(Scripted::default()));
    assert!(svc.prepare("v1", Vec::new()).await.is_empty());
    assert!(svc.unprepare("v1beta1", Vec::new()).await.is_empty());
}
