//! Streams from Python: the `Stream` class, streams other libraries lend, the default-stream
//! handles, the contexts work on a stream runs in, the relaxed capture mode, and waiting for a
//! whole device.

pub(crate) mod capture_mode;
pub(crate) mod current_context;
pub(crate) mod default_streams;
pub(crate) mod device_wait;
pub(crate) mod lent_streams;
pub(crate) mod primary_contexts;
pub(crate) mod stream;
