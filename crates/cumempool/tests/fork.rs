//! CUDA does not survive `fork()`: a child forked after the parent used this crate gets a typed
//! error from every call instead of reaching libcuda. Runs with or without a driver.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[cfg(unix)]
#[test]
fn a_forked_child_gets_a_typed_error_not_the_driver() {
    // With or without a driver here, the parent has now started using the crate.
    let _ = cumempool::init();
    // SAFETY: the child only reads an atomic through the crate and calls _exit; it allocates
    // nothing and takes no lock.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let code = match cumempool::init() {
            Err(cumempool::Error::ForkedChild) => 0,
            _ => 1,
        };
        // SAFETY: ends the child without running the parent's destructors or test harness.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for the child just forked.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "the child did not exit normally");
    assert_eq!(libc::WEXITSTATUS(status), 0, "the child's call did not answer Error::ForkedChild");
}
