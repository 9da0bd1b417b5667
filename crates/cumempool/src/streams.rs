//! Streams and events: the order in which pool memory is handed out and given back, and the
//! rules for captures other code may begin on them.

pub(crate) mod capture_mode;
pub(crate) mod capture_state;
pub(crate) mod deferred_frees;
pub(crate) mod event;
pub(crate) mod ordering;
pub(crate) mod orphans;
pub(crate) mod stream;
