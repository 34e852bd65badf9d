//! The DRA plugin services, `v1` and `v1beta1`: `NodePrepareResources` and
//! `NodeUnprepareResources` answered through [`Claims`] (run off the async
//! threads), exactly one entry per requested claim, keyed by UID, a claim's
//! failure in its entry's `error` (docs/dra-facts.md §4).

use std::collections::BTreeMap;
use std::sync::Arc;

use gpu_agent_proto::dra as proto;
use tonic::{Request, Response, Status};

use crate::claim::{ClaimRef, Claims, PrepareOutcome, PreparedDevice};

/// Both DRA API versions' service, over the node's claims.
#[derive(Clone)]
pub struct DraService {
    claims: Arc<dyn Claims>,
}

impl std::fmt::Debug for DraService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraService").finish_non_exhaustive()
    }
}

/// Which call, for messages and logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Call {
    Prepare,
    Unprepare,
}

impl Call {
    fn verb(self) -> &'static str {
        match self {
            Call::Prepare => "prepare",
            Call::Unprepare => "unprepare",
        }
    }
}

/// `namespace/name (uid)`: how a claim is named in errors and logs.
fn describe(claim: &ClaimRef) -> String {
    format!("{}/{} ({})", claim.namespace, claim.name, claim.uid)
}

/// The requested claims, each UID once (the first wins), in request order.
fn distinct(requested: Vec<ClaimRef>) -> Vec<ClaimRef> {
    let mut seen = std::collections::BTreeSet::new();
    requested
        .into_iter()
        .filter(|c| seen.insert(c.uid.clone()))
        .collect()
}

/// Exactly one answer per requested claim: the outcome [`Claims`] gave for
/// its UID, or an error naming the claim where it gave none; outcomes for
/// UIDs that were not asked about are dropped (the kubelet fails a response
/// that has them).
fn complete<T>(
    call: Call,
    requested: &[ClaimRef],
    mut outcomes: BTreeMap<String, Result<T, String>>,
) -> BTreeMap<String, Result<T, String>> {
    let answers: BTreeMap<_, _> = requested
        .iter()
        .map(|c| {
            let outcome = outcomes.remove(&c.uid).unwrap_or_else(|| {
                Err(format!(
                    "{} of claim {}: the node's claims gave no answer for it",
                    call.verb(),
                    describe(c)
                ))
            });
            (c.uid.clone(), outcome)
        })
        .collect();
    for uid in outcomes.keys() {
        tracing::warn!(call = call.verb(), claim_uid = %uid, "an answer for a claim that was not asked about; dropped");
    }
    answers
}

/// Every requested claim failed with `why` (the worker did not finish).
fn all_failed<T>(
    call: Call,
    requested: &[ClaimRef],
    why: &str,
) -> BTreeMap<String, Result<T, String>> {
    requested
        .iter()
        .map(|c| {
            let error = format!("{} of claim {}: {why}", call.verb(), describe(c));
            (c.uid.clone(), Err(error))
        })
        .collect()
}

/// Logs each claim's answer.
fn log_answers<T>(
    api: &str,
    call: Call,
    requested: &[ClaimRef],
    answers: &BTreeMap<String, Result<T, String>>,
    count: impl Fn(&T) -> usize,
) {
    for c in requested {
        match answers.get(&c.uid) {
            Some(Ok(done)) => tracing::info!(
                api,
                call = call.verb(),
                claim_uid = %c.uid,
                namespace = %c.namespace,
                claim = %c.name,
                devices = count(done),
                "claim {}d",
                call.verb()
            ),
            Some(Err(error)) => tracing::warn!(
                api,
                call = call.verb(),
                claim_uid = %c.uid,
                namespace = %c.namespace,
                claim = %c.name,
                error = %error,
                "claim not {}d",
                call.verb()
            ),
            None => {}
        }
    }
}

impl DraService {
    pub fn new(claims: Arc<dyn Claims>) -> Self {
        DraService { claims }
    }

    /// Prepares the requested claims: one outcome per distinct UID.
    pub async fn prepare(
        &self,
        api: &str,
        requested: Vec<ClaimRef>,
    ) -> BTreeMap<String, PrepareOutcome> {
        let requested = distinct(requested);
        let claims = self.claims.clone();
        let batch = requested.clone();
        let answers = match tokio::task::spawn_blocking(move || claims.prepare(&batch)).await {
            Ok(outcomes) => complete(Call::Prepare, &requested, outcomes),
            Err(e) => all_failed(
                Call::Prepare,
                &requested,
                &format!("the worker failed: {e}"),
            ),
        };
        log_answers(api, Call::Prepare, &requested, &answers, Vec::len);
        answers
    }

