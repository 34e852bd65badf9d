//! Reads a crate's `src/` as far as module paths go, for the tests that
//! keep the workspace in layers (issue 30): comments and strings blanked
//! ([`lex`]), the module paths a file writes ([`paths`]), lines of code
//! and of tests ([`lines`]), files and their modules ([`files`],
//! [`source`]), the import graph among a crate's files ([`graph`],
//! [`resolve`]) and its circles ([`circles`]).
//!
//! Dev-only: `controller/tests/layers.rs` and `agent/tests/layers.rs`.

pub mod circles;
pub mod files;
pub mod graph;
pub mod lex;
pub mod lines;
pub mod paths;
pub mod resolve;
pub mod source;

pub use circles::Circle;
pub use files::{module_of, rs_files};
pub use graph::Graph;
pub use lex::{Tok, is_ident, strip, strip_comments, tokens};
pub use lines::{cfg_test_items, code_lines, test_blocks, test_lines};
pub use paths::{PathUse, path_tail, paths};
pub use resolve::{Edge, Reexports};
pub use source::{File, Target};

#[cfg(test)]
mod tests;
