//! The public types can cross threads: pools, buffers and streams are shared by worker threads
//! in real programs, and a lost `Send`/`Sync` would be a breaking change.

fn send_sync<T: Send + Sync>() {}

#[test]
fn public_handles_are_send_and_sync() {
    send_sync::<cumempool::MemPool>();
    send_sync::<cumempool::PoolRef>();
    send_sync::<cumempool::Pool>();
    send_sync::<cumempool::Buffer<'static>>();
    send_sync::<cumempool::OwnedBuffer>();
    send_sync::<cumempool::Stream>();
    send_sync::<cumempool::Event>();
    send_sync::<cumempool::Context>();
    send_sync::<cumempool::RouteGuard>();
    send_sync::<cumempool::Device>();
    send_sync::<cumempool::Error>();
    send_sync::<cumempool::SharedAllocation>();
    send_sync::<cumempool_sys::Driver>();
    send_sync::<cumempool_sys::LoadError>();
    send_sync::<cumempool::PendingCopy>();
    send_sync::<cumempool::PendingCopyError>();
    send_sync::<cumempool::GraphMemory>();
}

/// Graphs may move to another thread, but the driver does not synchronise graph objects, so a
/// graph or an executable is never shared between threads (`&mut self` launches, no `Sync`).
#[test]
fn graphs_move_between_threads() {
    fn send<T: Send>() {}
    send::<cumempool::Graph<'static>>();
    send::<cumempool::GraphExec<'static>>();
}

#[test]
fn errors_are_static_std_errors() {
    fn error<E: std::error::Error + Send + Sync + 'static>() {}
    error::<cumempool::Error>();
    error::<cumempool::PendingCopyError>();
    error::<cumempool_sys::LoadError>();
}