    /// Unprepares the requested claims: one outcome per distinct UID (an
    /// unknown claim is [`Claims`]' to call done).
    pub async fn unprepare(
        &self,
        api: &str,
        requested: Vec<ClaimRef>,
    ) -> BTreeMap<String, Result<(), String>> {
        let requested = distinct(requested);
        let claims = self.claims.clone();
        let batch = requested.clone();
        let answers = match tokio::task::spawn_blocking(move || claims.unprepare(&batch)).await {
            Ok(outcomes) => complete(Call::Unprepare, &requested, outcomes),
            Err(e) => all_failed(
                Call::Unprepare,
                &requested,
                &format!("the worker failed: {e}"),
            ),
        };
        log_answers(api, Call::Unprepare, &requested, &answers, |()| 0);
        answers
    }
}

fn device_v1(d: PreparedDevice) -> proto::v1::Device {
    proto::v1::Device {
        request_names: d.request_names,
        pool_name: d.pool_name,
        device_name: d.device_name,
        cdi_device_ids: d.cdi_device_ids,
        share_id: d.share_id,
    }
}

/// v1beta1 has no `share_id`: a kubelet speaking it gets the device without.
fn device_v1beta1(d: PreparedDevice) -> proto::v1beta1::Device {
    proto::v1beta1::Device {
        request_names: d.request_names,
        pool_name: d.pool_name,
        device_name: d.device_name,
        cdi_device_ids: d.cdi_device_ids,
    }
}

/// One API version's `DraPlugin` impl: the same answers, that version's
/// messages (`$device` turns a [`PreparedDevice`] into its `Device`).
macro_rules! dra_plugin {
    ($api:ident, $device:path) => {
        pub mod $api {
            //! The service of this DRA API version.
            // `crate::…`, not `super::…`: the parent is this file.
            use crate::kubelet::dra::*;
            use gpu_agent_proto::dra::$api as api;

            /// The request's claims, as [`Claims`] takes them.
            pub fn claim_refs(claims: Vec<api::Claim>) -> Vec<ClaimRef> {
                claims
                    .into_iter()
                    .map(|c| ClaimRef {
                        namespace: c.namespace,
                        uid: c.uid,
                        name: c.name,
                    })
                    .collect()
            }

            /// The prepare response: each outcome as its claim's entry.
            pub fn prepare_response(
                answers: BTreeMap<String, PrepareOutcome>,
            ) -> api::NodePrepareResourcesResponse {
                let claims = answers
                    .into_iter()
                    .map(|(uid, outcome)| {
                        let entry = match outcome {
                            Ok(devices) => api::NodePrepareResourceResponse {
                                devices: devices.into_iter().map($device).collect(),
                                error: String::new(),
                            },
                            Err(error) => api::NodePrepareResourceResponse {
                                devices: Vec::new(),
                                error,
                            },
                        };
                        (uid, entry)
                    })
                    .collect();
                api::NodePrepareResourcesResponse { claims }
            }

            /// The unprepare response: each outcome as its claim's entry.
            pub fn unprepare_response(
                answers: BTreeMap<String, Result<(), String>>,
            ) -> api::NodeUnprepareResourcesResponse {
                let claims = answers
                    .into_iter()
                    .map(|(uid, outcome)| {
                        let error = outcome.err().unwrap_or_default();
                        (uid, api::NodeUnprepareResourceResponse { error })
                    })
                    .collect();
                api::NodeUnprepareResourcesResponse { claims }
            }

            #[tonic::async_trait]
            impl api::dra_plugin_server::DraPlugin for DraService {
                async fn node_prepare_resources(
                    &self,
                    request: Request<api::NodePrepareResourcesRequest>,
                ) -> Result<Response<api::NodePrepareResourcesResponse>, Status> {
                    let requested = claim_refs(request.into_inner().claims);
                    let answers = self.prepare(stringify!($api), requested).await;
                    Ok(Response::new(prepare_response(answers)))
                }

                async fn node_unprepare_resources(
                    &self,
                    request: Request<api::NodeUnprepareResourcesRequest>,
                ) -> Result<Response<api::NodeUnprepareResourcesResponse>, Status> {
                    let requested = claim_refs(request.into_inner().claims);
                    let answers = self.unprepare(stringify!($api), requested).await;
                    Ok(Response::new(unprepare_response(answers)))
                }
            }
        }
    };
}

dra_plugin!(v1, device_v1);
dra_plugin!(v1beta1, device_v1beta1);

#[cfg(test)]
mod tests;
