//! Who is on the other end of a report stream: the agent's projected
//! service-account token, checked by the API server's TokenReview. The
//! token must be for the audience `gpu-controller`, belong to the agents'
//! service account, and be bound to a pod on a node: that node is the only
//! one the stream may report for.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use kube::api::{Api, PostParams};
use sha2::Digest;

/// The extra field the API server puts in a pod-bound token's review.
pub const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";
/// A token the API server authenticated is not reviewed again until it
/// expires (its `exp`; the kubelet rotates it before): agents check in
/// every few seconds to minutes, and a review each time would be a request
/// per check-in. At most this long, though, and this long where the token
/// says no expiry.
const CACHE_MAX_FOR: Duration = Duration::from_secs(3600);
const CACHE_NO_EXP: Duration = Duration::from_secs(300);
/// A token refused is refused again from memory for this long: a bad agent
/// retrying costs no request, and a fix (RBAC, the token) shows soon.
const CACHE_REFUSED: Duration = Duration::from_secs(10);
/// Reviews kept at most (about 200 bytes each).
const CACHE_MAX: usize = 150_000;

/// Who the token says the caller is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub username: String,
    /// The node the token's pod is bound to.
    pub node_name: String,
}

/// Why a caller is not let in.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("no bearer token (the agent sends its projected service-account token)")]
    NoToken,
    #[error("the API server did not authenticate the token: {0}")]
    NotAuthenticated(String),
    #[error("the token is not for the audience {audience}")]
    Audience { audience: String },
    #[error("the token belongs to {user}, not to the agents' service account {expected}")]
    WrongAccount { user: String, expected: String },
    #[error(
        "the token is not bound to a node (no {NODE_NAME_EXTRA}): the agent must use a projected service-account token of its pod (Kubernetes 1.32 or later)"
    )]
    NoNode,
    #[error("cannot ask the API server to review the token: {0}")]
    Review(String),
}

/// A review's answer and until when it holds, by the token's SHA-256.
type Reviewed = (Instant, Result<Identity, AuthError>);

/// How long the token has left by its JWT `exp` claim, read without
/// checking the signature: only the API server's review says whether the
/// token is good; this only bounds how long that answer is kept. `None`:
/// not a JWT, or no `exp`.
pub fn lifetime_left(token: &str, now: std::time::SystemTime) -> Option<Duration> {
    use base64::Engine;
    let payload = token.split('.').nth(1)?;
    let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    let claims: serde_json::Value = serde_json::from_slice(&json).ok()?;
    let exp = std::time::UNIX_EPOCH + Duration::from_secs(claims.get("exp")?.as_u64()?);
    Some(exp.duration_since(now).unwrap_or(Duration::ZERO))
}

pub type AuthFuture<'a> = Pin<Box<dyn Future<Output = Result<Identity, AuthError>> + Send + 'a>>;

/// Checks a bearer token.
pub trait Authenticator: Send + Sync + 'static {
    fn authenticate<'a>(&'a self, token: &'a str) -> AuthFuture<'a>;
}

/// TokenReview through the API server, with a short cache by the token's
/// SHA-256 (the token itself is never kept).
pub struct TokenReviewer {
    client: kube::Client,
    audience: String,
    /// `system:serviceaccount:<namespace>:<name>`.
    account: String,
    cache: Mutex<HashMap<[u8; 32], Reviewed>>,
}

impl std::fmt::Debug for TokenReviewer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenReviewer")
            .field("audience", &self.audience)
            .field("account", &self.account)
            .finish_non_exhaustive()
    }
}

impl TokenReviewer {
    /// Tokens must be for `audience` and belong to `namespace/name`.
    pub fn new(client: kube::Client, audience: &str, namespace: &str, name: &str) -> Self {
        TokenReviewer {
            client,
            audience: audience.into(),
            account: format!("system:serviceaccount:{namespace}:{name}"),
            cache: Mutex::default(),
        }
    }

    async fn review(&self, token: &str) -> Result<Identity, AuthError> {
        let api: Api<TokenReview> = Api::all(self.client.clone());
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_string(),
                audiences: Some(vec![self.audience.clone()]),
            },
            ..Default::default()
        };
        let answer = api
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| AuthError::Review(e.to_string()))?;
        let status = answer.status.unwrap_or_default();
        if status.authenticated != Some(true) {
            return Err(AuthError::NotAuthenticated(
                status.error.unwrap_or_else(|| "no reason given".into()),
            ));
        }
        if !status
            .audiences
            .as_deref()
            .unwrap_or_default()
            .contains(&self.audience)
        {
            return Err(AuthError::Audience {
                audience: self.audience.clone(),
            });
        }
        let user = status.user.unwrap_or_default();
        let username = user.username.unwrap_or_default();
        if username != self.account {
            return Err(AuthError::WrongAccount {
                user: username,
                expected: self.account.clone(),
            });
        }
        let node_name = user
            .extra
            .as_ref()
            .and_then(|e| e.get(NODE_NAME_EXTRA))
            .and_then(|v| v.first())
            .filter(|n| !n.is_empty())
            .cloned()
            .ok_or(AuthError::NoNode)?;
        Ok(Identity {
            username,
            node_name,
        })
    }
}

impl Authenticator for TokenReviewer {
    fn authenticate<'a>(&'a self, token: &'a str) -> AuthFuture<'a> {
        Box::pin(async move {
            if token.is_empty() {
                return Err(AuthError::NoToken);
            }
            let key: [u8; 32] = sha2::Sha256::digest(token.as_bytes()).into();
            let now = Instant::now();
            if let Some((until, answer)) = self.cache.lock().unwrap().get(&key)
                && now < *until
            {
                return answer.clone();
            }
            // Not limited here: a check-in waiting for its review would
            // hold its connection's buffers (measured: 32 reviews at once
            // held 7,500 connections, 338 MiB, at 10,000 agents' first
            // check-ins); the TLS handshakes' turns pace them instead.
            let answer = self.review(token).await;
            let keep = match &answer {
                // A failure to ask is not an answer: it is not kept.
                Err(AuthError::Review(_)) => None,
                Err(_) => Some(CACHE_REFUSED),
                Ok(_) => Some(
                    lifetime_left(token, std::time::SystemTime::now())
                        .unwrap_or(CACHE_NO_EXP)
                        .min(CACHE_MAX_FOR),
                ),
            };
            if let Some(keep) = keep.filter(|k| !k.is_zero()) {
                let mut cache = self.cache.lock().unwrap();
                if cache.len() >= CACHE_MAX {
                    cache.retain(|_, (until, _)| now < *until);
                }
                if cache.len() < CACHE_MAX {
                    cache.insert(key, (now + keep, answer.clone()));
                }
            }
            answer
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;

    fn jwt(claims: &str) -> String {
        let b = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        format!("{}.{}.sig", b(r#"{"alg":"RS256"}"#), b(claims))
    }

    #[test]
    fn a_token_is_kept_until_its_exp() {
        let now = std::time::UNIX_EPOCH + Duration::from_secs(1_000);
        assert_eq!(
            lifetime_left(&jwt(r#"{"aud":["gpu-controller"],"exp":4600}"#), now),
            Some(Duration::from_secs(3600))
        );
        assert_eq!(
            lifetime_left(&jwt(r#"{"exp":10}"#), now),
            Some(Duration::ZERO),
            "expired already"
        );
        assert_eq!(lifetime_left(&jwt(r#"{"sub":"x"}"#), now), None);
        assert_eq!(lifetime_left("tok-1", now), None, "not a JWT");
        assert_eq!(lifetime_left("a.!!!.c", now), None);
    }
}
