//! The node's side of claims: per-claim CDI specs and the checkpoint.
