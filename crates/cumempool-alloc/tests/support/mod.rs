//! What the cache's test binaries share (each uses some of it: many are binaries of their own,
//! since a thread's lane number is process-wide).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use cumempool::Stream;
use cumempool_alloc::{CachingResource, StreamOrderedResource};

/// A stream handle the host heap never hands to a driver. Offset past the handles that mean
/// "a stream of the current context" (0, 1, 2), which `borrow_raw` refuses without a context.
pub fn fake_stream(id: usize) -> Stream {
    // SAFETY: HostHeap ignores streams, so the handle is never used.
    unsafe { Stream::borrow_raw((0x100 + id) as cumempool::sys::CUstream, None) }.unwrap()
}

/// Three blocks of `bytes` allocated on `stream` and freed there: the first free takes the
/// stream's slot, the second makes its lanes (both land in the shared lists), the third lands
/// in the calling thread's lane. Answers the blocks.
pub fn fill_this_threads_lane<R: StreamOrderedResource>(
    cache: &CachingResource<R>,
    stream: &Stream,
    bytes: usize,
) -> [u64; 3] {
    let blocks = [(); 3].map(|()| cache.allocate(bytes, 256, stream).unwrap());
    for block in blocks {
        // SAFETY: allocated just above with these arguments.
        unsafe { cache.deallocate(block, bytes, 256, stream) }.unwrap();
    }
    blocks
}

/// Whether this process is the child that [`run_in_child`] started with `env` set.
pub fn is_child(env: &str) -> bool {
    std::env::var_os(env).is_some()
}

/// Runs a test of this binary again in a child process with `env` set (for what cannot be
/// undone, such as a seccomp filter), and fails unless it succeeds within `limit`: a hang
/// fails the test instead of hanging it. `test` is the test's path,
/// `concat!(module_path!(), "::test_fn")`; a child that ran no test of that name fails too.
pub fn run_in_child(test: &str, env: &str, limit: std::time::Duration) {
    use std::io::Read;
    // The harness names a test by its path below the crate.
    let name = test.split_once("::").map_or(test, |(_, below)| below);
    let exe = std::env::current_exe().unwrap();
    let mut child = std::process::Command::new(exe)
        .args(["--exact", name, "--nocapture"])
        .env(env, "1")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let report = std::thread::spawn(move || {
        let mut report = String::new();
        let _ = stdout.read_to_string(&mut report);
        report
    });
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > limit {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("the child still ran after {limit:?}: killed");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let report = report.join().unwrap();
    print!("{report}");
    assert!(status.success(), "{status:?}");
    assert!(report.contains(" 1 passed"), "the child ran no test named {name}");
}

/// The seccomp answer that makes `membarrier` fail with EPERM, as a sandbox would.
#[cfg(target_os = "linux")]
pub const MEMBARRIER_EPERM: u32 = 0x0005_0000 | libc::EPERM as u32;
/// The seccomp answer that traps `membarrier` into a SIGSYS handler instead.
#[cfg(target_os = "linux")]
const MEMBARRIER_TRAP: u32 = 0x0003_0000;

/// Installs a seccomp filter on this thread (and the threads it starts) that answers
/// `membarrier` with `action` and allows every other system call. Cannot be undone: use it in a
/// child of [`run_in_child`].
#[cfg(target_os = "linux")]
pub fn filter_membarrier(action: u32) {
    let filter = [
        libc::sock_filter { code: 0x20, jt: 0, jf: 0, k: 0 }, // ld [nr]
        libc::sock_filter { code: 0x15, jt: 0, jf: 1, k: libc::SYS_membarrier as u32 }, // jeq
        libc::sock_filter { code: 0x06, jt: 0, jf: 0, k: action }, // ret action
        libc::sock_filter { code: 0x06, jt: 0, jf: 0, k: 0x7fff_0000 }, // ret ALLOW
    ];
    let program = libc::sock_fprog { len: filter.len() as u16, filter: filter.as_ptr().cast_mut() };
    // SAFETY: plain prctl calls with a valid filter program.
    unsafe {
        assert_eq!(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0);
        assert_eq!(libc::prctl(libc::PR_SET_SECCOMP, 2 /* SECCOMP_MODE_FILTER */, &program), 0);
    }
}

/// Makes every `membarrier` of this process from now on trap into a SIGSYS handler that calls
/// `answer` and hands the caller what it answers (0 for success, a negated errno for a
/// failure) in the call's place. Cannot be undone, and only once a process: use it in a child of
/// [`run_in_child`]. `answer` runs in a signal handler, so it may only touch atomics.
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
pub fn trap_membarrier(answer: fn() -> i64) {
    static ANSWER: std::sync::OnceLock<fn() -> i64> = std::sync::OnceLock::new();
    extern "C" fn on_sigsys(_: libc::c_int, _: *mut libc::siginfo_t, context: *mut libc::c_void) {
        let answer = ANSWER.get().map_or(0, |answer| answer());
        // SAFETY: the kernel passes the interrupted thread's context; rax is the syscall's answer.
        unsafe { (*context.cast::<libc::ucontext_t>()).uc_mcontext.gregs[libc::REG_RAX as usize] = answer };
    }
    assert!(ANSWER.set(answer).is_ok(), "membarrier is trapped once a process");
    // SAFETY: a plain signal handler.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigsys as extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) as usize;
        action.sa_flags = libc::SA_SIGINFO;
        assert_eq!(libc::sigaction(libc::SIGSYS, &action, std::ptr::null_mut()), 0);
    }
    filter_membarrier(MEMBARRIER_TRAP);
}

/// Runs `child` in a forked child process, which exits with its answer, and answers that exit
/// code. The child must only use what it was given and must not unwind.
#[cfg(target_os = "linux")]
pub fn exit_code_of_forked(child: impl FnOnce() -> i32) -> i32 {
    // SAFETY: the child runs `child` and ends with `_exit`, never returning here.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let code = child();
        // SAFETY: ends the child without running the parent's destructors twice.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for the child just forked.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "the child did not exit: {status}");
    libc::WEXITSTATUS(status)
}
