//! The ResourceClaims of every namespace, followed for the agents (issue
//! 31): each claim allocated to devices of driver `gpu.nvidia.com` is placed
//! on its node ([`crate::model::dra::claims`]), and each node's whole list
//! is handed to the fleet, which sends it down the node's stream; the
//! agent's `NodePrepareResources` answers from it without an API call.
//!
//! Every replica runs it (an agent's stream may be held by any replica that
//! leads, and a new leader must have the lists at once). A (re)listing
//! replaces everything at its end: claims deleted while the watch was down
//! leave their nodes' lists then.

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::Api;
use kube::runtime::watcher::{self, Event};

use crate::error::error_chain;
use crate::fleet::Fleet;
use crate::model::dra::claims::{ClaimsByNode, Placed, placed};

/// Where `claim` is now (`None`: on no node of ours). A claim that cannot
/// be placed is said, and is on no node: its prepare fails naming it.
fn place(claim: &ResourceClaim) -> Option<Placed> {
    match placed(claim) {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(
                claim = %format!(
                    "{}/{}",
                    claim.metadata.namespace.as_deref().unwrap_or_default(),
                    claim.metadata.name.as_deref().unwrap_or_default()
                ),
                error = %e,
                "a ResourceClaim cannot be handed to its node's agent"
            );
            None
        }
    }
}

/// Follows the claims until the stream ends (the watcher retries on its
/// own, with backoff).
pub async fn run(client: kube::Client, fleet: Arc<Fleet>) {
    let api: Api<ResourceClaim> = Api::all(client);
    let mut stream = std::pin::pin!(kube::runtime::WatchStreamExt::default_backoff(
        watcher::watcher(api, watcher::Config::default())
    ));
    let mut claims = ClaimsByNode::default();
    // Claims of a listing under way.
    let mut listing: Vec<Placed> = Vec::new();
    // Whether the watch is failing (said once, when it begins).
    let mut failing = false;
    // Whether a listing has been said already.
    let mut listed = false;
    while let Some(ev) = stream.next().await {
        match ev {
            Ok(Event::Init) => listing.clear(),
            Ok(Event::InitApply(c)) => listing.extend(place(&c)),
            Ok(Event::InitDone) => {
                claims = ClaimsByNode::from_all(std::mem::take(&mut listing));
                let lists = claims.lists();
                // Said at INFO once; a relisting (an expired watch) that
                // finds what was known says nothing above DEBUG.
                if listed {
                    tracing::debug!(
                        claims = claims.len(),
                        nodes = lists.len(),
                        "ResourceClaims listed again"
                    );
                } else {
                    tracing::info!(
                        claims = claims.len(),
                        nodes = lists.len(),
                        "ResourceClaims of gpu.nvidia.com listed"
                    );
                }
                listed = true;
                fleet.replace_dra_claims(lists);
            }
            Ok(Event::Apply(c)) => {
                let Some(uid) = c.metadata.uid.clone() else {
                    continue;
                };
                for node in claims.set(&uid, place(&c)) {
                    fleet.set_dra_claims(&node, claims.list(&node));
                }
            }
            Ok(Event::Delete(c)) => {
                let Some(uid) = c.metadata.uid.clone() else {
                    continue;
                };
                for node in claims.set(&uid, None) {
                    fleet.set_dra_claims(&node, claims.list(&node));
                }
            }
            // An expired resourceVersion: the watcher lists again; not a
            // failure.
            Err(watcher::Error::WatchError(s)) if s.code == 410 => {
                tracing::debug!("the ResourceClaims watch expired; listing them again");
                continue;
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(
                        error = %error_chain(&e),
                        "cannot watch the ResourceClaims: agents keep the claims they were sent"
                    );
                }
                failing = true;
                continue;
            }
        }
        if failing {
            tracing::info!("watching the ResourceClaims again");
            failing = false;
        }
    }
}
