//! What the examples share.
