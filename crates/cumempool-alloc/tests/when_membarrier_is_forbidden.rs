//! Found by review of the lanes: once the first cache chose the asymmetric fences, a
//! `membarrier` that starts failing (a seccomp filter installed after start-up, as sandboxes
//! and some service managers do) made every claim of a lane spin for ever: `release`,
//! `release_stream`, `stats`, eviction and `Drop` hung. Now claims give up with a typed error,
//! and `Drop` needs none. The probe runs in a child process (this binary, re-run) so that a
//! hang fails the test instead of hanging it.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![cfg(all(target_os = "linux", target_arch = "x86_64"))]

use cumempool::Stream;
use cumempool_alloc::{CachingResource, Error, HostHeap, Statistics, StreamOrderedResource};
use std::time::{Duration, Instant};

const CHILD: &str = "CUMEMPOOL_REVIEW_MEMBARRIER_CHILD";

/// Makes `membarrier` answer EPERM for this thread (and threads it starts), as a sandbox would.
fn forbid_membarrier() {
    let filter = [
        libc::sock_filter { code: 0x20, jt: 0, jf: 0, k: 0 }, // ld [nr]
        libc::sock_filter { code: 0x15, jt: 0, jf: 1, k: libc::SYS_membarrier as u32 }, // jeq
        libc::sock_filter { code: 0x06, jt: 0, jf: 0, k: 0x0005_0000 | libc::EPERM as u32 }, // ret ERRNO
        libc::sock_filter { code: 0x06, jt: 0, jf: 0, k: 0x7fff_0000 }, // ret ALLOW
    ];
    let program = libc::sock_fprog { len: filter.len() as u16, filter: filter.as_ptr().cast_mut() };
    // SAFETY: plain prctl calls with a valid filter program.
    unsafe {
        assert_eq!(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0);
        assert_eq!(libc::prctl(libc::PR_SET_SECCOMP, 2 /* SECCOMP_MODE_FILTER */, &program), 0);
    }
}

#[test]
fn release_returns_when_membarrier_is_forbidden_after_the_first_cache() {
    if std::env::var_os(CHILD).is_some() {
        let below = Statistics::new(HostHeap);
        let cache = CachingResource::new(&below);
        // SAFETY: HostHeap ignores streams, so the handle is never used.
        let stream = unsafe { Stream::borrow_raw(0x100 as cumempool::sys::CUstream, None) }.unwrap();
        // Three cached frees: slot, lanes, this thread's lane.
        let blocks = [(); 3].map(|()| cache.allocate(4096, 256, &stream).unwrap());
        for ptr in blocks {
            unsafe { cache.deallocate(ptr, 4096, 256, &stream) }.unwrap();
        }
        forbid_membarrier();
        eprintln!("child: releasing");
        let error = cache.release().unwrap_err();
        assert!(matches!(error, Error::LanesUnreachable { .. }), "{error}");
        eprintln!("child: {error}");
        assert_eq!(cache.stats().streams, 1, "stats still answers");
        // The hot path goes on: the lane's block is still there for this thread.
        let ptr = cache.allocate(4096, 256, &stream).unwrap();
        unsafe { cache.deallocate(ptr, 4096, 256, &stream) }.unwrap();
        drop(cache);
        assert_eq!(below.usage().current_bytes, 0, "drop gave every block back, the lane's too");
        eprintln!("child: dropped");
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let mut child = std::process::Command::new(exe)
        .args(["--exact", "release_returns_when_membarrier_is_forbidden_after_the_first_cache", "--nocapture"])
        .env(CHILD, "1")
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if start.elapsed() > Duration::from_secs(10) {
            child.kill().unwrap();
            child.wait().unwrap();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let status = status.expect("release() still spinning in expedited_membarrier after 10 s: killed");
    assert!(status.success(), "{status:?}");
}
